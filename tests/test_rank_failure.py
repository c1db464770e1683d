"""A failure on any rank ends the whole job within seconds, shown once: the failing rank
prints its one `error: [rank N] ...` line (a bug: its traceback) and exits at once, the launcher ends the
others; when every rank fails the same way only the first to claim the report on the process group's
store shows it. A rank that is killed (the OOM killer, SIGKILL) or hangs is named by the survivor's one line,
with the phase each rank was in, instead of gloo's "Connection closed by peer" traceback. In process with a
stand-in store for run_main's choices; through the launcher for a step-3 run (ZeRO-3 + hybrid) whose reward
function raises on rank 1, or on every rank, or kills rank 1."""

import contextlib
import datetime
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.launch import run_deepspeed, tail
from tests.test_step3_grpo import grpo_args, write_rows
from utils import errors
from utils.data import DataError
from utils.runtime import accelerator, distributed
from utils.train.run import _phases_tracked


class Exited(Exception):
    """What os._exit would have done: the test sees the exit code instead of losing its process."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


class DictStore:
    """The three calls of torch's Store that utils.errors makes, on a dict shared by the 'ranks'."""

    def __init__(self):
        self.values = {}

    def compare_set(self, key, expected, desired):
        if self.values.get(key, "") == expected:
            self.values[key] = desired
        return self.values[key].encode()

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key].encode()

    def set_timeout(self, timeout):
        pass

    def wait(self, keys, timeout: datetime.timedelta):
        if not all(k in self.values for k in keys):
            raise TimeoutError(f"{keys} not set within {timeout}")


class DeadStore:
    """A store whose host (rank 0) is gone."""

    def __getattr__(self, name):
        def lost(*args):
            raise RuntimeError("Connection was likely closed")

        return lost


@pytest.fixture
def rank_of_two(monkeypatch):
    """`as_rank(r, store)`: this process as rank r of 2 with `store` (None: no process group yet); os._exit
    raises Exited. Python's own excepthook: torch's, which an earlier test in this process may have installed,
    prefixes each line with "[rankN]: " (it does once tests/test_errors.py has run in this process)."""

    def exit_now(code):
        raise Exited(code)

    monkeypatch.setattr(errors.os, "_exit", exit_now)
    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def as_rank(rank: int, store):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(errors, "_store", store)

    return as_rank


def fails_with(error):
    def main(argv):
        raise error

    return main


def test_first_failing_rank_shows_its_error_tagged_the_others_stay_silent(rank_of_two, capsys):
    store = DictStore()
    rank_of_two(1, store)
    with pytest.raises(Exited) as exited:
        errors.run_main(fails_with(DataError("data.jsonl:3: field 'prompt' is missing")))
    assert exited.value.code == 1
    assert capsys.readouterr().err == "error: [rank 1] data.jsonl:3: field 'prompt' is missing\n"
    rank_of_two(0, store)  # the same bad input on rank 0, a moment later
    with pytest.raises(Exited) as exited:
        errors.run_main(fails_with(DataError("data.jsonl:3: field 'prompt' is missing")))
    assert exited.value.code == 1 and capsys.readouterr().err == ""


def test_a_bug_on_a_rank_ends_it_with_its_traceback_not_a_hang(rank_of_two, capsys):
    rank_of_two(1, DictStore())
    with pytest.raises(Exited) as exited:
        errors.run_main(fails_with(KeyError("a bug on rank 1")))
    err = capsys.readouterr().err
    assert exited.value.code == 1
    assert err.startswith("Traceback") and "KeyError: 'a bug on rank 1'" in err and "raise error" in err


def test_a_rank_whose_store_is_gone_ends_silently(rank_of_two, capsys):
    """Rank 0 (the store's host) reported and exited; this rank's error is that lost peer's consequence."""
    rank_of_two(1, DeadStore())
    with pytest.raises(Exited) as exited:
        errors.run_main(fails_with(RuntimeError("Connection closed by peer")))
    assert exited.value.code == 1 and capsys.readouterr().err == ""


def test_before_the_process_group_rank_n_shows_its_error_after_a_grace(rank_of_two, capsys, monkeypatch):
    """A flag every rank refuses is shown by rank 0 at once; rank 1 shows its own only if the launcher has not
    ended it meanwhile (rank 0 did not fail)."""
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    rank_of_two(0, None)
    with pytest.raises(Exited):
        errors.run_main(fails_with(errors.UsageError("--cliprange must be > 0")))
    assert capsys.readouterr().err == "error: [rank 0] --cliprange must be > 0\n" and slept == []
    rank_of_two(1, None)
    with pytest.raises(Exited):
        errors.run_main(fails_with(errors.UsageError("--cliprange must be > 0")))
    assert capsys.readouterr().err == "error: [rank 1] --cliprange must be > 0\n" and slept == [
        errors._NO_STORE_GRACE_S
    ]


def test_a_plain_exit_status_of_a_rank_leaves_at_once_too(rank_of_two):
    """argparse's SystemExit(2) ends the rank with that status without Python's shutdown; exit 0 stays normal."""
    rank_of_two(1, DictStore())
    with pytest.raises(Exited) as exited:
        errors.run_main(fails_with(SystemExit(2)))
    assert exited.value.code == 2
    with pytest.raises(SystemExit) as normal:
        errors.run_main(fails_with(SystemExit(0)))
    assert normal.value.code == 0


def test_a_library_exit_with_a_message_is_shown_as_python_would(rank_of_two, capsys):
    """sys.exit("message") in code not the project's: the message as Python prints it, exit 1, at once."""
    rank_of_two(1, DictStore())
    with pytest.raises(Exited) as exited:
        errors.run_main(fails_with(SystemExit("a library gave up")))
    assert exited.value.code == 1 and capsys.readouterr().err == "a library gave up\n"


def test_one_process_keeps_pythons_exit(monkeypatch, capsys):
    """No peers to wait on: SystemExit(1) and a re-raised bug, as before (no os._exit, no rank tag)."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit) as exc:
        errors.run_main(fails_with(DataError("bad row")))
    assert exc.value.code == 1 and capsys.readouterr().err == "error: bad row\n"
    with pytest.raises(KeyError):
        errors.run_main(fails_with(KeyError("a bug")))


# raises on rank 1 (or on every rank), after noting when it did
FAILING_REWARD = """
import os
import time

def failing(completions, **kwargs):
    if {ranks!r} == "every" or os.environ["RANK"] == "1":
        with open({stamp!r}, "a") as f:
            f.write(f"{{time.time()}}\\n")
        raise ValueError("boom on rank " + os.environ["RANK"])
    return [1.0] * len(completions)
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", ["1", "every"])
def test_a_reward_function_failing_on_some_rank_ends_the_job_at_once_shown_once(tiny_gpt2, tmp_path, ranks):
    write_rows(tmp_path, 24)
    stamp = tmp_path / "failed_at"
    (tmp_path / "failing.py").write_text(FAILING_REWARD.format(ranks=ranks, stamp=str(stamp)))
    args = grpo_args(tiny_gpt2, tmp_path, "--actor_zero_stage", 3, "--enable_hybrid_engine", "--max_steps", 2)
    args[args.index("--reward_funcs") + 1] = f"{tmp_path / 'failing.py'}:failing"
    try:
        # rank 1 alone: through the real `deepspeed` launcher, whose ending of the other ranks users rely on
        proc = run_deepspeed(
            "step3_ppo.main", args, timeout=150, log_path=str(tmp_path / "log.txt"), launcher=ranks == "1"
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the job was still running 150 s after its start")
    ended = time.time()
    assert proc.returncode != 0, tail(proc)
    output = proc.stdout + proc.stderr
    lines = [line for line in output.splitlines() if "boom on rank" in line]
    assert len(lines) == 1 and "error: [rank " in lines[0], tail(proc)
    assert ranks == "every" or "error: [rank 1] reward function" in lines[0], lines
    assert "Traceback" not in output, tail(proc)
    seconds = ended - min(map(float, stamp.read_text().split()))
    print(f"ended {seconds:.1f} s after the failure", file=sys.stderr)
    assert seconds < 20, seconds


def test_a_finished_rank_runs_the_exit_hooks_and_leaves_without_pythons_shutdown(rank_of_two, monkeypatch):
    """Python's shutdown only tears down torch's, DeepSpeed's and gloo's objects (1.3 s per 2-rank launch): a rank
    that finished runs the atexit hooks (workers ended) and leaves with its status; one process returns as usual."""
    hooks = []
    monkeypatch.setattr(errors.atexit, "_run_exitfuncs", lambda: hooks.append("ran"))
    rank_of_two(1, DictStore())
    with pytest.raises(Exited) as exited:
        errors.run_main(lambda argv: None)
    assert exited.value.code == 0 and hooks == ["ran"]
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert errors.run_main(lambda argv: "the run") == "the run" and hooks == ["ran"]


# what gloo raises on the survivor when its peer's process ended, and when the peer does not answer
GLOO_CLOSED = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:44191. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error."
)
GLOO_TIMED_OUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation"
)


@pytest.fixture
def peer(monkeypatch):
    """This process as rank 0 of 2, in phase "training", --dist_timeout 30; `peer(pid, phase)`: rank 1's process
    (on this host) and last phase on the stand-in store. The run's last checkpoint is step 4's."""
    store = DictStore()
    monkeypatch.setattr(distributed, "_store", store)
    monkeypatch.setattr(distributed, "_timeout_s", 30)
    monkeypatch.setattr(distributed, "_phase", "training")
    monkeypatch.setattr(distributed, "rank", lambda: 0)
    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    monkeypatch.setattr(errors, "_resume_point", lambda: "out/checkpoints/step-00000004")

    def rank1(pid: int, phase: str) -> DictStore:
        store.set("rlhf/process/1", f"{socket.gethostname()} {pid}")
        store.set("rlhf/phase/1", phase)
        return store

    return rank1


def ended_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_peer_is_named_with_what_each_rank_was_doing(peer):
    peer(ended_pid(), "experience")
    line = distributed.lost_peer_line(RuntimeError(GLOO_CLOSED))
    assert line.startswith("rank 1 (in experience) is gone: its process ended (killed? the OOM killer?"), line
    assert "; this rank was in training" in line and line.endswith(
        "--resume continues from out/checkpoints/step-00000004"
    )


def test_a_peer_that_does_not_answer_is_named(peer):
    peer(os.getpid(), "generation")  # alive (this process), in another phase
    line = distributed.lost_peer_line(RuntimeError(GLOO_TIMED_OUT))
    assert line.startswith("no answer within --dist_timeout 30 s from rank 1 (in generation): hung or too slow"), line
    assert "; this rank was in training" in line


def test_other_errors_and_a_lost_store_are_not_translated(peer, monkeypatch):
    peer(ended_pid(), "experience")
    assert distributed.lost_peer_line(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    monkeypatch.setattr(distributed, "_store", DeadStore())  # its host, rank 0, is gone: nothing to read
    assert distributed.lost_peer_line(RuntimeError(GLOO_CLOSED)) is None


def test_run_main_shows_the_lost_peer_line_once_instead_of_the_traceback(rank_of_two, peer, monkeypatch, capsys):
    store = peer(ended_pid(), "experience")
    rank_of_two(0, store)
    monkeypatch.setattr(errors, "_lost_peer", distributed.lost_peer_line)
    with pytest.raises(Exited) as exited:
        errors.run_main(fails_with(RuntimeError(GLOO_CLOSED)))
    err = capsys.readouterr().err
    assert exited.value.code == 1 and err.startswith("error: [rank 0] rank 1 (in experience) is gone: "), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_the_runs_phases_are_this_ranks_phase(monkeypatch):
    """A Run's PhaseMemory blocks (step 3's generation / experience / training) set the phase; after an error
    the phase it failed in stays."""
    monkeypatch.setattr(distributed, "_phase", "training")
    memory = _phases_tracked(accelerator.PhaseMemory())
    assert _phases_tracked(memory) is memory
    with memory.phase("generation"):
        assert distributed.current_phase() == "generation"
    assert distributed.current_phase() == "training" and "mem/generation_peak_gb" in memory.metrics()
    with contextlib.suppress(RuntimeError), memory.phase("experience"):
        raise RuntimeError(GLOO_CLOSED)
    assert distributed.current_phase() == "experience"


# rank 1 is killed (SIGKILL) or hangs (SIGSTOP) while scoring rewards, in the experience phase: the function runs
# in a worker process (step3_ppo/function_worker.py), whose parent is the rank
LOST_REWARD = """
import os
import signal

def lost(completions, **kwargs):
    if os.environ["RANK"] == "1":
        os.kill(os.getppid(), signal.{signal})
    return [1.0] * len(completions)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_rank_killed_or_hung_is_named_by_the_survivor(tiny_gpt2, tmp_path, how):
    write_rows(tmp_path, 24)
    (tmp_path / "lost.py").write_text(LOST_REWARD.format(signal="SIGKILL" if how == "killed" else "SIGSTOP"))
    args = grpo_args(tiny_gpt2, tmp_path, "--max_steps", 2, "--dist_timeout", 30)
    args[args.index("--reward_funcs") + 1] = f"{tmp_path / 'lost.py'}:lost"
    # killed: through the `deepspeed` launcher itself; hung: tests/ranks.py, which ends a stopped rank in 5 s, not 30
    log = str(tmp_path / "log.txt")
    proc = run_deepspeed("step3_ppo.main", args, timeout=240, log_path=log, launcher=how == "killed")
    assert proc.returncode != 0, tail(proc)
    output = proc.stdout + proc.stderr
    # (after the progress bar's last redraw, which ends in no newline)
    lines = [line[line.index("error:") :] for line in output.replace("\r", "\n").splitlines() if "error:" in line]
    expected = (
        "error: [rank 0] rank 1 (in experience) is gone: its process ended"
        if how == "killed"
        else "error: [rank 0] no answer within --dist_timeout 30 s from rank 1 (in experience)"
    )
    assert len(lines) == 1 and lines[0].startswith(expected), tail(proc)
    assert "; this rank was in " in lines[0] and "Traceback" not in output, tail(proc)
