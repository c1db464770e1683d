#!/usr/bin/env bash
# Sets up, then runs the whole pipeline (step 1 SFT -> step 2 reward model -> step 3 PPO) on the
# embedded default model (SmolLM2-135M-Instruct) and the IMDB/Rotten-Tomatoes demo task, on CPU.
# usage: bash scripts/demo.sh [--step 1 2 3] [--output_root DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS=(1 2 3)
OUTPUT_ROOT="$ROOT/out"
while [ $# -gt 0 ]; do
  case "$1" in
    --step) shift; STEPS=(); while [ $# -gt 0 ] && [[ "$1" =~ ^[123]$ ]]; do STEPS+=("$1"); shift; done ;;
    --output_root) OUTPUT_ROOT="$2"; shift 2 ;;
    *) echo "unknown argument: $1 (use --step 1 2 3, --output_root DIR)" >&2; exit 2 ;;
  esac
done
bash "$ROOT/scripts/setup.sh"
start=$(date +%s)
for step in "${STEPS[@]}"; do
  case "$step" in
    1) script="$ROOT/scripts/step1_sft/run_cpu.sh"; out="$OUTPUT_ROOT/step1" ;;
    2) script="$ROOT/scripts/step2_reward/run_cpu.sh"; out="$OUTPUT_ROOT/step2" ;;
    3) script="$ROOT/scripts/step3_ppo/run_cpu.sh"; out="$OUTPUT_ROOT/step3" ;;
  esac
  if [ ! -f "$script" ]; then echo "[demo] step $step is not implemented yet; skipping"; continue; fi
  echo "[demo] step $step -> $out"
  STEP1_DIR="$OUTPUT_ROOT/step1" STEP2_DIR="$OUTPUT_ROOT/step2" bash "$script" "$out"
done
echo "[demo] finished in $(( $(date +%s) - start )) s; outputs under $OUTPUT_ROOT"
