#!/usr/bin/env bash
# Step 2, DPO on one GPU: LoRA (the reference is the model with its adapters disabled: one copy in
# memory), bf16, ZeRO-0, gradient checkpointing.
# usage: MODEL=path/to/step1/output bash scripts/step2_dpo/run_single_gpu.sh [OUTPUT_DIR (out/step2_dpo)] [extra args]
# env: MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_gpu step2_dpo.main pairs \
  --data_split 0,5,5 \
  --zero_stage 0 --dtype bf16 --max_seq_len 512 --gradient_checkpointing \
  --lora_dim 128 --only_optimize_lora --lora_learning_rate 5e-5 \
  --per_device_train_batch_size 8 --per_device_eval_batch_size 8 \
  --learning_rate 5e-6 --weight_decay 0.0 --num_train_epochs 1 --num_warmup_steps 10 --seed 1234 \
  --beta 0.1 --dropout 0.0 --eval_interval 100 --eval_iters 100 \
  -- "$@"
