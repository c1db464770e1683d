#!/usr/bin/env bash
# Step 3 (PPO) on one (small) GPU: LoRA on actor and critic, reference and reward offloaded, bf16,
# hybrid generation mode.
# usage: ACTOR=step1_dir CRITIC=step2_dir bash scripts/step3_ppo/run_single_gpu.sh [OUTPUT_DIR (out/step3)] [extra args]
# env: ACTOR (default: $STEP1_DIR or out/step1), CRITIC (default: $STEP2_DIR or out/step2), DATA
#      ("src ..."; default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_gpu step3_ppo.main pairs \
  --data_split 0,5,5 \
  --actor_zero_stage 2 --critic_zero_stage 2 --offload_reference_model --offload_reward_model --dtype bf16 \
  --actor_lora_dim 128 --critic_lora_dim 128 --only_optimize_lora --actor_gradient_checkpointing \
  --critic_gradient_checkpointing --enable_hybrid_engine \
  --max_prompt_seq_len 256 --max_answer_seq_len 256 \
  --per_device_generation_batch_size 8 --per_device_training_batch_size 8 --ppo_epochs 1 \
  --actor_lora_learning_rate 5e-4 --critic_lora_learning_rate 5e-4 --num_train_epochs 1 --seed 1234 \
  -- "$@"
