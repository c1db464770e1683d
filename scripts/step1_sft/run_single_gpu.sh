#!/usr/bin/env bash
# Step 1 (SFT) on one GPU: LoRA so a small GPU fits larger models, bf16, ZeRO-0.
# usage: MODEL=path/or/hub-name bash scripts/step1_sft/run_single_gpu.sh [OUTPUT_DIR (out/step1)] [extra args]
# env: MODEL (default: the converted SmolLM2-135M-Instruct), DATA (sources; default data/demo/sft),
#      MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_gpu step1_sft.main sft \
  --config configs/step1_sft/single_gpu_lora.yaml \
  -- "$@"
