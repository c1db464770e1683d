#!/usr/bin/env bash
# Step 3 (PPO) on one node with every local GPU: ZeRO-3 for all four models, bf16, hybrid generation mode.
# usage: ACTOR=step1_dir CRITIC=step2_dir bash scripts/step3_ppo/run_single_node.sh [OUTPUT_DIR (out/step3)] [extra args]
# env: ACTOR (default: $STEP1_DIR or out/step1), CRITIC (default: $STEP2_DIR or out/step2), DATA
#      ("src ..."; default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_node step3_ppo.main pairs \
  --config configs/step3_ppo/ppo_single_node.yaml \
  -- "$@"
