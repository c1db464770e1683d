"""The generator's own log-probs against the trainer's: each correction by hand on small
tensors, the weights in the policy losses, generate's log-probs against the trainer's forward, and at lr 0
`rollout/logprob_diff_max` flat and small over 5 iterations with every metric finite."""

import math

import pytest
import torch

from step3_ppo.main import parse_args, setup
from step3_ppo.rollout import engines as rollout_engines
from tests.test_step3_grpo import grpo_args, write_rows
from tests.test_step3_lr0 import prompt_batches
from utils.errors import UsageError
from utils.math import losses
from utils.math.ops import ROLLOUT_CORRECTIONS, rollout_correction_weights

NAN, INF = float("nan"), float("inf")


def test_each_correction_by_hand():
    """Three rows of two actions (then padding holding nan/inf), w = pi_old / pi_rollout, C = 2:
    row 0 w = (0.9, 1.5), geometric mean 1.16; row 1 w = (0.25, 3), g.m. 0.87; row 2 w = (3, 3), g.m. 3."""
    w = torch.tensor([[0.9, 1.5], [0.25, 3.0], [3.0, 3.0]])
    rollout = torch.tensor([[-1.0, -2.0], [-0.5, -3.0], [-2.0, -1.0]])
    old = rollout + w.log()
    pad = torch.tensor([[NAN, INF]] * 3)
    mask = torch.tensor([[1, 1, 0, 0]] * 3)
    old, rollout = torch.cat([old, pad], 1), torch.cat([rollout, -pad], 1)
    expected = {
        "none": [[1, 1], [1, 1], [1, 1]],
        "tis": [[0.9, 1.5], [0.25, 2.0], [2.0, 2.0]],  # clamped at C
        "icepop": [[0.9, 1.5], [0.0, 0.0], [0.0, 0.0]],  # each token outside [0.5, 2] masked
        "seq_mask_tis": [[0.9, 1.5], [0.25, 2.0], [0.0, 0.0]],  # row 2's mean leaves [0.5, 2]; the rest TIS
    }
    assert set(expected) == set(ROLLOUT_CORRECTIONS)
    for mode, values in expected.items():
        weights = rollout_correction_weights(old, rollout, mask, mode, 2.0)
        assert torch.allclose(weights[:, :2], torch.tensor(values, dtype=torch.float32), atol=1e-6), (mode, weights)
        assert torch.equal(weights[:, 2:], torch.zeros(3, 2)) and not weights.requires_grad, mode
    with pytest.raises(ValueError, match="must be > 1"):
        rollout_correction_weights(old, rollout, mask, "tis", 1.0)
    with pytest.raises(ValueError, match="unknown rollout correction"):
        rollout_correction_weights(old, rollout, mask, "clip", 2.0)


@pytest.mark.parametrize("name", list(losses.POLICY_LOSSES))
def test_the_weights_multiply_each_actions_term_and_keep_the_count(name):
    """The loss with weights w equals the token mean of w x each action's term (0: the term leaves, the
    count stays), gradients included; nan in the padding of the weights reaches nothing. An action's term
    is the loss over that action alone (gspo's sequence ratio still over its row's actions)."""
    torch.manual_seed(0)
    logprobs = (-torch.rand(2, 4) - 0.5).requires_grad_()
    old, advantages = logprobs.detach() + 0.1 * torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[0.0, 1, 1, 1], [0, 0, 1, 1]])
    weights = torch.tensor([[NAN, 0.5, 0.0, 2.0], [INF, NAN, 1.0, 1.5]])
    fn = losses.POLICY_LOSSES[name].fn
    weighted, _ = fn(logprobs, old, advantages, mask, loss_mask=mask, loss_agg="token_mean", weights=weights)
    per_token = []
    for i in range(2):
        for t in range(4):
            if mask[i, t]:
                one = torch.zeros(2, 4)
                one[i, t] = 1
                term, _ = fn(logprobs, old, advantages, mask, loss_mask=one, loss_agg="token_mean")
                per_token.append(weights[i, t] * term)
    manual = torch.stack(per_token).sum() / mask.sum()
    assert torch.allclose(weighted, manual, atol=1e-6), (weighted, manual)
    (grad,) = torch.autograd.grad(weighted, logprobs)
    (manual_grad,) = torch.autograd.grad(manual, logprobs)
    assert torch.allclose(grad, manual_grad, atol=1e-6) and torch.isfinite(grad).all()


@pytest.fixture(scope="module")
def grpo_run(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rollout_mismatch")
    write_rows(tmp)
    run = setup(
        parse_args(
            grpo_args(
                tiny_llama,
                tmp,
                "--actor_zero_stage",
                0,
                "--actor_learning_rate",
                0,
                "--kl_ctl",
                0.1,
                "--rollout_correction",
                "tis",
            )
        )
    )
    return tmp, run


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_generate_gives_the_trainers_log_probs_of_its_tokens(grpo_run, temperature):
    """The hf engine's log-probs of the sampled tokens (generate's raw logits, KV cache, left padding) are the
    trainer's forward's (mask positions, no cache) at the rollout temperature, up to fp32 rounding."""
    _, run = grpo_run
    trainer, config = run.trainer, run.trainer.config
    saved = config.temperature
    config.temperature = temperature
    try:
        torch.manual_seed(3)
        rows = trainer.generate_rows(prompt_batches(run, 4, n_rows=4, offset=5)[0], logprobs=True)
        trainer.store_logprobs(rows, trainer.actor, "old_logprobs")
    finally:
        config.temperature = saved
    assert len({r.prompt_ids.numel() for r in rows}) > 1  # left padding differs
    diff = max((r.per_action["rollout_logprobs"] - r.per_action["old_logprobs"]).abs().max().item() for r in rows)
    print(f"temperature {temperature}: max |generator - trainer| log-prob {diff:.2e}")
    assert all(r.per_action["rollout_logprobs"].shape == r.response_ids.shape for r in rows)
    assert diff < 1e-4


@pytest.mark.slow
def test_lr0_logprob_diff_stays_flat_and_small_over_5_iterations(grpo_run):
    """At lr 0 nothing moves: the generator-trainer distance is rounding only, the same size at every
    iteration; the correction's weights are ~1 and the log-ratio stays ~0."""
    _, run = grpo_run
    maxima, means = [], []
    for step in range(5):
        torch.manual_seed(step)
        metrics, _ = run.trainer.step(prompt_batches(run, 2, n_rows=2, offset=2 * step), step=step)
        for key in (
            "rollout/logprob_diff_mean",
            "rollout/logprob_diff_max",
            "rollout/correction_weight_mean",
            "rollout/correction_masked_fraction",
            "loss/actor",
            "ppo/log_ratio_max_abs",
        ):
            assert math.isfinite(metrics[key]), (key, metrics)
        assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
        assert metrics["rollout/correction_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert metrics["rollout/correction_masked_fraction"] == 0.0
        maxima.append(metrics["rollout/logprob_diff_max"])
        means.append(metrics["rollout/logprob_diff_mean"])
    print(f"lr=0 rollout/logprob_diff_max over 5 iterations: {maxima}; means {means}")
    assert max(maxima) < 1e-3
    assert max(maxima) <= 10 * max(min(maxima), 1e-6)  # flat: no growth at lr 0


def test_a_correction_needs_the_generators_log_probs(grpo_run, tiny_llama, tmp_path, monkeypatch):
    tmp, _ = grpo_run
    with pytest.raises(UsageError, match="--no_rollout_logprobs leaves out"):
        parse_args(grpo_args(tiny_llama, tmp, "--rollout_correction", "icepop", "--no_rollout_logprobs"))
    with pytest.raises(UsageError, match="--rollout_correction_threshold must be > 1"):
        parse_args(grpo_args(tiny_llama, tmp, "--rollout_correction", "tis", "--rollout_correction_threshold", "1"))
    monkeypatch.setitem(
        rollout_engines.ROLLOUT_ENGINES,
        "plain",
        rollout_engines.RolloutEngineEntry(rollout_engines.ActorGenerate, "no log-probs"),
    )
    with pytest.raises(UsageError, match="--rollout_engine plain gives no log-probs"):
        parse_args(grpo_args(tiny_llama, tmp, "--rollout_engine", "plain", "--rollout_correction", "seq_mask_tis"))
    args = parse_args(grpo_args(tiny_llama, tmp, "--rollout_engine", "plain"))  # no correction: fine, no metrics
    assert args.rollout_correction == "none"
    # --old_logprobs rollout reads the same log-probs, and makes a correction's weights all 1
    with pytest.raises(
        UsageError,
        match="--old_logprobs rollout reads the generator's log-probs, which --rollout_engine plain does not give",
    ):
        parse_args(grpo_args(tiny_llama, tmp, "--rollout_engine", "plain", "--old_logprobs", "rollout"))
    with pytest.raises(UsageError, match="which --no_rollout_logprobs leaves out"):
        parse_args(grpo_args(tiny_llama, tmp, "--old_logprobs", "rollout", "--no_rollout_logprobs"))
    with pytest.raises(UsageError, match="--rollout_correction tis weighs the forward's old log-probs"):
        parse_args(grpo_args(tiny_llama, tmp, "--old_logprobs", "rollout", "--rollout_correction", "tis"))
    assert parse_args(grpo_args(tiny_llama, tmp, "--old_logprobs", "rollout")).old_logprobs == "rollout"
