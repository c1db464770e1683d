#!/usr/bin/env bash
# Step 3 on one (small) GPU: LoRA on actor and critic, reference and reward offloaded, bf16,
# hybrid generation mode.
# usage: ACTOR=step1_dir CRITIC=step2_dir bash scripts/step3_ppo/run_single_gpu.sh [OUTPUT_DIR] [extra args]
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step3}"; shift || true
ACTOR="${ACTOR:-$ROOT/out/step1}"; CRITIC="${CRITIC:-$ROOT/out/step2}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/pairs"; fi
mkdir -p "$OUTPUT"
deepspeed --num_gpus 1 --master_port "$MASTER_PORT" --module step3_ppo.main \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" --data_path $DATA --data_split 0,5,5 \
  --actor_zero_stage 2 --critic_zero_stage 2 --offload_reference_model --offload_reward_model --dtype bf16 \
  --actor_lora_dim 128 --critic_lora_dim 128 --only_optimize_lora --actor_gradient_checkpointing \
  --critic_gradient_checkpointing --enable_hybrid_engine \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 8 --per_device_training_batch_size 8 --ppo_epochs 1 \
  --actor_lora_learning_rate 5e-4 --critic_lora_learning_rate 5e-4 --num_train_epochs 1 --seed 1234 \
  --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/train.log"
exit "${PIPESTATUS[0]}"
