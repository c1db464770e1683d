"""Pure PPO math for the RLHF step-3 trainer (no DeepSpeed, no models).

Tensor layout convention
------------------------
Every per-token tensor lives on the *shifted* full sequence and has shape
``[B, L-1]`` for sequences of length ``L`` (prompt + response, left padded):

* position ``i`` holds quantities about token ``i+1`` predicted from prefix
  ``0..i``: the log-prob of token ``i+1``, the value of state ``i`` (the state
  in which token ``i+1`` is chosen) and the reward of action ``i+1``.
* ``action_mask`` ``[B, L-1]`` (float, bool or long: all accepted) is 1 exactly
  where token ``i+1`` is a generated token, up to and including the first EOS.
  Prompt tokens, left padding and tokens after the EOS are 0.  The actions of
  a row are contiguous (one block per row).

Why this layout: it is what ``logits[:, :-1]`` gathered at ``input_ids[:, 1:]``
gives, so actor log-probs, reference log-probs and critic values line up
position by position without any further slicing.

Masking: padding positions may hold arbitrary (even non-finite) numbers, so
masked reductions select with ``torch.where`` instead of multiplying by the
mask (``nan * 0 == nan``).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from utils.model import last_one_index
from torch import Tensor

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "logprobs_from_logits",
    "entropy_from_logits",
    "kl_estimate",
    "last_action_index",
    "compute_rewards",
    "FixedKLController",
    "AdaptiveKLController",
    "gae_advantages_and_returns",
    "actor_loss",
    "critic_loss",
    "kl_penalty_loss",
    "explained_variance",
    "RunningMoments",
    "KL_ESTIMATORS",
]

KL_ESTIMATORS = ("k1", "k2", "k3")


# ---------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------


def _weights(mask: Tensor, x: Tensor) -> Tensor:
    """Mask as floating weights in x's dtype (bool/long/float masks all accepted)."""
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    return mask.to(dtype=dtype, device=x.device)


def _select(x: Tensor, mask: Tensor) -> Tensor:
    """x on masked entries, 0 elsewhere; immune to nan/inf in padding."""
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x * mask``; padding never leaks in, even if it is nan/inf.

    ``dim=None`` sums everything (scalar), otherwise sums along ``dim``.
    """
    w = _weights(mask, x)
    xs = _select(x.to(w.dtype), mask) * w
    return xs.sum() if dim is None else xs.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over the masked entries only.

    Why: PPO losses must average over generated tokens, not over prompt/pad
    positions, otherwise the effective step size depends on padding.

    ``dim=None`` -> one scalar over the whole (mini-)batch (token-level mean);
    ``dim`` given -> per-row means (e.g. ``[B]`` for ``dim=-1``).
    Zero-count guard: where the mask sums to 0 (an empty batch / a row with no
    action) the numerator is also 0, so only those zero counts are replaced by
    1 and the result is 0 instead of nan. Non-zero counts (including
    fractional weight sums < 1) are left untouched, which a blanket
    ``clamp(min=1)`` would not do.
    """
    w = _weights(mask, x)
    total = masked_sum(x, mask, dim=dim)
    count = w.sum() if dim is None else w.sum(dim=dim)
    count = torch.where(count == 0, torch.ones_like(count), count)
    return total / count


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over the masked entries (scalar).

    ``unbiased`` applies Bessel's correction n/(n-1) with n = mask sum.
    Raises ValueError for an empty mask (no data: a silent 0/nan would hide a
    pipeline bug). With a single entry the variance is 0 and is returned
    without the (undefined) correction, so whitening one token yields 0
    instead of crashing a training step.
    """
    w = _weights(mask, x)
    n = w.sum()
    if n.item() == 0:
        raise ValueError("masked_var: mask is empty (sum == 0), variance undefined")
    mean = masked_mean(x, mask)
    var = masked_mean((x.to(w.dtype) - mean) ** 2, mask)
    if unbiased and n.item() > 1:
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean / unit variance using masked entries only.

    Why: advantage whitening must use statistics of real actions only; pad
    positions would bias mean and variance. ``shift_mean=False`` only rescales
    (keeps the original mean), as used for rewards in some recipes.
    Outputs at unmasked positions are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _select(whitened, mask)


# ---------------------------------------------------------------------------
# logits -> per-token quantities
# ---------------------------------------------------------------------------


def _row_chunks(logits: Tensor):
    """Split [..., V] logits into [N, V] chunks of one sequence each (bounded fp32 temp)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    chunk = logits.shape[-2] if logits.dim() >= 3 else max(flat.shape[0], 1)
    return flat, chunk


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] per position, computed in fp32.

    Shapes: logits ``[B, T, V]`` (any leading dims), labels ``[B, T]`` of
    valid token ids -> ``[B, T]`` fp32.

    Why ``gather - logsumexp``: ``log_softmax`` would allocate a full
    ``[B, T, V]`` output only to read one entry per position. For fp32 input
    no second full copy is kept; for bf16/fp16 input the upcast to fp32 (for
    an accurate logsumexp) is done one sequence at a time so peak extra memory
    is ``T*V`` fp32 instead of ``B*T*V``. Gathering in low precision and then
    upcasting is exact.
    """
    labels = labels.long()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1).float()
    if logits.dtype in (torch.float32, torch.float64):
        return picked - torch.logsumexp(logits, dim=-1).float()
    flat, chunk = _row_chunks(logits)
    lse = torch.cat([torch.logsumexp(c.float(), dim=-1) for c in flat.split(chunk, dim=0)])
    return picked - lse.view(picked.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy ``H = logsumexp(z) - sum softmax(z) * z`` in fp32, shape ``[B, T]``.

    Why: a monitoring signal (collapse of the policy shows as entropy -> 0).
    Computed one sequence at a time to bound the fp32 temporaries.
    """
    flat, chunk = _row_chunks(logits)
    out = []
    for c in flat.split(chunk, dim=0):
        c = c.float()
        p = torch.softmax(c, dim=-1)
        out.append(torch.logsumexp(c, dim=-1) - (p * c).sum(dim=-1))
    return torch.cat(out).view(logits.shape[:-1])


# ---------------------------------------------------------------------------
# KL to the reference and rewards
# ---------------------------------------------------------------------------


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(actor || reference) for tokens sampled from the actor.

    This is the KL to the FROZEN SFT REFERENCE model (the RLHF regulariser),
    NOT the PPO importance ratio against the old (rollout) policy.
    With ``log_ratio = logprobs - ref_logprobs`` (Schulman, "Approximating KL
    divergence"):

    * ``k1 = log_ratio``: unbiased, but can be negative per token.
    * ``k2 = 0.5 * log_ratio**2``: low variance, biased, >= 0.
    * ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased and >= 0
      (``exp(-log_ratio)`` is the ratio ref/actor). Grows exponentially when
      the actor is much less likely than the reference (log_ratio << 0);
      callers may clamp log_ratio if that matters.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1 + log_ratio


def last_action_index(action_mask: Tensor) -> Tensor:
    """Index (along the last dim) of the last action of each row, LongTensor ``[B]``.

    Why: the sequence-level reward-model score is credited to the final
    action (the EOS token, or the last generated token of a truncated row).
    Raises ValueError if some row has no action at all.
    """
    return last_one_index(action_mask)


def compute_rewards(
    score: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    kl_coef: float,
    clip_reward_value: Optional[float] = None,
    kl_estimator: str = "k1",
) -> Tuple[Tensor, Tensor]:
    """Per-token rewards: ``-kl_coef * KL`` on every action, plus the score on the last one.

    Why: the reward model only scores whole sequences; the dense KL penalty
    keeps the policy close to the SFT reference at every token. The score
    (optionally clipped to ``±clip_reward_value`` against reward hacking
    through outliers) is added at the last action of each row: the EOS action
    if present, else the last generated token of a truncated row.

    Returns ``(rewards, kl)``, both ``[B, L-1]`` and 0 outside the mask.
    Intended to be called under ``torch.no_grad()`` (rewards are constants).
    """
    kl = _select(kl_estimate(logprobs, ref_logprobs, kl_estimator), action_mask)
    rewards = -kl_coef * kl
    score = score.reshape(-1).to(dtype=rewards.dtype, device=rewards.device)
    if score.shape[0] != rewards.shape[0]:
        raise ValueError(f"score has {score.shape[0]} entries, batch has {rewards.shape[0]} rows")
    if clip_reward_value is not None:
        score = score.clamp(-clip_reward_value, clip_reward_value)
    idx = last_action_index(action_mask)
    rewards = rewards.scatter_add(-1, idx.unsqueeze(-1), score.unsqueeze(-1))
    return rewards, kl


class FixedKLController:
    """Constant KL coefficient (same interface as the adaptive controller)."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, "Fine-Tuning LMs from Human Preferences").

    Why: a fixed coefficient is either too weak early or too strong late; this
    proportional controller steers the measured KL towards ``target``:
    ``e = clip(current_kl / target - 1, -0.2, 0.2)``,
    ``value *= 1 + e * n_steps / horizon``. The clip bounds how fast the
    coefficient can move on a noisy KL estimate.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError("AdaptiveKLController: target and horizon must be > 0")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient up if KL > target, down if KL < target."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        mult = 1.0 + proportional_error * n_steps / self.horizon
        self.value *= mult

    def state_dict(self) -> Dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.value = float(state["value"])
        self.target = float(state.get("target", self.target))
        self.horizon = float(state.get("horizon", self.horizon))


# ---------------------------------------------------------------------------
# advantages
# ---------------------------------------------------------------------------


def gae_advantages_and_returns(
    values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float, lam: float
) -> Tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the action positions of each row.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma*lam*A_{t+1}``,
    where the step after a row's last action is terminal (``V = 0``, ``A = 0``).
    Why masking by the *next* position: rows end at different places (EOS then
    padding) and start at different offsets (left padding); whatever sits in
    padding must neither bootstrap the last action nor leak into the
    recursion. Outputs are 0 outside the mask; ``returns = advantages +
    values`` on actions (the critic's regression target). Both are detached.
    Vectorised over the batch, sequential over time.
    """
    with torch.no_grad():
        m = action_mask != 0
        v = _select(values.float(), m)
        r = _select(rewards.float(), m)
        T = v.shape[-1]
        adv = torch.zeros_like(v)
        next_adv = torch.zeros_like(v[..., 0])
        next_v = torch.zeros_like(v[..., 0])
        next_m = torch.zeros_like(v[..., 0])
        for t in range(T - 1, -1, -1):
            # next_v / next_adv are 0 when t+1 is not an action (terminal or padding)
            delta = r[..., t] + gamma * next_v * next_m - v[..., t]
            a_t = delta + gamma * lam * next_adv * next_m
            a_t = torch.where(m[..., t], a_t, torch.zeros_like(a_t))
            adv[..., t] = a_t
            next_adv, next_v, next_m = a_t, v[..., t], m[..., t].to(v.dtype)
        returns = _select(adv + v, m)
        out_dtype = values.dtype if values.is_floating_point() else adv.dtype
        return adv.to(out_dtype), returns.to(out_dtype)


# ---------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------


def actor_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor, cliprange: float
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate, token-level masked mean over all actions of the mini-batch.

    ``ratio = exp(logprobs - old_logprobs)`` is ALWAYS against the old
    (rollout-time) policy, never the reference model; at the first PPO epoch
    it is exactly 1. ``loss = mean(max(-A * ratio, -A * clip(ratio, 1±eps)))``:
    the pessimistic bound removes the incentive to move the ratio outside the
    trust region in the direction the advantage favours.

    Stats (detached): ``clipfrac`` fraction of actions where the clipped term
    is the active one; ``approx_kl`` = masked mean of the k2 estimator
    ``0.5 * (logp - old_logp)**2`` of KL(old || new) (a drift monitor);
    ``log_ratio_max_abs`` = max |logp - old_logp| over actions (0 if none).
    """
    log_ratio = _select(logprobs - old_logprobs, action_mask)
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(pg1, pg2), action_mask)
    with torch.no_grad():
        lr = log_ratio.detach()
        stats = {
            "clipfrac": masked_mean((pg2 > pg1).float(), action_mask),
            "approx_kl": masked_mean(0.5 * lr**2, action_mask),
            "log_ratio_max_abs": lr.abs().max() if lr.numel() else lr.new_zeros(()),
        }
    return loss, stats


def critic_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor, cliprange_value: float
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * mean(max((V - R)^2, (V_clip - R)^2))`` over actions.

    ``V_clip = old_values + clamp(values - old_values, ±cliprange_value)``.
    Why: keeps the critic from moving far from its rollout-time predictions in
    one update (mirrors the policy trust region). ``value_clipfrac`` is the
    fraction of actions where the clipped error is the active (larger) one.
    """
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf1 = (values - returns) ** 2
    vf2 = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf1, vf2), action_mask)
    with torch.no_grad():
        stats = {"value_clipfrac": masked_mean((vf2 > vf1).float(), action_mask)}
    return loss, stats


def kl_penalty_loss(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """GRPO-style "KL in the loss": masked mean of k3 KL(actor || reference).

    Differentiable w.r.t. ``logprobs`` (ref is a constant). An ALTERNATIVE to
    the in-reward penalty of ``compute_rewards``; the two are not used
    together by default (that would penalise KL twice).
    """
    kl = kl_estimate(logprobs, ref_logprobs.detach(), "k3")
    return masked_mean(kl, action_mask)


def explained_variance(values: Tensor, returns: Tensor, action_mask: Tensor) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over masked entries (0-d float tensor).

    Why: critic health monitor; 1 = perfect, 0 = no better than a constant,
    < 0 = worse. nan when the returns have zero variance.
    """
    with torch.no_grad():
        r = returns.float()
        var_y = masked_var(r, action_mask, unbiased=False)
        var_diff = masked_var(r - values.float(), action_mask, unbiased=False)
        return 1.0 - var_diff / var_y


class RunningMoments:
    """Running mean/std of all scores seen so far (Chan et al. parallel update).

    Why: optional reward normalisation needs stable statistics across
    rollouts, not just the current batch. ``update`` folds a batch in with the
    parallel-variance formula (exact, numerically stable) and returns the
    batch's own mean and std. ``std`` is the sample (unbiased) std over all
    values seen. Stats are kept as python floats (float64) for checkpoints.
    """

    def __init__(self):
        self.mean = 0.0
        self.var = 0.0  # population variance of everything seen
        self.std = 1.0
        self.count = 0

    def update(self, x: Tensor) -> Tuple[float, float]:
        """Fold the batch ``x`` (any shape) in; returns (batch mean, batch unbiased std)."""
        xs = x.detach().reshape(-1).to(torch.float64)
        n = xs.numel()
        if n == 0:
            raise ValueError("RunningMoments.update: empty batch")
        b_mean = xs.mean().item()
        b_var = ((xs - b_mean) ** 2).mean().item()  # population variance of the batch
        tot = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta * delta * self.count * n / tot
        self.mean += delta * n / tot
        self.var = m2 / tot
        self.count = tot
        self.std = math.sqrt(m2 / (tot - 1)) if tot > 1 else 0.0
        b_std = math.sqrt(b_var * n / (n - 1)) if n > 1 else 0.0
        return b_mean, b_std

    def state_dict(self) -> Dict[str, float]:
        return {"mean": self.mean, "var": self.var, "std": self.std, "count": self.count}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.mean = float(state["mean"])
        self.var = float(state["var"])
        self.std = float(state["std"])
        self.count = int(state["count"])
