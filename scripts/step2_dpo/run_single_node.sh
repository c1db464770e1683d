#!/usr/bin/env bash
# Step 2, DPO on one node with every local GPU: ZeRO-3, bf16, full fine-tuning; the reference
# log-probs are computed once before training (--precompute_ref_log_probs), so no reference model
# is held while the policy trains (DeepSpeed-Chat's step2_dpo_finetuning: beta 0.1, lr ~1e-6 scale).
# usage: MODEL=path/to/step1/output bash scripts/step2_dpo/run_single_node.sh [OUTPUT_DIR (out/step2_dpo)] [extra args]
# env: MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), MASTER_PORT (a free one). Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
launch_step single_node step2_dpo.main pairs \
  --config configs/step2_dpo/single_node.yaml \
  -- "$@"
