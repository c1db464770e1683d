"""The run lifecycle (utils/train/run.py) and the optimizer-step accounting of the micro-batch loop over it
(utils/train/loop.py): gradient-accumulation boundaries read where DeepSpeed means them, fp16 loss-scaler
skips counted as overflows (not as bad steps), per-phase peak memory, the resume skip, evaluations every
K steps in rows of their own, the run's state. fp16 loss scaling needs a GPU, so the overflow is a stub
engine that follows DeepSpeed's counter semantics; one real engine checks those semantics."""

import argparse

import pytest
import torch

from utils.runtime.accelerator import PhaseMemory
from utils.train.loop import APPLIED, OVERFLOW, backward_and_step, train_micro_batches
from utils.train.metrics_logger import read_metrics
from utils.train.run import Run, memory_postfix


class StubEngine:
    """DeepSpeed's engine as the loop sees it: the boundary is (micro_steps + 1) % gas == 0 until step()
    increments micro_steps; `overflow_at` lists the optimizer steps the fp16 loss scaler skips."""

    def __init__(self, gas: int, overflow_at=()):
        self.gas, self.overflow_at = gas, set(overflow_at)
        self.micro_steps, self.optimizer_steps, self.skipped, self._applied = 0, 0, 0, False

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def backward(self, loss):
        pass

    def step(self):
        self._applied = False
        if self.is_gradient_accumulation_boundary():
            if self.optimizer_steps + self.skipped in self.overflow_at:
                self.skipped += 1
            else:
                self.optimizer_steps += 1
                self._applied = True
        self.micro_steps += 1

    def was_step_applied(self):
        return self._applied


class Sampler:
    def set_epoch(self, epoch):
        pass


def args_for(tmp_path, num_epochs: int = 1, **extra):
    return argparse.Namespace(
        output_dir=str(tmp_path),
        num_train_epochs=num_epochs,
        max_bad_steps=3,
        enable_tensorboard=False,
        tensorboard_path=None,
        **extra,
    )


def make_run(tmp_path, total_steps: int, num_epochs: int = 1, memory=None, **kwargs) -> Run:
    run = Run(
        args_for(tmp_path, num_epochs, **kwargs.pop("extra", {})),
        "test",
        "test",
        {},
        None,
        total_steps,
        memory=memory,
        **kwargs,
    )
    run.restore()
    return run


def run(engine, n_batches: int, total_steps: int, num_epochs: int = 1, memory=None, tmp_path=None):
    import tempfile

    the_run = make_run(tmp_path or tempfile.mkdtemp(), total_steps, num_epochs, memory)
    logged = []
    engine.get_lr = lambda: [0.1]
    loader = [torch.tensor(float(i)) for i in range(n_batches)]

    def step_metrics(means):
        logged.append((the_run.loop.step + 1, means[0]))
        return {"train/loss": means[0]}, {}, None

    train_micro_batches(the_run, engine, loader, Sampler(), lambda batch: (batch, ()), step_metrics)
    the_run.logger.close()
    return the_run.loop, logged


def test_accumulation_boundaries_are_the_engines():
    engine = StubEngine(gas=2)
    loop, logged = run(engine, n_batches=4, total_steps=2)
    assert engine.optimizer_steps == 2 and loop.step == 2
    # each logged step is the mean loss of ITS two micro-batches (0,1) and (2,3)
    assert logged == [(1, 0.5), (2, 2.5)]


def test_max_steps_stops_after_the_last_update_not_one_micro_batch_early():
    engine = StubEngine(gas=2)
    loop, _ = run(engine, n_batches=8, total_steps=3)
    assert engine.optimizer_steps == 3 and loop.step == 3 and loop.batches_in_epoch == 6


def test_an_fp16_overflow_skip_counts_as_overflow_not_as_a_bad_step():
    engine = StubEngine(gas=1, overflow_at={1})
    loop, logged = run(engine, n_batches=4, total_steps=4)
    assert loop.overflow_steps == 1 and loop.bad_steps == 0
    assert loop.step == 4 and engine.optimizer_steps == 3 and len(logged) == 4


def test_backward_and_step_on_a_real_engine():
    """DeepSpeed's own boundary flag describes the NEXT micro-batch once step() has run: read it before."""
    from utils.runtime.distributed import init_distributed
    from utils.train.ds_config import train_ds_config
    from utils.train.loop import initialize_engine

    init_distributed()
    model = torch.nn.Linear(4, 1)
    engine = initialize_engine(
        model, train_ds_config(0, 1, 2, gradient_accumulation_steps=2), torch.optim.AdamW(model.parameters(), lr=0.1)
    )
    outcomes = [backward_and_step(engine, engine(torch.ones(2, 4)).sum()) for _ in range(4)]
    assert outcomes == [None, APPLIED, None, APPLIED] and engine.global_steps == 2
    assert OVERFLOW != APPLIED


PHASES = """
import json, torch
from utils.runtime.accelerator import PhaseMemory
memory = PhaseMemory()
with memory.phase("small"):
    pass
with memory.phase("big"):
    block = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MiB, touched
    del block
with memory.phase("after"):
    pass
print(json.dumps(memory.metrics()))
print(json.dumps(memory.metrics()))
"""


@pytest.mark.slow
def test_phase_memory_records_each_phases_peak():
    """In a fresh interpreter: in this one the heap already holds freed blocks (tune_malloc keeps them),
    so a new allocation need not raise the RSS at all."""
    import json
    import os
    import subprocess
    import sys

    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("the peak RSS cannot be reset here (no writable /proc/self/clear_refs)")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", PHASES],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": root},
    ).stdout.splitlines()
    metrics, again = json.loads(out[-2]), json.loads(out[-1])
    assert set(metrics) == {"mem/small_peak_gb", "mem/big_peak_gb", "mem/after_peak_gb"}
    assert metrics["mem/big_peak_gb"] - metrics["mem/small_peak_gb"] >= 250 / 1024
    assert metrics["mem/big_peak_gb"] - metrics["mem/after_peak_gb"] >= 200 / 1024  # the peak was reset
    assert again == {}  # read and cleared
    assert memory_postfix(metrics) == {"mem": f"{metrics['mem/big_peak_gb']:.2f}G"}


def test_training_loop_reports_the_training_phase_peak(tmp_path):
    run(StubEngine(gas=1), n_batches=2, total_steps=2, memory=PhaseMemory(), tmp_path=tmp_path)
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2] and all(r["mem/training_peak_gb"] > 0 for r in rows)


def test_steps_yield_units_and_a_resumed_run_skips_what_its_checkpoint_consumed(tmp_path):
    """Three batches per RL iteration, two iterations per epoch of 7 batches (the 7th is left over),
    resumed after the first iteration of epoch 1: the second iteration's batches come next."""
    fresh = make_run(tmp_path / "a", total_steps=4, num_epochs=2)
    seen = []
    for unit in fresh.steps(list(range(7)), Sampler(), batches_per_step=3):
        seen.append(unit)
        fresh.after_step({})
    assert seen == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]] and fresh.loop.step == 4
    resumed = make_run(tmp_path / "b", total_steps=4, num_epochs=2)
    resumed.loop.step, resumed.loop.epoch, resumed.loop.batches_in_epoch = 3, 1, 3
    assert list(resumed.steps(list(range(7)), Sampler(), batches_per_step=3))[:1] == [[3, 4, 5]]


def test_evaluations_every_k_steps_join_the_steps_row(tmp_path):
    calls = []

    def evaluate(step):
        calls.append(step)
        return {"eval/x": float(step), "time/eval_s": 0.0}

    for last, expected in ((False, [2, 4]), (True, [2, 4, 5])):
        run_ = make_run(
            tmp_path / str(last), total_steps=5, evaluate=evaluate, evaluate_last=last, extra={"eval_interval": 2}
        )
        calls.clear()
        for _ in run_.steps(list(range(10)), Sampler()):
            run_.after_step({"train/loss": 1.0})
        run_.logger.close()
        assert calls == expected
        rows = read_metrics(str(tmp_path / str(last)))
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # one row per step
        assert [r["step"] for r in rows if "eval/x" in r] == expected
        assert all(r["eval/x"] == r["step"] and r["train/loss"] == 1.0 for r in rows if "eval/x" in r)


def test_restore_keeps_the_state_of_before_and_logs_its_metrics_at_step_0(tmp_path):
    run_ = Run(args_for(tmp_path), "test", "test", {}, None, 1)
    state = run_.restore(lambda: ({"ppl_before": 3.5}, {"eval/perplexity": 3.5}))
    run_.logger.close()
    assert state == {"ppl_before": 3.5} and not run_.resumed
    assert read_metrics(str(tmp_path)) == [{"step": 0, "eval/perplexity": 3.5}]
