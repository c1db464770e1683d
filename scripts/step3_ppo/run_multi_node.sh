#!/usr/bin/env bash
# Step 3 on several nodes through the deepspeed launcher and a hostfile ("host slots=N" per line).
# usage: HOSTFILE=./hostfile ACTOR=... CRITIC=... bash scripts/step3_ppo/run_multi_node.sh [OUTPUT_DIR] [extra args]
#        MULTI_NODE_MODE=no_ssh NODE_RANK=i MASTER_ADDR=host0 MASTER_PORT=p ... (one node per call)
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step3}"; shift || true
ACTOR="${ACTOR:-$ROOT/out/step1}"; CRITIC="${CRITIC:-$ROOT/out/step2}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/pairs"; fi
mkdir -p "$OUTPUT"
LAUNCH="$(multi_node_launcher "${HOSTFILE:-./hostfile}")"
run_logged "$OUTPUT/train.log.node${NODE_RANK:-0}" $LAUNCH --module step3_ppo.main \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" --data_path $DATA --data_split 2,4,4 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --dtype "${DTYPE:-bf16}" \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 --ppo_epochs 1 \
  --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --num_train_epochs 1 --seed 1234 \
  --output_dir "$OUTPUT" "$@"
