"""The `python` tool's sandbox: each piece of model-written code runs under bubblewrap (`bwrap`), the operating
system's namespace sandbox; step3_ppo/agents/tools.py starts one per call (`command`) and enforces the wall clock.

What the code gets (`command`): its own user (uid 65534, no capabilities, no further user namespaces), PID, network
(loopback only), IPC, UTS and mount namespaces; a root that is read-only and holds only what the interpreter needs
(`interpreter_binds`: the python executable, its stdlib and shared libraries, /usr/lib and the /lib* folders, the
loader's cache), a /proc of its own PID namespace, the null/zero/full/random/urandom devices, and a writable tmpfs
/tmp capped at `total_write` bytes as its working folder. Not /, /home, /root, /work, the host's /tmp, /run or any
Unix socket: the trainer's files, data sets and environment are not there to read. Its environment is empty but for
PATH, HOME, TMPDIR and LANG. `--die-with-parent`: when the trainer dies, the sandbox dies; `--new-session`: no
terminal to type into. Killing the bwrap process ends the PID namespace and so every process the code started.

Processes: at most `PROCESSES` (64) processes and threads at once, the runner included (RLIMIT_NPROC), so a fork
bomb stops at 64 and ends at the timeout; a few threads or subprocesses work. Why RLIMIT_NPROC and how: the kernel
counts it per user namespace (the sandbox's own: other sandboxes and the host's processes do not count), but never
enforces it for host uid 0, and bwrap run by root maps the sandbox's uid 65534 to host uid 0. So as root (`spawn`)
bwrap waits (`--userns-block-fd`) while the trainer writes the user namespace's maps itself (uid and gid 0 -> 0 for
bwrap's set-up, 65534 -> 65534), and the runner, kept only CAP_SETUID and CAP_SETGID, sets the limits and becomes
uid/gid 65534 (host 65534: no capabilities left, the limit enforced) before the code runs; bwrap's --disable-userns
cannot be combined with that, so a seccomp filter (`seccomp_filter`) refuses new user namespaces instead (unshare and
clone with CLONE_NEWUSER; clone3, whose flags it cannot read, answers ENOSYS and the C library falls back to clone).
Not a cgroup's pids.max: a writable cgroup is not there in most containers and CI runners, RLIMIT_NPROC always is.
Run by another user, bwrap maps 65534 to that user and the runner only sets the limit.

Inside, this file is the runner (`python -I -S -u /sandbox/run.py TIMEOUT MEMORY FILE_SIZE PROCESSES UID`, standard
library only, the code on stdin): it closes every inherited descriptor but stdout/stderr, sets CPU-time,
address-space, file-size and process limits (`set_limits`), becomes UID if it is not -1, and runs the code as
`__main__` (`run_code`). Exit status: the code's; 125 with one line when
the limits could not be set (`missing()` runs the runner once, so a machine where they cannot be is refused at start;
an exit status is the code's to choose, so no status from a run stops the trainer).

Where bwrap is missing, too old (no `--size`) or cannot create namespaces (no unprivileged user namespaces),
`missing()` says so in one line naming the package, and the tool refuses to start: the code is never run unconfined.
"""

from __future__ import annotations

import os
import resource
import sys

# Only these three at the top: this file is also the runner inside the sandbox, started once per call, where each
# module more is start-up time (subprocess, json, shutil, linecache and traceback: about 20 ms); the host side's and
# the traceback's modules are imported where they are used.

REFUSED = 125  # the runner's exit status when the limits could not be set: the code was not run
WORKDIR = "/tmp"  # inside the sandbox: the code's working folder, HOME and TMPDIR, the only writable place
RUNNER = "/sandbox/run.py"  # where this file is bound inside the sandbox
SANDBOX_UID = 65534  # "nobody": not 0, so no capabilities inside the sandbox's user namespace
PROCESSES = 64  # processes and threads the code may have at once, the runner included (RLIMIT_NPROC)
BWRAP = "bwrap"  # the program (a test points it elsewhere)
INSTALL = "apt-get install bubblewrap / dnf install bubblewrap"
_DEVICES = ("null", "zero", "full", "random", "urandom")
_SYSTEM_LIBS = ("/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libx32", "/lib", "/lib32", "/lib64", "/libx32")
_PATHS: dict[str, tuple[str, ...]] = {}  # interpreter -> what it reads
_MISSING: dict[str, str | None] = {}  # bwrap program -> why the tool cannot run with it (checked once)


def interpreter() -> str:
    """The real python executable (a virtual environment's base interpreter: its packages are not in the sandbox)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def _interpreter_paths(python: str) -> tuple[str, ...]:
    """What `python -I -S` reads: its import path (stdlib, its zip, lib-dynload) and the folder of libpython."""
    import json  # lazy: host side only (see the imports above)
    import subprocess  # lazy: host side only

    if python not in _PATHS:
        shown = "import json, sys, sysconfig; print(json.dumps([*sys.path, sysconfig.get_config_var('LIBDIR') or '']))"
        found = subprocess.run([python, "-I", "-S", "-c", shown], capture_output=True, text=True, env={}, timeout=60)
        _PATHS[python] = tuple(json.loads(found.stdout)) if found.returncode == 0 else ()
    return _PATHS[python]


def interpreter_binds() -> tuple[list[str], list[tuple[str, str]]]:
    """(paths to bind read-only, (link, target) symlinks): what `python -I -S` needs to start and import its
    standard library, C extensions (ctypes, sockets, ssl) and their shared libraries, and nothing else."""
    python = interpreter()
    paths = {python, "/etc/ld.so.cache", *_interpreter_paths(python)}
    links = []
    for path in _SYSTEM_LIBS:
        if os.path.islink(path):  # a merged /usr: /lib -> usr/lib
            links.append((path, os.readlink(path)))
        else:
            paths.add(path)
    real = sorted({os.path.realpath(path) for path in paths if path and os.path.exists(path)})
    kept = [path for path in real if not any(path.startswith(other + os.sep) for other in real if other != path)]
    return kept, links


def _ancestors(paths: list[str]) -> list[str]:
    """The folders above `paths` (not `/`), shallowest first: bwrap would make them mode 0700 (closed to uid 65534)."""
    found = {os.path.dirname(path) for path in paths}
    for path in list(found):
        while path not in ("/", ""):
            found.add(path)
            path = os.path.dirname(path)
    found.discard("/")
    return sorted(found - set(paths), key=lambda path: (path.count(os.sep), path))


def command(
    timeout: float,
    memory: int,
    file_size: int,
    total_write: int,
    bwrap: str | None = None,
    status_fd: int = -1,
    processes: int = PROCESSES,
    as_root: tuple[int, int, int] | None = None,
) -> list[str]:
    """The bwrap command line that runs the runner on the code read from stdin (see the module's docstring).
    `as_root`: (block fd, info fd, seccomp fd) of `spawn` when run by root: the trainer writes the uid and gid maps,
    the runner drops to SANDBOX_UID."""
    binds, links = interpreter_binds()
    python = interpreter()
    argv = [bwrap or BWRAP, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv"]
    if as_root is None:
        argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--disable-userns", "--cap-drop", "ALL"]
    else:
        block, info, seccomp = as_root
        argv += ["--userns-block-fd", str(block), "--info-fd", str(info), "--add-seccomp-fd", str(seccomp)]
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    env = {"PATH": os.path.dirname(python), "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
    for name, value in env.items():
        argv += ["--setenv", name, value]
    for folder in _ancestors([*binds, RUNNER, WORKDIR, "/dev/null"]):
        argv += ["--perms", "0755", "--dir", folder]
    for path in binds:
        argv += ["--ro-bind", path, path]
    for link, target in links:
        argv += ["--symlink", target, link]
    argv += ["--ro-bind", os.path.abspath(__file__), RUNNER, "--proc", "/proc"]
    for device in _DEVICES:
        if os.path.exists(f"/dev/{device}"):
            argv += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    argv += ["--symlink", "/proc/self/fd", "/dev/fd", "--perms", "01777", "--size", str(total_write)]
    argv += ["--tmpfs", WORKDIR, "--chdir", WORKDIR, "--remount-ro", "/"]
    if status_fd >= 0:
        argv += ["--json-status-fd", str(status_fd)]
    drop = SANDBOX_UID if as_root is not None else -1
    runner = [repr(float(timeout)), str(memory), str(file_size), str(processes), str(drop)]
    return [*argv, python, "-I", "-S", "-u", RUNNER, *runner]


# seccomp's classic BPF: (code, jump if true, jump if false, k) over struct seccomp_data {nr, arch, ip, args[6]}
_LOAD, _JEQ, _JSET, _RET = 0x20, 0x15, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JSET|K, BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
_EPERM, _ENOSYS, _CLONE_NEWUSER, _X32 = 1, 38, 0x10000000, 0x40000000
# machine -> (AUDIT_ARCH, unshare, clone, clone3)
_SYSCALLS = {"x86_64": (0xC000003E, 272, 56, 435), "aarch64": (0xC00000B7, 97, 220, 435)}


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """A seccomp program refusing new user namespaces (what --disable-userns does, for `spawn`'s root case):
    unshare or clone with CLONE_NEWUSER gets EPERM, clone3 ENOSYS (its flags are in memory a filter cannot read;
    the C library falls back to clone), a syscall of another ABI (i386, x32) EPERM. None on a machine not listed."""
    import struct  # lazy: host side only (see the imports above)

    known = _SYSCALLS.get(machine or os.uname().machine)
    if known is None:
        return None
    arch, unshare, clone, clone3 = known
    program = [
        (_LOAD, 0, 0, 4),  # arch
        (_JEQ, 1, 0, arch),
        (_RET, 0, 0, _ERRNO | _EPERM),
        (_LOAD, 0, 0, 0),  # nr
        (0x35, 0, 1, _X32),  # BPF_JMP|JGE|K: an x32 call
        (_RET, 0, 0, _ERRNO | _EPERM),
        (_JEQ, 3, 0, unshare),
        (_JEQ, 2, 0, clone),
        (_JEQ, 5, 0, clone3),
        (_RET, 0, 0, _ALLOW),
        (_LOAD, 0, 0, 16),  # args[0]'s low half: the flags of unshare and of clone on both machines
        (_JSET, 0, 1, _CLONE_NEWUSER),
        (_RET, 0, 0, _ERRNO | _EPERM),
        (_RET, 0, 0, _ALLOW),
        (_RET, 0, 0, _ERRNO | _ENOSYS),
    ]
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


def spawn(
    timeout: float,
    memory: int,
    file_size: int,
    total_write: int,
    bwrap: str | None = None,
    status_fd: int = -1,
    processes: int = PROCESSES,
):
    """Start bwrap on `command`'s line (stdin, stdout and stderr pipes, stderr into stdout, its own session; the
    caller writes the code and reaps it). As root, also the user namespace's maps (see the module's docstring)."""
    import subprocess  # lazy: host side only (see the imports above)

    keep = (status_fd,) if status_fd >= 0 else ()
    options = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={})
    if os.geteuid() != 0:
        argv = command(timeout, memory, file_size, total_write, bwrap, status_fd, processes)
        return subprocess.Popen(argv, pass_fds=keep, start_new_session=True, **options)
    program = seccomp_filter()
    if program is None:
        raise OSError(f"no seccomp filter for this machine ({os.uname().machine}) to refuse user namespaces")
    (block_read, block_write), (info_read, info_write), (filter_read, filter_write) = os.pipe(), os.pipe(), os.pipe()
    try:
        os.write(filter_write, program)
        os.close(filter_write)
        filter_write = -1
        argv = command(
            timeout, memory, file_size, total_write, bwrap, status_fd, processes, (block_read, info_write, filter_read)
        )
        process = subprocess.Popen(
            argv, pass_fds=(*keep, block_read, info_write, filter_read), start_new_session=True, **options
        )
        for fd in (block_read, info_write, filter_read):
            os.close(fd)
        block_read = info_write = filter_read = -1
        info = _read_info(info_read)
        if info is None and process.poll() is None:  # no namespace to map after 30 s: not started unmapped
            process.kill()
        if info is not None:  # bwrap made the namespace and waits: map it (else it failed; its output says why)
            try:
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{info}/{name}", "w") as f:
                        f.write(f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n")
            except OSError:
                process.kill()  # an unmapped sandbox would run the code as host root: never
                raise
        try:
            os.write(block_write, b"1")
        except BrokenPipeError:  # bwrap ended before waiting (it failed): its output and status say why
            pass
        return process
    finally:
        for fd in (block_read, block_write, info_read, info_write, filter_read, filter_write):
            if fd >= 0:
                os.close(fd)


def _read_info(fd: int) -> int | None:
    """The sandbox's child pid from bwrap's --info-fd (a JSON object), or None when bwrap closed it first."""
    import json  # lazy: host side only (see the imports above)
    import select  # lazy: host side only

    text = b""
    while select.select([fd], [], [], 30)[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        text += chunk
        try:
            return int(json.loads(text)["child-pid"])
        except ValueError:
            continue
    return None


def missing() -> str | None:
    """Why the python tool cannot run here (one line naming the package), or None; checked once per process."""
    if BWRAP not in _MISSING:
        _MISSING[BWRAP] = _missing(BWRAP)
    return _MISSING[BWRAP]


def _missing(bwrap: str) -> str | None:
    import shutil  # lazy: host side only (see the imports above)
    import subprocess  # lazy: host side only

    if not sys.platform.startswith("linux"):
        return "needs Linux and bubblewrap (bwrap) to isolate the code (this is not Linux); the code is never run"
    found = shutil.which(bwrap)
    if found is None:
        return f"needs bubblewrap (bwrap) to isolate the code; install it ({INSTALL}); the code is never run unconfined"
    try:
        usage = subprocess.run([found, "--help"], capture_output=True, text=True, timeout=30).stdout
        if "--size" not in usage or "--disable-userns" not in usage or "--userns-block-fd" not in usage:
            needs = "--size, --disable-userns, --userns-block-fd"
            return f"needs bubblewrap 0.8 or newer ({needs}); {found} is older ({INSTALL})"
        process = spawn(10.0, 1 << 30, 1 << 20, 1 << 20, bwrap=found)
        try:  # a thread too: the C library's clone3, refused by the root case's seccomp filter, falls back to clone
            out, _ = process.communicate(b"import threading; threading.Thread(target=print).start()", timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        probe = subprocess.CompletedProcess(process.args, process.returncode, b"", out)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap ({found}) could not be run ({exc}); the code is never run unconfined"
    if probe.returncode != 0:
        said = " ".join((probe.stderr or probe.stdout).decode("utf-8", "replace").split())[:200]
        if not said.startswith("bwrap:"):  # the sandbox was made; the interpreter in it did not start
            return f"python did not start in the bubblewrap sandbox ({said or f'exit status {probe.returncode}'})"
        return (
            f"bubblewrap cannot create its namespaces here ({said}); it needs unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1, or an AppArmor profile that allows bwrap); the code is "
            "never run unconfined"
        )
    return None


# ---------------------------------------------------------------- the runner, inside the sandbox


def set_limits(timeout: float, memory: int, file_size: int, processes: int = PROCESSES) -> None:
    """CPU seconds (a backstop to the wall clock kept from outside), address space, size of any file written, and
    processes and threads at once (counted in the sandbox's user namespace; see the module's docstring)."""
    cpu = int(timeout) + 1
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_code(code: str) -> int:
    """Run `code` as `__main__`; its exit status (a traceback on stderr, as Python shows one, for a raise)."""
    try:
        exec(compile(code, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        return 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException as exc:
        import linecache  # lazy: only for a traceback (see the imports above)
        import traceback  # lazy: as linecache

        linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")  # source lines in tracebacks
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


def main(argv: list[str]) -> int:
    timeout, memory, file_size, processes, uid = float(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    code = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # bwrap's status pipe and anything else inherited
    try:
        set_limits(timeout, memory, file_size, processes)
        if uid >= 0:  # run by root: become the mapped uid 65534, which RLIMIT_NPROC applies to (drops all capabilities)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
    except (OSError, ValueError) as exc:
        print(f"sandbox: the limits could not be set ({exc}); the code was not run", file=sys.stderr)
        return REFUSED
    return run_code(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
