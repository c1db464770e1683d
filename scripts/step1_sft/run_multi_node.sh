#!/usr/bin/env bash
# Step 1 (SFT) on several nodes through the deepspeed launcher and a hostfile ("host slots=N" per
# line): ZeRO-3, bf16. The output directory must be on a filesystem every node sees.
# usage: HOSTFILE=./hostfile MODEL=... bash scripts/step1_sft/run_multi_node.sh [OUTPUT_DIR (out/step1)] [extra args]
#        MULTI_NODE_MODE=no_ssh NODE_RANK=i MASTER_ADDR=host0 MASTER_PORT=p ... (one node per call)
# env: HOSTFILE (./hostfile), MULTI_NODE_MODE (ssh | no_ssh), NODE_RANK, MASTER_ADDR, MASTER_PORT,
#      MODEL (default: the converted SmolLM2-135M-Instruct), DATA (sources; default data/demo/sft),
#      DTYPE (bf16). Log: OUTPUT_DIR/train.log.node$NODE_RANK (node0 in ssh mode).
source "$(dirname "$0")/../common.sh"
launch_step multi_node step1_sft.main sft \
  --config configs/step1_sft/multi_node.yaml ${DTYPE:+--dtype "$DTYPE"} \
  -- "$@"
