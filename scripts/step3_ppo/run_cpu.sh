#!/usr/bin/env bash
# Step 3 (PPO) on CPU: 2 ranks (gloo), actor/reference from step 1, critic/reward from step 2, all
# ZeRO-3, hybrid generation mode, fp32, prompts from the demo pairs (the half step 2 did not use:
# --data_split 0,5,5). 15 iterations of 16 rollouts take 359 s on an idle 2-core machine
# (~21 s/iteration) for the demo's result.
# usage: bash scripts/step3_ppo/run_cpu.sh [OUTPUT_DIR (out/step3)] [extra step3_ppo/main.py arguments]
# env: ACTOR (default: $STEP1_DIR or out/step1), CRITIC (default: $STEP2_DIR or out/step2), DATA
#      ("src ..."; default data/demo/pairs), NUM_RANKS (2), MAX_STEPS (15), MASTER_PORT (a free one).
#      Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step cpu step3_ppo.main pairs \
  --config configs/step3_ppo/ppo_cpu.yaml ${MAX_STEPS:+--max_steps "$MAX_STEPS"} \
  -- "$@"
