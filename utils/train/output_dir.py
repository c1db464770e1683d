"""One run per output directory, and deletions that stay inside it.

A run holds an OS lock (fcntl.flock) on OUTPUT_DIR/.run.lock from its flag checks until the process
exits: the kernel drops it when the process dies, however it dies, so a killed run never leaves a
lock behind. The file holds the holder's pid@host, which a refused second run names. Without it two
runs started into one directory both exit 0, one's metrics next to the other's model.

Only rank 0 locks (RANK unset: a run without a launcher is rank 0): on the shared filesystem a
multi-node run needs, a lock per node's local rank 0 would make node 1 find node 0's lock and refuse
its own run. The lock is released by `release` at the end of an in-process run (tests run several
in one interpreter), or with the process.

This module imports nothing of the project but utils.errors (utils/train/flags.py calls it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time

from utils.errors import ProjectError

LOCK_FILE = ".run.lock"

_held: dict[str, int] = {}  # realpath of a locked output directory -> the open file holding its lock


class OutputDirBusy(ProjectError):
    """Another live run holds the output directory's lock; str() names its pid@host."""


def lock_output_dir(path: str, flag: str = "--output_dir") -> bool:
    """Take the run's lock on `path` (made if missing) on rank 0; other ranks take none. Raises
    OutputDirBusy at once when a live process holds it. Returns whether this process holds it."""
    if os.environ.get("RANK", "0") != "0":
        return False
    real = os.path.realpath(path)
    if real in _held:
        return True
    os.makedirs(real, exist_ok=True)
    fd = os.open(os.path.join(real, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid, _, host = _owner(fd).partition("@")
        os.close(fd)
        raise OutputDirBusy(
            f"{flag} {path} is in use by another run (pid {pid} on {host or 'an unknown host'}): "
            f"wait for it to end, or choose another {flag}"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}@{socket.gethostname()}\n".encode())
    _held[real] = fd
    return True


def _owner(fd: int, wait_s: float = 1.0) -> str:
    """The holder's pid@host (it writes it right after locking: read again briefly if still empty)."""
    deadline = time.time() + wait_s
    while True:
        text = os.pread(fd, 256, 0).decode(errors="replace").strip()
        if text or time.time() > deadline:
            return text or "unknown"
        time.sleep(0.05)


def holds_lock(path: str) -> bool:
    return os.path.realpath(path) in _held


def release(path: str | None = None) -> None:
    """Drop this process's lock on `path` (every lock it holds when None); the file stays, as
    unlinking a lock file lets two later runs lock two different files."""
    for real in [os.path.realpath(path)] if path is not None else list(_held):
        fd = _held.pop(real, None)
        if fd is not None:
            os.close(fd)


def is_within(path: str, directory: str) -> bool:
    """`path` is `directory` or inside it, symlinks resolved on both sides."""
    path, directory = os.path.realpath(path), os.path.realpath(directory)
    return path == directory or path.startswith(directory.rstrip(os.sep) + os.sep)


def remove_entry(path: str) -> None:
    """Delete `path` without following a symlink: a link is unlinked (its target is not ours), a real
    folder is removed by rmtree (which unlinks the links inside it), a file is removed."""
    if os.path.islink(path) or os.path.isfile(path):
        os.remove(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
