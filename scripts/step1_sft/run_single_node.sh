#!/usr/bin/env bash
# Step 1 (SFT) on one node with every local GPU: ZeRO-3, bf16.
# usage: MODEL=path/or/hub-name bash scripts/step1_sft/run_single_node.sh [OUTPUT_DIR (out/step1)] [extra args]
# env: MODEL (default: the converted SmolLM2-135M-Instruct), DATA (sources; default data/demo/sft),
#      MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_node step1_sft.main sft \
  --data_split 10,0,0 \
  --zero_stage 3 --dtype bf16 --max_seq_len 512 \
  --per_device_train_batch_size 4 --per_device_eval_batch_size 4 --gradient_accumulation_steps 1 \
  --learning_rate 9.65e-6 --weight_decay 0.0 --num_train_epochs 4 --num_warmup_steps 0 --seed 1234 \
  -- "$@"
