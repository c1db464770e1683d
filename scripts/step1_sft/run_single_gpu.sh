#!/usr/bin/env bash
# Step 1 on one GPU: LoRA so a small GPU fits larger models, bf16, ZeRO-0.
# usage: MODEL=path/or/hub-name bash scripts/step1_sft/run_single_gpu.sh [OUTPUT_DIR] [extra args]
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step1}"; shift || true
MODEL="${MODEL:-$(default_model)}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/sft"; fi
mkdir -p "$OUTPUT"
deepspeed --num_gpus 1 --master_port "$MASTER_PORT" --module step1_sft.main \
  --model_name_or_path "$MODEL" --data_path $DATA --data_split 10,0,0 \
  --zero_stage 0 --dtype bf16 --max_seq_len 512 --gradient_checkpointing \
  --lora_dim 128 --only_optimize_lora --lora_learning_rate 5e-4 \
  --per_device_train_batch_size 8 --per_device_eval_batch_size 8 \
  --learning_rate 1e-3 --num_train_epochs 1 --seed 1234 \
  --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/train.log"
exit "${PIPESTATUS[0]}"
