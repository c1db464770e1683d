#!/usr/bin/env bash
# Step 3 on CPU: 2 ranks (gloo), actor/reference from step 1, critic/reward from step 2, all ZeRO-3,
# hybrid generation mode, prompts from the demo pairs (the half step 2 did not use). 15 iterations
# of 16 rollouts take 359 s on an idle 2-core machine (~21 s/iteration) for the demo's result.
# usage: bash scripts/step3_ppo/run_cpu.sh [OUTPUT_DIR] [extra step3_ppo/main.py arguments]
#        ACTOR=dir CRITIC=dir DATA="src ..." override the inputs.
source "$(dirname "$0")/../common.sh"
OUTPUT="${1:-$ROOT/out/step3}"; shift || true
ACTOR="${ACTOR:-${STEP1_DIR:-$ROOT/out/step1}}"
CRITIC="${CRITIC:-${STEP2_DIR:-$ROOT/out/step2}}"
if [ -z "${DATA:-}" ]; then ensure_demo_data; DATA="$DEMO_DATA/pairs"; fi
mkdir -p "$OUTPUT"
deepspeed --num_gpus "${NUM_RANKS:-2}" --master_port "$MASTER_PORT" --module step3_ppo.main \
  --actor_model_name_or_path "$ACTOR" --critic_model_name_or_path "$CRITIC" \
  --data_path $DATA --data_split 0,5,5 \
  --actor_zero_stage 3 --critic_zero_stage 3 --enable_hybrid_engine --dtype fp32 \
  --max_prompt_seq_len 24 --max_answer_seq_len 24 --min_answer_seq_len 2 --temperature 1.0 --top_k 50 \
  --per_device_generation_batch_size 8 --generation_batches 1 --per_device_training_batch_size 4 --ppo_epochs 1 \
  --actor_learning_rate 2e-5 --critic_learning_rate 5e-5 --lr_scheduler_type constant \
  --kl_ctl 0.05 --clip_reward_value 5 --max_steps "${MAX_STEPS:-15}" --seed 1234 --print_answers \
  --print_answers_interval 10 --output_dir "$OUTPUT" "$@" 2>&1 | tee "$OUTPUT/train.log"
exit "${PIPESTATUS[0]}"
