"""Every loss of utils/math/losses.py: hand-computed values where new, and a FINITE gradient with nan/inf in
every padded position (the layout contract of utils/math/ops.py says padding may hold them)."""

import math

import pytest
import torch

from utils.math import losses

NAN, INF = float("nan"), float("inf")
MASK = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])


def poisoned(values, fill):
    """A [2, 4] leaf tensor: `values` on MASK's actions, `fill` (nan/inf/-inf/-100) everywhere else."""
    x = torch.full((2, 4), fill)
    x[MASK != 0] = torch.tensor(values)
    return x.requires_grad_(True)


POLICY_LOSS_CASES = {  # every registered loss, and ppo with each option
    "ppo": lambda *a: losses.policy_loss(*a, cliprange=0.2),
    "ppo_clip_higher_dual_clip": lambda *a: losses.policy_loss(*a, cliprange=0.2, cliprange_high=0.28, dual_clip=3.0),
    "gspo": lambda *a: losses.gspo_loss(*a, dual_clip=3.0),
    "cispo": lambda *a: losses.cispo_loss(*a, cliprange_high=0.28),
}


@pytest.mark.parametrize("case", sorted(POLICY_LOSS_CASES))
@pytest.mark.parametrize("fill", [NAN, INF, -INF, -100.0])
def test_policy_loss_gradient_finite_with_non_finite_padding(fill, case):
    assert {"ppo", "gspo", "cispo"} <= set(POLICY_LOSS_CASES) and set(losses.POLICY_LOSSES) <= set(POLICY_LOSS_CASES)
    logprobs = poisoned([-1.0, -2.0, -0.5, -1.5], fill)
    old = poisoned([-1.1, -2.0, -0.4, -1.5], fill).detach()
    advantages = poisoned([1.0, -1.0, 0.5, 2.0], fill).detach()
    loss, stats = POLICY_LOSS_CASES[case](logprobs, old, advantages, MASK)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[MASK == 0] == 0).all()
    assert math.isfinite(stats["log_ratio_max_abs"].item()) and stats["log_ratio_max_abs"].item() == pytest.approx(0.1)


@pytest.mark.parametrize("fill", [NAN, INF, -INF])
def test_value_loss_gradient_finite_with_non_finite_padding(fill):
    values = poisoned([0.5, 1.0, -0.5, 2.0], fill)
    old = poisoned([0.4, 1.0, -0.5, 2.5], fill).detach()
    returns = poisoned([1.0, 1.0, 0.0, 2.0], fill).detach()
    loss, _ = losses.value_loss(values, old, returns, MASK, cliprange_value=0.2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(values.grad).all()
    assert (values.grad[MASK == 0] == 0).all()


def test_kl_penalty_loss_gradient_finite_issue_reproduction():
    """k3 of a pad log-ratio below -88 must not overflow exp(): the loss and its gradient stay finite."""
    lp = torch.tensor([[-100.0, -1.0, -2.0]], requires_grad=True)
    loss = losses.kl_penalty_loss(
        lp, torch.tensor([[0.0, -1.5, -1.0]]), torch.tensor([[0.0, 1.0, 1.0]]), estimator="k3"
    )
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 0] == 0
    # d/dlp of mean(exp(ref - lp) - 1 + lp - ref) over the 2 actions = (1 - exp(ref - lp)) / 2
    assert lp.grad[0, 1:].tolist() == pytest.approx([(1 - math.exp(-0.5)) / 2, (1 - math.exp(1.0)) / 2], abs=1e-6)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
@pytest.mark.parametrize("fill", [NAN, INF, -INF])
def test_kl_penalty_loss_gradient_finite_with_non_finite_padding(fill, estimator):
    logprobs = poisoned([-1.0, -2.0, -0.5, -1.5], fill)
    ref = poisoned([-1.2, -1.0, -0.5, -3.0], fill).detach()
    old = poisoned([-1.1, -2.0, -0.4, -1.5], fill).detach()
    loss = losses.kl_penalty_loss(logprobs, ref, MASK, estimator=estimator, old_logprobs=old)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[MASK == 0] == 0).all()


@pytest.mark.parametrize("fill", [NAN, INF, -INF])
def test_entropy_bonus_gradient_finite_with_non_finite_padding(fill):
    entropy = poisoned([0.5, 1.0, 2.0, 0.1], fill)
    bonus = losses.entropy_bonus(entropy, MASK)
    bonus.backward()
    assert bonus.item() == pytest.approx(0.9) and torch.isfinite(entropy.grad).all()
    assert (entropy.grad[MASK == 0] == 0).all()


@pytest.mark.parametrize("fill", [NAN, INF, -INF])
def test_sft_nll_gradient_finite_with_non_finite_logits_at_untrained_positions(fill):
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 5)
    labels = torch.tensor([[-100, -100, 3, 1], [-100, 2, 4, -100]])
    trained = labels[:, 1:] != -100  # position i predicts label i+1
    logits[:, :-1][~trained] = fill
    logits[:, -1] = fill  # the last position predicts nothing
    logits.requires_grad_(True)
    nll, count = losses.sft_nll(logits, labels)
    nll.backward()
    assert count.item() == 4 and torch.isfinite(nll) and torch.isfinite(logits.grad).all()
    expected = sum(
        -torch.log_softmax(logits.detach()[b, i], -1)[labels[b, i + 1]].item()
        for b in range(2)
        for i in range(3)
        if trained[b, i]
    )
    assert nll.item() == pytest.approx(expected, rel=1e-6)


def test_pairwise_loss_gradient_finite_at_extreme_margins():
    chosen = torch.tensor([-200.0, 0.0, 300.0], requires_grad=True)
    loss = losses.pairwise_loss(chosen, torch.tensor([200.0, 0.0, -300.0]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(chosen.grad).all()
    assert loss.item() == pytest.approx((400.0 + math.log(2)) / 3, rel=1e-6)


# --------------------------------------------------------------------------- DPO (the pure loss)
def test_dpo_loss_is_ln2_when_the_policy_is_the_reference_and_by_hand_otherwise():
    import math

    from utils.math.losses import dpo_loss

    logps = torch.tensor([-12.0, -3.5, -40.0])
    for smoothing in (0.0, 0.1):
        loss, stats = dpo_loss(logps, logps - 1.0, logps, logps - 1.0, beta=0.1, label_smoothing=smoothing)
        assert loss.item() == pytest.approx(math.log(2)) and stats["accuracy"] == 0 and stats["margin"] == 0
    # one pair: chosen +2 over the reference, rejected -3: h = 5, beta 0.2 -> beta * h = 1
    args = (torch.tensor([-8.0]), torch.tensor([-13.0]), torch.tensor([-10.0]), torch.tensor([-10.0]))
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    assert dpo_loss(*args, beta=0.2)[0].item() == pytest.approx(-math.log(sig(1.0)))
    assert dpo_loss(*args, beta=0.2, label_smoothing=0.1)[0].item() == pytest.approx(
        -0.9 * math.log(sig(1.0)) - 0.1 * math.log(sig(-1.0))
    )
    assert dpo_loss(*args, beta=0.2, loss_type="ipo")[0].item() == pytest.approx((5 - 1 / 0.4) ** 2)
    assert dpo_loss(logps, logps, logps, logps, beta=0.1, loss_type="ipo")[0].item() == pytest.approx(25.0)
    _, stats = dpo_loss(*args, beta=0.2)
    assert stats["chosen_reward"].item() == pytest.approx(0.4) and stats["rejected_reward"].item() == pytest.approx(
        -0.6
    )
    assert stats["accuracy"] == 1 and stats["margin"].item() == pytest.approx(1.0)


def test_dpo_loss_gradient_moves_chosen_up_and_rejected_down_and_bad_settings_stop():
    from utils.math.losses import dpo_loss

    chosen, rejected = torch.tensor([-5.0], requires_grad=True), torch.tensor([-5.0], requires_grad=True)
    ref = torch.tensor([-5.0], requires_grad=True)
    for loss_type in ("sigmoid", "ipo"):
        chosen.grad = rejected.grad = ref.grad = None
        dpo_loss(chosen, rejected, ref, ref, beta=0.1, loss_type=loss_type)[0].backward()
        assert chosen.grad.item() < 0 < rejected.grad.item() and ref.grad is None  # the reference is a constant
    for kwargs, message in (
        ({"beta": 0.0}, "beta"),
        ({"beta": 0.1, "loss_type": "hinge"}, "unknown DPO loss"),
        ({"beta": 0.1, "label_smoothing": 0.5}, "label_smoothing"),
    ):
        with pytest.raises(ValueError, match=message):
            dpo_loss(chosen, rejected, ref, ref, **kwargs)


def test_response_nll_is_the_token_mean_over_the_batch_and_lowers_the_likelihoods_it_sees():
    from utils.math.losses import response_nll

    logps = torch.tensor([-6.0, -2.0], requires_grad=True)  # 3 and 1 tokens: (6 + 2) / 4 per token
    loss = response_nll(logps, torch.tensor([3, 1]))
    assert loss.item() == pytest.approx(2.0)
    loss.backward()
    assert logps.grad.tolist() == pytest.approx([-0.25, -0.25])  # descent raises every response's log-prob
    assert response_nll(torch.zeros(2), torch.zeros(2)).item() == 0.0  # no token: 0, not nan


def test_every_policy_loss_entry_is_the_plain_surrogate_at_the_first_epoch_and_reads_real_settings():
    """At the first PPO epoch the policy IS the old policy: every registered loss gives ratio 1, so the
    gradient of -advantage aggregated (and that value, except CISPO's -A * logprob whose gradient only is
    the surrogate's), log-ratio 0, nothing clipped; the options an entry reads are PPOConfig fields
    (the flags of the same name), so the trainer can hand them over by name."""
    import dataclasses

    from step3_ppo.trainer import PPOConfig
    from utils.math.losses import POLICY_LOSSES

    fields = {f.name for f in dataclasses.fields(PPOConfig)}
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    advantages = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    for name, entry in POLICY_LOSSES.items():
        assert entry.help and set(entry.options) <= fields, name
        options = {option: getattr(PPOConfig(stop_token_ids=(0,), pad_token_id=0), option) for option in entry.options}
        logprobs.grad = None
        loss, stats = entry.fn(
            logprobs,
            logprobs.detach(),
            advantages,
            mask,
            loss_mask=mask,
            loss_agg="token_mean",
            agg_constant=None,
            **options,
        )
        if name != "cispo":
            assert loss.item() == pytest.approx(-(1 - 2 + 0.5 + 3 + 1) / 5), name
        loss.backward()
        assert logprobs.grad.flatten().tolist() == pytest.approx((-advantages * mask / 5).flatten().tolist()), name
        assert stats["log_ratio_max_abs"].item() == 0 and stats["clipfrac"].item() == 0, name
