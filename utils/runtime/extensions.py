"""DeepSpeed's JIT-built communication op: built per checkout, and never a silent wait on a dead build.

On CPU, DeepSpeed's process group loads its shared-memory all-reduce op (`ShareMemCommBuilder`,
`deepspeed_shm_comm`, deepspeed/comm/torch.py:build_shm_op), building it on first use through
torch.utils.cpp_extension under a `lock` file in its build folder that every other loader polls
for, forever and without a word. In the shared ~/.cache/torch_extensions two checkouts stall each
other, and a process killed while building leaves `lock` behind: every later run waits forever.

Here (1) the build folder is the checkout's own, `<repo>/.cache/torch_extensions`, unless
TORCH_EXTENSIONS_DIR says otherwise (scripts/common.sh and tests/launch.py set the same); (2) the op
is loaded before DeepSpeed starts the process group, under an fcntl lock of our own in the build
folder, which dies with its holder and names it (pid@host) to a waiter. Every loader of this project
holds that lock while torch's `lock` exists, so torch's `lock` found while we hold ours is stale: it
is removed, with one line naming it, and the build redone (ninja rebuilds what the killed build left
unfinished). Refusing instead would only make the user delete the same file by hand. A process
outside the project building in the same folder is not covered: keep TORCH_EXTENSIONS_DIR per checkout.
`python -m utils.runtime.extensions` builds the op ahead of any run (scripts/setup.sh).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
from typing import Callable

from utils.runtime.cache_dir import REPO_ROOT

CHECKOUT_DIR = os.path.join(REPO_ROOT, ".cache", "torch_extensions")
TORCH_LOCK = "lock"  # torch.utils.cpp_extension's FileBaton in the op's build folder
OUR_LOCK = ".rlhf_build.lock"


def use_interpreter_tools() -> None:
    """This interpreter's bin folder first on PATH, as an activated venv has it. torch builds with the first
    `ninja` on PATH, and the venv's (pip, 1.13) and the system's (1.11) log their builds differently: runs
    with the venv activated (the scripts) and without (`.venv/bin/python`, the tests) rebuilt the op for
    each other, 20-25 s each time. Process-wide, so DeepSpeed's later JIT builds (cpu_adam) agree too."""
    tools = os.path.dirname(sys.executable)
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != tools:
        os.environ["PATH"] = os.pathsep.join([tools, path]) if path else tools


def use_checkout_dir() -> str:
    """TORCH_EXTENSIONS_DIR, set to this checkout's folder unless the user chose one; returns it."""
    return os.environ.setdefault("TORCH_EXTENSIONS_DIR", CHECKOUT_DIR)


@contextlib.contextmanager
def build_lock(build_dir: str, say: Callable[[str], None] = print, say_after_s: float = 10.0):
    """Hold our lock on `build_dir` (waiting for a live holder, named after `say_after_s`), with torch's
    stale `lock` removed first."""
    os.makedirs(build_dir, exist_ok=True)
    fd = os.open(os.path.join(build_dir, OUR_LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _acquire(fd, build_dir, say, say_after_s)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
        stale = os.path.join(build_dir, TORCH_LOCK)
        if os.path.exists(stale):
            say(
                f"[extensions] removed the stale build lock {stale} (its build was killed: no process holds "
                f"{OUR_LOCK}); rebuilding"
            )
            os.remove(stale)
        yield
    finally:
        os.close(fd)  # releases the flock


def _acquire(fd: int, build_dir: str, say: Callable[[str], None], say_after_s: float) -> None:
    """flock `fd`, polling; one line names the holder once the wait exceeds `say_after_s`."""
    start, said = time.time(), False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if not said and time.time() - start > say_after_s:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "pid unknown"
                say(
                    f"[extensions] waiting for {holder} (pid@host), which is building or loading a DeepSpeed op "
                    f"in {build_dir}"
                )
                said = True
            time.sleep(0.1)


def comm_op_builder():
    """DeepSpeed's shared-memory comm op builder on this accelerator (None where there is none: CUDA)."""
    import deepspeed.ops  # lazy: +0.5 s on every --help (deepspeed)
    from deepspeed.accelerator import get_accelerator  # lazy: +0.5 s on every --help (deepspeed)

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    return builder


def load_comm_op(say: Callable[[str], None] = print) -> str | None:
    """Build (first time) and load the op DeepSpeed's process group will use, under our lock; DeepSpeed
    then finds it loaded. Returns its build folder (None: nothing to build here)."""
    from torch.utils.cpp_extension import _get_build_directory  # lazy: +0.15 s on every --help

    use_checkout_dir()
    use_interpreter_tools()
    builder = comm_op_builder()
    if builder is None:
        return None
    build_dir = _get_build_directory(builder.NAME, False)
    with build_lock(build_dir, say):
        builder.load()
    return build_dir


def main() -> int:
    """Prebuild the op (scripts/setup.sh), so that no run pays for the build or waits on another's."""
    build_dir = load_comm_op()
    os.makedirs(use_checkout_dir(), exist_ok=True)  # done: scripts/setup.sh asks again only when it is missing
    print(
        f"[setup] DeepSpeed's communication op is built in {build_dir}"
        if build_dir
        else "[setup] no DeepSpeed communication op to build on this accelerator"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
