#!/usr/bin/env bash
# Step 2 on several nodes through the deepspeed launcher and a hostfile ("host slots=N" per line).
# usage: HOSTFILE=./hostfile MODEL=... bash scripts/step2_reward/run_multi_node.sh [OUTPUT_DIR] [extra args]
#        MULTI_NODE_MODE=no_ssh NODE_RANK=i MASTER_ADDR=host0 MASTER_PORT=p ... (one node per call)
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step2}"; shift || true
MODEL="${MODEL:-$(step1_output_or_default_model)}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/pairs"; fi
mkdir -p "$OUTPUT"
LAUNCH="$(multi_node_launcher "${HOSTFILE:-./hostfile}")"
$LAUNCH --module step2_reward.main \
  --model_name_or_path "$MODEL" --data_path $DATA --data_split 0,5,5 \
  --zero_stage 3 --dtype "${DTYPE:-bf16}" --max_seq_len 512 \
  --per_device_train_batch_size 4 --per_device_eval_batch_size 4 \
  --learning_rate 9.65e-6 --weight_decay 0.1 --num_train_epochs 1 --seed 1234 \
  --dropout 0.0 --eval_interval 100 --eval_iters 100 \
  --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/train.log.node${NODE_RANK:-0}"
exit "${PIPESTATUS[0]}"
