#!/usr/bin/env bash
# Step 2, DPO on several nodes through the deepspeed launcher and a hostfile ("host slots=N" per
# line): ZeRO-3, bf16, full fine-tuning, a frozen ZeRO-3 reference engine partitioned like the policy.
# The output directory must be on a filesystem every node sees.
# usage: HOSTFILE=./hostfile MODEL=... bash scripts/step2_dpo/run_multi_node.sh [OUTPUT_DIR (out/step2_dpo)] [extra args]
#        MULTI_NODE_MODE=no_ssh NODE_RANK=i MASTER_ADDR=host0 MASTER_PORT=p ... (one node per call)
# env: HOSTFILE (./hostfile), MULTI_NODE_MODE (ssh | no_ssh), NODE_RANK, MASTER_ADDR, MASTER_PORT,
#      MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), DTYPE (bf16). Log: OUTPUT_DIR/train.log.node$NODE_RANK (node0 in ssh mode).
source "$(dirname "$0")/../common.sh"
launch_step multi_node step2_dpo.main pairs \
  --config configs/step2_dpo/multi_node.yaml ${DTYPE:+--dtype "$DTYPE"} \
  -- "$@"
