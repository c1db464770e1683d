"""Running the real entry points from tests: through the `deepspeed` launcher, or in one process.

Multi-process runs are few and check the files a run wrote (metrics.jsonl, exported models), not
its exit noise: a rank rarely aborts at exit after finishing (shared/notes), so a run counts as
good when the expected outputs exist even if the exit code says otherwise.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tests.ranks import PIDS_FILE_VAR
from utils.runtime.ports import free_port  # noqa: F401  (the tests take their ports from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# set in os.environ by a test that ran a trainer in-process (utils.runtime.distributed.init_distributed): a child
# that inherited them would join that process group's port instead of starting its own
PROCESS_GROUP_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def subprocess_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in PROCESS_GROUP_VARS}
    env.update(
        {
            "PYTHONPATH": ROOT,
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    # DeepSpeed's JIT ops in this checkout's folder, as scripts/common.sh sets it (utils/runtime/extensions.py)
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".cache", "torch_extensions"))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def rank_command(
    module: str, args: list, num_ranks: int = 2, launcher: bool = False, zygote: bool = False
) -> list[str]:
    """The command that runs N CPU ranks (gloo) of `python -m MODULE ARGS` on this machine: tests/ranks.py,
    which starts them as `deepspeed --num_gpus N --module` does without its two start-ups, or, with
    `launcher=True`, the `deepspeed` command itself (for tests of what the launcher adds). `zygote=True`:
    the ranks are forked by the tests' fork server (tests/zygote.py) when it runs (N = 0: one plain
    `python -m MODULE`)."""
    port, args = str(free_port()), [str(a) for a in args]
    if launcher:
        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        return [deepspeed, "--num_gpus", str(num_ranks), "--master_port", port, "--module", module, *args]
    ranks = os.path.join(ROOT, "tests", "ranks.py")
    sock = zygote_socket() if zygote else None
    if sock:
        return [sys.executable, ranks, "--zygote", sock, str(num_ranks), port, module, *args]
    if num_ranks == 0:
        return [sys.executable, "-m", module, *args]
    return [sys.executable, ranks, str(num_ranks), port, module, *args]


_servers: dict = {}


def zygote_socket(kind: str = "ranks") -> str | None:
    """The socket of this pytest session's fork server (tests/zygote.py; `kind` "vllm": the one with vLLM
    imported), started on first use; None when RLHF_TESTS_ZYGOTE=0 or it could not start (the runs then
    start fresh interpreters)."""
    if kind in _servers:
        return _servers[kind]
    _servers[kind] = None
    if os.environ.get("RLHF_TESTS_ZYGOTE", "1") == "0" or not hasattr(socket, "send_fds"):
        return None
    import atexit
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix=f"rlhf-zygote-{kind}-")
    sock = os.path.join(folder, "s")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "zygote.py"), sock, kind],
        cwd=ROOT,
        env=subprocess_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    last = said = proc.stdout.readline()
    while said and not said.startswith("ready"):  # what the imports print (DeepSpeed's accelerator line) comes first
        last, said = said, proc.stdout.readline()
    if not said.startswith("ready"):
        proc.kill()
        shutil.rmtree(folder, ignore_errors=True)
        print(f"tests/zygote.py {kind} did not start ({last.strip()}): fresh interpreters instead", file=sys.stderr)
        return None

    def stop():
        proc.stdin.close()  # the server leaves when its stdin closes
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(folder, ignore_errors=True)

    atexit.register(stop)
    _servers[kind] = sock
    return sock


def vllm_python() -> str | None:
    """A `--vllm_python` for tests: an executable that runs `python SCRIPT ARGS` (the vLLM worker) forked
    from the fork server with vLLM imported (~1 s instead of ~13 s of start-up), and any other command
    (vllm_missing's probe) with this interpreter; None (this interpreter) when that server does not run."""
    sock = zygote_socket("vllm")
    if sock is None:
        return None
    shim = os.path.join(os.path.dirname(sock), "python")
    if not os.path.exists(shim):
        with open(shim, "w") as f:
            f.write(
                f'#!/bin/bash\nif [ "${{1:-}}" = -c ]; then exec "{sys.executable}" "$@"; fi\n'
                f'exec "{sys.executable}" "{ROOT}/tests/ranks.py" --zygote "{sock}" 0 - "$@"\n'
            )
        os.chmod(shim, 0o755)
    return shim


def forked_commands_env(sock: str) -> dict:
    """Bash functions, exported through the environment (bash defines `name` from BASH_FUNC_name%%), that
    make a script's `deepspeed --num_gpus N --master_port P --module MODULE ARGS` and `python -m MODULE ARGS`
    run through the tests' fork server (tests/zygote.py), the first printing its command line as deepspeed's
    launcher does ("cmd = ..."); any other form runs the command itself. For the quick demos, whose time is
    mostly start-ups (each `deepspeed` launch pays three interpreters: its runner, its launch module, a rank)."""
    front = f'"{sys.executable}" "{ROOT}/tests/ranks.py" --zygote "{sock}"'
    return {
        "BASH_FUNC_deepspeed%%": '() { if [ "$1" = --num_gpus ] && [ "$3" = --master_port ] && [ "$5" = --module ]; '
        f'then local n="$2" p="$4" m="$6"; shift 6; echo "cmd = (fork server) python -u -m $m $*"; '
        f'{front} "$n" "$p" "$m" "$@"; '
        'else command deepspeed "$@"; fi; }',
        "BASH_FUNC_python%%": '() { if [ "$1" = -m ] && [ $# -ge 2 ]; '
        f'then local m="$2"; shift 2; {front} 0 - "$m" "$@"; else command python "$@"; fi; }}',
    }


def run_deepspeed(
    module: str,
    args: list,
    num_ranks: int = 2,
    timeout: int = 600,
    log_path: str | None = None,
    env: dict | None = None,
    launcher: bool = False,
) -> subprocess.CompletedProcess:
    """N ranks of `python -m MODULE ARGS` from the repository root (CPU ranks, gloo); see rank_command."""
    return _run(rank_command(module, args, num_ranks, launcher, zygote=True), timeout, log_path, env)


def run_module(
    module: str, args: list, timeout: int = 600, log_path: str | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` in a single process (rank 0 of 1, no launcher)."""
    return _run(rank_command(module, args, num_ranks=0, zygote=True), timeout, log_path, env)


def _run(cmd, timeout, log_path, env) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env or subprocess_env(), capture_output=True, text=True, timeout=timeout)
    if log_path:
        with open(log_path, "w") as f:
            f.write(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    return proc


def metrics(output_dir: str) -> list[dict]:
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return (proc.stdout + proc.stderr)[-n:]


def start_deepspeed(
    module: str,
    args: list,
    num_ranks: int = 2,
    log_path: str | None = None,
    env: dict | None = None,
    launcher: bool = False,
) -> subprocess.Popen:
    """Like run_deepspeed, but returns at once; the launcher and its ranks share a new process group (with the
    fork server: the front, which writes the ranks' pids for kill_group; the ranks die with it)."""
    cmd = rank_command(module, args, num_ranks, launcher, zygote=True)
    env = dict(env or subprocess_env())
    import tempfile

    env[PIDS_FILE_VAR] = os.path.join(tempfile.mkdtemp(prefix="rlhf-ranks-"), "pids")
    log = open(log_path or os.devnull, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc.rank_pids_file = env[PIDS_FILE_VAR]
    return proc


def kill_group(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGKILL the launcher and every rank it started, and wait until none of them runs: a killed process
    holds its files (the output directory's lock) until the kernel has torn its memory down, which takes
    seconds for GBs on this VM, and a run started at once from the tests' fork server is faster than that.
    Ranks forked by the fork server are SIGKILLed by their supervisor when the front dies."""
    import shutil
    import signal
    import time

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    pids_file = getattr(proc, "rank_pids_file", None)
    pids = [int(p) for p in open(pids_file).read().split()] if pids_file and os.path.exists(pids_file) else []
    deadline = time.monotonic() + timeout
    # a forked rank leads its own process group (with what it started: a reward worker, a tool's sandbox)
    while any(_group_running(group) for group in [proc.pid, *pids]) and time.monotonic() < deadline:
        time.sleep(0.02)
    if pids_file:
        shutil.rmtree(os.path.dirname(pids_file), ignore_errors=True)


def process_running(pid: int) -> bool:
    """Whether `pid` still holds its files (_holds_files)."""
    return _holds_files(pid, _stat(pid))


def _holds_files(pid: int, stat: list[str] | None) -> bool:
    """A SIGKILLed process whose main thread is a zombie still holds its files while its other threads (torch's,
    gloo's) tear down the memory and files they share: a zombie counts as gone only once it is its last thread."""
    if stat is None:
        return False
    if stat[0] != "Z":
        return True
    try:
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except OSError:
        return False


def _group_running(pgid: int) -> bool:
    """Whether a process of group `pgid` still holds its files (each /proc/PID/stat read once)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        stat = _stat(pid)
        if stat is not None and stat[2] == str(pgid) and _holds_files(pid, stat):
            return True
    return False


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, ...); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
