#!/usr/bin/env bash
# Step 2, DPO (the alternative to the reward model: its output is a policy) on CPU: 2 ranks (gloo)
# through the deepspeed launcher, ZeRO-2, fp32, the demo pairs (the step-2 half, --data_split 0,5,5)
# and the step-1 output out/step1 when it exists, else the embedded SmolLM2-135M-Instruct.
# LoRA (rank 16, every Linear, base frozen): the reference is the same model with its adapters
# disabled, so no second copy is held; sigmoid DPO, beta 0.1, plus the chosen responses' NLL (RPO,
# --nll_loss_coef 1.0), 40 steps of 16 pairs (4 per rank x 2 accumulation x 2 ranks). Measured on the
# demo's step-1 model on 2026-12-01 (2-core CPU, nothing else running): held-out implicit-reward accuracy
# 0.80, margin 0.54, chosen log-prob -91.2 -> -89.8, in 13 min 4 s (14.7 s/step). Without the NLL term
# (accuracy 0.82, chosen log-prob -91.2 -> -107.8) the policy stopped ending its answers (EOS fraction
# 0.00, KL to SFT 15.6 nats, garbled text) although both judges preferred it.
# usage: bash scripts/step2_dpo/run_cpu.sh [OUTPUT_DIR (out/step2_dpo)] [extra step2_dpo/main.py arguments]
# env: MODEL (default: out/step1 if it holds a model, else SmolLM2-135M-Instruct), DATA (sources;
#      default data/demo/pairs), NUM_RANKS (2), MAX_STEPS (40), MASTER_PORT (a free one), LOSS_TYPE (sigmoid;
#      ipo as sigmoid; simpo: beta 2.0 (its paper's), the NLL term kept; orpo: its own NLL term, no beta;
#      kto: beta 0.1, each pair one desirable and one undesirable example).
#      Log: OUTPUT_DIR/train.log.
source "$(dirname "$0")/../common.sh"
# the preset is sigmoid DPO; another LOSS_TYPE layers its own preset on it (configs/step2_dpo/loss_LOSS.yaml)
case "${LOSS_TYPE:-sigmoid}" in
  sigmoid) LOSS=() ;;
  ipo|simpo|orpo|kto) LOSS=(--config "configs/step2_dpo/loss_$LOSS_TYPE.yaml") ;;
  *) echo "LOSS_TYPE must be sigmoid, ipo, simpo, orpo or kto, got $LOSS_TYPE" >&2; exit 2 ;;
esac
launch_step cpu step2_dpo.main pairs \
  --config configs/step2_dpo/cpu.yaml "${LOSS[@]}" ${MAX_STEPS:+--max_steps "$MAX_STEPS"} \
  -- "$@"
