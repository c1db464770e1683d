#!/usr/bin/env bash
# Step 3 (PPO) on one node with every local GPU: ZeRO-3 for all four models, bf16, hybrid generation mode.
# usage: ACTOR=step1_dir CRITIC=step2_dir bash scripts/step3_ppo/run_single_node.sh [OUTPUT_DIR (out/step3)] [extra args]
# env: ACTOR (default: $STEP1_DIR or out/step1), CRITIC (default: $STEP2_DIR or out/step2), DATA
#      ("src ..."; default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_node step3_ppo.main pairs \
  --data_split 0,5,5 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --dtype bf16 \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 4 --per_device_training_batch_size 4 --generation_batches 1 --ppo_epochs 1 \
  --actor_learning_rate 9.65e-6 --critic_learning_rate 5e-6 --num_train_epochs 1 --num_warmup_steps 100 \
  --actor_gradient_checkpointing --seed 1234 \
  -- "$@"
