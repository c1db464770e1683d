#!/usr/bin/env bash
# Step 2, DPO on one node with every local GPU: ZeRO-3, bf16, full fine-tuning; the reference
# log-probs are computed once before training (--precompute_ref_log_probs), so no reference model
# is held while the policy trains (DeepSpeed-Chat's step2_dpo_finetuning: beta 0.1, lr ~1e-6 scale).
# usage: MODEL=path/to/step1/output bash scripts/step2_dpo/run_single_node.sh [OUTPUT_DIR (out/step2_dpo)] [extra args]
# env: MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_node step2_dpo.main pairs \
  --data_split 0,5,5 \
  --zero_stage 3 --dtype bf16 --max_seq_len 512 --precompute_ref_log_probs \
  --per_device_train_batch_size 8 --per_device_eval_batch_size 8 --gradient_accumulation_steps 1 \
  --learning_rate 1e-6 --weight_decay 0.0 --num_train_epochs 1 --num_warmup_steps 10 --seed 1234 \
  --beta 0.1 --dropout 0.0 --eval_interval 100 --eval_iters 100 \
  -- "$@"
