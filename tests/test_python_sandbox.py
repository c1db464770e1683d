"""The python tool's sandbox against hostile code (step3_ppo/agents/python_sandbox.py: bubblewrap): each probe is
something model-written code tried, and each must be denied: changing a host file's mode, owner, times or extended
attributes; reading the trainer's environment or data files; reaching a Unix socket, an abstract one or a localhost
TCP port; writing past the total cap; outliving its timeout or a killed trainer (a setsid child included)."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from step3_ppo.agents import python_sandbox
from step3_ppo.agents.tools import PYTHON_TOTAL_WRITE, python, run_python
from tests.test_tools import escaping_child, marked_processes

REPO = Path(__file__).resolve().parents[1]
SANDBOX_MISSING = python_sandbox.missing()
pytestmark = pytest.mark.skipif(SANDBOX_MISSING is not None, reason=f"the python tool refuses here: {SANDBOX_MISSING}")


def test_only_the_interpreter_is_bound():
    """Neither /, the repository, the host's /tmp, /home, /run nor /var is bound: only the interpreter's files."""
    binds, _ = python_sandbox.interpreter_binds()
    assert python_sandbox.interpreter() in binds or any(
        python_sandbox.interpreter().startswith(path + os.sep) for path in binds
    )
    for path in binds:
        assert path not in ("/", "/tmp", "/home", "/root", "/run", "/var", "/var/run", "/work", "/etc", "/usr")
        assert not str(REPO).startswith(path + os.sep) and path != str(REPO)


def test_host_file_attributes_cannot_change(tmp_path):
    """chmod (a setuid bit, mode 000 on a folder), chown, utime, setxattr: on a file of the trainer's it is not
    there; on a file the interpreter needs it is read-only."""
    victim, folder = tmp_path / "victim.txt", tmp_path / "checkpoint"
    victim.write_text("weights")
    folder.mkdir()
    visible = os.path.realpath(os.__file__)  # the stdlib's os.py, bound read-only
    before = [os.stat(path) for path in (victim, folder, visible)]
    code = f"""
import errno, os
for path in [{str(victim)!r}, {str(folder)!r}, {visible!r}]:
    for name, attempt in [
        ("chmod", lambda: os.chmod(path, 0o4777)),
        ("chmod000", lambda: os.chmod(path, 0)),
        ("chown", lambda: os.chown(path, 0, 0)),
        ("utime", lambda: os.utime(path, (0, 0))),
        ("setxattr", lambda: os.setxattr(path, "user.rlhf", b"1")),
    ]:
        try:
            attempt()
            print(name, "DONE")
        except OSError as exc:
            print(name, errno.errorcode[exc.errno])
"""
    lines = python(code).splitlines()
    assert len(lines) == 15, lines
    assert lines[:10] == [f"{name} ENOENT" for name in ("chmod", "chmod000", "chown", "utime", "setxattr")] * 2
    assert all(line.split()[1] in ("EROFS", "EPERM") for line in lines[10:]), lines
    after = [os.stat(path) for path in (victim, folder, visible)]
    for old, new in zip(before, after):
        assert (new.st_mode, new.st_uid, new.st_gid, new.st_mtime_ns) == (
            old.st_mode,
            old.st_uid,
            old.st_gid,
            old.st_mtime_ns,
        )


def test_the_trainers_environment_and_processes_are_not_readable(monkeypatch):
    """/proc/<pid>/environ of a process holding a token (a stand-in trainer) and of this one: not there (the
    sandbox's /proc is its own PID namespace's), and nothing of this process's environment reaches the sandbox,
    bwrap's own included (its /proc/1)."""
    secret = "hf_secret_token_for_the_probe"
    monkeypatch.setenv("RLHF_TEST_SECRET", secret)
    trainer = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        env=dict(os.environ),
        stdout=subprocess.PIPE,
    )
    try:
        assert trainer.stdout.readline() == b"up\n"
        with open(f"/proc/{trainer.pid}/environ") as f:
            assert secret in f.read()  # what the probe looks for is there to find, from outside
        code = f"""
import os
for pid in [{trainer.pid}, {os.getpid()}]:
    try:
        open(f"/proc/{{pid}}/environ").read()
        print("read")
    except OSError as exc:
        print(type(exc).__name__)
seen = [str(os.environ)]
for pid in filter(str.isdigit, os.listdir("/proc")):
    for part in ("environ", "cmdline"):
        try:
            seen.append(open(f"/proc/{{pid}}/{{part}}", "rb").read().decode(errors="replace"))
        except OSError:
            pass
print(sorted(int(pid) for pid in filter(str.isdigit, os.listdir("/proc"))))
print(seen)
"""
        output = python(code)
    finally:
        trainer.kill()
        trainer.wait()
        trainer.stdout.close()
    lines = output.splitlines()
    assert lines[:2] == ["FileNotFoundError", "FileNotFoundError"], output
    assert max(eval(lines[2])) < 10  # only the sandbox's own processes (its PID namespace)
    assert secret not in output and "RLHF_TEST_SECRET" not in output


def test_unix_sockets_are_unreachable(tmp_path):
    """A path-based socket (a docker.sock, the session bus) is not in the sandbox, an abstract one is in another
    network namespace, and /run, /var/run are not there."""
    path = tmp_path / "s.sock"
    abstract = f"\0rlhf-sandbox-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as hidden:
        server.bind(str(path))
        server.listen()
        hidden.bind(abstract)
        hidden.listen()
        output = python(f"""
import os, socket
for address in [{str(path)!r}, {abstract!r}]:
    try:
        socket.socket(socket.AF_UNIX).connect(address)
        print("connected")
    except OSError as exc:
        print(type(exc).__name__)
print(os.path.exists("/run"), os.path.exists("/var/run"), os.path.exists("/var/run/docker.sock"))
""")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert output == "FileNotFoundError\nConnectionRefusedError\nFalse False False\n"


def test_tcp_to_a_localhost_port_is_refused():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        output = python(f"""
import socket
for host in ["127.0.0.1", "localhost", "::1"]:
    try:
        socket.create_connection((host, {port}), timeout=2)
        print("connected")
    except OSError as exc:
        print(type(exc).__name__)
""")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert "connected" not in output and output.splitlines()[0] == "ConnectionRefusedError", output


def test_writes_stop_at_the_total_cap():
    """1 MiB files until the folder is full: what the code writes in all stops at the cap (a tmpfs's size); nowhere
    else is writable."""
    code = """
import errno, os
written = 0
try:
    for i in range(10_000):
        with open(f"f{i}", "wb") as f:
            for _ in range(16):
                f.write(b"x" * 65536)
                f.flush()
                written += 65536
except OSError as exc:
    print(errno.errorcode[exc.errno], written)
try:
    open("big", "wb").write(b"x" * (2 << 20))
except OSError as exc:
    print(errno.errorcode[exc.errno])
for path in ["/escape", "/dev/escape", "/proc/escape", "/sandbox/escape", "/usr/lib/escape"]:
    try:
        open(path, "wb").write(b"x")
        print("wrote", path)
    except OSError as exc:
        print(errno.errorcode[exc.errno])
"""
    cap = 4 << 20
    run = run_python(code, total_write=cap)
    reason, written = run.output.splitlines()[0].split()
    assert reason == "ENOSPC" and cap - (1 << 20) <= int(written) <= cap, run.output
    assert run.output.splitlines()[1] in ("ENOSPC", "EFBIG")  # out of room, or past the 1 MiB file limit
    assert run.output.splitlines()[2:] == ["EROFS", "EROFS", "ENOENT", "EROFS", "EROFS"]  # the rest is read-only
    default = python(code.replace("range(10_000)", "range(100_000)"))
    assert int(default.split()[1]) <= PYTHON_TOTAL_WRITE, default


def test_the_trainers_files_are_not_visible(tmp_path):
    data = tmp_path / "heldout.jsonl"
    data.write_text('{"prompt": "the answer"}\n')
    repo_data = next((REPO / "data").rglob("*.jsonl"), None)
    paths = [str(data), str(tmp_path), str(REPO), str(REPO / "data"), os.path.expanduser("~/.cache")]
    paths += [str(repo_data)] if repo_data is not None else []
    output = python(f"""
import os
for path in {paths!r}:
    print(os.path.exists(path))
print(os.listdir("/tmp"))
""")
    assert output == "False\n" * len(paths) + "[]\n"


@pytest.mark.slow
def test_a_killed_trainer_takes_the_sandbox_with_it(tmp_path):
    """The trainer dies (SIGKILL, no finally runs): the code, and a child that left its session, die with it."""
    marker = f"rlhf-sandbox-orphan-{os.getpid()}-{time.monotonic_ns()}"
    code = escaping_child(marker) + "time.sleep(100)\n"
    trainer = subprocess.Popen(
        [sys.executable, "-c", f"from step3_ppo.agents.tools import run_python; run_python({code!r}, timeout=60)"],
        cwd=REPO,
    )
    try:
        deadline = time.monotonic() + 30
        while not marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_processes(marker), "the sandboxed child never started"
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 5
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_processes(marker) == []
    finally:
        trainer.kill()
        trainer.wait()
        for pid in marked_processes(marker):
            os.kill(pid, signal.SIGKILL)


def test_the_code_has_no_capabilities_or_new_namespaces():
    output = python("""
import ctypes, os
print(os.getuid(), [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0])
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare(0x10000000), ctypes.get_errno() != 0)  # CLONE_NEWUSER
""")
    assert output == "65534 0000000000000000\n-1 True\n"


def _process_count() -> int:
    """The host's processes running the sandbox's runner (a forked child keeps its command line)."""
    return len(marked_processes(python_sandbox.RUNNER))


@pytest.mark.slow
def test_a_fork_bomb_stops_at_the_process_limit_and_ends():
    """`while True: os.fork()` stops at PROCESSES processes (RLIMIT_NPROC, counted in the sandbox's own user
    namespace), ends at its timeout with an observation, and leaves no process behind."""
    before = _process_count()
    started = time.monotonic()
    run = run_python(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout=3
    )
    assert run.timed_out and time.monotonic() - started < 6
    deadline = time.monotonic() + 5
    while _process_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _process_count() == before
    counted = python("""
import os, time
children = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        children += 1
except OSError as exc:
    print(children, exc.strerror)
""")
    assert counted == f"{python_sandbox.PROCESSES - 1} Resource temporarily unavailable\n"


def test_a_few_threads_and_subprocesses_run():
    output = python("""
import subprocess, sys, threading
results = []
threads = [threading.Thread(target=results.append, args=(i,)) for i in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(sorted(results))
print(subprocess.run([sys.executable, "-c", "print(7)"], capture_output=True, text=True).stdout, end="")
""")
    assert output == "[0, 1, 2, 3, 4, 5, 6, 7]\n7\n"


@pytest.mark.skipif(os.geteuid() != 0 or os.uname().machine != "x86_64", reason="the seccomp filter is root's case")
def test_no_syscall_creates_a_user_namespace():
    """Run as root, the seccomp filter stands in for --disable-userns: clone and unshare with CLONE_NEWUSER get
    EPERM, clone3 (flags the filter cannot read) ENOSYS; a plain fork and threads still work."""
    output = python("""
import ctypes, os, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
for number, args in [(272, (0x10000000,)), (56, (0x10000000 | 17, 0, 0, 0, 0)), (435, (0, 0))]:
    print(libc.syscall(number, *args), os.strerror(ctypes.get_errno()))
pid = os.fork()
if pid == 0:
    os._exit(7)
print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
thread = threading.Thread(target=print, args=("thread",))
thread.start()
thread.join()
""")
    assert output == (
        "-1 Operation not permitted\n-1 Operation not permitted\n-1 Function not implemented\n7\nthread\n"
    )
