#!/usr/bin/env bash
# Step 2 on one GPU: LoRA on the backbone (the value head always trains), bf16, ZeRO-0.
# usage: MODEL=path/to/step1/output bash scripts/step2_reward/run_single_gpu.sh [OUTPUT_DIR] [extra args]
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step2}"; shift || true
MODEL="${MODEL:-$(step1_output_or_default_model)}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/pairs"; fi
mkdir -p "$OUTPUT"
deepspeed --num_gpus 1 --master_port "$MASTER_PORT" --module step2_reward.main \
  --model_name_or_path "$MODEL" --data_path $DATA --data_split 0,5,5 \
  --zero_stage 0 --dtype bf16 --max_seq_len 512 --gradient_checkpointing \
  --lora_dim 128 --only_optimize_lora --lora_learning_rate 5e-4 \
  --per_device_train_batch_size 8 --per_device_eval_batch_size 8 \
  --learning_rate 5e-5 --weight_decay 0.1 --num_train_epochs 1 --num_warmup_steps 0 --seed 1234 \
  --eval_interval 100 --eval_iters 100 \
  --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/train.log"
exit "${PIPESTATUS[0]}"
