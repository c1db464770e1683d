"""The policy losses of step 3 and their options (clip-higher, dual-clip, the entropy bonus, the KL loss forms,
GDPO's normalize-then-sum), pure tensors: hand-computed values of ppo, gspo and cispo; a float64 finite-difference
check of every loss's gradient; each KL loss form's expected gradient against the EXACT gradient of KL(pi || ref) on
a small categorical distribution; the flags' checks; the reference page's list of the losses. The nan/inf-padding
checks of the same losses are in tests/test_losses.py; lr=0 through the trainer in
tests/test_step3_policy_losses_lr0.py."""

import math
import os
import re

import pytest
import torch

from scripts import gen_reference
from step3_ppo.algo.advantages import group_normalized
from step3_ppo.rewards.combine import combine
from utils.errors import UsageError
from utils.math import losses
from utils.math.ops import entropy_from_logits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ratios_to_logprobs(ratios, logprobs=None):
    """(logprobs, old_logprobs) [1, T] whose per-token ratio exp(logprobs - old) is `ratios`."""
    r = torch.tensor([ratios], dtype=torch.float64)
    lp = torch.tensor([logprobs], dtype=torch.float64) if logprobs is not None else torch.full_like(r, -1.0)
    return lp.requires_grad_(True), lp.detach() - r.log()


# --------------------------------------------------------------------------- ppo: clip-higher and dual-clip
def test_ppo_clip_higher_by_hand():
    """ratios (1.5, 0.5, 1.25, 0.7), advantages (1, -1, 1, -1), --cliprange 0.2: max(-A r, -A clip(r, 0.8,
    1.2)) = (-1.2, 0.8, -1.2, 0.8), mean -0.2, every token clipped; clip-higher 0.28: token 3 stays
    unclipped at -1.25 and token 1 is capped at -1.28: (-1.28 + 0.8 - 1.25 + 0.8) / 4 = -0.2325, clipfrac
    3/4; a lower bound of its own, 0.6 (ratio >= 0.4): tokens 2 and 4 unclipped at 0.5 and 0.7, the upper
    bound still --cliprange: (-1.2 + 0.5 - 1.2 + 0.7) / 4 = -0.3, clipfrac 1/2."""
    lp, old = ratios_to_logprobs([1.5, 0.5, 1.25, 0.7])
    adv, mask = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64), torch.ones(1, 4)
    loss, stats = losses.policy_loss(lp, old, adv, mask, cliprange=0.2)
    assert loss.item() == pytest.approx(-0.2) and stats["clipfrac"].item() == 1.0
    loss, stats = losses.policy_loss(lp, old, adv, mask, cliprange=0.2, cliprange_high=0.28)
    assert loss.item() == pytest.approx(-0.2325) and stats["clipfrac"].item() == 0.75
    loss.backward()  # only token 3 is unclipped: d(-A r)/d logp = -A r = -1.25, over 4 tokens
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -1.25 / 4, 0.0])
    loss, stats = losses.policy_loss(lp, old, adv, mask, cliprange=0.2, cliprange_low=0.6)
    assert loss.item() == pytest.approx(-0.3) and stats["clipfrac"].item() == 0.5


def test_ppo_dual_clip_caps_negative_advantages_only():
    """C = 3: A = -2 at ratio 5 -> max(10, 2 * 1.2) = 10, capped at -A * C = 6 (no gradient); A = -2 at
    ratio 2 -> 4 < 6, unchanged (gradient -A r = 4); A = +1 at ratio 5 -> max(-5, -1.2) = -1.2, a positive
    advantage is never capped. Mean (6 + 4 - 1.2) / 3."""
    lp, old = ratios_to_logprobs([5.0, 2.0, 5.0])
    adv, mask = torch.tensor([[-2.0, -2.0, 1.0]], dtype=torch.float64), torch.ones(1, 3)
    plain, _ = losses.policy_loss(lp, old, adv, mask, cliprange=0.2)
    assert plain.item() == pytest.approx((10 + 4 - 1.2) / 3)
    loss, stats = losses.policy_loss(lp, old, adv, mask, cliprange=0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx((6 + 4 - 1.2) / 3)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 4.0 / 3, 0.0])
    with pytest.raises(ValueError, match="dual_clip"):
        losses.policy_loss(lp, old, adv, mask, cliprange=0.2, dual_clip=1.0)


# --------------------------------------------------------------------------- gspo
def test_gspo_sequence_ratio_and_default_ranges_by_hand():
    """Row 0: log-ratios (0.1, -0.3) -> s = exp(-0.1) = 0.904837, A = 1: below 1 - 3e-4 with A > 0 the
    unclipped term is the pessimistic one: -0.904837, not clipped. Row 1: log-ratio 0.002 -> s = 1.002002
    > 1 + 4e-4, A = 1: clipped, -1.0004. seq_mean over the rows; clipfrac over actions: 1 of 3."""
    lp = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[0.1, -0.3], [0.002, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.ones(2, 2, dtype=torch.float64)
    loss, stats = losses.gspo_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx((-math.exp(-0.1) - (1 + 4e-4)) / 2, rel=1e-12)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3) and stats["log_ratio_max_abs"].item() == pytest.approx(0.3)
    loss.backward()  # row 0: d(-s)/d logp_t = -s / |y| per token, / 2 rows; row 1 clipped: 0
    assert lp.grad.flatten().tolist() == pytest.approx([-math.exp(-0.1) / 4] * 2 + [0.0, 0.0])
    # the ranges given: [0.8, 1.2] leaves row 1 unclipped
    loss, _ = losses.gspo_loss(lp, old, adv, mask, cliprange_low=0.2, cliprange_high=0.2)
    assert loss.item() == pytest.approx((-math.exp(-0.1) - math.exp(0.002)) / 2, rel=1e-12)


def test_gspo_per_token_form_is_the_sequence_gradient_and_the_trainer_aggregates_by_sequence():
    """GSPO-token with per-token advantages: the value of s_i,t is s_i everywhere, the gradient reaches
    each token; the registry's own aggregation is seq_mean (the trainer's default for it)."""
    assert losses.POLICY_LOSSES["gspo"].loss_agg == "seq_mean"
    assert losses.POLICY_LOSSES["cispo"].loss_agg == "token_mean" and losses.POLICY_LOSSES["ppo"].loss_agg is None
    lp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[1e-4, -1e-4, 3e-4]], dtype=torch.float64)  # mean 1e-4: inside the range
    adv = torch.tensor([[1.0, 2.0, -3.0]], dtype=torch.float64)
    loss, _ = losses.gspo_loss(lp, old, adv, torch.ones(1, 3))
    s = math.exp(1e-4)
    assert loss.item() == pytest.approx(-s * (1 + 2 - 3) / 3, abs=1e-15)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-s / 3, -2 * s / 3, 3 * s / 3])


# --------------------------------------------------------------------------- cispo
def test_cispo_by_hand():
    """ratios (2, 0.5), A (1, -1), logprobs (-0.5, -1), eps_high 0.28: weights sg(min(r, 1.28)) = (1.28, 0.5);
    loss = mean(-w A logp) = (0.64 - 0.5) / 2 = 0.07; gradient -w A / 2 = (-0.64, 0.25) (the capped token
    keeps a gradient, unlike PPO's clip); clipfrac 1/2. No lower bound: ratio 0.5 is not raised."""
    lp, old = ratios_to_logprobs([2.0, 0.5], [-0.5, -1.0])
    adv, mask = torch.tensor([[1.0, -1.0]], dtype=torch.float64), torch.ones(1, 2)
    loss, stats = losses.cispo_loss(lp, old, adv, mask, cliprange=0.2, cliprange_high=0.28)
    assert loss.item() == pytest.approx(0.07) and stats["clipfrac"].item() == 0.5
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([-0.64, 0.25])
    lp.grad = None
    losses.cispo_loss(lp, old, adv, mask, cliprange=0.2)[0].backward()  # eps_high from --cliprange: 1.2
    assert lp.grad.tolist()[0] == pytest.approx([-0.6, 0.25])


# --------------------------------------------------------------------------- entropy, KL
def test_entropy_bonus_by_hand():
    """Uniform logits over 4 tokens: entropy ln 4 per position; the bonus aggregates over the actions only
    (here seq_mean of rows of 1 and 2 actions: ln 4)."""
    logits = torch.zeros(2, 3, 4)
    entropy = entropy_from_logits(logits)
    assert entropy.flatten().tolist() == pytest.approx([math.log(4)] * 6)
    mask = torch.tensor([[0, 1, 0], [1, 1, 0]])
    assert losses.entropy_bonus(entropy, mask, "seq_mean").item() == pytest.approx(math.log(4))


def test_kl_loss_forms_by_hand():
    """logprobs (-1, -2), ref (-1.5, -1), old (-1.1, -2): k2 = 0.5 (lp - ref)^2 = (0.125, 0.5) weighted by the
    detached ratio (e^0.1, 1): value (0.125 e^0.1 + 0.5) / 2, gradient w (lp - ref) / 2 = (0.25 e^0.1, -0.5);
    k3 = e^(ref - lp) - 1 + lp - ref, gradient (1 - e^(ref - lp)) / 2."""
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref, old = torch.tensor([[-1.5, -1.0]], dtype=torch.float64), torch.tensor([[-1.1, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    loss = losses.kl_penalty_loss(lp, ref, mask, estimator="k2", old_logprobs=old)
    assert loss.item() == pytest.approx((0.125 * math.exp(0.1) + 0.5) / 2)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([0.25 * math.exp(0.1), -0.5])
    lp.grad = None
    loss = losses.kl_penalty_loss(lp, ref, mask, estimator="k3")
    assert loss.item() == pytest.approx((math.exp(-0.5) - 1 + 0.5 + math.exp(1) - 1 - 1) / 2)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([(1 - math.exp(-0.5)) / 2, (1 - math.exp(1)) / 2])
    with pytest.raises(ValueError, match="k1"):
        losses.kl_penalty_loss(lp, ref, mask, estimator="k1")


def expected_kl_loss_gradient(theta, ref_logp, sample_logp, estimator, weighted):
    """d/dtheta of E_{x ~ sample}[kl_penalty_loss(log pi_theta(x))], the expectation EXACT: every token of
    the vocabulary weighted by its sampling probability (the rollout's policy pi_old)."""
    logp = torch.log_softmax(theta, -1)
    total = 0
    for x in range(theta.numel()):
        one = lambda t: t[x].view(1, 1)  # noqa: E731
        total = total + sample_logp[x].exp() * losses.kl_penalty_loss(
            one(logp),
            one(ref_logp),
            torch.ones(1, 1),
            estimator=estimator,
            old_logprobs=one(sample_logp) if weighted else None,
        )
    return torch.autograd.grad(total, theta)[0]


def test_kl_loss_gradient_is_the_exact_kl_gradient_on_a_categorical():
    """KL(pi || ref) of a 6-token categorical pi = softmax(theta): its exact gradient against each loss
    form's expected gradient. k2 (ratio-weighted): equal on-policy AND off-policy (samples from pi_old);
    k2 without the ratio: equal only on-policy; k3: never; its expectation is the gradient of the
    REVERSE KL(ref || pi), the bias the warning names."""
    torch.manual_seed(0)
    theta = torch.randn(6, dtype=torch.float64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.randn(6, dtype=torch.float64), -1)
    old_logp = torch.log_softmax(theta.detach() + 0.7 * torch.randn(6, dtype=torch.float64), -1)
    logp = torch.log_softmax(theta, -1)
    exact = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), theta)[0]
    reverse = torch.autograd.grad((ref_logp.exp() * (ref_logp - torch.log_softmax(theta, -1))).sum(), theta)[0]
    on_policy = torch.log_softmax(theta, -1).detach()

    def close(a, b):
        return torch.allclose(a, b, rtol=1e-10, atol=1e-12)

    assert close(expected_kl_loss_gradient(theta, ref_logp, on_policy, "k2", True), exact)
    assert close(expected_kl_loss_gradient(theta, ref_logp, on_policy, "k2", False), exact)
    assert close(expected_kl_loss_gradient(theta, ref_logp, old_logp, "k2", True), exact)
    assert not close(expected_kl_loss_gradient(theta, ref_logp, old_logp, "k2", False), exact)
    k3 = expected_kl_loss_gradient(theta, ref_logp, on_policy, "k3", False)
    assert not close(k3, exact) and close(k3, reverse)
    assert (exact - k3).abs().max() > 0.05  # not a rounding difference


# --------------------------------------------------------------------------- finite differences (float64)
def finite_difference(f, x: torch.Tensor, h: float = 1e-6) -> torch.Tensor:
    """Central differences of the scalar f at x, entry by entry."""
    grad = torch.zeros_like(x)
    for i in range(x.numel()):
        step = torch.zeros_like(x).view(-1)
        step[i] = h
        step = step.view_as(x)
        grad.view(-1)[i] = (f(x + step) - f(x - step)) / (2 * h)
    return grad


# log-ratios away from every kink (1 +- eps, C), 2 rows, ragged (row 1 has 3 actions)
LOG_RATIOS = torch.tensor([[0.05, -0.4, 0.3, 0.0], [1.3, -0.1, 0.15, 0.0]], dtype=torch.float64)
FD_MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
FD_ADV = torch.tensor([[1.0, -0.5, -2.0, 0.7], [-1.5, 0.8, 1.1, 0.0]], dtype=torch.float64)
FD_LP = torch.tensor([[-1.0, -2.5, -0.3, -1.7], [-0.8, -1.2, -3.0, 0.0]], dtype=torch.float64)
PPO_OPTIONS = {
    "plain": {},
    "clip_higher": {"cliprange_high": 0.28},
    "clip_low": {"cliprange_low": 0.5},
    "dual_clip": {"dual_clip": 3.0},
    "all": {"cliprange_high": 0.28, "cliprange_low": 0.1, "dual_clip": 3.0},
}


def autograd_of(f, x):
    x = x.clone().requires_grad_(True)
    f(x).backward()
    return x.grad


@pytest.mark.parametrize("option", sorted(PPO_OPTIONS))
@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean", "constant_norm"])
def test_ppo_gradient_matches_finite_differences(option, loss_agg):
    old = FD_LP - LOG_RATIOS

    def f(lp):
        return losses.policy_loss(
            lp,
            old,
            FD_ADV,
            FD_MASK,
            0.2,
            loss_agg=loss_agg,
            agg_constant=5,
            **PPO_OPTIONS[option],
        )[0]

    assert torch.allclose(autograd_of(f, FD_LP), finite_difference(f, FD_LP), atol=1e-8)


@pytest.mark.parametrize("dual_clip", [None, 3.0])
@pytest.mark.parametrize("ranges", [{}, {"cliprange_low": 0.2, "cliprange_high": 0.28}])
def test_gspo_gradient_is_the_sequence_level_objectives(dual_clip, ranges):
    """With one advantage per row the sequence-level GSPO objective mean_i max(-A_i s_i, -A_i clip(s_i)) (the
    loss's VALUE) has, by finite differences, the gradient autograd gives through the per-token form."""
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4, [-2.0] * 4], dtype=torch.float64)
    log_ratios = torch.tensor([[-0.1, 0.05, 0.0, 0.0], [0.2, 0.0, 0.1, 0.0], [1.3, 1.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]])  # row 2: s = exp(1.15) > C = 3 when capped
    lp = torch.tensor([[-1.0, -2.0, 0, 0], [-0.5, -0.7, -3.0, 0], [-1.5, -0.2, 0, 0]], dtype=torch.float64)
    old = lp - log_ratios
    f = lambda x: losses.gspo_loss(x, old, adv, mask, dual_clip=dual_clip, **ranges)[0]  # noqa: E731
    grad = autograd_of(f, lp)
    assert torch.allclose(grad, finite_difference(f, lp), atol=1e-8)
    assert grad[0].abs().sum() > 0 and grad[1].abs().sum() > 0  # not everything clipped away


def test_cispo_gradient_matches_finite_differences_with_the_weight_held():
    """CISPO's gradient is defined with the importance weight a constant (stop-gradient): moving the
    rollout's log-probs along with the policy's holds the ratio, so differences of the loss in that
    direction are its gradient. Tokens whose weight is capped also match plain differences."""
    old = FD_LP - LOG_RATIOS
    f = lambda lp: losses.cispo_loss(lp, old + (lp - FD_LP), FD_ADV, FD_MASK, 0.2, cliprange_high=0.28)[0]  # noqa: E731
    grad = autograd_of(lambda lp: losses.cispo_loss(lp, old, FD_ADV, FD_MASK, 0.2, cliprange_high=0.28)[0], FD_LP)
    assert torch.allclose(grad, finite_difference(f, FD_LP), atol=1e-8)
    plain = finite_difference(
        lambda lp: losses.cispo_loss(lp, old, FD_ADV, FD_MASK, 0.2, cliprange_high=0.28)[0], FD_LP
    )
    capped = (LOG_RATIOS.exp() > 1.28) & (FD_MASK != 0)
    assert capped.sum() == 2 and torch.allclose(grad[capped], plain[capped], atol=1e-8)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_kl_loss_gradient_matches_finite_differences(estimator):
    """k2's importance weight is detached: differences along the direction that holds it (old moved with
    the policy); k3 has no weight: plain differences."""
    ref, old = FD_LP - 0.3 * LOG_RATIOS - 0.2, FD_LP - LOG_RATIOS
    if estimator == "k2":

        def f(lp):
            return losses.kl_penalty_loss(lp, ref, FD_MASK, estimator="k2", old_logprobs=old + (lp - FD_LP))
    else:

        def f(lp):
            return losses.kl_penalty_loss(lp, ref, FD_MASK, estimator="k3")

    grad = autograd_of(
        lambda lp: losses.kl_penalty_loss(lp, ref, FD_MASK, estimator=estimator, old_logprobs=old), FD_LP
    )
    assert torch.allclose(grad, finite_difference(f, FD_LP), atol=1e-8)


def test_entropy_bonus_gradient_matches_finite_differences():
    torch.manual_seed(1)
    logits = torch.randn(2, 4, 5, dtype=torch.float64)
    f = lambda z: losses.entropy_bonus(entropy_from_logits(z), FD_MASK, "seq_mean")  # noqa: E731
    assert torch.allclose(autograd_of(f, logits), finite_difference(f, logits), atol=1e-8)


# --------------------------------------------------------------------------- GDPO: normalise, then sum
def test_normalize_then_sum_by_hand():
    """Group 0, rewards a = (1, 0, 0) and b = (0, 10, 20): the plain sum (1, 10, 20) is b's ordering alone.
    z(a) = (2/3, -1/3, -1/3) / sqrt(1/3) = (1.1547, -0.5774, -0.5774), z(b) = (-1, 0, 1): sum (0.1547,
    -0.5774, 0.4226). Group 1: a = (1, 1, nan) is flat (0, 0) and the nan stays on its row; b = (2, 4, 6)
    -> (-1, 0, 1): (-1, 0, nan). Weights (1, 0.5) scale each normalised reward."""
    a = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, float("nan")])
    b = torch.tensor([0.0, 10.0, 20.0, 2.0, 4.0, 6.0])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert combine({"a": a, "b": b})[:5].tolist() == [1.0, 10.0, 20.0, 3.0, 5.0]
    total = combine({"a": a, "b": b}, None, groups, "normalize_then_sum")
    z_a = 2 / 3 / math.sqrt(1 / 3)
    assert total[:5].tolist() == pytest.approx([z_a - 1, -z_a / 2, -z_a / 2 + 1, -1, 0], abs=1e-5)
    assert math.isnan(total[5])
    weighted = combine({"a": a, "b": b}, [1.0, 0.5], groups, "normalize_then_sum")
    assert weighted[:3].tolist() == pytest.approx([z_a - 0.5, -z_a / 2, -z_a / 2 + 0.5], abs=1e-5)
    # one reward: its group z-score (GRPO's advantage of that reward)
    assert combine({"b": b}, None, groups, "normalize_then_sum").tolist() == pytest.approx(
        group_normalized(b, groups).tolist()
    )
    with pytest.raises(ValueError, match="group ids"):
        combine({"a": a}, None, None, "normalize_then_sum")
    with pytest.raises(ValueError, match="unknown reward normalisation"):
        combine({"a": a}, None, groups, "gdpo")


# --------------------------------------------------------------------------- flags and the reference page
def rl_args(*extra):
    return [
        "--actor_model_name_or_path",
        "/nonexistent",
        "--critic_model_name_or_path",
        "/nonexistent",
        "--data_path",
        "x.jsonl",
        "--output_dir",
        "/nonexistent/out",
        *extra,
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dual_clip", "1"], "--dual_clip must be > 1"),
        (["--policy_loss", "cispo", "--dual_clip", "3"], "--dual_clip does nothing with --policy_loss cispo"),
        (["--policy_loss", "cispo", "--cliprange_low", "0.1"], "--cliprange_low does nothing with --policy_loss cispo"),
        (["--cliprange_high", "0"], "--cliprange_high must be > 0"),
        (["--entropy_coef", "-0.1"], "--entropy_coef must be >= 0"),
        (
            ["--reward_norm", "normalize_then_sum", "--reward_funcs", "format"],
            "--advantage_estimator gae has no groups",
        ),
    ],
)
def test_impossible_policy_loss_settings_stop_before_any_model_loads(flags, message):
    from step3_ppo.main import parse_args

    with pytest.raises(UsageError) as info:
        parse_args(rl_args(*flags))
    assert message in str(info.value)


def test_k3_as_a_loss_prints_its_bias(capsys):
    from step3_ppo.main import parse_args

    with pytest.raises(Exception):  # the fake model path stops it after the warning
        parse_args(rl_args("--kl_in_loss", "--kl_loss_estimator", "k3"))
    out = capsys.readouterr().out
    assert out.count("warning") == 1 and "KL(reference || actor)" in out
    with pytest.raises(Exception):
        parse_args(rl_args("--kl_in_loss"))
    assert "warning" not in capsys.readouterr().out


def test_the_reference_page_lists_every_policy_loss_with_its_help():
    """docs/reference/registries.md (kept equal to the generator's output by tests/test_docs_reference.py) has a row
    per `--policy_loss` with its help and the flags it reads; an entry registered later shows there too."""
    with open(os.path.join(ROOT, gen_reference.REGISTRIES_PAGE)) as f:
        rows = section_rows(f.read(), "## Policy losses")
    assert [row[0] for row in rows] == [f"`{name}`" for name in losses.POLICY_LOSSES]
    for row, (name, entry) in zip(rows, losses.POLICY_LOSSES.items()):
        assert row[1] == gen_reference.cell(entry.help), name
        assert all(f"`--{option}`" in row[2] for option in entry.options), name


def test_a_registered_policy_loss_shows_on_the_reference_page(monkeypatch):
    monkeypatch.setitem(
        losses.POLICY_LOSSES, "toy_pg", losses.PolicyLoss(losses.policy_loss, "a toy | loss", ("dual_clip",))
    )
    rows = section_rows(gen_reference.registries_page(), "## Policy losses")
    assert ["`toy_pg`", "a toy \\| loss", "`--dual_clip`", "the estimator's"] in rows


def section_rows(page: str, heading: str) -> list[list[str]]:
    """The cells of the table rows under `heading` (up to the next `## `), header and rule left out."""
    body = page[page.index(heading + "\n") + len(heading) :]
    body = body[: body.index("\n## ")] if "\n## " in body else body
    lines = [line for line in body.splitlines() if line.startswith("| ")][1:]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
