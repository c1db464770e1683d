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

Inside, this file is the runner (`python -I -S -u /sandbox/run.py TIMEOUT MEMORY FILE_SIZE`, standard library only,
the code on stdin): it closes every inherited descriptor but stdout/stderr, sets CPU-time, address-space and file-size
limits (`set_limits`), and runs the code as `__main__` (`run_code`). Exit status: the code's; 125 with one line when
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


def command(
    timeout: float, memory: int, file_size: int, total_write: int, bwrap: str | None = None, status_fd: int = -1
) -> list[str]:
    """The bwrap command line that runs the runner on the code read from stdin (see the module's docstring)."""
    binds, links = interpreter_binds()
    python = interpreter()
    argv = [bwrap or BWRAP, "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    argv += ["--disable-userns", "--die-with-parent", "--new-session", "--cap-drop", "ALL", "--clearenv"]
    env = {"PATH": os.path.dirname(python), "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
    for name, value in env.items():
        argv += ["--setenv", name, value]
    for path in binds:
        argv += ["--ro-bind", path, path]
    for link, target in links:
        argv += ["--symlink", target, link]
    argv += ["--ro-bind", os.path.abspath(__file__), RUNNER, "--proc", "/proc", "--dir", "/dev"]
    for device in _DEVICES:
        if os.path.exists(f"/dev/{device}"):
            argv += ["--dev-bind", f"/dev/{device}", f"/dev/{device}"]
    argv += ["--symlink", "/proc/self/fd", "/dev/fd", "--size", str(total_write), "--tmpfs", WORKDIR]
    argv += ["--chdir", WORKDIR, "--remount-ro", "/"]
    if status_fd >= 0:
        argv += ["--json-status-fd", str(status_fd)]
    return [*argv, python, "-I", "-S", "-u", RUNNER, repr(float(timeout)), str(memory), str(file_size)]


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
        if "--size" not in usage or "--disable-userns" not in usage:
            return f"needs bubblewrap 0.8 or newer (--size, --disable-userns); {found} is older ({INSTALL})"
        probe = subprocess.run(
            [*command(10.0, 1 << 30, 1 << 20, 1 << 20, bwrap=found)],
            input=b"pass",
            capture_output=True,
            env={},
            timeout=30,
        )
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


def set_limits(timeout: float, memory: int, file_size: int) -> None:
    """CPU seconds (a backstop to the wall clock kept from outside), address space, and size of any file written."""
    cpu = int(timeout) + 1
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
    timeout, memory, file_size = float(argv[0]), int(argv[1]), int(argv[2])
    code = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # bwrap's status pipe and anything else inherited
    try:
        set_limits(timeout, memory, file_size)
    except (OSError, ValueError) as exc:
        print(f"sandbox: the limits could not be set ({exc}); the code was not run", file=sys.stderr)
        return REFUSED
    return run_code(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
