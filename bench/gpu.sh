#!/usr/bin/env bash
# ONE prepared check for a machine with one GPU and no network: steps 1-3 on a tiny model and on a
# SmolLM2-135M-shaped one in bf16 (ZeRO-3 + hybrid generation mode), the lr=0 invariant on CUDA in
# fp32 with TF32 off, the run_single_gpu.sh configurations (LoRA, offloaded frozen models), and the
# generation benchmark, then step 1's training tokens/s and MFU (bench/sft_throughput.py's figures, on
# rows of a fixed length); prints s/step, tokens/s and peak memory per phase, and writes a dated report
# to bench/results/ (and to $OUT). bench/gpu_run.py is the body and lists the runs; the chunked log-probs'
# memory row (bench/chunked_logprobs.py) runs after it.
#
# On the GPU machine (no network; its own python3 and CUDA torch; no deepspeed): first, HERE,
#   bash bench/gpu_prepare.sh                       # wheels, SmolLM2's config+tokenizer, demo data
# then copy the tree with bench/gpu_carry to the GPU machine and run there:
#   bash bench/gpu.sh                                (ends in about 7 minutes: GPU_RUN_BUDGET_S=330 + the row)
# Without CUDA it runs its CPU fallback (tiny model, the same runs) in the repository's venv:
#   bash bench/gpu.sh
# env: GPU_SH_PYTHON (the python to use; default python3 when it sees CUDA, else .venv/bin/python),
#      GPU_SH_INSTALL=1 (install bench/gpu_carry/wheels into a private folder first: default on a GPU),
#      GPU_SH_CHUNKED=0 (skip the chunked log-probs row), GPU_SH_CHUNKED_TIMEOUT (its limit, seconds: 240),
#      GPU_RUN_BUDGET_S, GPU_RUN_WORK, and gpu_run.py's flags after the script's name.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ -z "${GPU_SH_PYTHON:-}" ] && command -v python3 >/dev/null && \
   python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  GPU_SH_PYTHON="$(command -v python3)"; GPU_SH_INSTALL="${GPU_SH_INSTALL:-1}"
fi
if [ -z "${GPU_SH_PYTHON:-}" ]; then
  [ -x "$ROOT/.venv/bin/python" ] || bash "$ROOT/scripts/setup.sh" || exit 1
  GPU_SH_PYTHON="$ROOT/.venv/bin/python"
fi
SITE="${TMPDIR:-/tmp}/rlhf_gpu_site"
if [ "${GPU_SH_INSTALL:-0}" = 1 ]; then
  ls "$ROOT"/bench/gpu_carry/wheels/*.whl >/dev/null 2>&1 || {
    echo "error: bench/gpu_carry/wheels is empty: run 'bash bench/gpu_prepare.sh' on a machine with network" \
         "and carry bench/gpu_carry" >&2; exit 2; }
  rm -rf "$SITE"
  "$GPU_SH_PYTHON" -m pip install --quiet --no-deps --no-index --disable-pip-version-check --target "$SITE" \
    "$ROOT"/bench/gpu_carry/wheels/*.whl || exit 1
  export PYTHONPATH="$SITE:$ROOT"
else
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
# the launch scripts call `python` and `deepspeed`: both on PATH, both this python's
mkdir -p "$SITE/bin"
ln -sf "$GPU_SH_PYTHON" "$SITE/bin/python"
printf '#!/bin/sh\nexec "%s" -m deepspeed.launcher.runner "$@"\n' "$GPU_SH_PYTHON" > "$SITE/bin/deepspeed"
chmod +x "$SITE/bin/deepspeed"
export PATH="$SITE/bin:$PATH" RLHF_USE_CURRENT_ENV=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
timeout "${GPU_SH_TIMEOUT:-400}" "$GPU_SH_PYTHON" bench/gpu_run.py "$@"
rc=$?
# The chunked LM head's row (GPU_SH_CHUNKED=0 skips it): peak memory of one actor step's log-prob forward and
# backward, --logprob_chunk_tokens 256/512/1024 against the whole logits (0), 8 rows of 384-token answers; on a
# GPU a SmolLM2-135M-shaped random model (torch.cuda.max_memory_allocated, about a minute), in the CPU fallback
# (no CUDA, or --mode cpu) the tiny model. Its report goes to bench/results/chunked_logprobs/ (on a GPU) and to $OUT.
if [ "${GPU_SH_CHUNKED:-1}" = 1 ]; then
  chunked=(--batch 8 --chunks 0,256,512,1024)
  if [[ " $* " == *" --mode cpu "* ]] || \
     ! "$GPU_SH_PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    chunked+=(--tiny --device cpu); tag=cpu-fallback
  else
    chunked+=(--device cuda); tag=gpu
  fi
  # a GPU's report joins the benchmark's results; the CPU fallback's (a check that it runs) stays in the temp dir,
  # where it cannot become chunked_logprobs' latest result in bench/results/INDEX.md
  results="$ROOT/bench/results/chunked_logprobs"
  [ "$tag" = gpu ] || { results="${TMPDIR:-/tmp}/rlhf_gpu_chunked"; mkdir -p "$results"; }
  save="$results/$(date +%F)-$tag.txt"
  timeout "${GPU_SH_CHUNKED_TIMEOUT:-240}" "$GPU_SH_PYTHON" bench/chunked_logprobs.py "${chunked[@]}" --save "$save" \
    || { echo "[gpu.sh] chunked_logprobs failed (exit $?)" >&2; [ "$rc" = 0 ] && rc=1; }
  [ -n "${OUT:-}" ] && [ -f "$save" ] && cp "$save" "${save%.txt}.json" "$OUT"/ 2>/dev/null
fi
exit "$rc"
