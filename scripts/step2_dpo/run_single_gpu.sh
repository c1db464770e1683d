#!/usr/bin/env bash
# Step 2, DPO on one GPU: LoRA (the reference is the model with its adapters disabled: one copy in
# memory), bf16, ZeRO-0, gradient checkpointing.
# usage: MODEL=path/to/step1/output bash scripts/step2_dpo/run_single_gpu.sh [OUTPUT_DIR (out/step2_dpo)] [extra args]
# env: MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_gpu step2_dpo.main pairs \
  --config configs/step2_dpo/single_gpu_lora.yaml \
  -- "$@"
