"""A fork server for the tests' runs: Python, torch, DeepSpeed, transformers and the project imported once,
each run's processes forked from it.

Each process a test starts pays ~5-7 s of interpreter start and imports on 2 cores before any work (a tiny
2-rank step-3 run of one step: 11 s, most of it imports); the suite starts a hundred or so. Here one server
per pytest session (started by tests/launch.py on first use) imports what a rank imports, without running
any torch op (so no OpenMP pool exists to break in a fork; the native threads torch and pyarrow start while
importing are the ones a fork-started DataLoader worker meets too), and then serves requests on a Unix socket: the
front process (`tests/ranks.py --zygote`, as light as before) sends the module, its arguments, its
environment, its working directory and its stdin/stdout/stderr (SCM_RIGHTS), and gets the exit status
back. For each request the server forks a supervisor, which forks the ranks (each with the variables
deepspeed's launcher gives a rank, or one plain process for `python -m MODULE`), ends them all when one
fails (as tests/ranks.py does), SIGTERMs them when the front forwards a SIGTERM/SIGINT and SIGKILLs them
when the front dies (a test's timeout).

A rank runs the module as `python -u -m MODULE` would (runpy, `__main__`, its exit code, the atexit hooks,
unbuffered stdio), in the request's environment. The front learns the ranks' pids (and writes them where
RLHF_TESTS_RANK_PIDS says: a test that SIGKILLs a run waits for them to end, tests.launch.kill_group). What a fresh
interpreter would do differently: variables read while importing keep the server's values (the tests set the same ones:
tests.launch.subprocess_env; a rank's OMP_NUM_THREADS is applied with torch.set_num_threads, since libgomp read the
server's when loaded), and numpy's global random state is the server's (the project seeds its own generators). The
multi-node and launcher runs still start fresh interpreters; so does every user. A second server, `zygote.py SOCKET
vllm`, has vLLM imported instead and forks the vLLM worker (a script, run as `python SCRIPT ARGS`) for the tests that
pass tests.launch.vllm_python as --vllm_python.
RLHF_TESTS_ZYGOTE=0 turns both off.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import sys
import threading
import time

from ranks import PIDS_FILE_VAR, rank_env  # tests/ is sys.path[0] of the server and of the front (scripts)

# what the ranks of the tests' runs import, first the heavy libraries, then the project's entry points
PRELOAD = (
    "torch",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch._inductor.compile_fx",
    "transformers",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "transformers.models.opt.modeling_opt",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gpt2.tokenization_gpt2",
    "transformers.tokenization_utils_fast",
    "tokenizers",
    "safetensors.torch",
    "peft",
    "datasets",
    "matplotlib",
    "step1_sft.main",
    "step2_reward.main",
    "step2_dpo.main",
    "step3_ppo.main",
    "step3_ppo.eval",
    "step3_ppo.agents.eval",
    "step3_ppo.plot",
    "utils.models.tiny",
    "utils.models.default",
    "data.make_demo_data",
    "data.make_tool_data",
)
# the vLLM worker's (step3_ppo/rollout/vllm_worker.py, a script: --vllm_python points at tests.launch.vllm_python's
# shim): its imports are ~12 s of its ~17 s start on 2 cores, paid by each of the suite's half-dozen workers
VLLM_PRELOAD = (
    "torch",
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.inputs",
    "vllm.sampling_params",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.model_executor.models.llama",
)
PRELOADS = {"ranks": PRELOAD, "vllm": VLLM_PRELOAD}
HEADER = struct.Struct("!I")
GRACE_S = 5.0  # SIGTERM -> SIGKILL, as tests/ranks.py


def preload(names=PRELOAD) -> list[str]:
    """Import `names`; returns those that failed (a module missing here is imported by the rank)."""
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001  an optional one (vLLM's extras) or a model class this version lacks
            failed.append(name)
    return failed


# ---------------------------------------------------------------- the front (tests/ranks.py --zygote)


def request(sock_path: str, num_ranks: int, port: str, module: str, args: list[str]) -> int:
    """Run MODULE through the server with this process's environment, working directory and stdio; return
    its exit status (the first failed rank's). SIGTERM/SIGINT here are passed on to the ranks."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(sock_path)
    body = json.dumps(
        {
            "num_ranks": num_ranks,
            "port": port,
            "module": module,
            "args": args,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
        }
    ).encode()
    socket.send_fds(conn, [HEADER.pack(len(body))], [0, 1, 2])
    conn.sendall(body)

    def forward(signum, frame):
        try:
            conn.sendall(b"T")
        except OSError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    reply = b""
    while True:
        while b"\n" in reply:
            line, reply = reply.split(b"\n", 1)
            if not line.startswith(b"pids "):
                return int(line)
            if os.environ.get(PIDS_FILE_VAR):  # for tests.launch.kill_group, which waits for them to end
                with open(os.environ[PIDS_FILE_VAR] + ".tmp", "w") as f:
                    f.write(line[5:].decode())
                os.replace(os.environ[PIDS_FILE_VAR] + ".tmp", os.environ[PIDS_FILE_VAR])
        chunk = conn.recv(256)
        if not chunk:
            return 1  # the supervisor died: nothing to report
        reply += chunk


# ---------------------------------------------------------------- the server


def serve(sock_path: str, kind: str = "ranks") -> None:
    if kind == "vllm":  # as the worker sets it before its imports: its model lives in its own process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    missing = preload(PRELOADS[kind])
    if threading.active_count() != 1:  # a Python thread started while importing would be missing in the forks
        print(f"zygote: {threading.active_count()} Python threads after the imports; not serving", flush=True)
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped by the kernel
    print("ready" + (f" (not preloaded: {' '.join(missing)})" if missing else ""), flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return  # pytest ended (its end of our stdin closed)
        if listener not in readable:
            continue
        conn, _ = listener.accept()
        try:
            head, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
            (size,) = HEADER.unpack(head)
            body = b""
            while len(body) < size:
                body += conn.recv(size - len(body))
            req = json.loads(body)
        except Exception as e:  # noqa: BLE001  a broken request ends that request, not the server
            print(f"zygote: bad request: {e}", file=sys.stderr, flush=True)
            conn.close()
            continue
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os._exit(supervise(conn, req, fds))
        conn.close()
        for fd in fds:
            os.close(fd)


def supervise(conn: socket.socket, req: dict, fds: list[int]) -> int:
    """Fork the ranks, wait for them as tests/ranks.py does, send their exit status to the front."""
    pids = []
    for rank in range(max(req["num_ranks"], 1)):
        pid = os.fork()
        if pid == 0:
            conn.close()
            run_rank(req, fds, rank)
        with contextlib.suppress(OSError):  # here too, so that no kill comes before the rank's own setpgid
            os.setpgid(pid, pid)
        pids.append(pid)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"pids {' '.join(map(str, pids))}\n".encode())
    except OSError:
        pass
    codes: dict[int, int] = {}
    code = None
    while code is None:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        failed = [c for c in codes.values() if c != 0]
        if failed:
            stop(pids, codes, signal.SIGTERM)
            code = failed[0]
        elif len(codes) == len(pids):
            code = 0
        elif select.select([conn], [], [], 0.05)[0]:
            if conn.recv(1):  # the front was sent SIGTERM or SIGINT
                stop(pids, codes, signal.SIGTERM)
                code = 128 + signal.SIGTERM
            else:  # the front died (SIGKILL: a test's kill or timeout): nobody waits for these ranks
                stop(pids, codes, signal.SIGKILL)
                return 1
    try:
        conn.sendall(f"{code}\n".encode())
    except OSError:
        pass
    return 0


def stop(pids: list[int], codes: dict, signum: int) -> None:
    """Signal every live rank (SIGKILL: its whole process group); SIGKILL those still alive GRACE_S later."""
    live = [pid for pid in pids if pid not in codes]
    for pid in live:
        kill(pid, signum)
    deadline = time.monotonic() + GRACE_S
    while live:
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
                live.remove(pid)
        if live and time.monotonic() > deadline:
            for pid in live:
                kill(pid, signal.SIGKILL)
            deadline = float("inf")
        time.sleep(0.02)


def kill(pid: int, signum: int) -> None:
    """SIGTERM to the rank (as deepspeed's launcher sends it), SIGKILL to its process group."""
    try:
        os.killpg(pid, signum) if signum == signal.SIGKILL else os.kill(pid, signum)
    except ProcessLookupError:
        pass


def run_rank(req: dict, fds: list[int], rank: int) -> None:
    """In the forked rank: the request's stdio, directory, environment and argv, then `python -u -m MODULE`.
    Its own process group, so that a SIGKILL reaches what it started too (a reward worker, a tool's sandbox), as
    the SIGKILL of a launcher's group does."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True, write_through=True
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
        write_through=True,
    )
    os.chdir(req["cwd"])
    os.environ.clear()
    # N = 0: `python -m MODULE`, one process without the launcher's variables
    os.environ.update(rank_env(rank, req["num_ranks"], req["port"], req["env"]) if req["num_ranks"] else req["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # libgomp read the server's value when torch was imported
        import torch

        if torch.get_num_threads() != int(threads):
            torch.set_num_threads(int(threads))
    module = req["module"]
    sys.argv = [module, *([f"--local_rank={rank}"] if req["num_ranks"] else []), *req["args"]]
    sys.modules.pop(module, None)  # preloaded: `python -m` runs it as __main__ without a second copy imported first
    code = 0
    try:
        if module.endswith(".py"):  # a script, as `python SCRIPT ARGS` (the vLLM worker)
            sys.path[0] = os.path.dirname(os.path.abspath(module))
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  what an interpreter prints for an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


if __name__ == "__main__":
    serve(sys.argv[1], *sys.argv[2:])
