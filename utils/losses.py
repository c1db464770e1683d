"""Every training loss of the project, pure tensors (no DeepSpeed, no models, no orchestration).

- ``sft_nll``: next-token NLL on trained labels (step 1, PPO-ptx, perplexity);
- ``pairwise_loss`` / ``pair_metrics``: the reward model's Bradley-Terry loss (step 2);
- ``policy_loss`` (``POLICY_LOSSES``): PPO's clipped surrogate against the OLD policy (step 3's actor);
- ``value_loss``: the clipped value loss (step 3's critic);
- ``kl_penalty_loss``: KL(actor || reference) as a loss term (GRPO-style alternative to the
  in-reward penalty);
- ``pair_loss`` (``PAIR_LOSSES``; ``dpo_loss`` with a reference): preference tuning from sequence
  log-probs (DPO, conservative DPO, IPO), and ``response_nll``, the optional NLL term on the chosen responses
  (RPO) (step2_dpo).

Per-token losses follow the layout of utils/ops.py (``[B, L-1]``, ``action_mask``). Every input
is selected with the mask BEFORE any arithmetic: a pad may hold nan/inf (a log-prob below -88 at
a pad label, a stored 0 against a live -inf), and ``where(mask, f(x), 0)`` alone still
back-propagates ``0 * f'(x) = nan`` into ``x``. ``tests/test_losses.py`` checks that every loss's
gradient is finite with nan/inf in all padded positions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from utils.ops import aggregate, kl_estimate, masked_mean, select

__all__ = ["IGNORE_INDEX", "sft_nll", "pairwise_loss", "pair_metrics", "policy_loss", "PolicyLoss", "POLICY_LOSSES",
           "value_loss", "PairLogps", "PairLoss", "PairOption", "PAIR_LOSSES", "DPO_LOSS_TYPES", "pair_loss", "dpo_loss",
           "response_nll", "kl_penalty_loss"]

IGNORE_INDEX = -100


def sft_nll(logits: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
    """(sum of next-token NLL over trained labels, their count), in fp32.

    ``logits`` ``[B, L, V]`` of the whole sequence, ``labels`` ``[B, L]`` with ``IGNORE_INDEX``
    on untrained tokens (prompt, padding); the prediction at position i is scored against label
    i+1. ``F.cross_entropy`` (one fused log-softmax + gather) rather than ops.logprobs_from_logits:
    it is what step 1 has always trained with, and the demo's digits depend on its rounding.
    Logits of untrained positions are zeroed first, so a non-finite logit there cannot reach the
    gradient.
    """
    shift_labels = labels[:, 1:].to(logits.device)
    mask = shift_labels != IGNORE_INDEX
    shift_logits = select(logits[:, :-1].float(), mask.unsqueeze(-1))
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.clamp(min=0).reshape(-1),
                          reduction="none").view_as(shift_labels)
    return select(nll, mask).sum(), mask.sum()


def pairwise_loss(chosen_scores: Tensor, rejected_scores: Tensor, margin: float = 0.0) -> Tensor:
    """Bradley-Terry loss: mean(-log sigmoid(chosen - rejected - margin)), numerically stable."""
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float() - margin).mean()


def pair_metrics(chosen_scores: Tensor, rejected_scores: Tensor) -> dict:
    """accuracy (strict chosen > rejected), mean chosen/rejected scores and mean margin, as floats."""
    c, r = chosen_scores.detach().float(), rejected_scores.detach().float()
    return {"accuracy": (c > r).float().mean().item(), "chosen_mean": c.mean().item(),
            "rejected_mean": r.mean().item(), "margin_mean": (c - r).mean().item()}


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor,
                cliprange: float, loss_mask: Tensor | None = None, loss_agg: str = "token_mean",
                agg_constant: float | None = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate over the actions of the mini-batch, aggregated by ``loss_agg``
    (utils.ops.aggregate: token mean by default, per-sequence mean, or Dr. GRPO's constant).

    ``ratio = exp(logprobs - old_logprobs)`` is ALWAYS against the old (rollout-time) policy,
    never the reference model; at the first PPO epoch it is exactly 1.
    ``loss = agg(max(-A * ratio, -A * clip(ratio, 1±eps)))``: the pessimistic bound removes the
    incentive to move the ratio outside the trust region in the direction the advantage favours.
    ``loss_mask`` (default ``action_mask``): the actions that enter the loss; rows dropped from
    training (a truncated answer, a group without signal) are 0 there but still 1 in
    ``action_mask``, whose log-ratio is still measured.

    Stats (detached, over ``loss_mask``): ``clipfrac`` fraction of actions where the clipped term
    is the active one; ``approx_kl`` = masked mean of the k2 estimator ``0.5 * (logp - old_logp)**2``
    of KL(old || new) (a drift monitor); ``log_ratio_max_abs`` = max |logp - old_logp| over all of
    ``action_mask`` (0 if none).
    """
    loss_mask = action_mask if loss_mask is None else loss_mask
    logprobs, old_logprobs = select(logprobs, action_mask), select(old_logprobs, action_mask)
    advantages = select(advantages, action_mask)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = aggregate(torch.max(pg1, pg2), loss_mask, loss_agg, agg_constant)
    with torch.no_grad():
        lr = log_ratio.detach()
        stats = {
            "clipfrac": masked_mean((pg2 > pg1).float(), loss_mask),
            "approx_kl": masked_mean(0.5 * lr**2, loss_mask),
            "log_ratio_max_abs": lr.abs().max() if lr.numel() else lr.new_zeros(()),
        }
    return loss, stats


@dataclass(frozen=True)
class PolicyLoss:
    """One `--policy_loss` of step 3: `fn(logprobs, old_logprobs, advantages, action_mask, *, loss_mask,
    loss_agg, agg_constant, **options) -> (loss, stats)` with stats `clipfrac`, `approx_kl`,
    `log_ratio_max_abs` (tensors); `options` names the RL settings (PPOConfig fields, flags of the same
    name) it reads besides those; `help` is the flag's one line."""
    fn: Callable[..., Tuple[Tensor, Dict[str, Tensor]]]
    help: str
    options: Tuple[str, ...] = ()


# A new policy loss is one entry here and its pure function above (with a hand-computed test).
POLICY_LOSSES: Dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(policy_loss, "PPO's clipped surrogate, ratio against the rollout-time policy clipped to "
                                   "1 +- --cliprange (Schulman et al. 2017)", options=("cliprange",)),
}


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor,
               cliprange_value: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * mean(max((V - R)^2, (V_clip - R)^2))`` over actions.

    ``V_clip = old_values + clamp(values - old_values, ±cliprange_value)``. Why: keeps the critic
    from moving far from its rollout-time predictions in one update (mirrors the policy trust
    region). ``value_clipfrac`` is the fraction of actions where the clipped error is the active
    (larger) one.
    """
    values, old_values = select(values, action_mask), select(old_values, action_mask)
    returns = select(returns, action_mask)
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf1 = (values - returns) ** 2
    vf2 = (values_clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(vf1, vf2), action_mask)
    with torch.no_grad():
        stats = {"value_clipfrac": masked_mean((vf2 > vf1).float(), action_mask)}
    return loss, stats


def kl_penalty_loss(logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor, loss_agg: str = "token_mean",
                    agg_constant: float | None = None) -> Tensor:
    """GRPO-style "KL in the loss": k3 KL(actor || reference), aggregated as the policy loss is.

    Differentiable w.r.t. ``logprobs`` (ref is a constant). An ALTERNATIVE to the in-reward
    penalty of step 3's reward shaping; the two are not used together (that would penalise KL
    twice).
    """
    logprobs, ref_logprobs = select(logprobs, action_mask), select(ref_logprobs.detach(), action_mask)
    return aggregate(kl_estimate(logprobs, ref_logprobs, "k3"), action_mask, loss_agg, agg_constant)


@dataclass(frozen=True)
class PairLogps:
    """SEQUENCE log-probs [B] of a batch of preference pairs (summed over each response's tokens), the
    reference's (None when the loss needs no reference) and the responses' token counts (None unless
    the loss needs lengths)."""
    chosen: Tensor
    rejected: Tensor
    ref_chosen: Tensor | None = None
    ref_rejected: Tensor | None = None
    chosen_tokens: Tensor | None = None
    rejected_tokens: Tensor | None = None


def _ratios(p: PairLogps) -> Tuple[Tensor, Tensor]:
    """(logp_c - ref_c, logp_r - ref_r) in fp32, the reference a constant."""
    return (p.chosen.float() - p.ref_chosen.detach().float(), p.rejected.float() - p.ref_rejected.detach().float())


def sigmoid_pair_loss(p: PairLogps, beta: float, label_smoothing: float = 0.0) -> Tuple[Tensor, Tensor, Tensor]:
    """DPO (Rafailov et al. 2023): ``-log sigmoid(beta * h)`` with ``h = (logp_c - ref_c) - (logp_r - ref_r)``,
    the policy's log-ratio margin over the reference's; ln 2 when the policy is the reference.
    ``label_smoothing`` eps (conservative DPO: each label is wrong with probability eps):
    ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``. Implicit rewards ``beta * (logp - ref)``."""
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing}")
    chosen_ratio, rejected_ratio = _ratios(p)
    h = chosen_ratio - rejected_ratio
    losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses, beta * chosen_ratio, beta * rejected_ratio


def ipo_pair_loss(p: PairLogps, beta: float) -> Tuple[Tensor, Tensor, Tensor]:
    """IPO (Azar et al. 2023): ``(h - 1 / (2 beta))^2``, a squared target margin, which does not push h to
    infinity on pairs the policy already ranks right (DPO's overfitting on easy pairs)."""
    chosen_ratio, rejected_ratio = _ratios(p)
    return (chosen_ratio - rejected_ratio - 1 / (2 * beta)) ** 2, beta * chosen_ratio, beta * rejected_ratio


@dataclass(frozen=True)
class PairOption:
    """A setting of one pair loss, offered as the DPO step's flag `--<name>`."""
    default: float
    help: str


@dataclass(frozen=True)
class PairLoss:
    """One `--loss_type` of the DPO step: `fn(pairs: PairLogps, beta, **options) -> (losses [B], chosen
    rewards [B], rejected rewards [B])` (the rewards detached by the caller: the implicit rewards whose
    accuracy and margin are reported). `needs_reference`: False for a reference-free loss (no reference
    model, no reference log-probs); `needs_lengths`: the responses' token counts are filled in;
    `options`: its own settings, each a flag of the DPO step."""
    fn: Callable[..., Tuple[Tensor, Tensor, Tensor]]
    help: str
    needs_reference: bool = True
    needs_lengths: bool = False
    options: Dict[str, PairOption] = field(default_factory=dict)


# A new pair loss (SimPO, ORPO, ...) is one entry here and its pure function above (with a hand-computed test).
PAIR_LOSSES: Dict[str, PairLoss] = {
    "sigmoid": PairLoss(sigmoid_pair_loss, "DPO's -log sigmoid(beta * margin of log-ratios) (Rafailov et al. 2023)",
                        options={"label_smoothing": PairOption(
                            0.0, "conservative DPO: the probability that a pair's label is flipped, in [0, 0.5)")}),
    "ipo": PairLoss(ipo_pair_loss, "IPO's squared target margin 1 / (2 beta) (Azar et al. 2023)"),
}
DPO_LOSS_TYPES = tuple(PAIR_LOSSES)


def pair_loss(pairs: PairLogps, beta: float, loss_type: str = "sigmoid", **options) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Mean preference loss of a batch of pairs by the `PAIR_LOSSES` entry `loss_type` (its own options by
    name), with the implicit-reward stats (detached): the mean chosen and rejected rewards, the fraction
    of pairs whose chosen reward is higher, and their mean margin."""
    if loss_type not in PAIR_LOSSES:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; choose from {', '.join(PAIR_LOSSES)}")
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    losses, chosen_rewards, rejected_rewards = PAIR_LOSSES[loss_type].fn(pairs, beta, **options)
    with torch.no_grad():
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        stats = {"chosen_reward": chosen_rewards.mean(), "rejected_reward": rejected_rewards.mean(),
                 "accuracy": (chosen_rewards > rejected_rewards).float().mean(),
                 "margin": (chosen_rewards - rejected_rewards).mean()}
    return losses.mean(), stats


def dpo_loss(chosen_logps: Tensor, rejected_logps: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor,
             beta: float, loss_type: str = "sigmoid", **options) -> Tuple[Tensor, Dict[str, Tensor]]:
    """`pair_loss` of pairs scored against a reference (every loss of the DPO family that has one)."""
    return pair_loss(PairLogps(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps), beta, loss_type,
                     **options)


def response_nll(logps: Tensor, token_counts: Tensor) -> Tensor:
    """Mean NLL per response token over a batch: ``-sum(logps) / sum(token_counts)`` from sequence
    log-probs [B] and their token counts [B]. DPO's optional term on the chosen responses
    (``--nll_loss_coef``; TRL's ``rpo_alpha``, OpenRLHF's ``--nll_loss_coef``): it keeps the
    chosen answers' likelihood from falling while the margin grows."""
    return -logps.float().sum() / token_counts.float().sum().clamp(min=1.0)
