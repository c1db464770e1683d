#!/usr/bin/env bash
# Step 3 with GRPO on one node with every local GPU: the verifiable task of run_grpo_cpu.sh with
# GPU-sized batches, bf16, ZeRO-3 + hybrid generation; no critic, no reward model, 8 answers per prompt.
# usage: bash scripts/step3_ppo/run_grpo_single_node.sh [OUTPUT_DIR (out/step3)] [extra step3_ppo/main.py arguments]
# env: ACTOR (default: the embedded SmolLM2-135M-Instruct), DATA (prompt rows with an 'answer' field;
#      default data/arithmetic), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
# The settings: configs/step3_ppo/grpo_arithmetic_gpu.yaml (shared with the other GPU GRPO script).
source "$(dirname "$0")/../common.sh"
grpo_inputs || exit
launch_step single_node step3_ppo.main arithmetic \
  --config configs/step3_ppo/grpo_arithmetic_gpu.yaml \
  -- "$@"
