#!/usr/bin/env bash
# Step 1 (SFT) on one GPU: LoRA so a small GPU fits larger models, bf16, ZeRO-0.
# usage: MODEL=path/or/hub-name bash scripts/step1_sft/run_single_gpu.sh [OUTPUT_DIR (out/step1)] [extra args]
# env: MODEL (default: the converted SmolLM2-135M-Instruct), DATA (sources; default data/demo/sft),
#      MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_gpu step1_sft.main sft \
  --data_split 10,0,0 \
  --zero_stage 0 --dtype bf16 --max_seq_len 512 --gradient_checkpointing \
  --lora_dim 128 --only_optimize_lora --lora_learning_rate 5e-4 \
  --per_device_train_batch_size 8 --per_device_eval_batch_size 8 \
  --learning_rate 1e-3 --num_train_epochs 1 --seed 1234 \
  -- "$@"
