#!/usr/bin/env bash
# Step 2 (reward model) on one GPU: LoRA on the backbone (the value head always trains), bf16, ZeRO-0.
# usage: MODEL=path/to/step1/output bash scripts/step2_reward/run_single_gpu.sh [OUTPUT_DIR (out/step2)] [extra args]
# env: MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_gpu step2_reward.main pairs \
  --config configs/step2_reward/single_gpu_lora.yaml \
  -- "$@"
