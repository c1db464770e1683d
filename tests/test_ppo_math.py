"""Hand-computed checks of the pure RL math: utils.math.ops, utils.math.losses, step3_ppo.algo.shaping,
step3_ppo.algo.advantages.

Expected numbers are written out (or derived with plain python/math), never
obtained by calling the function under test.
"""

import math
import statistics

import numpy as np
import pytest
import torch

from step3_ppo.algo.advantages import gae_advantages_and_returns
from step3_ppo.algo.shaping import AdaptiveKLController, FixedKLController, RunningMoments, clip_scores, compute_rewards
from utils.math.losses import kl_penalty_loss
from utils.math.losses import policy_loss as actor_loss
from utils.math.losses import value_loss as critic_loss
from utils.math.ops import (
    entropy_from_logits,
    explained_variance,
    kl_estimate,
    last_one_index,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

NAN = float("nan")


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def close(a, b, tol=1e-5):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=tol, rtol=tol, equal_nan=True), (a, b)


# ---------------------------------------------------------------- masked ops

MASK_VARIANTS = [
    lambda m: t(m),
    lambda m: t(m, torch.bool),
    lambda m: t(m, torch.long),
]


@pytest.mark.parametrize("mk", MASK_VARIANTS)
def test_masked_sum_mean_ignore_masked_entries(mk):
    x = t([[1.0, 2.0, 100.0], [3.0, NAN, 4.0]])  # 100 and nan are padding
    mask = mk([[1, 1, 0], [1, 0, 1]])
    close(masked_sum(x, mask), 10.0)
    close(masked_mean(x, mask), 2.5)  # (1+2+3+4)/4
    close(masked_mean(x, mask, dim=-1), [1.5, 3.5])
    close(masked_mean(x, mask, dim=1), [1.5, 3.5])
    close(masked_sum(x, mask, dim=1), [3.0, 7.0])


def test_masked_mean_zero_count_guard():
    x = t([[1.0, 2.0], [3.0, 4.0]])
    mask = t([[0, 0], [1, 1]])
    close(masked_mean(x, mask, dim=-1), [0.0, 3.5])  # empty row -> 0, not nan
    close(masked_mean(x, torch.zeros(2, 2)), 0.0)
    # fractional weights are not clamped up to 1
    close(masked_mean(t([2.0]), t([0.5])), 2.0)


def test_masked_var():
    x = t([[1.0, 2.0, 50.0], [3.0, NAN, 4.0]])
    mask = t([[1, 1, 0], [1, 0, 1]])
    # values 1,2,3,4: mean 2.5, squared deviations sum to 5
    close(masked_var(x, mask, unbiased=False), 1.25)
    close(masked_var(x, mask), 5.0 / 3.0)
    with pytest.raises(ValueError):
        masked_var(x, torch.zeros_like(mask))
    close(masked_var(t([7.0, 1.0]), t([1, 0])), 0.0)  # single entry


def test_masked_whiten():
    x = t([[1.0, 2.0, 50.0], [3.0, NAN, 4.0]])
    mask = t([[1, 1, 0], [1, 0, 1]], torch.bool)
    s = math.sqrt(5.0 / 3.0)  # unbiased std of 1,2,3,4
    expected = [[-1.5 / s, -0.5 / s, 0.0], [0.5 / s, 0.0, 1.5 / s]]
    w = masked_whiten(x, mask)
    close(w, expected)
    assert not torch.isnan(w).any()
    close(masked_mean(w, mask), 0.0)
    close(masked_var(w, mask), 1.0, tol=1e-4)
    w2 = masked_whiten(x, mask, shift_mean=False)
    close(w2, [[-1.5 / s + 2.5, -0.5 / s + 2.5, 0.0], [0.5 / s + 2.5, 0.0, 1.5 / s + 2.5]])
    # single masked entry whitens to 0 instead of crashing
    close(masked_whiten(t([5.0, 3.0]), t([1, 0])), [0.0, 0.0])


# ---------------------------------------------------------------- logits


def test_logprobs_from_logits_hand_values():
    logits = t([[[0.0, 0.0, 0.0, 0.0], [math.log(1), math.log(2), math.log(3), -1e4]]])
    labels = torch.tensor([[1, 2]])
    out = logprobs_from_logits(logits, labels)
    assert out.shape == (1, 2) and out.dtype == torch.float32
    close(out, [[-math.log(4.0), math.log(0.5)]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_from_logits_matches_log_softmax(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 11, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 11, (3, 5), generator=g)
    ref = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    out = logprobs_from_logits(logits, labels)
    assert out.dtype == torch.float32 and out.shape == (3, 5)
    close(out, ref, tol=1e-5)


def test_logprobs_from_logits_grad_bf16():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits.requires_grad_(True)
    labels = torch.zeros(2, 3, dtype=torch.long)
    logprobs_from_logits(logits, labels).sum().backward()
    assert logits.grad is not None and logits.grad.shape == logits.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_from_logits(dtype):
    p = [1 / 6, 2 / 6, 3 / 6]
    h = -sum(pi * math.log(pi) for pi in p)
    logits = t([[[0.0, 0.0, 0.0], [0.0, math.log(2), math.log(3)]]]).to(dtype)
    out = entropy_from_logits(logits)
    assert out.shape == (1, 2) and out.dtype == torch.float32
    close(out, [[math.log(3.0), h]], tol=2e-2 if dtype == torch.bfloat16 else 1e-5)


# ---------------------------------------------------------------- KL / rewards


def test_kl_estimators_hand_values():
    lp = t([-1.0, -2.0, -0.5])
    ref = t([-1.5, -1.0, -0.5])  # log_ratio = [0.5, -1.0, 0.0]
    close(kl_estimate(lp, ref), [0.5, -1.0, 0.0])
    close(kl_estimate(lp, ref, "k1"), [0.5, -1.0, 0.0])
    close(kl_estimate(lp, ref, "k2"), [0.125, 0.5, 0.0])
    close(kl_estimate(lp, ref, "k3"), [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0])
    close(kl_estimate(lp, ref, "k3"), [0.10653066, 0.71828183, 0.0])


def test_k3_nonnegative_and_unknown_estimator():
    g = torch.Generator().manual_seed(2)
    lp, ref = torch.randn(200, generator=g) * 3, torch.randn(200, generator=g) * 3
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    assert (kl_estimate(lp, ref, "k2") >= 0).all()
    with pytest.raises(ValueError, match="k1.*k2.*k3"):
        kl_estimate(lp, ref, "k4")


def test_last_one_index_is_the_last_action():
    mask = t([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1]])
    idx = last_one_index(mask)
    assert idx.dtype == torch.long
    assert idx.tolist() == [2, 3, 3]
    assert last_one_index(mask.bool()).tolist() == [2, 3, 3]
    with pytest.raises(ValueError):
        last_one_index(t([[0, 1], [0, 0]]))


# row 0: prompt at 0, actions 1..3 (EOS action at 3), padding at 4
# row 1: left padding 0..1, actions 2..4, truncated (no EOS) -> last action 4
REWARD_MASK = [[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
LOG_RATIO = [[9.0, 0.1, -0.2, 0.3, NAN], [5.0, 5.0, 0.2, 0.0, -0.1]]


def test_clip_scores():
    close(clip_scores(t([2.0, -3.0, 0.5, -1.5]), 1.5), [1.5, -1.5, 0.5, -1.5])
    scores = t([2.0, -3.0])
    assert clip_scores(scores, None) is scores  # None: no clip


def test_compute_rewards_with_clipped_scores():
    lp = t(LOG_RATIO)
    ref = torch.zeros(2, 5)
    rewards, kl = compute_rewards(clip_scores(t([2.0, -3.0]), 1.5), lp, ref, t(REWARD_MASK), kl_coef=0.1)
    close(kl, [[0, 0.1, -0.2, 0.3, 0], [0, 0, 0.2, 0.0, -0.1]])
    close(rewards, [[0, -0.01, 0.02, -0.03 + 1.5, 0], [0, 0, -0.02, 0.0, 0.01 - 1.5]])


def test_compute_rewards_no_clip_and_k3():
    rewards, _ = compute_rewards(
        t([2.0, -3.0]), t(LOG_RATIO), torch.zeros(2, 5), t(REWARD_MASK, torch.bool), kl_coef=0.1
    )
    close(rewards, [[0, -0.01, 0.02, -0.03 + 2.0, 0], [0, 0, -0.02, 0.0, 0.01 - 3.0]])
    rewards, kl = compute_rewards(
        t([0.0, 0.0]), t(LOG_RATIO), torch.zeros(2, 5), t(REWARD_MASK, torch.long), kl_coef=0.5, kl_estimator="k3"
    )
    k3 = lambda r: math.exp(-r) - 1 + r  # noqa: E731
    close(kl, [[0, k3(0.1), k3(-0.2), k3(0.3), 0], [0, 0, k3(0.2), 0.0, k3(-0.1)]])
    close(rewards, -0.5 * kl)


def test_kl_controllers():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(9.0, 256)  # error 0.5 -> clipped to 0.2; mult = 1 + 0.2*256/1e4 = 1.00512
    close(c.value, 0.100512, tol=1e-12)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(3.0, 256)  # error -0.5 -> -0.2; mult = 0.99488
    close(c.value, 0.099488, tol=1e-12)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(6.6, 256)  # error 0.1 (unclipped); mult = 1.00256
    close(c.value, 0.100256, tol=1e-12)
    c.update(torch.tensor(6.0), 256)  # on target: unchanged
    close(c.value, 0.100256, tol=1e-12)

    c2 = AdaptiveKLController(1.0, target=1.0, horizon=1.0)
    c2.load_state_dict(c.state_dict())
    assert c2.value == c.value and c2.target == 6.0 and c2.horizon == 10000

    f = FixedKLController(0.05)
    f.update(100.0, 256)
    assert f.value == 0.05
    f2 = FixedKLController(1.0)
    f2.load_state_dict(f.state_dict())
    assert f2.value == 0.05


# ---------------------------------------------------------------- GAE


def test_gae_hand_values():
    values = t([[9.0, 1.0, 2.0, 9.0]])
    rewards = t([[0.0, 0.5, 1.0, 0.0]])
    mask = t([[0, 1, 1, 0]])
    adv, ret = gae_advantages_and_returns(values, rewards, mask, gamma=0.9, lam=0.8)
    # t=2 (last action, terminal next): delta = 1 + 0 - 2 = -1 -> A = -1
    # t=1: delta = 0.5 + 0.9*2 - 1 = 1.3; A = 1.3 + 0.72*(-1) = 0.58
    close(adv, [[0.0, 0.58, -1.0, 0.0]])
    close(ret, [[0.0, 1.58, 1.0, 0.0]])


def _gae_reference(values, rewards, mask, gamma, lam):
    B, T = len(values), len(values[0])
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    for b in range(B):
        acts = [i for i in range(T) if mask[b][i]]
        start, end = acts[0], acts[-1]
        last = 0.0
        for i in range(end, start - 1, -1):
            next_v = values[b][i + 1] if i < end else 0.0
            delta = rewards[b][i] + gamma * next_v - values[b][i]
            last = delta + gamma * lam * last
            adv[b][i] = last
            ret[b][i] = last + values[b][i]
    return adv, ret


def test_gae_vs_python_loop_ragged_rows():
    T = 9
    spans = [(0, 8), (3, 8), (2, 5), (6, 6), (1, 7)]  # (first, last) action index per row
    g = torch.Generator().manual_seed(3)
    values = torch.randn(len(spans), T, generator=g)
    rewards = torch.randn(len(spans), T, generator=g)
    mask = torch.zeros(len(spans), T)
    for b, (s, e) in enumerate(spans):
        mask[b, s : e + 1] = 1
    exp_adv, exp_ret = _gae_reference(values.tolist(), rewards.tolist(), mask.tolist(), 0.95, 0.9)
    # garbage (incl. nan) outside the actions must not leak
    values_g = torch.where(mask.bool(), values, torch.full_like(values, NAN))
    rewards_g = torch.where(mask.bool(), rewards, torch.full_like(rewards, 1e3))
    adv, ret = gae_advantages_and_returns(values_g, rewards_g, mask.bool(), gamma=0.95, lam=0.9)
    close(adv, exp_adv)
    close(ret, exp_ret)
    assert not adv.requires_grad


# ---------------------------------------------------------------- losses


def test_actor_loss_clipping_cases():
    # one row; position 0 is prompt, 5 is padding (garbage log-probs)
    ratios = [1.1, 1.5, 0.5, 1.5]
    advs = [1.0, 1.0, -1.0, -2.0]
    lp = t([[0.0] + [math.log(r) for r in ratios] + [50.0]]).requires_grad_(True)
    old = torch.zeros(1, 6)
    adv = t([[7.0] + advs + [7.0]])
    mask = t([[0, 1, 1, 1, 1, 0]])
    loss, stats = actor_loss(lp, old, adv, mask, cliprange=0.2)
    # a) A=+1, r=1.1 inside:        max(-1.1, -1.1) = -1.1
    # b) A=+1, r=1.5 > 1.2 clipped: max(-1.5, -1.2) = -1.2   (clip active)
    # c) A=-1, r=0.5 < 0.8 clipped: max( 0.5,  0.8) =  0.8   (clip active)
    # d) A=-2, r=1.5 pessimistic:   max( 3.0,  2.4) =  3.0
    close(loss, (-1.1 - 1.2 + 0.8 + 3.0) / 4)  # 0.375
    close(stats["clipfrac"], 0.5)
    lrs = [math.log(r) for r in ratios]
    close(stats["approx_kl"], sum(0.5 * x * x for x in lrs) / 4)
    close(stats["log_ratio_max_abs"], math.log(2.0))
    loss.backward()
    # d loss/d logp = -A*ratio/4 where the unclipped branch is active, else 0
    close(lp.grad, [[0.0, -1.1 / 4, 0.0, 0.0, 2 * 1.5 / 4, 0.0]])


def test_actor_loss_positive_adv_low_ratio_not_clipped():
    lp = t([[math.log(0.5), math.log(0.9)]])
    loss, stats = actor_loss(lp, torch.zeros(1, 2), t([[1.0, -1.0]]), t([[1, 1]]), cliprange=0.2)
    # A=+1, r=0.5: max(-0.5, -0.8) = -0.5 (unclipped); A=-1, r=0.9 inside: 0.9
    close(loss, (-0.5 + 0.9) / 2)
    close(stats["clipfrac"], 0.0)


def test_actor_loss_zero_log_ratio():
    lp = t([[-1.0, -2.0, -3.0], [-0.5, -0.1, -9.0]])
    adv = t([[1.0, 2.0, 3.0], [-4.0, 5.0, 100.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])
    loss, stats = actor_loss(lp, lp.clone(), adv, mask, cliprange=0.2)
    close(loss, -(1 + 2 + 3 - 4 + 5) / 5)  # ratio 1 -> -mean(A)
    close(stats["clipfrac"], 0.0)
    close(stats["approx_kl"], 0.0)
    close(stats["log_ratio_max_abs"], 0.0)


def test_critic_loss():
    old = t([[0.0, 1.0, 1.0, 1.0]])
    values = t([[5.0, 1.1, 1.5, 1.5]]).requires_grad_(True)
    returns = t([[9.0, 2.0, 2.0, 1.0]])
    mask = t([[0, 1, 1, 1]])
    loss, stats = critic_loss(values, old, returns, mask, cliprange_value=0.2)
    # a) inside: clipped = 1.1 -> 0.81 both
    # b) clipped = 1.2: max(0.25, 0.64) = 0.64 (clip active)
    # c) clipped = 1.2, R = 1: max(0.25, 0.04) = 0.25
    close(loss, 0.5 * (0.81 + 0.64 + 0.25) / 3)
    close(stats["value_clipfrac"], 1.0 / 3.0)
    loss.backward()
    # grad = 0.5 * 2 (V - R) / 3 on unclipped-active entries, 0 where clip active
    close(values.grad, [[0.0, (1.1 - 2.0) / 3, 0.0, (1.5 - 1.0) / 3]])


def test_kl_penalty_loss():
    lp = t([[-1.0, -2.0, 4.0]]).requires_grad_(True)
    ref = t([[-1.5, -1.0, 0.0]])
    mask = t([[1, 1, 0]])
    loss = kl_penalty_loss(lp, ref, mask)
    close(loss, (math.exp(-0.5) - 0.5 + math.e - 2.0) / 2)
    loss.backward()
    # d k3 / d logp = 1 - exp(-log_ratio)
    close(lp.grad, [[(1 - math.exp(-0.5)) / 2, (1 - math.e) / 2, 0.0]])


def test_explained_variance():
    returns = t([[9.0, 1.0, 2.0], [3.0, 4.0, -7.0]])
    mask = t([[0, 1, 1], [1, 1, 0]])
    close(explained_variance(returns.clone(), returns, mask), 1.0)
    values = t([[0.0, 0.5, 2.5], [2.5, 4.5, 0.0]])
    # residuals ±0.5 -> var 0.25; var(1,2,3,4) = 1.25 -> 1 - 0.2
    close(explained_variance(values, returns, mask), 0.8)
    close(explained_variance(torch.full_like(returns, 2.5), returns, mask), 0.0)


# ---------------------------------------------------------------- running moments


def test_running_moments():
    batches = [[1.0, 2.0, 3.0], [4.0, 5.0], [10.0, -1.0, 0.5, 2.0], [7.0]]
    rm = RunningMoments()
    seen = []
    for b in batches:
        bm, bs = rm.update(torch.tensor(b))
        seen += b
        assert bm == pytest.approx(statistics.mean(b))
        assert bs == pytest.approx(statistics.stdev(b) if len(b) > 1 else 0.0)
        assert rm.mean == pytest.approx(statistics.mean(seen))
        assert rm.std == pytest.approx(statistics.stdev(seen))
        assert rm.std == pytest.approx(float(np.std(seen, ddof=1)))
        assert rm.count == len(seen)
    rm2 = RunningMoments()
    rm2.load_state_dict(rm.state_dict())
    more = torch.tensor([[3.0, 3.5], [-2.0, 0.0]])  # any shape is flattened
    rm.update(more)
    rm2.update(more)
    seen += more.flatten().tolist()
    assert rm2.mean == pytest.approx(statistics.mean(seen))
    assert rm2.std == pytest.approx(statistics.stdev(seen))
    assert rm2.state_dict() == rm.state_dict()


# --------------------------------------------------------------------------- critic-free estimators (pure)
def test_grpo_dr_grpo_and_rloo_by_hand():
    from step3_ppo.algo.advantages import group_normalized, leave_one_out
    from step3_ppo.rewards.combine import zero_variance_groups

    # group 5: four samples [1, 0, 0, 1]; group 9: equal rewards; group 7: two samples [2, 0]
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 2.0, 0.0])
    groups = torch.tensor([5, 5, 5, 5, 9, 9, 7, 7])
    std4 = (1 / 3) ** 0.5  # unbiased std of [1, 0, 0, 1]
    grpo = group_normalized(scores, groups, eps=1e-12)
    expected = [0.5 / std4, -0.5 / std4, -0.5 / std4, 0.5 / std4, 0.0, 0.0, 1 / 2**0.5, -1 / 2**0.5]
    assert torch.allclose(grpo, torch.tensor(expected), atol=1e-6)
    dr = group_normalized(scores, groups, scale_by_std=False)
    assert torch.allclose(dr, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 1.0, -1.0]))
    rloo = leave_one_out(scores, groups)  # r_i - mean of the others
    assert torch.allclose(rloo, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0, 2.0, -2.0]), atol=1e-6)
    assert leave_one_out(torch.tensor([4.0]), torch.tensor([0])).eq(0).all()  # group of one
    assert zero_variance_groups(scores, groups).tolist() == [False] * 4 + [True, True, False, False]
    assert zero_variance_groups(torch.tensor([4.0]), torch.tensor([0])).tolist() == [False]  # one row: not a group


@pytest.mark.parametrize("name, expected_row0", [("grpo", 0.5 / (1 / 3) ** 0.5), ("dr_grpo", 0.5), ("rloo", 2 / 3)])
def test_estimators_put_the_group_advantage_on_every_action(name, expected_row0):
    """No KL in the reward: each action of a row gets its sequence advantage; padding stays 0; with a
    per-token KL penalty the advantage is the return-to-go (the penalties still ahead are added)."""
    from step3_ppo.algo.advantages import advantages_and_returns, get_estimator
    from step3_ppo.algo.shaping import compute_rewards

    estimator = get_estimator(name)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0])
    mask = torch.tensor([[0, 1, 1, 1], [0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 0]], dtype=torch.float32)
    zeros = torch.zeros(4, 4)
    shaped = estimator.baseline(scores, groups)
    rewards, _ = compute_rewards(shaped, zeros, zeros, mask, kl_coef=0.0)
    adv, returns = advantages_and_returns(estimator, zeros, rewards, mask, gamma=1.0, lam=0.95)
    assert torch.allclose(adv[0], torch.tensor([0.0, expected_row0, expected_row0, expected_row0]), atol=1e-5)
    assert adv[1, 3] == 0 and adv[2, 1] == 0 and torch.equal(adv, returns)
    logprobs = torch.full((4, 4), -1.0)
    rewards, kl = compute_rewards(shaped, logprobs, logprobs - 0.5, mask, kl_coef=0.1)  # KL 0.5 per action
    adv, _ = advantages_and_returns(estimator, zeros, rewards, mask, gamma=1.0, lam=0.95)
    assert torch.allclose(adv[0, 1:], expected_row0 - 0.05 * torch.tensor([3.0, 2.0, 1.0]), atol=1e-5)


def test_estimator_aliases_and_defaults():
    from step3_ppo.algo.advantages import ESTIMATORS, estimator_name

    assert estimator_name("group_norm") == "grpo" and estimator_name("reinforce") == "reinforce_pp"
    assert estimator_name("reinforce_baseline") == "reinforce_pp_baseline"
    with pytest.raises(ValueError, match="choose from"):
        estimator_name("ppo2")
    assert [n for n, e in ESTIMATORS.items() if e.needs_critic] == ["gae"]
    assert ESTIMATORS["dr_grpo"].loss_agg == "constant_norm" and ESTIMATORS["grpo"].loss_agg == "seq_mean"
    assert ESTIMATORS["reinforce_pp"].whiten and not ESTIMATORS["grpo"].whiten


def test_length_penalty_by_hand():
    from step3_ppo.algo.shaping import length_penalty

    lengths = torch.tensor([10, 16, 18, 20, 20])
    ended = torch.tensor([True, True, True, True, False])
    # max 20, buffer 4: from 16 tokens on, up to -factor at 20
    assert torch.allclose(length_penalty(lengths, ended, 20, 4, 0.5), torch.tensor([0.0, 0.0, -0.25, -0.5, -0.5]))
    assert torch.allclose(
        length_penalty(lengths, ended, 20, truncation_penalty=1.0), torch.tensor([0.0, 0.0, 0.0, 0.0, -1.0])
    )
    assert length_penalty(lengths, ended, 20).abs().sum() == 0


def test_loss_aggregations_by_hand():
    from utils.math.ops import aggregate

    x = torch.tensor([[1.0, 3.0, 9.0], [4.0, 0.0, 0.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # row 2: dropped (no action)
    assert aggregate(x, mask, "token_mean").item() == pytest.approx(8 / 3)  # (1+3+4)/3 tokens
    assert aggregate(x, mask, "seq_mean").item() == pytest.approx((2 + 4) / 2)  # rows' means, 2 rows
    assert aggregate(x, mask, "constant_norm", 4).item() == pytest.approx((4 / 4 + 4 / 4) / 2)
    assert aggregate(x, torch.zeros_like(mask), "seq_mean").item() == 0
    with pytest.raises(ValueError, match="positive constant"):
        aggregate(x, mask, "constant_norm")


def test_returns_to_go_by_hand():
    from step3_ppo.algo.advantages import returns_to_go

    rewards = torch.tensor([[9.0, -0.1, -0.1, 0.9, 9.0], [9.0, 9.0, -0.2, 1.8, 9.0]])  # 9: padding, ignored
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 0]])
    out = returns_to_go(rewards, mask, gamma=1.0)
    assert torch.allclose(out, torch.tensor([[0, 0.7, 0.8, 0.9, 0], [0, 0, 1.6, 1.8, 0]]), atol=1e-6)
    half = returns_to_go(rewards, mask, gamma=0.5)
    assert torch.allclose(half[0, 1:4], torch.tensor([-0.1 + 0.5 * (-0.1 + 0.5 * 0.9), -0.1 + 0.45, 0.9]), atol=1e-6)
