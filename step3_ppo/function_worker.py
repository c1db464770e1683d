"""A user's function in a worker process of its own, so that no call can take the run with it.

Why: in the trainer's process a call stuck in C code (a catastrophic regex, `sum(range(10**13))`) or
one that catches every BaseException cannot be stopped by SIGALRM or a thread, and a `sys.exit(0)` ends
the run with exit status 0 and nothing saved. In a process of its own the call is killed at its deadline
(the whole process group, with anything it started), and a worker that exits or crashes is one failed
call, like a raise. Reward functions (step3_ppo/rewards/reward_worker.py), tools and environments use it.

One worker per function, started at its first call and reused; killed (deadline) or dead, it is started
again for the next call. It is `python -m step3_ppo.function_worker`, not multiprocessing's spawn or forkserver: those
re-import the launching module (`step3_ppo.main`: torch, DeepSpeed, transformers, 5 s on a loaded
machine) in every child; this one imports only the `loader`'s module and starts in about 0.1 s. The
worker calls `loader(spec, **options)` to get the function, then answers each call's keyword arguments,
pickled over a socket pair; nothing of the trainer's process (threads, the process group, CUDA) is
forked. It dies with the process that started it.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import os
import pickle
import signal
import subprocess
import sys
from multiprocessing import Pipe
from multiprocessing.connection import Connection

from utils.errors import ProjectError, one_line
from utils.runtime.cache_dir import REPO_ROOT

START_LIMIT_S = 300.0  # loading the function (the user's own imports: torch, a judge) on a loaded machine
_MESSAGE_LIMIT = 200
_live: set[subprocess.Popen] = set()  # killed at exit: a worker stuck in a call never reads EOF


class CallFailed(Exception):
    """A call that gave no result; str() says why in one line, `kind` which way: "raised" (an Exception, the
    worker lives on), "exit" (sys.exit or a BaseException: the worker exits), "timeout" (killed at the
    deadline), "died" (exited or crashed), "start" (not loaded within START_LIMIT_S), "load" (the loader
    raised a non-ProjectError), "unpicklable" (the result cannot be sent back), "unreadable" (nor read back)."""

    def __init__(self, problem: str, kind: str = "raised"):
        super().__init__(problem)
        self.kind = kind


class FunctionWorker:
    """The parent's end: `call(kwargs, timeout)` is `fn(**kwargs)` for the `fn = loader(spec, **options)` the
    worker loaded, or raises CallFailed, or re-raises a ProjectError the loader or the call raised (the setup
    is wrong: one line, the caller stops the run). `loader` is "package.module:function"; `deadline_name`
    names the timeout in the message ("ran past --reward_timeout 2 s ...")."""

    def __init__(
        self,
        spec: str,
        loader: str,
        options: dict | None = None,
        *,
        deadline_name: str = "the timeout",
        start_limit: float = START_LIMIT_S,
    ):
        self.spec, self.loader, self.options = spec, loader, dict(options or {})
        self.deadline_name, self.start_limit = deadline_name, start_limit
        self.process: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.ready = False

    def call(self, kwargs: dict, timeout: float | None = None):
        if self.process is None or self.process.poll() is not None:  # never started, or died between calls
            self.start()
        if not self.ready:
            self.wait_ready()
        try:
            self.conn.send_bytes(pickle.dumps(kwargs, pickle.HIGHEST_PROTOCOL))
        except OSError:
            raise self.died() from None
        if not self.conn.poll(timeout or None):  # None or 0: no deadline
            self.stop()
            raise CallFailed(f"ran past {self.deadline_name} {timeout:g} s (its worker process was killed)", "timeout")
        return self.receive()

    def start(self) -> None:
        self.stop()
        parent_end, child_end = Pipe()  # a socket pair: both ends send and receive
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        command = [sys.executable, "-m", "step3_ppo.function_worker", str(child_end.fileno()), str(os.getpid())]
        # its own process group: a kill at the deadline ends what it started, and Ctrl-C is the trainer's to handle
        self.process = subprocess.Popen(
            command, pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL, env=env, start_new_session=True
        )
        child_end.close()
        _live.add(self.process)
        self.conn, self.ready = parent_end, False
        self.conn.send_bytes(pickle.dumps((self.loader, self.spec, self.options, list(sys.path))))

    def wait_ready(self) -> None:
        if not self.conn.poll(self.start_limit):
            self.stop()
            raise CallFailed(f"its worker process did not load it within {self.start_limit:g} s", "start")
        self.receive()
        self.ready = True

    def receive(self):
        """The worker's answer to a start or a call: the value, or the matching exception."""
        try:
            kind, payload = pickle.loads(self.conn.recv_bytes())
        except (EOFError, OSError):
            raise self.died() from None
        except Exception as exc:  # a result whose class the parent cannot import
            raise CallFailed(
                f"returned a value that cannot be read back from its worker process: "
                f"{one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}",
                "unreadable",
            ) from None
        if kind in ("ok", "ready"):
            return payload
        if kind in ("error", "exit", "load"):  # the setup is wrong, or the worker exits after saying so
            self.stop()
        if kind == "error":
            raise _rebuilt(*payload)
        raise CallFailed(payload, kind)

    def died(self) -> CallFailed:
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # alive, but its end of the socket is closed
            pass
        process = self.process
        self.stop()
        status = process.returncode
        how = f"killed by signal {signal.Signals(-status).name}" if status < 0 else f"exit status {status}"
        return CallFailed(f"its worker process died ({how})", "died")

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


def _rebuilt(data: bytes, message: str) -> ProjectError:
    """The ProjectError the worker raised, attributes and all, without calling its __init__ (a subclass's
    takes other arguments than its one-line message); a plain ProjectError(message) if its class is not
    importable here."""
    try:
        cls, args, state = pickle.loads(data)
        if isinstance(cls, type) and issubclass(cls, ProjectError):
            exc = cls.__new__(cls)
            exc.args = args
            exc.__dict__.update(state)
            return exc
    except Exception:
        pass
    return ProjectError(message)


# ---------------------------------------------------------------- the worker's end


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this worker when the trainer's process dies (even by SIGKILL, while a call hangs)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)


def _send(conn: Connection, kind: str, payload) -> None:
    try:
        data = pickle.dumps((kind, payload), pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        data = pickle.dumps(
            (
                "unpicklable",
                f"returned a {type(payload).__name__}, which cannot be pickled back "
                f"from its worker process ({one_line(exc, _MESSAGE_LIMIT)})",
            )
        )
    try:
        conn.send_bytes(data)
    except OSError:  # the trainer is gone (BrokenPipeError): nothing to report to, nothing to print
        os._exit(0)


def _receive(conn: Connection):
    """The next call's arguments; None when the trainer closed its end or died (a SIGKILLed rank resets the
    connection before PR_SET_PDEATHSIG's signal lands here: that must not print a traceback beside its error)."""
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _error(exc: ProjectError) -> tuple[bytes, str]:
    try:
        data = pickle.dumps((type(exc), exc.args, dict(vars(exc))), pickle.HIGHEST_PROTOCOL)
    except Exception:  # an attribute that does not pickle: the message alone
        data = b""
    return data, str(exc)


def _outcome(fn, kwargs: dict) -> tuple[str, object]:
    try:
        return "ok", fn(**kwargs)
    except ProjectError as exc:  # the function says the setup is wrong (math_exact without 'answer')
        return "error", _error(exc)
    except Exception as exc:
        return "raised", f"raised {one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}"
    except SystemExit as exc:
        return "exit", f"called sys.exit({exc.code!r})"
    except BaseException as exc:
        return "exit", f"raised {one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}"


def _load(loader: str, spec: str, options: dict):
    module, _, name = loader.partition(":")
    return getattr(importlib.import_module(module), name)(spec, **options)


def serve(fd: int) -> None:
    """Load the function, say ready, then answer calls until the parent closes its end."""
    conn = Connection(fd)
    if (start := _receive(conn)) is None:
        return
    loader, spec, options, path = start
    sys.path[:] = path
    try:
        fn = _load(loader, spec, options)
    except ProjectError as exc:
        return _send(conn, "error", _error(exc))
    except Exception as exc:
        return _send(
            conn,
            "load",
            f"its worker process could not load it: {one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}",
        )
    _send(conn, "ready", None)
    while (kwargs := _receive(conn)) is not None:
        kind, payload = _outcome(fn, kwargs)
        _send(conn, kind, payload)
        if kind == "exit":
            sys.stdout.flush()
            os._exit(1)  # its state is suspect; the next call starts a fresh worker


if __name__ == "__main__":
    _die_with_parent(int(sys.argv[2]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the trainer decides what Ctrl-C stops
    serve(int(sys.argv[1]))
