#!/usr/bin/env bash
# Creates .venv at the repository root and installs the pinned requirements. Idempotent: when the
# requirement files have not changed since the last successful run it returns in about a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
STAMP=.venv/.requirements.sha256
want="$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
# DeepSpeed's CPU communication op, built into TORCH_EXTENSIONS_DIR ahead of any run (about 40 s), so that no
# run pays for it or waits on another's build (utils/extensions.py); after an install, or while the folder is
# missing (a run rebuilds a missing or outdated op itself)
prebuild_ops() {
  HF_HUB_OFFLINE=1 .venv/bin/python -m utils.extensions 2>&1 | grep '^\[setup\]\|^\[extensions\]\|rror' || true
}
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  [ -d "$TORCH_EXTENSIONS_DIR" ] || prebuild_ops
  exit 0
fi
echo "[setup] creating .venv and installing requirements (about a minute on a fresh machine)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
.venv/bin/python -c "import torch, deepspeed, transformers, peft, datasets; print('[setup] torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" 2>&1 | grep '^\[setup\]'
prebuild_ops  # against the torch just installed (ninja rebuilds when its headers changed)
echo "$want" > "$STAMP"
