#!/usr/bin/env bash
# The step-2 alternatives side by side on the demo's data and settings (the DPO-family results table): the demo's
# step 1 and step 2 (reward model, for the evaluation's RM column), then scripts/step2_dpo/run_cpu.sh
# once per loss from the same step-1 model (LOSS_TYPE: each loss with its own flags), then one
# step3_ppo.eval of every output against SFT on the demo's 128 held-out prompts (reward model, both
# judges with 95% intervals, KL to SFT, lengths, EOS fraction).
# usage: bash bench/preference_losses.sh [OUTPUT_ROOT (bench/runs/preference_losses)] [LOSS ...]
#        (losses: default sigmoid simpo orpo). Report: OUTPUT_ROOT/report.txt (each loss's held-out
#        accuracy and margin before -> after, its time and peak memory per rank, then the evaluation table).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$(mkdir -p "${1:-$ROOT/bench/runs/preference_losses}" && cd "${1:-$ROOT/bench/runs/preference_losses}" && pwd)"
shift $(( $# > 0 ? 1 : 0 ))
LOSSES=("$@"); [ ${#LOSSES[@]} -gt 0 ] || LOSSES=(sigmoid simpo orpo)
cd "$ROOT"
start=$(date +%s)
REPORT="$OUT/report.txt"
echo "# bench/preference_losses.sh on $(date -u +%F) ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores)" > "$REPORT"
if [ ! -f "$OUT/step1/model.safetensors" ] || [ ! -f "$OUT/step2/model.safetensors" ]; then
  t0=$(date +%s)
  bash scripts/demo.sh --step 1 2 --output_root "$OUT"
  echo "steps 1-2 (the demo's): $(( $(date +%s) - t0 )) s" >> "$REPORT"
fi
source scripts/common.sh
POLICIES=()
for loss in "${LOSSES[@]}"; do
  t0=$(date +%s)
  LOSS_TYPE="$loss" MODEL="$OUT/step1" bash scripts/step2_dpo/run_cpu.sh "$OUT/$loss" --overwrite_output_dir
  wall=$(( $(date +%s) - t0 ))
  python - "$OUT/$loss" "$loss" "$wall" >> "$REPORT" <<'EOF'
import json, sys
out, loss, wall = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
evals = [r for r in rows if "eval/loss" in r]
before, after = evals[0], evals[-1]
peak = max(r.get("mem/training_peak_gb", 0.0) for r in rows)
train_s = max(r.get("time/train_s", 0.0) for r in rows)
steps = max(r.get("step", 0) for r in rows)
def fmt(value):  # the accuracy of a reference-based loss before training is undefined (not logged)
    return "undefined" if value is None else f"{value:.3f}"
if "eval/examples" in after:  # KTO: no pairs to rank
    figures = (f"held-out margin {before['eval/margin']:.3f} -> {after['eval/margin']:.3f} (desirable reward "
               f"{after['eval/desirable_reward']:.3f}, undesirable {after['eval/undesirable_reward']:.3f}, z0 "
               f"{after['eval/z0']:.3f}), logp {after['eval/logp']:.1f}")
else:
    figures = (f"held-out accuracy {fmt(before.get('eval/accuracy'))} -> {fmt(after.get('eval/accuracy'))}, margin "
               f"{before['eval/margin']:.3f} -> {after['eval/margin']:.3f}, chosen logp {before['eval/chosen_logp']:.1f} "
               f"-> {after['eval/chosen_logp']:.1f}")
print(f"{loss}: {figures}; training {train_s:.0f} s ({train_s / max(steps, 1):.1f} s/step), "
      f"the run {wall} s; peak {peak:.2f} GiB per rank")
EOF
  POLICIES+=(--policy "$loss=$OUT/$loss")
done
t0=$(date +%s)
OMP_NUM_THREADS=2 python -m step3_ppo.eval --sft_model "$OUT/step1" "${POLICIES[@]}" --reward_model "$OUT/step2" \
  --prompts "$DEMO_DATA/pairs/eval.jsonl" --num_prompts 128 --out "$OUT/eval.json" | tee "$OUT/eval.txt"
echo "evaluation: $(( $(date +%s) - t0 )) s; all: $(( $(date +%s) - start )) s" >> "$REPORT"
cat "$OUT/eval.txt" >> "$REPORT"
cat "$REPORT"
