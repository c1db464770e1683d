#!/usr/bin/env bash
# Sets up (idempotent, with vLLM for the rollout-engine tests), lints, then runs the whole test suite on CPU.
# Extra arguments go to pytest; test files or ids among them (tests/...) run instead of the whole suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" --with-vllm
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RLHF_TESTS_NEED_VLLM=1  # installed just above: a missing vLLM fails its tests instead of skipping them
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"  # as scripts/common.sh
# Two test processes (pytest-xdist; RLHF_TEST_WORKERS, or -n 0 among the arguments, says otherwise): alone, one
# left a core idle about half the time (the fast tier is single-threaded, the multi-rank runs wait on start-ups
# and on each other). --dist worksteal: an idle worker takes tests queued on the other.
targets=(tests)
for arg in "$@"; do case "$arg" in tests|tests/*) targets=() ;; esac; done
# The linter and the format check first (about a second; settings in pyproject.toml): the whole suite's runs only,
# so that one test file can be run while its module is being edited.
if [ "${#targets[@]}" -gt 0 ]; then
  .venv/bin/ruff check --quiet . || { echo "error: ruff check failed (fix, or .venv/bin/ruff check --fix .)" >&2; exit 1; }
  .venv/bin/ruff format --check --quiet . || { echo "error: not formatted (.venv/bin/ruff format .)" >&2; exit 1; }
  # The docs site (mkdocs.yml): --strict fails on a broken internal link, a page missing from the nav or a nav entry
  # without its page; its output only when it fails. Generated reference pages are checked by tests/test_docs_reference.py.
  docs_log="$(NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$ROOT/.cache/site" 2>&1)" \
    || { echo "$docs_log" | grep -v '^INFO' >&2; echo "error: the docs site does not build (mkdocs build --strict)" >&2; exit 1; }
fi
exec .venv/bin/python -m pytest "${targets[@]}" -q -p no:cacheprovider -n "${RLHF_TEST_WORKERS:-2}" --dist worksteal "$@"
