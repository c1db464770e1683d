#!/usr/bin/env bash
# Step 1 on one node with every local GPU: ZeRO-3, bf16.
# usage: MODEL=path/or/hub-name bash scripts/step1_sft/run_single_node.sh [OUTPUT_DIR] [extra args]
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step1}"; shift || true
MODEL="${MODEL:-$(default_model)}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/sft"; fi
mkdir -p "$OUTPUT"
deepspeed --master_port "$MASTER_PORT" --module step1_sft.main \
  --model_name_or_path "$MODEL" --data_path $DATA --data_split 10,0,0 \
  --zero_stage 3 --dtype bf16 --max_seq_len 512 \
  --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --gradient_accumulation_steps 1 \
  --learning_rate 9.65e-6 --weight_decay 0.0 --num_train_epochs 4 --num_warmup_steps 0 --seed 1234 \
  --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/train.log"
exit "${PIPESTATUS[0]}"
