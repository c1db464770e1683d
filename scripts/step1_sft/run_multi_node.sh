#!/usr/bin/env bash
# Step 1 on several nodes through the deepspeed launcher and a hostfile ("host slots=N" per line).
# usage: HOSTFILE=./hostfile MODEL=... bash scripts/step1_sft/run_multi_node.sh [OUTPUT_DIR] [extra args]
#        MULTI_NODE_MODE=no_ssh NODE_RANK=i MASTER_ADDR=host0 MASTER_PORT=p ... (one node per call)
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step1}"; shift || true
MODEL="${MODEL:-$(default_model)}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/sft"; fi
mkdir -p "$OUTPUT"
LAUNCH="$(multi_node_launcher "${HOSTFILE:-./hostfile}")"
run_logged "$OUTPUT/train.log.node${NODE_RANK:-0}" $LAUNCH --module step1_sft.main \
  --model_name_or_path "$MODEL" --data_path $DATA --data_split 10,0,0 \
  --zero_stage 3 --dtype "${DTYPE:-bf16}" --max_seq_len 512 \
  --per_device_train_batch_size 4 --per_device_eval_batch_size 4 \
  --learning_rate 9.65e-6 --num_train_epochs 4 --seed 1234 \
  --output_dir "$OUTPUT" "$@"
