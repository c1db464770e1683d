"""A reward function's own worker process, so that no call can take the run with it.

Why: in the trainer's process a call stuck in C code (a catastrophic regex, `sum(range(10**13))`) or
one that catches every BaseException cannot be stopped by SIGALRM or a thread, and a `sys.exit(0)` ends
step 3 with exit status 0 and nothing saved. In a process of its own the call is killed at its deadline
(the whole process group, with anything it started), and a worker that exits or crashes is one failed
call naming the function and the rows, like a raise.

One worker per function, started at its first call and reused; killed (deadline) or dead, it is started
again for the next batch. It is `python -m step3_ppo.reward_worker`, not multiprocessing's spawn or
forkserver: those re-import the launching module (`step3_ppo.main`: torch, DeepSpeed, transformers, 5 s
on a loaded machine) in every child; this one imports step3_ppo.reward_funcs, which needs no torch, and
starts in about 0.1 s. The worker loads the function by its spec (and the built-in's options) and gets
each call's keyword lists pickled over a socket; nothing of the trainer's process (threads, the process
group, CUDA) is forked. It dies with the process that started it.
"""
from __future__ import annotations

import atexit
import os
import pickle
import signal
import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from step3_ppo.reward_funcs import BUILTINS, CallFailed, RewardFunction, RewardFunctionError, load_reward_function
from utils.errors import one_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START_LIMIT_S = 300.0  # loading the function (the user's own imports: torch, a judge) on a loaded machine
_MESSAGE_LIMIT = 200
_live: set[subprocess.Popen] = set()  # killed at exit: a worker stuck in a call never reads EOF


class RewardWorker:
    """The parent's end: `call(kwargs, timeout)` is the function's result, or raises CallFailed (it raised,
    ran past `timeout`, exited or crashed) or RewardFunctionError (it cannot be loaded: stops the run)."""

    def __init__(self, func: RewardFunction):
        self.func = func
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.ready = False

    def call(self, kwargs: dict, timeout: float | None):
        if self.process is None or self.process.poll() is not None:  # never started, or died between calls
            self.start()
        if not self.ready:
            self.wait_ready()
        try:
            self.conn.send_bytes(pickle.dumps(kwargs, pickle.HIGHEST_PROTOCOL))
        except OSError:
            raise self.died() from None
        if not self.conn.poll(timeout or None):  # None or 0: no deadline, as in score_batch
            self.stop()
            raise CallFailed(f"ran past --reward_timeout {timeout:g} s (its worker process was killed)")
        return self.receive()

    def start(self) -> None:
        self.stop()
        parent_end, child_end = Pipe()  # a socket pair: both ends send and receive
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, "-m", "step3_ppo.reward_worker", str(child_end.fileno()), str(os.getpid())]
        # its own process group: a kill at the deadline ends what it started, and Ctrl-C is the trainer's to handle
        self.process = subprocess.Popen(command, pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True)
        child_end.close()
        _live.add(self.process)
        self.conn, self.ready = parent_end, False
        builtin = BUILTINS.get(self.func.spec)
        builtin_module = builtin.make.__module__ if builtin else None
        self.conn.send_bytes(pickle.dumps((self.func.spec, self.func.options, builtin_module, list(sys.path))))

    def wait_ready(self) -> None:
        if not self.conn.poll(START_LIMIT_S):
            self.stop()
            raise CallFailed(f"its worker process did not load it within {START_LIMIT_S:g} s")
        self.receive()
        self.ready = True

    def receive(self):
        """The worker's answer to a start or a call: the value, or the matching exception."""
        try:
            kind, payload = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self.died() from None
        except Exception as exc:  # a result whose class the parent cannot import
            raise CallFailed(f"returned a value that cannot be read back from its worker process: "
                             f"{one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}") from None
        if kind == "setup":
            self.stop()
            raise RewardFunctionError(*payload)
        if kind == "fatal":  # a BaseException such as SystemExit: the worker exits after saying so
            self.stop()
            raise CallFailed(payload)
        if kind == "raised":
            raise CallFailed(payload)
        return payload

    def died(self) -> CallFailed:
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # alive, but its end of the socket is closed
            pass
        process = self.process
        self.stop()
        status = process.returncode
        how = f"killed by signal {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        return CallFailed(f"its worker process died ({how})")

    def stop(self) -> None:
        """Kill the worker's whole process group (a hung call, anything it started) and forget it."""
        if self.process is not None:
            _kill(self.process)
            _live.discard(self.process)
        if self.conn is not None:
            self.conn.close()
        self.process, self.conn, self.ready = None, None, False


def _kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        process.wait()


@atexit.register
def _kill_live_workers() -> None:
    for process in list(_live):
        _kill(process)


# ---------------------------------------------------------------- the worker's end

def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this worker when the trainer's process dies (even by SIGKILL, while a call hangs)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _send(conn: Connection, kind: str, payload) -> None:
    try:
        data = pickle.dumps((kind, payload), pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        data = pickle.dumps(("raised", f"returned a {type(payload).__name__}, which cannot be pickled back from its "
                                       f"worker process ({one_line(exc, _MESSAGE_LIMIT)}); return a list"))
    conn.send_bytes(data)


def _setup_error(exc: RewardFunctionError) -> tuple:
    return exc.function, f"in its worker process: {exc.problem}", exc.origin, exc.index


def _load(spec: str, options: dict, builtin_module: str | None):
    if builtin_module and spec not in BUILTINS:  # a built-in registered by another module when it is imported
        __import__(builtin_module)
    return load_reward_function(spec, **options).fn


def _outcome(fn, kwargs: dict) -> tuple[str, object]:
    try:
        return "ok", fn(**kwargs)
    except RewardFunctionError as exc:  # the function says the setup is wrong (math_exact without 'answer')
        return "setup", (exc.function, exc.problem, exc.origin, exc.index)
    except Exception as exc:
        return "raised", f"raised {one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}"
    except SystemExit as exc:
        return "fatal", f"called sys.exit({exc.code!r})"
    except BaseException as exc:
        return "fatal", f"raised {one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}"


def serve(fd: int) -> None:
    """Load the function, say ready, then answer calls until the parent closes its end."""
    conn = Connection(fd)
    spec, options, builtin_module, path = pickle.loads(conn.recv_bytes())
    sys.path[:] = path
    try:
        fn = _load(spec, options, builtin_module)
    except RewardFunctionError as exc:
        return _send(conn, "setup", _setup_error(exc))
    except Exception as exc:
        return _send(conn, "setup", (spec, f"its worker process could not load it: "
                                           f"{one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}", None, None))
    _send(conn, "ready", None)
    while True:
        try:
            kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        kind, payload = _outcome(fn, kwargs)
        _send(conn, kind, payload)
        if kind == "fatal":
            sys.stdout.flush()
            os._exit(1)  # its state is suspect; the next batch starts a fresh worker


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides what Ctrl-C stops
    serve(int(sys.argv[1]))
