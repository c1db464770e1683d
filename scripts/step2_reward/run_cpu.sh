#!/usr/bin/env bash
# Step 2 (reward model) on CPU: 2 ranks (gloo) through the deepspeed launcher, ZeRO-2, fp32, the demo
# pairs (the step-2 half, --data_split 0,5,5; step 3 uses the other half) and the step-1 output
# out/step1 when it exists, else the embedded SmolLM2-135M-Instruct.
# LoRA (rank 16, every Linear of the backbone, base frozen) + the value head, 40 steps of 16 pairs
# (4 per rank x 2 accumulation x 2 ranks). Measured on SmolLM2-135M-Instruct on an idle 2-core
# machine: held-out accuracy 0.53 -> 0.88 on the 300 eval pairs in 291 s (5.0 s/step; ZeRO-3: 8.3).
# usage: bash scripts/step2_reward/run_cpu.sh [OUTPUT_DIR (out/step2)] [extra step2_reward/main.py arguments]
# env: MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), NUM_RANKS (2), MAX_STEPS (40), MASTER_PORT (a free one).
#      Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step cpu step2_reward.main pairs \
  --config configs/step2_reward/cpu.yaml ${MAX_STEPS:+--max_steps "$MAX_STEPS"} \
  -- "$@"
