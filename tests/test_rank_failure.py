"""A failure on any rank ends the whole job within seconds, shown once: the failing rank
prints its one `error: [rank N] ...` line (a bug: its traceback) and exits at once, the launcher ends the
others; when every rank fails the same way only the first to claim the report on the process group's
store shows it. In process with a stand-in store for run_main's choices; through the launcher for a step-3
run (ZeRO-3 + hybrid) whose reward function raises on rank 1, or on every rank."""

import datetime
import subprocess
import sys
import time

import pytest

from tests.launch import run_deepspeed, tail
from tests.test_step3_grpo import grpo_args, write_rows
from utils import errors
from utils.data import DataError


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
