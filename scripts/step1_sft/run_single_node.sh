#!/usr/bin/env bash
# Step 1 (SFT) on one node with every local GPU: ZeRO-3, bf16.
# usage: MODEL=path/or/hub-name bash scripts/step1_sft/run_single_node.sh [OUTPUT_DIR (out/step1)] [extra args]
# env: MODEL (default: the converted SmolLM2-135M-Instruct), DATA (sources; default data/demo/sft),
#      MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_node step1_sft.main sft \
  --config configs/step1_sft/single_node.yaml \
  -- "$@"
