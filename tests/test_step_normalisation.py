"""One normalisation over the whole optimizer step: a token (sequence, pair) mean over
every micro-batch of the gradient-accumulation window and every rank, the last partial window by its own
count, in step 1, the DPO step and step 3. The 2-rank case runs the product's loops under the launcher
(tests/step_normalisation_probe.py) against one plain batch of all the rows; the rest is the arithmetic
and the loop's boundaries on a stub engine."""

import json
import os

import pytest
import torch

from tests.launch import run_deepspeed, tail
from tests.test_training_loop import Sampler, make_run
from utils.train.loop import accumulation_windows, step_normalised_loss, train_micro_batches


def test_equal_counts_leave_the_micro_batch_loss_unchanged_bit_for_bit():
    term = torch.tensor(0.1234567, requires_grad=True) * 3.0
    loss, logged = step_normalised_loss({"tokens": term}, {"tokens": 7}, {"tokens": 28.0}, accumulation=2, ranks=2)
    assert torch.equal(loss, term) and logged == pytest.approx(term.item() / 4)
    # unequal counts: accumulation x ranks x count / total (DeepSpeed divides by both again)
    loss, logged = step_normalised_loss(
        {"tokens": term, "pairs": term},
        {"tokens": 3, "pairs": 0},
        {"tokens": 20.0, "pairs": 8.0},
        accumulation=2,
        ranks=2,
    )
    assert loss.item() == pytest.approx(term.item() * 0.6) and logged == pytest.approx(term.item() * 0.15)
    assert step_normalised_loss({"tokens": term}, {"tokens": 0}, {"tokens": 0.0}, 2, 2)[0].item() == 0.0


def test_accumulation_windows_keep_the_last_partial_one():
    assert list(accumulation_windows(range(5), 2)) == [[0, 1], [2, 3], [4]]
    assert list(accumulation_windows([], 3)) == []


def test_sft_and_dpo_counts_are_the_units_their_losses_average_over():
    from types import SimpleNamespace

    from step1_sft.main import trained_tokens
    from step2_dpo.main import PreferenceLoss
    from utils.data import PreferenceCollator, SFTCollator
    from utils.math.losses import sft_nll

    batch = SFTCollator(0)(
        [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [5, 6], "labels": [-100, -100]}]
    )
    assert trained_tokens(batch) == {"tokens": int(sft_nll(torch.zeros(2, 4, 9), batch["labels"])[1])} == {"tokens": 2}
    pairs = PreferenceCollator(0)(
        [
            {"prompt_input_ids": [1, 2], "chosen_response_ids": [3, 4, 5], "rejected_response_ids": [6]},
            {"prompt_input_ids": [1], "chosen_response_ids": [3], "rejected_response_ids": [6, 7]},
        ]
    )
    options = dict(beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
    assert PreferenceLoss(SimpleNamespace(nll_loss_coef=0.0, **options)).units(pairs) == {"pairs": 2}
    assert PreferenceLoss(SimpleNamespace(nll_loss_coef=0.5, **options)).units(pairs) == {
        "pairs": 2,
        "chosen_tokens": 4,
    }


class WindowEngine:
    """DeepSpeed's engine as train_micro_batches sees it with its own windows: the boundary is the one set
    before each backward; records the losses handed to backward and the boundaries."""

    def __init__(self, gas: int):
        self.gas, self.boundary, self.calls, self.optimizer_steps = gas, None, [], 0

    def gradient_accumulation_steps(self):
        return self.gas

    def set_gradient_accumulation_boundary(self, boundary):
        self.boundary = boundary

    def is_gradient_accumulation_boundary(self):
        return self.boundary

    def backward(self, loss):
        self.calls.append((round(loss.item(), 6), self.boundary))

    def step(self):
        self.optimizer_steps += int(self.boundary)

    def was_step_applied(self):
        return True

    def get_lr(self):
        return [0.1]


def test_the_loop_reads_each_window_ahead_and_closes_it_itself(tmp_path):
    """Windows of 2 micro-batches with 1 and 3 tokens, then a partial window of one: each loss is scaled by
    2 x count / the window's total (one rank), the last partial window by its own total; the logged loss is
    the window's token mean; a non-finite last micro-batch still closes its window (0 x a replayed one)."""
    engine = WindowEngine(gas=2)
    batches = [
        {"n": 1, "loss": 1.0},
        {"n": 3, "loss": 2.0},
        {"n": 2, "loss": 4.0},
        {"n": 2, "loss": float("nan")},
        {"n": 5, "loss": 3.0},
    ]
    logged = []
    run = make_run(tmp_path, total_steps=3)

    def step_metrics(means):
        logged.append(means[0])
        return {"train/loss": means[0]}, {}, None

    train_micro_batches(
        run,
        engine,
        batches,
        Sampler(),
        lambda b: ({"tokens": torch.tensor(b["loss"])}, ()),
        step_metrics,
        counts=lambda b: {"tokens": b["n"]},
    )
    run.logger.close()
    assert engine.calls == [
        (0.5, False),
        (3.0, True),  # 1 x 2/4, 2 x 2 x 3/4
        (4.0, False),
        (0.0, True),  # the nan micro-batch: 0 x the first one, still the boundary
        (6.0, True),
    ]  # the partial window: 3 x 2 x 5/5
    assert engine.optimizer_steps == 3 and run.loop.step == 3 and run.loop.bad_steps == 1
    assert logged == pytest.approx([(1 * 1 + 2 * 3) / 4, 4.0 * 2 / 4, 3.0])  # the skipped tokens stay counted


@pytest.mark.slow
def test_two_ranks_with_accumulation_give_the_gradients_of_one_batch(tiny_gpt2, tmp_path):
    """m = 2 rows, k = 2 accumulation steps, r = 2 ranks, ragged rows and masked tokens, then a partial
    window: SFT, DPO with its NLL term, PPO (token_mean and seq_mean, with the entropy bonus). The gradient
    DeepSpeed applies equals that of one plain batch of all the window's rows within 1e-6 relative, and the
    logged loss is that batch's; the former per-micro-batch normalisation is far off on the same rows."""
    out = tmp_path / "probe.json"
    proc = run_deepspeed(
        "tests.step_normalisation_probe", [tiny_gpt2, out, tmp_path], timeout=900, log_path=str(tmp_path / "log.txt")
    )
    assert out.exists(), tail(proc)
    results = json.loads(out.read_text())
    assert results.pop("ranks") == 2
    worst = max(err for case in results.values() for err in case["rel_err"])
    print(f"worst relative gradient error over {sorted(results)} x (full, partial window): {worst:.2e}")
    for name, case in results.items():
        assert len(case["rel_err"]) == 2 and max(case["rel_err"]) <= 1e-6, (name, case)
        for logged, expected in zip(case["logged"], case["expected"]):
            assert logged == pytest.approx(expected, rel=1e-5, abs=1e-6), (name, case)
        assert max(case["old_rel_err"]) > 1e-2, (name, case)  # the control: these rows are ragged enough
    assert os.path.exists(tmp_path / "sft" / "metrics.jsonl")
