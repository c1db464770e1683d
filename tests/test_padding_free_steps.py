"""`--padding_free` and `--max_tokens_per_micro_batch` in steps 1 (SFT), 2 (reward model) and DPO (KTO: padding-free
only): one optimizer step's gradient with packed forwards and token-budget micro-batches of unequal sizes equals the
padded fixed-size path's within 1e-5 relative (the step's loss stays one mean over its tokens or pairs), every
micro-batch within the budget, an example longer than the budget refused before any model loads, a model whose
attention ignores the position ids (OPT) refused with one line."""

from __future__ import annotations

import argparse
import contextlib
import json
import random

import pytest
import torch

import utils.models.forward as forward
import utils.train.loop as loop
from tests.test_step1_run import common_args as sft_args
from tests.test_step1_run import sft_data  # noqa: F401  (fixture)
from tests.test_step2_dpo import _dpo_args
from tests.test_step_normalisation import WindowEngine
from tests.test_training_loop import Sampler, make_run
from utils.errors import UsageError
from utils.train.loop import TokenBudget, micro_batch_schedule, token_budget, train_micro_batches

TOL = 1e-5


# --------------------------------------------------------------------------- the loop, on a stub engine
def test_a_budget_recuts_each_window_into_micro_batches_within_it_with_one_mean(tmp_path):
    """Windows of 2 loader batches of 3 examples re-cut into micro-batches of at most 10 tokens (first fit
    decreasing): unequal micro-batches, each within the budget, the boundary on each window's last one, every
    loss scaled by accumulation x count / the window's total (one rank), the logged loss the window's token mean."""
    lengths = [[6, 3, 2], [5, 4, 1], [9, 1, 1], [3, 3, 3]]  # two windows of 2 loader batches
    loader = [[{"n": n} for n in batch] for batch in lengths]
    engine, seen, logged = WindowEngine(gas=2), [], []
    collate = lambda examples: {"n": [e["n"] for e in examples]}  # noqa: E731
    budget = TokenBudget(10, lambda e: e["n"], collate)
    run = make_run(tmp_path, total_steps=2)

    def micro_step(batch):
        seen.append(batch["n"])
        return {"tokens": torch.tensor(float(sum(batch["n"])))}, ()  # a term per token of sum(n): the loss is n

    def step_metrics(means):
        logged.append(means[0])
        return {"train/loss": means[0]}, {}, None

    counts = lambda batch: {"tokens": sum(batch["n"])}  # noqa: E731
    train_micro_batches(run, engine, loader, Sampler(), micro_step, step_metrics, counts=counts, budget=budget)
    run.logger.close()
    assert seen == [[6, 4], [3, 2, 5], [1], [9, 1], [1, 3, 3, 3]]  # first fit decreasing, rows in their order
    assert all(sum(n) <= 10 for n in seen) and len({len(n) for n in seen}) > 1
    assert [boundary for _, boundary in engine.calls] == [False, False, True, False, True]
    # window 1 holds 21 tokens: a micro-batch of 10 tokens and loss 10 -> 10 x 2 x 10 / 21
    assert [loss for loss, _ in engine.calls] == pytest.approx([200 / 21, 200 / 21, 2 / 21, 10, 10], abs=1e-5)
    assert logged == pytest.approx([(100 + 100 + 1) / 21, (100 + 100) / 20])
    assert engine.optimizer_steps == 2 and run.loop.step == 2


def test_a_budget_needs_the_counts(tmp_path):
    with pytest.raises(ValueError, match="needs the micro-batches' counts"):
        train_micro_batches(
            make_run(tmp_path, 1), WindowEngine(1), [], Sampler(), None, None, budget=TokenBudget(4, len, list)
        )


def test_an_example_over_the_budget_is_named_in_one_line_and_the_loader_yields_examples():
    args = argparse.Namespace(
        max_tokens_per_micro_batch=8, per_device_train_batch_size=2, num_train_epochs=1, gradient_accumulation_steps=1
    )
    args.seed, args.max_steps, examples = 1, 0, [[1] * 5, [1] * 9, [1] * 8, [1] * 12]
    with pytest.raises(UsageError) as error:
        token_budget(args, examples, None, len, "example")
    message = str(error.value)
    assert "\n" not in message and message.startswith("--max_tokens_per_micro_batch 8: example 1 of the training split")
    assert "has 9 tokens" in message and "2 of 4 are over the budget, the longest 12" in message
    budget = token_budget(args, examples[:1] + examples[2:3], None, len, "example")
    assert budget.limit == 8
    assert token_budget(argparse.Namespace(max_tokens_per_micro_batch=0), examples, None, len, "x") is None
    _, loader, steps = micro_batch_schedule(examples[:2], None, args, budget)
    assert steps == 1 and [sorted(map(len, batch)) for batch in loader] == [[5, 9]]  # lists of examples, uncut


# --------------------------------------------------------------------------- flags
@pytest.mark.parametrize("module", ["step1_sft.main", "step2_reward.main", "step2_dpo.main"])
def test_the_steps_take_both_flags(module, tmp_path):
    import importlib

    step = importlib.import_module(module)
    common = ["--model_name_or_path", str(tmp_path), "--data_path", str(tmp_path), "--output_dir", str(tmp_path / "o")]
    args = step.parse_args(common + ["--padding_free", "--max_tokens_per_micro_batch", "96"])
    assert args.padding_free and args.max_tokens_per_micro_batch == 96
    help_text = step.build_parser().format_help()
    assert "--padding_free" in help_text and "--max_tokens_per_micro_batch" in help_text
    with pytest.raises(UsageError, match="--max_tokens_per_micro_batch must be >= 0"):
        step.parse_args(common + ["--max_tokens_per_micro_batch", "-1"])


def test_kto_takes_padding_free_but_not_a_token_budget(tmp_path):
    from step2_dpo.main import parse_args

    common = ["--model_name_or_path", str(tmp_path), "--data_path", str(tmp_path), "--output_dir", str(tmp_path / "o")]
    assert parse_args(common + ["--loss_type", "kto", "--padding_free"]).padding_free
    with pytest.raises(UsageError, match="may leave an example alone"):
        parse_args(common + ["--loss_type", "kto", "--max_tokens_per_micro_batch", "96"])


# --------------------------------------------------------------------------- the steps' runs, in process
class Recorder:
    """The first optimizer step's gradient of the run's trained engine (read before its `step()` at the boundary,
    ZeRO 0, one rank), every training micro-batch's (rows, real tokens) and the padding-free forwards run."""

    def __init__(self, monkeypatch, module):
        self.grads, self.micro_batches, self.packed_forwards = [], [], 0
        build, counted, packed_forward = module.build_trained_engine, loop.counted, forward.packed_forward

        def counting_packed_forward(*args, **kwargs):
            self.packed_forwards += 1
            return packed_forward(*args, **kwargs)

        def build_and_watch(*args, **kwargs):
            engine = build(*args, **kwargs)
            step = engine.step

            def watched_step(*a, **k):
                if engine.is_gradient_accumulation_boundary() and not self.grads:
                    self.grads.append(
                        torch.cat(
                            [
                                p.grad.detach().double().flatten()
                                for p in engine.module.parameters()
                                if p.grad is not None
                            ]
                        )
                    )
                return step(*a, **k)

            engine.step = watched_step
            return engine

        @contextlib.contextmanager
        def recording(run, batch, *args):
            mask = batch["attention_mask"]
            self.micro_batches.append((mask.shape[0], int(mask.sum())))
            with counted(run, batch, *args):
                yield

        monkeypatch.setattr(module, "build_trained_engine", build_and_watch)
        monkeypatch.setattr(loop, "counted", recording)
        monkeypatch.setattr(forward, "packed_forward", counting_packed_forward)


def first_step(monkeypatch, main_module: str, argv: list) -> Recorder:
    import importlib

    module = importlib.import_module(main_module)
    with monkeypatch.context() as patch:
        recorder = Recorder(patch, module)
        module.main([str(a) for a in argv])
    assert recorder.grads, "no optimizer step"
    return recorder


def assert_same_step(padded: Recorder, packed: Recorder, budget: int | None, rows_per_example: int) -> None:
    """The packed run's first gradient equals the padded run's within TOL relative; with a `budget` its first
    step ran the same examples in micro-batches of unequal sizes, each within the budget, re-cut from the padded
    run's 2 x --per_device_train_batch_size."""
    g, ref = packed.grads[0], padded.grads[0]
    err = float((g - ref).norm() / ref.norm())
    print(f"relative gradient difference {err:.2e}; micro-batches (rows, tokens) {packed.micro_batches}")
    assert err <= TOL, err
    assert packed.packed_forwards > 0 and padded.packed_forwards == 0  # the forwards the flag asked for
    if budget is None:
        return
    window = padded.micro_batches[:2]  # --gradient_accumulation_steps 2, a fixed number of rows each
    rows = [n for n, _ in packed.micro_batches]
    k = next(k for k in range(1, len(rows) + 1) if sum(rows[:k]) == sum(n for n, _ in window))
    step = packed.micro_batches[:k]
    assert sum(t for _, t in step) == sum(t for _, t in window), (step, window)  # the same examples
    assert all(tokens <= budget for _, tokens in step) and len({n for n, _ in step}) > 1, step
    assert len(step) > len(window) and all(n % rows_per_example == 0 for n in rows[:k]), step  # pairs never split


WORDS = ["good", "great", "fine", "bad", "awful", "dull", "movie", "film", "plot", "actor", "scene", "music"]


def ragged_rows(n: int, rng: random.Random) -> list[dict]:
    """Pairs of ragged lengths (prompts of 1-8 words, responses of 1-6): padded batches hold much padding."""

    def words(k):
        return " " + " ".join(rng.choice(WORDS) for _ in range(k))

    return [
        {
            "prompt": f"Human:{words(rng.randint(1, 8))}\n\nAssistant:",
            "chosen": words(rng.randint(1, 6)),
            "rejected": words(rng.randint(1, 6)),
        }
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def ragged_pairs(tmp_path_factory) -> str:
    folder, rng = tmp_path_factory.mktemp("ragged_pairs"), random.Random(5)
    for name, n in (("train.jsonl", 32), ("eval.jsonl", 8)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in ragged_rows(n, rng)))
    return str(folder)


@pytest.fixture(scope="module")
def ragged_feedback(tmp_path_factory) -> str:
    """KTO's unpaired rows of ragged lengths, desirable and undesirable in turn."""
    folder, rng = tmp_path_factory.mktemp("ragged_feedback"), random.Random(6)
    rows = [
        {"prompt": r["prompt"], "completion": r["chosen"], "label": bool(i % 2)}
        for i, r in enumerate(ragged_rows(32, rng))
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ragged_rows(8, rng)))
    return str(folder)


STEP = ["--max_steps", 1, "--gradient_accumulation_steps", 2, "--zero_stage", 0, "--gradient_clipping", 0]


@pytest.mark.slow
def test_sft_packed_budget_step_equals_the_padded_one(monkeypatch, tiny_llama, sft_data, tmp_path):
    base = sft_args(tiny_llama, sft_data, str(tmp_path / "padded"), steps=1) + STEP
    base[base.index("--per_device_train_batch_size") + 1] = 4
    padded = first_step(monkeypatch, "step1_sft.main", base)
    budget = 50
    argv = sft_args(tiny_llama, sft_data, str(tmp_path / "packed"), steps=1) + STEP
    argv[argv.index("--per_device_train_batch_size") + 1] = 4
    packed = first_step(
        monkeypatch, "step1_sft.main", argv + ["--padding_free", "--max_tokens_per_micro_batch", budget]
    )
    assert_same_step(padded, packed, budget, 1)


def _reward_args(model, data, out):
    argv = _dpo_args(model, data, out, steps=1) + STEP + ["--dropout", 0.0]
    argv[argv.index("--per_device_train_batch_size") + 1] = 4
    return argv


@pytest.mark.slow
def test_reward_model_packed_budget_step_equals_the_padded_one(monkeypatch, tiny_llama, ragged_pairs, tmp_path):
    padded = first_step(monkeypatch, "step2_reward.main", _reward_args(tiny_llama, ragged_pairs, tmp_path / "padded"))
    budget = 60
    packed = first_step(
        monkeypatch,
        "step2_reward.main",
        _reward_args(tiny_llama, ragged_pairs, tmp_path / "packed")
        + ["--padding_free", "--max_tokens_per_micro_batch", budget],
    )
    assert_same_step(padded, packed, budget, 2)


@pytest.mark.slow
def test_dpo_packed_budget_step_equals_the_padded_one(monkeypatch, tiny_llama, ragged_pairs, tmp_path):
    """With the precomputed reference (its log-probs packed too) and the NLL term (a second unit, chosen tokens)."""
    extra = ["--precompute_ref_log_probs", "--nll_loss_coef", 0.5]
    padded = first_step(monkeypatch, "step2_dpo.main", _reward_args(tiny_llama, ragged_pairs, tmp_path / "p") + extra)
    budget = 60
    packed = first_step(
        monkeypatch,
        "step2_dpo.main",
        _reward_args(tiny_llama, ragged_pairs, tmp_path / "q")
        + extra
        + ["--padding_free", "--max_tokens_per_micro_batch", budget],
    )
    assert_same_step(padded, packed, budget, 2)


@pytest.mark.slow
def test_kto_packed_step_equals_the_padded_one(monkeypatch, tiny_llama, ragged_feedback, tmp_path):
    """KTO's unpaired batches (its examples and their mismatched rows) and its reference engine, packed."""
    extra = ["--loss_type", "kto"]
    padded = first_step(
        monkeypatch, "step2_dpo.main", _reward_args(tiny_llama, ragged_feedback, tmp_path / "p") + extra
    )
    packed = first_step(
        monkeypatch,
        "step2_dpo.main",
        _reward_args(tiny_llama, ragged_feedback, tmp_path / "q") + extra + ["--padding_free"],
    )
    assert_same_step(padded, packed, None, 2)


# --------------------------------------------------------------------------- refusals of a run
def test_an_sft_example_over_the_budget_stops_the_run_before_any_model_loads(
    monkeypatch, tiny_gpt2, sft_data, tmp_path
):
    import step1_sft.main as step1

    monkeypatch.setattr(step1, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(UsageError) as error:
        step1.main(
            [str(a) for a in sft_args(tiny_gpt2, sft_data, str(tmp_path)) + ["--max_tokens_per_micro_batch", 12]]
        )
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("--max_tokens_per_micro_batch 12: example ") and "tokens (" in str(error.value)


def test_opt_with_padding_free_stops_with_one_line(tiny_opt, sft_data, tmp_path):
    from step1_sft.main import main

    with pytest.raises(UsageError) as error:
        main([str(a) for a in sft_args(tiny_opt, sft_data, str(tmp_path), steps=1) + ["--padding_free"]])
    assert "\n" not in str(error.value) and "--padding_free: OPT" in str(error.value)
