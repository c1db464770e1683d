"""The optimizer-step accounting of the training loop (utils/training.py): gradient-accumulation boundaries
read where DeepSpeed means them, fp16 loss-scaler skips counted as overflows (not as bad steps), per-phase
peak memory. fp16 loss scaling needs a GPU, so the overflow is a stub engine that follows DeepSpeed's
counter semantics; one real engine checks those semantics."""
import pytest
import torch

from utils.accelerator import PhaseMemory
from utils.checkpoint import LoopState
from utils.training import APPLIED, OVERFLOW, backward_and_step, memory_postfix, run_micro_batches


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


class FiniteGuard:
    def all_finite(self, *values):
        return True


def run(engine, n_batches: int, total_steps: int, num_epochs: int = 1, memory=None):
    loop, logged = LoopState(), []
    loader = [torch.tensor(float(i)) for i in range(n_batches)]
    run_micro_batches(engine, loader, Sampler(), loop, total_steps, num_epochs, FiniteGuard(),
                      lambda batch: (batch, ()), lambda means: logged.append((loop.step, means[0])), "test", memory)
    return loop, logged


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
    from utils.distributed import init_distributed
    from utils.ds_config import train_ds_config
    from utils.training import initialize_engine

    init_distributed()
    model = torch.nn.Linear(4, 1)
    engine = initialize_engine(model, train_ds_config(0, 1, 2, gradient_accumulation_steps=2),
                               torch.optim.AdamW(model.parameters(), lr=0.1))
    outcomes = [backward_and_step(engine, engine(torch.ones(2, 4)).sum()) for _ in range(4)]
    assert outcomes == [None, APPLIED, None, APPLIED] and engine.global_steps == 2
    assert OVERFLOW != APPLIED


PHASES = """
import json, torch
from utils.accelerator import PhaseMemory
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
    out = subprocess.run([sys.executable, "-c", PHASES], cwd=root, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": root}).stdout.splitlines()
    metrics, again = json.loads(out[-2]), json.loads(out[-1])
    assert set(metrics) == {"mem/small_peak_gb", "mem/big_peak_gb", "mem/after_peak_gb"}
    assert metrics["mem/big_peak_gb"] - metrics["mem/small_peak_gb"] >= 250 / 1024
    assert metrics["mem/big_peak_gb"] - metrics["mem/after_peak_gb"] >= 200 / 1024  # the peak was reset
    assert again == {}  # read and cleared
    assert memory_postfix(metrics) == {"mem": f"{metrics['mem/big_peak_gb']:.2f}G"}


def test_training_loop_reports_the_training_phase_peak():
    memory = PhaseMemory()
    run(StubEngine(gas=1), n_batches=2, total_steps=2, memory=memory)
    assert list(memory.metrics()) == ["mem/training_peak_gb"]
