#!/usr/bin/env bash
# Step 3 (PPO) on several nodes through the deepspeed launcher and a hostfile ("host slots=N" per
# line): ZeRO-3 for all four models, bf16, hybrid generation mode. The output directory must be on
# a filesystem every node sees.
# usage: HOSTFILE=./hostfile ACTOR=... CRITIC=... bash scripts/step3_ppo/run_multi_node.sh [OUTPUT_DIR (out/step3)] [extra args]
#        MULTI_NODE_MODE=no_ssh NODE_RANK=i MASTER_ADDR=host0 MASTER_PORT=p ... (one node per call)
# env: HOSTFILE (./hostfile), MULTI_NODE_MODE (ssh | no_ssh), NODE_RANK, MASTER_ADDR, MASTER_PORT,
#      ACTOR (default: $STEP1_DIR or out/step1), CRITIC (default: $STEP2_DIR or out/step2), DATA
#      ("src ..."; default data/demo/pairs), DTYPE (bf16). Log: OUTPUT_DIR/train.log.node$NODE_RANK
#      (node0 in ssh mode).
source "$(dirname "$0")/../common.sh"
launch_step multi_node step3_ppo.main pairs \
  --config configs/step3_ppo/ppo_multi_node.yaml ${DTYPE:+--dtype "$DTYPE"} \
  -- "$@"
