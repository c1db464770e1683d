"""How an entry point ends on an error the program raised itself: ONE `error: ...` line, printed once
per job, and a non-zero exit; tracebacks are kept for bugs.

There is one path: every known failure raises a `ProjectError`, and the entry point's `run_main` prints its
str() as the one line (adding the `error:` prefix) and exits 1. The subclasses are defined where they are
raised: a flag or command line that asks for what cannot be done (`UsageError`, here; utils.train.flags.fail
raises it), bad data (utils.data.DataError), a model path or directory that is not what a flag expects
(utils.models.loading.ModelLoadError), a bad checkpoint (utils.train.checkpoint.CheckpointError), a final model
directory that could not be written (utils.models.export.ExportWriteError), a run whose
updates keep going non-finite (utils.train.checkpoint.NonFiniteUpdates), a reward function that does not load
or misbehaves (step3_ppo.rewards.functions.RewardFunctionError), a step-3 iteration that --skip_bad_rewards
left with nothing to train (step3_ppo.trainer.NothingToTrain). A `SystemExit` is Python's own exit
(argparse's status 2 for a bad flag, 0 for --help) and keeps its status; no code of the project raises
`SystemExit("error: ...")` (tests/test_errors.py checks). Under the `deepspeed` launcher every rank usually
meets the same bad input; without this each printed a 20-line `[rankN]: Traceback` whose last line was the
only useful one.

A job of several ranks ends as a whole within seconds when any rank fails, whatever the error: the
failing rank exits at once (`os._exit`, so no atexit hook, process-group destructor or stray thread
can keep it alive while its peers wait in a collective), and the launcher then ends the others. The
first rank to fail claims the report on the process group's store (which utils.runtime.distributed hands over
here); it shows its error tagged `[rank N]`, the other failing ranks (the same bad input, or a dead
peer's consequences) stay silent. A collective that failed because a peer is gone (killed: the OOM killer,
SIGKILL) or hangs is shown as one line naming that rank and what each rank was doing
(utils.runtime.distributed.lost_peer_line), not as gloo's traceback.

Ctrl-C (SIGINT, which the terminal sends to the launcher and every rank at once) ends the run with one line from
rank 0, `interrupted; --resume continues from <the last checkpoint>` (or that there is none yet), and exit
status 130: no rank prints its KeyboardInterrupt traceback, and an error a rank meets because a peer already left
counts as the same interrupt. The launcher answers the same Ctrl-C with SIGTERM to every rank, which would kill
rank 0 before its line: SIGTERM is therefore caught, ignored once the run is interrupted and otherwise ends the
rank within half a second (status 143), even while its main thread is inside a long C call (a backward, a
collective), as a thread reading Python's signal wakeup pipe acts on it. An interrupted rank leaves within
`_INTERRUPT_GRACE_S` even when its main thread is stuck in a collective; a second Ctrl-C leaves at once. The run
says where a resume continues from through `use_resume_point` (utils.train.run).

This module imports nothing of the project: the errors subclass `ProjectError` where they are defined,
so `run_main` needs no list of them (and no import of the modules that define them).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import select
import signal
import sys
import threading
import time

_CLAIM_KEY, _SHOWN_KEY = "rlhf/failure_claimed_by", "rlhf/failure_shown"
_SHOWN_WAIT_S = 5.0  # how long a silent rank waits for the claiming rank to show its error
_NO_STORE_GRACE_S = 5.0  # before the process group exists: how long rank N > 0 waits before showing its own
_store = None  # the process group's store, once it exists (use_store)
_INTERRUPT_STATUS = 130  # a shell's status for a command ended by SIGINT (128 + 2)
_INTERRUPT_GRACE_S = 10.0  # how long after Ctrl-C a rank whose main thread does not get back may take to leave
_SIGTERM_GRACE_S = 0.5  # how long a SIGTERM waits for a SIGINT of the same Ctrl-C that a busy thread still holds
_resume_point = None  # () -> the checkpoint a --resume continues from, or None (use_resume_point)
_lost_peer = None  # exception -> its one line when a peer rank is gone or hangs, else None (use_store)
_interrupted = threading.Event()  # set by the first SIGINT
_interrupt_once = threading.Lock()  # around setting _interrupted and starting the watchdog
_interrupt_shown = threading.Lock()  # held by whichever (main thread or watchdog) prints the line
_raised = False  # the main thread raised KeyboardInterrupt for the first Ctrl-C
_fork_hook = False  # os.register_at_fork done (`_forked_child`)
_wakeup_fd = -1  # the write end of the signal wakeup pipe `_watch_signals` reads


class ProjectError(Exception):
    """An error the program raises itself about its input (data, a model directory, a checkpoint, a
    reward function): its str() is the one line the user reads, so `run_main` prints it without a
    traceback. Subclasses keep their built-in base where they had one (DataError is also a ValueError)."""


class UsageError(ProjectError):
    """A command line that asks for what cannot be done: a flag out of range, flags that contradict each other
    or the input they name, a flag whose package is missing (utils.train.flags.fail raises it)."""


def one_line(text, limit: int | None = None) -> str:
    """`text` (an exception, a message) with its whitespace collapsed to single spaces, cut at `limit`."""
    line = " ".join(str(text).split())
    return line if limit is None else line[:limit]


def use_store(store, lost_peer=None) -> None:
    """Where the ranks of this job agree which one reports a failure (utils.runtime.distributed, at start);
    `lost_peer(exc)`: the one line for a collective that failed because a peer is gone or hangs (None: not one)."""
    global _store, _lost_peer
    _store, _lost_peer = store, lost_peer


def use_resume_point(where) -> None:
    """`where()` gives the checkpoint a --resume of this run continues from (None: none yet); the line an
    interrupted run prints names it (utils.train.run registers it)."""
    global _resume_point
    _resume_point = where


def resume_point() -> str | None:
    """The checkpoint a --resume of this run continues from (None: none, or no run registered)."""
    if _resume_point is not None:
        with contextlib.suppress(Exception):
            return _resume_point()
    return None


def interrupted_line() -> str:
    """What an interrupted run says: where a --resume continues from, or that there is nothing to resume."""
    where = resume_point()
    if where:
        return f"interrupted; --resume continues from {where}"
    return "interrupted before the first checkpoint; nothing to resume"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def report(message: str) -> None:
    """Print `message` as one error line, tagged with this rank in a job of several."""
    text = one_line(message)
    text = text[len("error:") :].lstrip() if text.startswith("error:") else text
    tag = f"[rank {_rank()}] " if _world_size() > 1 else ""
    print(f"error: {tag}{text}", file=sys.stderr, flush=True)


def run_main(main, argv=None):
    """`main(argv)`, with the project's own errors turned into one readable line and exit status 1; in a
    job of several ranks any error ends this rank at once, shown by one rank only (`_fail`), and a rank that
    finished leaves at once too (`_finish_now`). Ctrl-C: one line from rank 0 and status 130 (`_leave_interrupted`)."""
    previous = _catch_interrupts()
    try:
        result = main(argv)
    except SystemExit as exc:  # Python's own exit (argparse: 2 for a bad flag, 0 for --help): its status kept
        if _interrupted.is_set():
            _leave_interrupted()
        if _world_size() > 1 and exc.code not in (0, None):
            if not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)  # what Python prints for sys.exit("message")
            _exit_now(exc.code if isinstance(exc.code, int) else 1)
        raise
    except KeyboardInterrupt:
        _leave_interrupted()
    except ProjectError as exc:
        if _interrupted.is_set():
            _leave_interrupted()
        message = str(exc)
        _fail(lambda: report(message))
    except Exception as exc:  # a bug: its traceback, as Python (and torch's [rankN] hook) shows it
        if _interrupted.is_set():  # a peer that left on the same Ctrl-C: a closed connection, a collective's error
            _leave_interrupted()
        if _world_size() == 1:
            raise
        error = exc  # bound outside the except's own name, which Python unbinds when the clause ends
        _fail(lambda: _show_exception(error))
    finally:
        _release_signals(previous)  # an in-process run (tests): Python's own signal handling back
    if _world_size() > 1:
        _finish_now(result if isinstance(result, int) else 0)
    return result


def _show_exception(error: BaseException) -> None:
    """A collective that failed because a peer rank is gone or hangs: its one line (which rank, what each was
    doing: utils.runtime.distributed.lost_peer_line); any other error: its traceback."""
    line = None
    if _lost_peer is not None:
        with contextlib.suppress(Exception):
            line = _lost_peer(error)
    if line:
        report(line)
    else:
        sys.excepthook(type(error), error, error.__traceback__)


def _catch_interrupts():
    """SIGINT marks the run interrupted before Python raises KeyboardInterrupt, SIGTERM is caught (`_on_sigterm`),
    and a thread reads Python's signal wakeup pipe to act on both while the main thread is inside a C call. Main
    thread only (elsewhere signal handlers cannot be set: Python's own stay). Returns what `_release_signals`
    puts back (None: nothing)."""
    global _interrupt_shown, _raised, _fork_hook, _wakeup_fd
    _interrupted.clear()
    _interrupt_shown, _raised = threading.Lock(), False
    if threading.current_thread() is not threading.main_thread():
        return None
    if not _fork_hook:
        os.register_at_fork(after_in_child=_forked_child)
        _fork_hook = True
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    _wakeup_fd = write_fd
    previous = (
        signal.signal(signal.SIGINT, _on_sigint),
        signal.signal(signal.SIGTERM, _on_sigterm),
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False),
        write_fd,
    )
    threading.Thread(target=_watch_signals, args=(read_fd,), name="signal-watch", daemon=True).start()
    return previous


def _release_signals(previous) -> None:
    if previous is None:
        return
    sigint, sigterm, wakeup_fd, write_fd = previous
    signal.signal(signal.SIGINT, sigint)
    signal.signal(signal.SIGTERM, sigterm)
    signal.set_wakeup_fd(wakeup_fd)
    os.close(write_fd)  # the watching thread reads the end of the pipe and leaves


def _forked_child() -> None:
    """A child forked from a rank (a DataLoader worker) gets Python's own signal handling back: its signals stay
    its own, not bytes in the rank's wakeup pipe (a worker ended with SIGTERM would end the rank)."""
    with contextlib.suppress(Exception):  # forked from another thread: not the child's main thread
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _watch_signals(read_fd: int) -> None:
    """Python's C-level handler writes each signal's number to the wakeup pipe at once, whatever the main thread
    is doing: a SIGINT starts the interrupt (`_start_interrupt`); a SIGTERM of a run not interrupted ends the rank,
    as SIGTERM's default did (no flush: the main thread may hold a stream's lock), unless a SIGINT follows within
    `_SIGTERM_GRACE_S`: the kernel hands a signal to whichever thread it picks, so the terminal's SIGINT, sent
    first, can reach the pipe after the launcher's SIGTERM when the thread it picked waits for a CPU."""
    term_at = None
    with contextlib.closing(os.fdopen(read_fd, "rb", buffering=0)) as pipe:
        while True:
            wait = None if term_at is None else max(0.0, term_at + _SIGTERM_GRACE_S - time.monotonic())
            if not select.select([pipe], [], [], wait)[0]:
                if not _interrupted.is_set() and signal.SIGINT not in signal.sigpending():
                    os._exit(128 + signal.SIGTERM)
                term_at = None
                continue
            data = pipe.read(64)
            if not data:
                return
            for signum in data:
                if signum == signal.SIGINT:
                    _start_interrupt()
                elif signum == signal.SIGTERM and term_at is None and not _interrupted.is_set():
                    term_at = time.monotonic()


def _start_interrupt() -> None:
    """The first SIGINT: the run is interrupted, and a watchdog ends this rank if its main thread does not get
    back to Python (stuck in a collective) within `_INTERRUPT_GRACE_S`."""
    with _interrupt_once:
        if _interrupted.is_set():
            return
        _interrupted.set()
    threading.Thread(target=_interrupt_watchdog, name="interrupt-watchdog", daemon=True).start()


def _on_sigint(signum, frame):
    """The first Ctrl-C: KeyboardInterrupt, as Python's own handler raises it; a second: leave at once."""
    global _raised
    _start_interrupt()
    if _raised:
        _exit_now(_INTERRUPT_STATUS)
    _raised = True
    raise KeyboardInterrupt


def _on_sigterm(signum, frame):
    """A handler, so that SIGTERM no longer kills at once: the thread reading the wakeup pipe decides
    (`_watch_signals`). Should another library have taken the wakeup fd (asyncio's signal handlers), this
    main-thread handler ends a run not interrupted itself."""
    current = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(current)
    if current != _wakeup_fd and not _interrupted.is_set():
        os._exit(128 + signal.SIGTERM)


def _interrupt_watchdog() -> None:
    time.sleep(_INTERRUPT_GRACE_S)
    _show_interrupted()
    _exit_now(_INTERRUPT_STATUS)


def _show_interrupted() -> None:
    """Rank 0 prints the interrupted line, once (whichever of the main thread and the watchdog comes first)."""
    if _interrupt_shown.acquire(blocking=False) and _rank() == 0:
        start = "\n" if sys.stderr.isatty() else ""  # in a terminal: after the progress bar and the ^C, not on them
        print(f"{start}{interrupted_line()}", file=sys.stderr, flush=True)


def _leave_interrupted() -> None:
    """End an interrupted run: its one line (rank 0), status 130; a rank of several leaves without Python's
    shutdown (its peers are leaving too), after the exit hooks (workers ended, logs flushed)."""
    _interrupted.set()
    _show_interrupted()
    if _world_size() == 1:
        raise SystemExit(_INTERRUPT_STATUS) from None
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    _exit_now(_INTERRUPT_STATUS)


def _fail(show) -> None:
    """`show()` the error and exit 1: in one process as usual, in a job of several once per job and at once."""
    if _world_size() == 1:
        show()
        raise SystemExit(1) from None
    if _store is None:
        _show_without_store(show)
    else:
        _show_once(show)
    _exit_now(1)


def _exit_now(code: int) -> None:
    """Flush and leave without Python's shutdown: nothing may keep a failed rank alive while its peers
    wait for it in a collective (they wait up to --dist_timeout; the launcher ends them once it exits)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _finish_now(code: int) -> None:
    """A rank of a multi-rank job that finished leaves without the rest of Python's shutdown, which only tears
    down torch's, DeepSpeed's and gloo's objects (1.3 s of each 2-rank launch, measured): the atexit hooks run
    (workers ended, logging flushed), the streams are flushed; the run's files are closed by then (utils.train.run)."""
    atexit._run_exitfuncs()
    _exit_now(code)


def _show_once(show) -> None:
    """The first rank to claim the failure on the store shows its error; a rank that loses the claim
    waits (bounded) until it is shown, as the launcher ends every rank once one exits. A store that
    does not answer has lost its host (rank 0), which either reported or was killed (the launcher
    then names it), so this rank's error, most likely the lost peer's consequence, is not shown."""
    with _native_stderr_muted():
        try:
            claimed = _store.compare_set(_CLAIM_KEY, "", str(_rank())) == str(_rank()).encode()
        except Exception:
            claimed = False
    if claimed:
        show()
        sys.stderr.flush()
    with _native_stderr_muted(), contextlib.suppress(Exception):
        if claimed:
            _store.set(_SHOWN_KEY, "1")
        else:
            _store.wait([_SHOWN_KEY], datetime.timedelta(seconds=_SHOWN_WAIT_S))


def _show_without_store(show) -> None:
    """Before the process group exists (flags, paths): every rank usually fails the same way, so rank 0
    shows its error at once and rank N > 0 only if it is still alive after a grace period, that is,
    when rank 0 did not fail (the launcher ends every rank once one exits)."""
    if _rank() != 0:
        time.sleep(_NO_STORE_GRACE_S)
    show()


@contextlib.contextmanager
def _native_stderr_muted():
    """File descriptor 2 sent to /dev/null: torch's store client logs a lost connection with a page of
    C++ stack frames, noise around the one line this module prints."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
