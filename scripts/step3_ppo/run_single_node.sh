#!/usr/bin/env bash
# Step 3 on one node with every local GPU: ZeRO-3 for all four models, bf16, hybrid generation mode.
# usage: ACTOR=step1_dir CRITIC=step2_dir bash scripts/step3_ppo/run_single_node.sh [OUTPUT_DIR] [extra args]
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step3}"; shift || true
ACTOR="${ACTOR:-$ROOT/out/step1}"; CRITIC="${CRITIC:-$ROOT/out/step2}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/pairs"; fi
mkdir -p "$OUTPUT"
deepspeed --master_port "$MASTER_PORT" --module step3_ppo.main \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" --data_path $DATA --data_split 2,4,4 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --dtype bf16 \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 \
  --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --num_train_epochs 1 --num_warmup_steps 100 \
  --actor_gradient_checkpointing --seed 1234 --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/train.log"
exit "${PIPESTATUS[0]}"
