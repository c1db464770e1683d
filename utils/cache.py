"""The project's cache folder (converted default model, tiny test models) and how entries are made."""
from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
