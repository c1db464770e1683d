"""The `python` tool's sandbox: runs one piece of model-written code so that it cannot write outside a fresh
folder, reach TCP, signal the trainer, or outlive its timeout. Standard library only: it is started as
`python -I -u python_sandbox.py FOLDER TIMEOUT MEMORY FILE_SIZE` (isolated: no PYTHON* variables, no user
site, no script folder on sys.path) with the code on stdin; step3_ppo/agents/tools.py starts it, one per call.

Two processes. The keeper (this script's main) confines itself with Landlock (below), becomes the child
subreaper, then forks the runner, which adds resource limits and a nested Landlock domain that only
scopes signals (so the code cannot kill its keeper) and runs the code. At the runner's end or at the
timeout the keeper kills every process left under it, including ones that left the process group with
setsid (orphans are reparented to the subreaper), and exits: 124 past the timeout, else the runner's
status (128 + signal for a signal; the code's own 124 or 125 as 1); a SIGTERM (tools.py: too much output) ends it all
the same way.

Landlock (Linux >= 5.13, ABI from `landlock_abi()`) is the part that cannot be skipped: every write-type
filesystem right the kernel knows (write, truncate, create/remove files, directories, links, devices,
sockets and fifos, rename across folders, device ioctls) is handled and allowed only beneath FOLDER and on
/dev/null; reads and execution stay allowed (imports need them). ABI >= 4 also denies TCP bind and connect
(UDP is not covered), ABI >= 6 scopes signals and abstract unix sockets to the sandbox. Without Landlock
the keeper refuses to run the code (exit 125); tools.py checks the ABI before it starts one.
"""

from __future__ import annotations

import ctypes
import linecache
import os
import resource
import select
import signal
import struct
import sys
import time
import traceback

TIMED_OUT, REFUSED = 124, 125  # the keeper's exit status past the timeout / without a sandbox

_LANDLOCK_CREATE_RULESET, _LANDLOCK_ADD_RULE, _LANDLOCK_RESTRICT_SELF = 444, 445, 446  # every architecture
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS, _PR_SET_CHILD_SUBREAPER = 38, 36

# filesystem rights that change something, and the ABI that introduced each
_WRITE_RIGHTS = {
    1 << 1: 1,  # WRITE_FILE
    1 << 4: 1,  # REMOVE_DIR
    1 << 5: 1,  # REMOVE_FILE
    1 << 6: 1,  # MAKE_CHAR
    1 << 7: 1,  # MAKE_DIR
    1 << 8: 1,  # MAKE_REG
    1 << 9: 1,  # MAKE_SOCK
    1 << 10: 1,  # MAKE_FIFO
    1 << 11: 1,  # MAKE_BLOCK
    1 << 12: 1,  # MAKE_SYM
    1 << 13: 2,  # REFER (rename or link across folders)
    1 << 14: 3,  # TRUNCATE
    1 << 15: 5,  # IOCTL_DEV
}
_FILE_RIGHTS = (1 << 1) | (1 << 14) | (1 << 15)  # the ones a rule on a single file (/dev/null) may carry
_NET_TCP = (1 << 0) | (1 << 1)  # BIND_TCP, CONNECT_TCP (ABI 4)
_SCOPES = (1 << 0) | (1 << 1)  # ABSTRACT_UNIX_SOCKET, SIGNAL (ABI 6)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SandboxError(OSError):
    """Landlock could not be applied: the code must not run."""


def _syscall(number: int, *args) -> int:
    result = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise SandboxError(err, f"syscall {number}: {os.strerror(err)}")
    return result


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where it has none (too old, not built in, or disabled at boot)."""
    try:
        return _syscall(
            _LANDLOCK_CREATE_RULESET,
            ctypes.c_void_p(None),
            ctypes.c_size_t(0),
            ctypes.c_uint32(_CREATE_RULESET_VERSION),
        )
    except SandboxError:
        return 0


def write_rights(abi: int) -> int:
    """The write-type filesystem rights this ABI knows (a ruleset may not name newer ones)."""
    return sum(right for right, since in _WRITE_RIGHTS.items() if since <= abi)


def _ruleset(abi: int, fs: int, net: int, scoped: int) -> int:
    """A new ruleset's fd; the attribute struct is as long as this ABI's (8, 16 or 24 bytes)."""
    fields = (fs, net, scoped)[: 3 if abi >= 6 else 2 if abi >= 4 else 1]
    attr = ctypes.create_string_buffer(struct.pack(f"={len(fields)}Q", *fields), 8 * len(fields))
    return _syscall(_LANDLOCK_CREATE_RULESET, attr, ctypes.c_size_t(8 * len(fields)), ctypes.c_uint32(0))


def _allow_beneath(ruleset: int, path: str, rights: int) -> None:
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        attr = ctypes.create_string_buffer(struct.pack("=Qi", rights, fd), 12)  # packed struct
        _syscall(_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH), attr, ctypes.c_uint32(0))
    finally:
        os.close(fd)


def _restrict_self(ruleset: int) -> None:
    try:
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise SandboxError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        _syscall(_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)


def confine(folder: str, abi: int) -> None:
    """This process and all it starts: writes only beneath `folder` (and to /dev/null), no TCP (ABI >= 4),
    signals and abstract unix sockets only within the sandbox (ABI >= 6)."""
    if abi < 1:
        raise SandboxError(0, "this kernel has no Landlock")
    rights = write_rights(abi)
    ruleset = _ruleset(abi, rights, _NET_TCP if abi >= 4 else 0, _SCOPES if abi >= 6 else 0)
    try:
        _allow_beneath(ruleset, folder, rights)
        _allow_beneath(ruleset, os.devnull, rights & _FILE_RIGHTS)
    except BaseException:
        os.close(ruleset)
        raise
    _restrict_self(ruleset)


def scope_signals(abi: int) -> None:
    """A nested domain that only scopes signals: the code can no longer signal its keeper (ABI >= 6)."""
    if abi >= 6:
        _restrict_self(_ruleset(abi, 0, 0, _SCOPES))


def set_limits(timeout: float, memory: int, file_size: int) -> None:
    """CPU seconds (a backstop to the keeper's wall clock), address space, and size of any file written."""
    cpu = int(timeout) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_code(code: str) -> int:
    """Run `code` as `__main__`; its exit status (a traceback on stderr, as Python shows one, for a raise)."""
    linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # source lines in tracebacks
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        frames = traceback.extract_tb(exc.__traceback__)
        skip = next((i for i, frame in enumerate(frames) if frame.filename == "<code>"), len(frames))
        sys.stderr.write("Traceback (most recent call last):\n" if skip < len(frames) else "")
        sys.stderr.write("".join(traceback.format_list(frames[skip:])))
        sys.stderr.write("".join(traceback.format_exception_only(type(exc), exc)))
        return 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass


def _children() -> list[int]:
    """This process's child processes (orphans of its descendants included: it is their subreaper)."""
    pids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(pid) for pid in f.read().split()]
        except OSError:
            pass
    return pids


def kill_all_below() -> None:
    """SIGKILL every process left under this one until none is: a killed parent's children come back here."""
    while True:
        pids = _children()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.002)


def _wait(pid: int, timeout: float) -> int | None:
    """The runner's exit status as a shell shows it, or None past `timeout`."""
    pidfd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    if not ready:
        return None
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def _end_on_request(signum, frame) -> None:
    """SIGTERM from tools.py (the code printed past the output limit): end everything under here, then exit."""
    kill_all_below()
    os._exit(128 + signum)


def main(argv: list[str]) -> int:
    folder, timeout, memory, file_size = argv[0], float(argv[1]), int(argv[2]), int(argv[3])
    code = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        abi = landlock_abi()
        confine(folder, abi)
        _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, ValueError) as exc:
        print(f"sandbox: Landlock could not be applied ({exc}); the code was not run", file=sys.stderr)
        return REFUSED
    os.chdir(folder)
    signal.signal(signal.SIGTERM, _end_on_request)
    sys.stdout.flush()
    pid = os.fork()
    if pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            scope_signals(abi)
            set_limits(timeout, memory, file_size)
        except BaseException as exc:
            print(f"sandbox: {exc}; the code was not run", file=sys.stderr)
            os._exit(REFUSED)
        os._exit(run_code(code))
    status = _wait(pid, timeout)
    kill_all_below()
    if status is None:
        return TIMED_OUT
    return 1 if status in (TIMED_OUT, REFUSED) else status  # those two say what the keeper did, not the code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
