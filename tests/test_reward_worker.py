"""Reward functions in their own worker process (step3_ppo/rewards/reward_worker.py): a call stuck in C code, a
busy loop or a function that swallows every BaseException is killed at --reward_timeout; sys.exit or a
dead worker is one failed call naming the function and the rows; --skip_bad_rewards tells the first error
of each function and stops an iteration left with nothing to train; the specs are checked before any
model is loaded. In this process through FunctionReward, except one step-3 run."""

import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from step3_ppo import main as step3_main
from step3_ppo.algo.shaping import FixedKLController
from step3_ppo.function_worker import FunctionWorker
from step3_ppo.rewards.components import FunctionReward
from step3_ppo.rewards.functions import RewardFunctionError, load_reward_function
from step3_ppo.trainer import NothingToTrain, PPOConfig, PPOTrainer
from tests.launch import run_module, tail
from tests.test_step3_grpo import grpo_args, write_rows
from utils.errors import UsageError
from utils.math.rows import Row

SLACK_S = 3.0  # killing and reaping a worker, on a loaded machine

FUNCTIONS = """
import os, sys, time

def c_loop(completions, **kwargs):
    if "stuck" in completions:
        sum(range(10**9))  # C code (10 to 30 s here), where no signal gets in
    return [1.0] * len(completions)

def spin(completions, pid_file, **kwargs):
    with open(pid_file[0], "w") as f:
        f.write(str(os.getpid()))
    if "spin" in completions:
        while True:
            pass
    return [2.0] * len(completions)

def stubborn(completions, **kwargs):
    give_up = time.monotonic() + (12 if "stuck" in completions else 0)
    while time.monotonic() < give_up:  # swallows the in-process SIGALRM's exception
        try:
            time.sleep(0.05)
        except BaseException:
            pass
    return [0.0] * len(completions)

def quits(completions, how, **kwargs):
    if how[0] == "sys.exit":
        sys.exit(0)
    if how[0] == "os._exit":
        os._exit(3)
    return [3.0] * len(completions)

def always_fails(completions, **kwargs):
    raise ValueError("column 'answer' is empty")
"""


@pytest.fixture(scope="module")
def functions(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward_worker") / "rewards.py"
    path.write_text(FUNCTIONS)
    return path


TEXTS = ["fine", "stuck", "spin", "a" * 27 + "b", "aa"]  # a row's completion is TEXTS[its one response id]


def reward(path, name, options=None, **kwargs) -> FunctionReward:
    """The FunctionReward of `path:name` (a built-in without `path`), decoding a row's one id as TEXTS[id]."""
    tokenizer = SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [TEXTS[int(i[0])] for i in ids])
    return FunctionReward(
        load_reward_function(f"{path}:{name}" if path else name, **(options or {})), tokenizer, **kwargs
    )


def rows(*texts, **extra) -> list[Row]:
    """Rows whose decoded completion is `texts[i]` and whose prompt rows carry `extra`."""
    return [
        Row(
            torch.tensor([1]),
            torch.tensor([TEXTS.index(t)]),
            True,
            group=i,
            prompt={"prompt": f"p{i}", "origin": f"data/x.jsonl:{i + 1}", "extra": dict(extra)},
        )
        for i, t in enumerate(texts)
    ]


def timed(call):
    start = time.monotonic()
    with pytest.raises(RewardFunctionError) as info:
        call()
    return str(info.value), time.monotonic() - start


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_a_call_in_c_code_is_killed_at_the_deadline(functions):
    r = reward(functions, "c_loop", timeout=0.5)
    assert r(rows("fine")).tolist() == [1.0]  # the worker is started (and loaded) before the timed call
    message, elapsed = timed(lambda: r(rows("stuck", "fine")))
    assert elapsed < 0.5 + SLACK_S, elapsed
    assert "\n" not in message and "c_loop" in message and "--reward_timeout 0.5 s" in message
    assert "data/x.jsonl:1, data/x.jsonl:2" in message
    assert r(rows("fine")).tolist() == [1.0]  # a fresh worker for the next batch


def test_a_catastrophic_regex_is_killed_at_the_deadline_off_the_main_thread():
    """Off the main thread the in-process fallback could not even take the GIL back from the regex."""
    r = reward(None, "format", timeout=0.5, options={"format_pattern": "(a+)+$"})
    assert r(rows("aa")).tolist() == [1.0]
    out = {}

    def score():
        start = time.monotonic()
        try:
            r(rows("a" * 27 + "b"))
        except RewardFunctionError as exc:
            out["error"] = str(exc)
        out["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(60)
    assert out["elapsed"] < 0.5 + SLACK_S, out
    assert "reward function format: ran past --reward_timeout 0.5 s" in out.get("error", ""), out


def test_a_busy_loop_runs_in_a_worker_that_is_killed_and_replaced(functions, tmp_path):
    pid_file = str(tmp_path / "pid")
    r = reward(functions, "spin", timeout=0.5)
    assert r(rows("fine", pid_file=pid_file)).tolist() == [2.0]
    first = int(open(pid_file).read())
    assert first != os.getpid()
    message, elapsed = timed(lambda: r(rows("spin", pid_file=pid_file)))
    assert elapsed < 0.5 + SLACK_S and "--reward_timeout" in message
    assert gone(first)  # killed, not abandoned
    assert r(rows("fine", pid_file=pid_file)).tolist() == [2.0]
    assert int(open(pid_file).read()) not in (first, os.getpid())


def test_a_function_catching_every_base_exception_is_stopped(functions):
    r = reward(functions, "stubborn", timeout=0.5)
    assert r(rows("fine")).tolist() == [0.0]
    message, elapsed = timed(lambda: r(rows("stuck")))
    assert "--reward_timeout 0.5 s" in message and elapsed < 0.5 + SLACK_S, elapsed


def test_sys_exit_or_a_dead_worker_is_a_failed_call(functions):
    r = reward(functions, "quits")
    message, _ = timed(lambda: r(rows("fine", "stuck", how="sys.exit")))
    assert "\n" not in message and "quits: called sys.exit(0)" in message
    assert "batch of 2 rows: data/x.jsonl:1, data/x.jsonl:2" in message
    message, _ = timed(lambda: r(rows("fine", how="os._exit")))
    assert "quits: its worker process died (exit status 3)" in message
    assert r(rows("fine", how="no")).tolist() == [3.0]
    skipping = reward(functions, "quits", skip_bad=True)
    assert torch.isnan(skipping(rows("fine", "fine", how="sys.exit"))).all() and skipping.skipped == 2


def test_a_worker_whose_trainer_is_gone_leaves_without_a_traceback(functions, capfd):
    """A SIGKILLed rank resets the socket (it dies with the worker's "ready" unread) before PR_SET_PDEATHSIG
    reaches the worker: the worker must leave quietly, or its traceback lands beside the rank's one error line."""
    worker = FunctionWorker(f"{functions}:spin", "step3_ppo.rewards.reward_worker:load", {"options": {}})
    worker.start()  # the worker inherits this process's stderr, which capfd reads
    process = worker.process
    assert worker.conn.poll(60)  # "ready" is waiting, unread: closing now resets the connection
    worker.conn.close()
    assert process.wait(timeout=30) == 0
    assert "Traceback" not in capfd.readouterr().err
    worker.conn = None
    worker.stop()


def test_skip_bad_prints_the_first_error_of_each_function_once(functions, capsys):
    r = reward(functions, "always_fails", skip_bad=True)
    for _ in range(3):
        assert torch.isnan(r(rows("fine", "stuck"))).all()
    told = [line for line in capsys.readouterr().out.splitlines() if "--skip_bad_rewards" in line]
    assert len(told) == 1 and "always_fails" in told[0] and "ValueError: column 'answer' is empty" in told[0]
    assert r.skipped == 6


def test_an_iteration_left_with_nothing_to_train_stops_the_run():
    config = PPOConfig(stop_token_ids=(2,), pad_token_id=0, skip_bad_rewards=True)
    component = SimpleNamespace(name="always_fails")
    trainer = PPOTrainer(
        SimpleNamespace(actor=None, ref=None, critic=None), config, FixedKLController(0.0), [component]
    )
    batch = rows("fine", "stuck")
    for row in batch:
        row.score = row.score_parts["always_fails"] = float("nan")
        row.trained = False
    with pytest.raises(NothingToTrain) as info:
        trainer.stop_if_nothing_to_train(batch, step=4)
    assert str(info.value).startswith("iteration 5: nothing left to train: 2 of 2 rows")
    assert "always_fails" in str(info.value) and "\n" not in str(info.value)
    batch[0].trained, batch[0].score = True, 1.0
    trainer.stop_if_nothing_to_train(batch, step=4)  # one row left: it trains


def test_reward_specs_are_checked_before_any_model_is_loaded(tiny_llama, tmp_path, monkeypatch):
    write_rows(tmp_path)
    loaded = []
    monkeypatch.setattr(step3_main, "start_process", lambda args: None)
    monkeypatch.setattr(step3_main, "load_tokenizer", lambda *a, **k: loaded.append("tokenizer"))
    monkeypatch.setattr(step3_main, "build_engines", lambda *a, **k: loaded.append("engines"))
    args = grpo_args(tiny_llama, tmp_path)
    args[args.index("--reward_funcs") + 1] = f"{tmp_path / 'missing.py'}:reward"
    with pytest.raises(UsageError, match="^--reward_funcs: .*missing.py:reward: no such file"):
        step3_main.setup(step3_main.parse_args(args))
    assert loaded == []


@pytest.mark.slow
def test_step3_with_a_function_that_always_fails_and_skip_bad_stops_with_one_line(tiny_llama, tmp_path):
    write_rows(tmp_path)
    (tmp_path / "failing.py").write_text(FUNCTIONS)
    args = grpo_args(tiny_llama, tmp_path, "--actor_zero_stage", 0, "--max_steps", 2, "--skip_bad_rewards")
    args[args.index("--reward_funcs") + 1] = f"{tmp_path / 'failing.py'}:always_fails"
    proc = run_module("step3_ppo.main", args, timeout=300)
    errors = [line[line.index("error:") :] for line in proc.stderr.splitlines() if "error:" in line]  # after tqdm's bar
    told = [line for line in proc.stdout.splitlines() if "warning: --skip_bad_rewards" in line]
    assert proc.returncode == 1 and len(errors) == 1, tail(proc)
    assert errors[0].startswith("error: iteration 1: nothing left to train") and "always_fails" in errors[0]
    assert len(told) == 1 and "ValueError: column 'answer' is empty" in told[0], tail(proc)
    assert not os.path.exists(tmp_path / "out" / "actor")
