"""Every training loss of the project, pure tensors (no DeepSpeed, no models, no orchestration).

- ``sft_nll``: next-token NLL on trained labels (step 1, PPO-ptx, perplexity);
- ``pairwise_loss`` / ``pair_metrics``: the reward model's Bradley-Terry loss (step 2);
- ``POLICY_LOSSES`` (step 3's actor, against the OLD policy): ``policy_loss`` (PPO's clipped
  surrogate, with clip-higher and dual-clip), ``gspo_loss`` (GSPO's sequence-level ratio),
  ``cispo_loss`` (CISPO's clipped, stop-gradient importance weight); ``entropy_bonus``;
- ``value_loss``: the clipped value loss (step 3's critic);
- ``kl_penalty_loss``: KL(actor || reference) as a loss term (GRPO-style alternative to the
  in-reward penalty), in a form whose gradient is KL's (k2, importance-weighted), or k3;
- ``pair_loss`` (``PAIR_LOSSES``; ``dpo_loss`` with a reference): preference tuning from sequence
  log-probs (DPO, conservative DPO, IPO, SimPO, ORPO), ``unpaired_loss`` of labelled single examples
  (KTO, with ``kto_reference_point``), and ``response_nll``, the optional NLL term on the chosen responses
  (RPO) (step2_dpo).

Per-token losses follow the layout of utils/math/ops.py (``[B, L-1]``, ``action_mask``). Every input
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

from utils.math.ops import aggregate, kl_estimate, masked_mean, select

__all__ = [
    "IGNORE_INDEX",
    "sft_nll",
    "pairwise_loss",
    "pair_metrics",
    "policy_loss",
    "gspo_loss",
    "cispo_loss",
    "entropy_bonus",
    "PolicyLoss",
    "POLICY_LOSSES",
    "GSPO_CLIPRANGE_LOW",
    "GSPO_CLIPRANGE_HIGH",
    "value_loss",
    "PairLogps",
    "PairLoss",
    "PairOption",
    "PAIR_LOSSES",
    "simpo_pair_loss",
    "orpo_pair_loss",
    "DPO_LOSS_TYPES",
    "UnpairedLogps",
    "kto_reference_point",
    "kto_loss",
    "unpaired_stats",
    "unpaired_loss",
    "pair_loss",
    "dpo_loss",
    "response_nll",
    "KL_LOSS_ESTIMATORS",
    "kl_penalty_loss",
]

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
    return token_nll(logits[:, :-1], shift_labels).sum(), (shift_labels != IGNORE_INDEX).sum()


def token_nll(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token NLL ``[...]`` fp32 of ``targets`` under ``logits`` ``[..., V]`` (the prediction already aligned
    with its target), 0 where the target is ``IGNORE_INDEX``: sft_nll's arithmetic, and that of the chunked SFT
    loss (utils.models.forward.lm_nll), which applies it one chunk of tokens at a time."""
    trained = targets != IGNORE_INDEX
    logits = select(logits.float(), trained.unsqueeze(-1))
    nll = F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.clamp(min=0).reshape(-1), reduction="none"
    ).view_as(targets)
    return select(nll, trained)


def pairwise_loss(chosen_scores: Tensor, rejected_scores: Tensor, margin: float = 0.0) -> Tensor:
    """Bradley-Terry loss: mean(-log sigmoid(chosen - rejected - margin)), numerically stable."""
    return -F.logsigmoid(chosen_scores.float() - rejected_scores.float() - margin).mean()


def pair_metrics(chosen_scores: Tensor, rejected_scores: Tensor) -> dict:
    """accuracy (strict chosen > rejected), mean chosen/rejected scores and mean margin, as floats."""
    c, r = chosen_scores.detach().float(), rejected_scores.detach().float()
    return {
        "accuracy": (c > r).float().mean().item(),
        "chosen_mean": c.mean().item(),
        "rejected_mean": r.mean().item(),
        "margin_mean": (c - r).mean().item(),
    }


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, low: float, high: float, dual_clip: float | None
) -> Tuple[Tensor, Tensor]:
    """(per-token loss, where the clip is active) of PPO's pessimistic bound
    ``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))``, capped at ``-A * dual_clip`` where A < 0."""
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.max(pg1, pg2)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        loss = torch.where(advantages < 0, torch.min(loss, -advantages * dual_clip), loss)
    return loss, pg2 > pg1


def _masked_inputs(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, action_mask: Tensor, loss_mask: Tensor | None
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logprobs, log_ratio to the old policy, advantages), each selected on ``action_mask`` before any
    arithmetic (0 elsewhere, whatever the padding holds), and ``loss_mask`` (default ``action_mask``)."""
    logprobs, old_logprobs = select(logprobs, action_mask), select(old_logprobs, action_mask)
    loss_mask = action_mask if loss_mask is None else loss_mask
    return logprobs, logprobs - old_logprobs, select(advantages, action_mask), loss_mask


def _weighted(per_token: Tensor, weights: Tensor | None, action_mask: Tensor) -> Tensor:
    """Each action's loss term times its off-policy weight (the rollout correction, utils.math.ops.
    rollout_correction_weights: detached, >= 0; 0 removes the term but keeps the action in the
    aggregation's count); unchanged when ``weights`` is None."""
    return per_token if weights is None else per_token * select(weights.detach(), action_mask)


def _policy_stats(log_ratio: Tensor, clipped: Tensor, loss_mask: Tensor) -> Dict[str, Tensor]:
    """The stats every policy loss returns (detached): ``clipfrac``, the fraction of ``loss_mask``'s actions
    whose clip is active; ``approx_kl``, the masked mean of k2 ``0.5 * log_ratio**2`` of KL(old || new) (a drift
    monitor); ``log_ratio_max_abs``, max |per-token log-ratio| over every action (``log_ratio`` is 0 elsewhere)."""
    with torch.no_grad():
        lr = log_ratio.detach()
        return {
            "clipfrac": masked_mean(clipped.float(), loss_mask),
            "approx_kl": masked_mean(0.5 * lr**2, loss_mask),
            "log_ratio_max_abs": lr.abs().max() if lr.numel() else lr.new_zeros(()),
        }


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    cliprange: float = 0.2,
    loss_mask: Tensor | None = None,
    loss_agg: str = "token_mean",
    agg_constant: float | None = None,
    *,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO clipped surrogate over the actions of the mini-batch, aggregated by ``loss_agg``
    (utils.math.ops.aggregate: token mean by default, per-sequence mean, or Dr. GRPO's constant).

    ``ratio = exp(logprobs - old_logprobs)`` is ALWAYS against the old (rollout-time) policy,
    never the reference model; at the first PPO epoch it is exactly 1.
    ``loss = agg(max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)))`` (Schulman et al. 2017,
    1707.06347): the pessimistic bound removes the incentive to move the ratio outside the trust region
    in the direction the advantage favours. ``eps_low`` / ``eps_high`` are ``cliprange_low`` /
    ``cliprange_high``, each ``cliprange`` when None; a larger ``eps_high`` is DAPO's clip-higher
    (Yu et al. 2025, 2503.14476, 0.28): low-probability tokens with a positive advantage may grow further,
    which keeps the entropy from collapsing.
    ``dual_clip`` C > 1 (Ye et al. 2020, 1912.09729; OpenRLHF's and veRL's ``clip_ratio_c``, 3): where
    A < 0 the bound above is ``-A * ratio`` for a large ratio, unbounded; it is capped,
    ``min(max(pg1, pg2), -A * C)``, so one token the policy already made much likelier cannot dominate
    the step (its gradient is 0 where the cap is active).
    ``loss_mask`` (default ``action_mask``): the actions that enter the loss; rows dropped from
    training (a truncated answer, a group without signal) are 0 there but still 1 in
    ``action_mask``, whose log-ratio is still measured. Stats: ``_policy_stats`` (``clipfrac``: the
    clipped term is the active one). ``weights``: each action's off-policy weight, multiplying its
    term (``_weighted``; every policy loss takes them).
    """
    low = cliprange if cliprange_low is None else cliprange_low
    high = cliprange if cliprange_high is None else cliprange_high
    _, log_ratio, advantages, loss_mask = _masked_inputs(logprobs, old_logprobs, advantages, action_mask, loss_mask)
    per_token, clipped = _clipped_surrogate(torch.exp(log_ratio), advantages, low, high, dual_clip)
    per_token = _weighted(per_token, weights, action_mask)
    return aggregate(per_token, loss_mask, loss_agg, agg_constant), _policy_stats(log_ratio, clipped, loss_mask)


GSPO_CLIPRANGE_LOW, GSPO_CLIPRANGE_HIGH = 3e-4, 4e-4  # the ranges of the GSPO paper's experiments (2507.18071)


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    loss_mask: Tensor | None = None,
    loss_agg: str = "seq_mean",
    agg_constant: float | None = None,
    *,
    cliprange_low: float | None = None,
    cliprange_high: float | None = None,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, 2507.18071): the clipped surrogate on the SEQUENCE's importance ratio
    ``s_i = exp(mean over row i's actions of (logprobs - old_logprobs))`` (the length-normalised
    sequence likelihood ratio), in the paper's per-token form GSPO-token:
    ``s_i,t = sg[s_i] * pi_t / sg[pi_t]``, whose value is ``s_i`` on every action and whose gradient
    reaches each token's log-prob; ``loss = agg(max(-A_t * s_i,t, -A_t * clip(s_i,t, 1 - eps_low,
    1 + eps_high)))``. With one advantage per sequence and ``seq_mean`` aggregation (the default
    here, and the paper's 1/|y_i| sum) its gradient is exactly GSPO's sequence-level one.
    Why: a token-level ratio is one noisy sample of an importance weight; the sequence's mean
    log-ratio matches the unit the reward is given at, and is clipped whole (the paper: far more
    tokens clipped than PPO, and stabler training, notably of MoE models).
    ``eps_low`` / ``eps_high``: ``cliprange_low`` / ``cliprange_high``, the paper's 3e-4 / 4e-4 when
    None (a mean log-ratio moves far less than one token's; --cliprange does not apply).
    ``dual_clip`` as in ``policy_loss``. The sequence ratio is over ``action_mask`` (every action of
    the row), the loss over ``loss_mask``. Stats: ``_policy_stats`` on the per-token log-ratio
    (``clipfrac``: the fraction of actions whose sequence is clipped).
    """
    low = GSPO_CLIPRANGE_LOW if cliprange_low is None else cliprange_low
    high = GSPO_CLIPRANGE_HIGH if cliprange_high is None else cliprange_high
    logprobs, log_ratio, advantages, loss_mask = _masked_inputs(
        logprobs, old_logprobs, advantages, action_mask, loss_mask
    )
    sequence_log_ratio = masked_mean(log_ratio.detach(), action_mask, dim=-1).unsqueeze(-1)
    ratio = torch.exp(sequence_log_ratio + logprobs - logprobs.detach())
    per_token, clipped = _clipped_surrogate(ratio, advantages, low, high, dual_clip)
    per_token = _weighted(per_token, weights, action_mask)
    return aggregate(per_token, loss_mask, loss_agg, agg_constant), _policy_stats(log_ratio, clipped, loss_mask)


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    cliprange: float = 0.2,
    loss_mask: Tensor | None = None,
    loss_agg: str = "token_mean",
    agg_constant: float | None = None,
    *,
    cliprange_high: float | None = None,
    weights: Tensor | None = None,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """CISPO (MiniMax-M1, 2506.13585): ``loss = agg(-sg(min(ratio, 1 + eps_high)) * A * logprobs)``,
    token mean by default (the paper's 1 / sum |o_i|). The importance weight is clipped and detached
    and multiplies a REINFORCE term, so every token keeps a gradient, ``-sg(w) * A``, however far its
    ratio moved: PPO's clip zeroes the gradient of exactly the rare tokens ("However", "Wait") whose
    ratio grows fastest, which the paper found carry the reflective behaviour. No lower bound (the
    paper sets eps_low large and tunes only eps_high). ``eps_high``: ``cliprange_high``, ``cliprange``
    when None. The loss VALUE is not a surrogate of the return (it scales with the log-probs); only
    its gradient is. Stats: ``_policy_stats`` (``clipfrac``: the weight is capped).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    logprobs, log_ratio, advantages, loss_mask = _masked_inputs(
        logprobs, old_logprobs, advantages, action_mask, loss_mask
    )
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, max=1.0 + high)
    loss = aggregate(
        _weighted(-weight * advantages * logprobs, weights, action_mask), loss_mask, loss_agg, agg_constant
    )
    return loss, _policy_stats(log_ratio, ratio > 1.0 + high, loss_mask)


def entropy_bonus(
    entropy: Tensor, action_mask: Tensor, loss_agg: str = "token_mean", agg_constant: float | None = None
) -> Tensor:
    """The policy's entropy (nats per token) over the actions, aggregated as the policy loss is; step 3
    subtracts ``--entropy_coef`` times it from the actor loss (OpenRLHF's ``entropy_coef``, veRL's
    ``entropy_coeff``), which pushes against the entropy collapse of RL on a few answers."""
    return aggregate(select(entropy, action_mask), action_mask, loss_agg, agg_constant)


@dataclass(frozen=True)
class PolicyLoss:
    """One `--policy_loss` of step 3: `fn(logprobs, old_logprobs, advantages, action_mask, *, loss_mask,
    loss_agg, agg_constant, weights, **options) -> (loss, stats)` (`weights`: the rollout correction's
    per-action off-policy weights or None, multiplying each action's term) with stats `clipfrac`, `approx_kl`,
    `log_ratio_max_abs` (tensors); `options` names the RL settings (PPOConfig fields, flags of the same
    name) it reads besides those; `help` is the flag's one line; `loss_agg`: its own default of
    `--loss_agg` (None: the advantage estimator's)."""

    fn: Callable[..., Tuple[Tensor, Dict[str, Tensor]]]
    help: str
    options: Tuple[str, ...] = ()
    loss_agg: str | None = None


# A new policy loss is one entry here and its pure function above (with a hand-computed test).
POLICY_LOSSES: Dict[str, PolicyLoss] = {
    "ppo": PolicyLoss(
        policy_loss,
        "PPO's clipped surrogate, ratio against the rollout-time policy clipped to "
        "[1 - --cliprange_low, 1 + --cliprange_high] (Schulman et al. 2017; clip-higher: "
        "DAPO), optional --dual_clip",
        options=("cliprange", "cliprange_low", "cliprange_high", "dual_clip"),
    ),
    "gspo": PolicyLoss(
        gspo_loss,
        "GSPO's surrogate on the sequence ratio exp(mean log-ratio), clipped to "
        "[1 - 3e-4, 1 + 4e-4] unless --cliprange_low/high say otherwise, sequence mean "
        "(Zheng et al. 2025)",
        options=("cliprange_low", "cliprange_high", "dual_clip"),
        loss_agg="seq_mean",
    ),
    "cispo": PolicyLoss(
        cispo_loss,
        "CISPO's REINFORCE term weighted by the detached ratio capped at "
        "1 + --cliprange_high, token mean (MiniMax-M1 2025)",
        options=("cliprange", "cliprange_high"),
        loss_agg="token_mean",
    ),
}


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor, cliprange_value: float
) -> Tuple[Tensor, Dict[str, Tensor]]:
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


KL_LOSS_ESTIMATORS = ("k2", "k3")


def kl_penalty_loss(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    action_mask: Tensor,
    loss_agg: str = "token_mean",
    agg_constant: float | None = None,
    estimator: str = "k3",
    old_logprobs: Tensor | None = None,
) -> Tensor:
    """KL(actor || reference) as a loss term (GRPO-style), aggregated as the policy loss is.

    ``k2`` (step 3's default, ``--kl_loss_estimator``): ``sg(pi / pi_old) * 0.5 * (logprobs - ref)**2``.
    Its gradient, ``sg(pi / pi_old) * (log pi - log ref) * grad log pi``, averaged over tokens drawn
    from pi_old is exactly grad KL(pi || ref): on-policy because E_pi[grad log pi] = 0, off-policy
    (later mini-batches and PPO epochs, samples from the rollout's pi_old) thanks to the detached
    importance weight (OpenRLHF's ``unbiased_gradient``, #1309; the weight is 1 while the policy is
    the rollout's, and omitted without ``old_logprobs``). Not clamped: a clamp would bias it again.
    ``k3``: ``exp(ref - logprobs) - 1 + logprobs - ref``, an unbiased VALUE of KL(pi || ref) but a
    biased loss: its expected gradient is ``-E_pi[(ref / pi) grad log pi] = grad KL(ref || pi)``, the
    reverse direction (OpenRLHF #1101, open-instruct #534); kept for the runs that used it (and this
    function's default, its former only form).
    Differentiable w.r.t. ``logprobs`` only (reference and old policy are constants). An ALTERNATIVE
    to the in-reward penalty of step 3's reward shaping; the two are not used together (that would
    penalise KL twice).
    """
    if estimator not in KL_LOSS_ESTIMATORS:
        raise ValueError(f"unknown KL loss estimator {estimator!r}; choose from {', '.join(KL_LOSS_ESTIMATORS)}")
    logprobs, ref_logprobs = select(logprobs, action_mask), select(ref_logprobs.detach(), action_mask)
    if estimator == "k3":
        return aggregate(kl_estimate(logprobs, ref_logprobs, "k3"), action_mask, loss_agg, agg_constant)
    per_token = kl_estimate(logprobs, ref_logprobs, "k2")
    if old_logprobs is not None:
        per_token = torch.exp(logprobs.detach() - select(old_logprobs.detach(), action_mask)) * per_token
    return aggregate(per_token, action_mask, loss_agg, agg_constant)


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


def _per_token(p: PairLogps) -> Tuple[Tensor, Tensor]:
    """The responses' average log-prob per token (fp32): the length-normalised sequence scores."""
    return (
        p.chosen.float() / p.chosen_tokens.float().clamp(min=1.0),
        p.rejected.float() / p.rejected_tokens.float().clamp(min=1.0),
    )


def simpo_pair_loss(p: PairLogps, beta: float, simpo_gamma: float = 0.5) -> Tuple[Tensor, Tensor, Tensor]:
    """SimPO (Meng et al. 2024, arXiv 2405.14734): ``-log sigmoid(beta * (avg_c - avg_r) - gamma)`` with
    ``avg`` a response's log-prob per token: the reward is the policy's own length-normalised likelihood,
    no reference model at all, and ``gamma`` a target margin (TRL's CPO `simpo_gamma`). The paper's
    beta is 2-2.5 (the default here when --beta is not given), gamma 0.5-1.6. Rewards ``beta * avg``."""
    chosen, rejected = _per_token(p)
    return -F.logsigmoid(beta * (chosen - rejected) - simpo_gamma), beta * chosen, beta * rejected


def orpo_pair_loss(p: PairLogps, beta: float, orpo_lambda: float = 0.1) -> Tuple[Tensor, Tensor, Tensor]:
    """ORPO (Hong et al. 2024, arXiv 2403.07691), its odds-ratio term: ``-lambda log sigmoid(log odds_c -
    log odds_r)``, ``odds(y) = P / (1 - P)`` with ``P = exp(avg)`` the response's per-token likelihood, so
    ``log odds = avg - log(1 - exp(avg))``. No reference; the full ORPO loss adds the chosen responses' NLL
    per token (the entry's `nll_coef` 1: the SFT term). `beta` is not read. Rewards: ``avg`` of each."""
    chosen, rejected = _per_token(p)
    # log(1 - exp(avg)) for avg < 0; avg == 0 (P = 1) would be -inf: clamp just below
    log_odds = (
        chosen
        - torch.log1p(-torch.exp(chosen.clamp(max=-1e-6)))
        - rejected
        + torch.log1p(-torch.exp(rejected.clamp(max=-1e-6)))
    )
    return -orpo_lambda * F.logsigmoid(log_odds), chosen, rejected


@dataclass(frozen=True)
class UnpairedLogps:
    """SEQUENCE log-probs [B] of unpaired examples (KTO) under the policy and the reference, their labels
    (``desirable`` [B] bool: thumbs-up) and the batch's reference point ``z0`` (``kto_reference_point``)."""

    logps: Tensor
    ref_logps: Tensor
    desirable: Tensor
    z0: Tensor


def kto_reference_point(kl_logps: Tensor, ref_kl_logps: Tensor, reduce: Callable | None = None) -> Tensor:
    """KTO's reference point z0 = max(0, mean KL(policy || reference)), estimated as in the paper from
    MISMATCHED (prompt, completion) rows of the batch (each prompt with another example's completion,
    so the estimate reads the policy's drift, not the batch's own labels): the mean of ``logp - ref_logp``
    over those rows, clamped at 0, detached (no gradient flows through z0). ``reduce([sum, count]) ->
    [sum, count]`` sums over ranks first (utils.runtime.distributed.all_reduce_sum), so every rank uses one z0."""
    diff = kl_logps.detach().double() - ref_kl_logps.detach().double()
    totals = [diff.sum().item(), float(diff.numel())]
    if reduce is not None:
        totals = reduce(totals)
    return torch.tensor(max(totals[0] / max(totals[1], 1.0), 0.0), dtype=torch.float32, device=kl_logps.device)


def kto_loss(
    p: UnpairedLogps, beta: float, kto_desirable_weight: float = 1.0, kto_undesirable_weight: float = 1.0
) -> Tuple[Tensor, Tensor]:
    """KTO (Ethayarajh et al. 2024, arXiv 2402.01306), per example: with ``r = logp - ref_logp`` (the
    implicit reward over beta) and z0 the reference point, a desirable example costs
    ``w_d * (1 - sigmoid(beta * (r - z0)))``, an undesirable one ``w_u * (1 - sigmoid(beta * (z0 - r)))``:
    a prospect-theory value, saturating, so each kind is pushed away from z0 without a paired other.
    ``w_d``, ``w_u`` (the paper: keep ``w_d * n_d / (w_u * n_u)`` in [1, 4/3]) balance unequal counts.
    Returns (losses [B], rewards ``beta * r`` [B]); TRL's KTOTrainer computes the same."""
    ratio = p.logps.float() - p.ref_logps.detach().float()
    z0 = p.z0.detach().float()
    desirable = p.desirable.bool()
    losses = torch.where(
        desirable,
        kto_desirable_weight * (1 - torch.sigmoid(beta * (ratio - z0))),
        kto_undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratio))),
    )
    return losses, beta * ratio


def unpaired_stats(rewards: Tensor, desirable: Tensor) -> Dict[str, Tensor]:
    """Sums and counts of the implicit rewards of each kind (detached), so that means over micro-batches
    and ranks stay exact; an accuracy is not defined without pairs."""
    rewards, desirable = rewards.detach().float(), desirable.bool()
    return {
        "desirable_reward_sum": rewards[desirable].sum(),
        "desirable_count": desirable.sum().float(),
        "undesirable_reward_sum": rewards[~desirable].sum(),
        "undesirable_count": (~desirable).sum().float(),
    }


@dataclass(frozen=True)
class PairOption:
    """A setting of one pair loss, offered as the DPO step's flag `--<name>`; `minimum` (with `strict`: >)
    its lower bound and `below` its exclusive upper one: the flag's range (checked as it is parsed)."""

    default: float
    help: str
    minimum: float | None = None
    strict: bool = False
    below: float | None = None


@dataclass(frozen=True)
class PairLoss:
    """One `--loss_type` of the DPO step: `fn(pairs: PairLogps, beta, **options) -> (losses [B], chosen
    rewards [B], rejected rewards [B])` (the rewards detached by the caller: the implicit rewards whose
    accuracy and margin are reported). `needs_reference`: False for a reference-free loss (no reference
    model, no reference log-probs); `needs_lengths`: the responses' token counts are filled in;
    `options`: its own settings, each a flag of the DPO step; `default_beta`: --beta when not given;
    `nll_coef`: the chosen responses' NLL per token is part of the loss with this weight (ORPO's SFT
    term; --nll_loss_coef is then refused); `reads_beta` False: --beta is refused (ORPO). `unpaired`:
    the loss reads single labelled examples, not pairs (KTO): `fn(examples: UnpairedLogps, beta,
    **options) -> (losses [B], rewards [B])`, through `unpaired_loss`."""

    fn: Callable[..., Tuple[Tensor, Tensor, Tensor]]
    help: str
    needs_reference: bool = True
    needs_lengths: bool = False
    options: Dict[str, PairOption] = field(default_factory=dict)
    default_beta: float = 0.1
    nll_coef: float = 0.0
    reads_beta: bool = True
    unpaired: bool = False


# A new pair loss (SimPO, ORPO, ...) is one entry here and its pure function above (with a hand-computed test).
PAIR_LOSSES: Dict[str, PairLoss] = {
    "sigmoid": PairLoss(
        sigmoid_pair_loss,
        "DPO's -log sigmoid(beta * margin of log-ratios) (Rafailov et al. 2023)",
        options={
            "label_smoothing": PairOption(
                0.0, "conservative DPO: the probability that a pair's label is flipped, in [0, 0.5)", 0.0, below=0.5
            )
        },
    ),
    "ipo": PairLoss(ipo_pair_loss, "IPO's squared target margin 1 / (2 beta) (Azar et al. 2023)"),
    "simpo": PairLoss(
        simpo_pair_loss,
        "SimPO's -log sigmoid(beta * margin of per-token log-probs - gamma), no "
        "reference (Meng et al. 2024; --beta default 2.0)",
        needs_reference=False,
        needs_lengths=True,
        default_beta=2.0,
        options={
            "simpo_gamma": PairOption(
                0.5, "SimPO's target margin gamma between the beta-scaled per-token log-probs (>= 0)", minimum=0.0
            )
        },
    ),
    "orpo": PairLoss(
        orpo_pair_loss,
        "ORPO's chosen NLL per token + lambda * -log sigmoid(log odds ratio of the "
        "per-token likelihoods), no reference (Hong et al. 2024; no --beta)",
        needs_reference=False,
        needs_lengths=True,
        nll_coef=1.0,
        reads_beta=False,
        options={
            "orpo_lambda": PairOption(
                0.1, "ORPO's weight lambda of the odds-ratio term against the NLL (> 0)", minimum=0.0, strict=True
            )
        },
    ),
    "kto": PairLoss(
        kto_loss,
        "KTO's 1 - sigmoid(beta * (log-ratio - z0)) of unpaired desirable / undesirable examples "
        "(their sign flipped), z0 the policy's KL to the reference on mismatched pairs (Ethayarajh et al. "
        "2024; rows {prompt, completion, label}, or pairs: one of each)",
        unpaired=True,
        options={
            "kto_desirable_weight": PairOption(
                1.0, "KTO's weight of the desirable examples' loss (> 0)", minimum=0.0, strict=True
            ),
            "kto_undesirable_weight": PairOption(
                1.0, "KTO's weight of the undesirable examples' loss (> 0)", minimum=0.0, strict=True
            ),
        },
    ),
}
DPO_LOSS_TYPES = tuple(PAIR_LOSSES)


def pair_loss(pairs: PairLogps, beta: float, loss_type: str = "sigmoid", **options) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Mean preference loss of a batch of pairs by the `PAIR_LOSSES` entry `loss_type` (its own options by
    name), with the implicit-reward stats (detached): the mean chosen and rejected rewards, the fraction
    of pairs whose chosen reward is higher, and their mean margin."""
    _check_loss(loss_type, beta, unpaired=False)
    losses, chosen_rewards, rejected_rewards = PAIR_LOSSES[loss_type].fn(pairs, beta, **options)
    with torch.no_grad():
        chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
        stats = {
            "chosen_reward": chosen_rewards.mean(),
            "rejected_reward": rejected_rewards.mean(),
            "accuracy": (chosen_rewards > rejected_rewards).float().mean(),
            "margin": (chosen_rewards - rejected_rewards).mean(),
        }
    return losses.mean(), stats


def unpaired_loss(
    examples: UnpairedLogps, beta: float, loss_type: str = "kto", **options
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Mean loss of a batch of unpaired examples by the `PAIR_LOSSES` entry `loss_type` (one with
    `unpaired`), with the stats of `unpaired_stats` and z0."""
    _check_loss(loss_type, beta, unpaired=True)
    losses, rewards = PAIR_LOSSES[loss_type].fn(examples, beta, **options)
    stats = unpaired_stats(rewards, examples.desirable)
    stats["z0"] = examples.z0.detach().float()
    return losses.mean(), stats


def _check_loss(loss_type: str, beta: float, unpaired: bool) -> None:
    if loss_type not in PAIR_LOSSES:
        raise ValueError(f"unknown DPO loss type {loss_type!r}; choose from {', '.join(PAIR_LOSSES)}")
    if PAIR_LOSSES[loss_type].unpaired != unpaired:
        raise ValueError(
            f"loss type {loss_type!r} reads {'unpaired examples' if not unpaired else 'pairs'}: "
            f"use {'unpaired_loss' if not unpaired else 'pair_loss'}"
        )
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")


def dpo_loss(
    chosen_logps: Tensor,
    rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    **options,
) -> Tuple[Tensor, Dict[str, Tensor]]:
    """`pair_loss` of pairs scored against a reference (every loss of the DPO family that has one)."""
    return pair_loss(
        PairLogps(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps), beta, loss_type, **options
    )


def response_nll(logps: Tensor, token_counts: Tensor) -> Tensor:
    """Mean NLL per response token over a batch: ``-sum(logps) / sum(token_counts)`` from sequence
    log-probs [B] and their token counts [B]. DPO's optional term on the chosen responses
    (``--nll_loss_coef``; TRL's ``rpo_alpha``, OpenRLHF's ``--nll_loss_coef``): it keeps the
    chosen answers' likelihood from falling while the margin grows."""
    return -logps.float().sum() / token_counts.float().sum().clamp(min=1.0)
