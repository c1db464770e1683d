#!/usr/bin/env bash
# Step 3 with GRPO on one GPU: the verifiable task of run_grpo_cpu.sh with
# GPU-sized batches, bf16, ZeRO-3 + hybrid generation; no critic, no reward model, 8 answers per prompt.
# usage: bash scripts/step3_ppo/run_grpo_single_gpu.sh [OUTPUT_DIR (out/step3)] [extra step3_ppo/main.py arguments]
# env: ACTOR (default: the embedded SmolLM2-135M-Instruct), DATA (prompt rows with an 'answer' field;
#      default data/arithmetic), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
grpo_inputs || exit
launch_step single_gpu step3_ppo.main arithmetic \
  --data_split 0,0,1 --advantage_estimator grpo --n_samples_per_prompt 8 \
  --reward_funcs math_exact format --reward_weights 1.0 0.0 --format_pattern '^\s*\d+\s*\.?\s*$' \
  --actor_zero_stage 3 --enable_hybrid_engine --dtype bf16 \
  --max_prompt_seq_len 128 --max_answer_seq_len 64 --temperature 0.7 \
  --per_device_generation_batch_size 32 --per_device_training_batch_size 64 --ppo_epochs 1 \
  --actor_learning_rate 1e-6 --kl_ctl 0.02 --kl_in_loss --num_train_epochs 1 \
  --eval_interval 10 --eval_num_prompts 200 --seed 1234 \
  -- "$@"
