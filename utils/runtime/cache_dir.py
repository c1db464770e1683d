"""The project's cache folder (converted default model, tiny test models) and how entries are made."""

from __future__ import annotations

import os
import sys

# the checkout's root: the cache, the JIT op's folder and the worker's PYTHONPATH are found from it (one home)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def default_cache_root() -> str:
    """`$RLHF_CACHE`, else `<repo>/.cache`."""
    return os.environ.get("RLHF_CACHE") or os.path.join(REPO_ROOT, ".cache")


def relax_permissions(path: str) -> None:
    """mkdtemp makes 0700 dirs (and save_pretrained may write 0600 files): apply the usual umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            os.chmod(full, 0o666 & ~umask)


def print_path_for_scripts(make_path) -> None:
    """Run `make_path()` with everything it prints sent to stderr, then print only its result.

    Shell scripts read a model folder as `$(python -m ... --print_path)`. Libraries imported on
    the way (DeepSpeed's accelerator warning, op builds) write to stdout, some of them at the file
    descriptor level, so fd 1 itself is pointed at stderr while the work runs.
    """
    sys.stdout.flush()
    saved_stdout = os.dup(1)
    try:
        os.dup2(2, 1)
        path = make_path()
        sys.stdout.flush()
    finally:
        os.dup2(saved_stdout, 1)
        os.close(saved_stdout)
    print(path, flush=True)
