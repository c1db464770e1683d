#!/usr/bin/env bash
# Step 1 (SFT) on CPU: 2 ranks (gloo) through the deepspeed launcher, ZeRO-2, fp32, the demo data and
# the embedded SmolLM2-135M-Instruct. ZeRO-2, not 3: on one CPU machine ZeRO-3's per-layer gathers
# cost more time than the memory they save for a 135M model (pass --zero_stage 3 to try; the tests
# run step 1 under ZeRO-3). Measured on an idle 2-core machine: held-out perplexity 132.6 -> 48.5 in
# 275 s (40 steps of 16 sequences, 5.9 s/step; ZeRO-3: 6.7).
# usage: bash scripts/step1_sft/run_cpu.sh [OUTPUT_DIR (out/step1)] [extra step1_sft/main.py arguments]
# env: MODEL (default: the converted SmolLM2-135M-Instruct), DATA (sources; default data/demo/sft),
#      NUM_RANKS (2), MAX_STEPS (40), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step cpu step1_sft.main sft \
  --config configs/step1_sft/cpu.yaml ${MAX_STEPS:+--max_steps "$MAX_STEPS"} \
  -- "$@"
