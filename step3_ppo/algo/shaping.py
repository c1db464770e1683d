"""The per-token reward step 3 optimises, and its coefficients (pure tensors, no models).

`compute_rewards` assembles it: the KL PENALTY, -kl_coef * KL(actor || frozen SFT reference) per
action, plus the sequence score (reward model and/or reward functions, step3_ppo/rewards/components.py, with
`length_penalty` added, clipped by `clip_scores` and an estimator's baseline applied) on the row's
last action. The KL coefficient is fixed or adaptive (the controllers below); scores can be
normalised by running statistics (`RunningMoments`). The PPO clip against the OLD policy is a
different KL and lives in utils/math/losses.py policy_loss.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from utils.math.ops import kl_estimate, last_one_index, select


def clip_scores(scores: Tensor, clip_reward_value: Optional[float]) -> Tensor:
    """The sequence scores clipped to ``±clip_reward_value`` (None: unchanged).

    Why: against reward hacking through outliers, a few rows scored far outside the usual range
    (a reward model extrapolating) would otherwise dominate the advantages of the whole rollout.
    Applied after the optional normalisation and before an estimator's group baseline.
    """
    if clip_reward_value is None:
        return scores
    return scores.clamp(-clip_reward_value, clip_reward_value)


def compute_rewards(
    score: Tensor, logprobs: Tensor, ref_logprobs: Tensor, action_mask: Tensor, kl_coef: float, kl_estimator: str = "k1"
) -> Tuple[Tensor, Tensor]:
    """Per-token rewards: ``-kl_coef * KL`` on every action, plus the score on the last one.

    Why: the reward model only scores whole sequences; the dense KL penalty keeps the policy close
    to the SFT reference at every token. The score (already shaped: `clip_scores`, a baseline) is
    added at the last action of each row (`utils.math.ops.last_one_index`): the EOS action if present,
    else the last generated token of a truncated row.

    Returns ``(rewards, kl)``, both ``[B, L-1]`` and 0 outside the mask. Intended to be called
    under ``torch.no_grad()`` (rewards are constants).
    """
    kl = select(kl_estimate(logprobs, ref_logprobs, kl_estimator), action_mask)
    rewards = -kl_coef * kl
    score = score.reshape(-1).to(dtype=rewards.dtype, device=rewards.device)
    if score.shape[0] != rewards.shape[0]:
        raise ValueError(f"score has {score.shape[0]} entries, batch has {rewards.shape[0]} rows")
    idx = last_one_index(action_mask)
    rewards = rewards.scatter_add(-1, idx.unsqueeze(-1), score.unsqueeze(-1))
    return rewards, kl


def length_penalty(
    lengths: Tensor,
    ended: Tensor,
    max_len: int,
    overlong_buffer_len: int = 0,
    overlong_penalty_factor: float = 1.0,
    truncation_penalty: float = 0.0,
) -> Tensor:
    """A non-positive addition to each row's sequence reward [B] against the length exploit.

    - DAPO's overlong penalty (Yu et al. 2025): answers longer than ``max_len - overlong_buffer_len``
      tokens lose ``factor * excess / overlong_buffer_len``, up to ``factor`` at ``max_len``; a soft
      ramp instead of a cliff, so a slightly long correct answer is not punished as a wrong one.
    - ``truncation_penalty``: subtracted from rows cut at ``max_len`` without an EOS (``ended``
      False): an unfinished answer is not an answer.
    ``lengths`` counts response tokens, the EOS included.
    """
    lengths = lengths.float()
    penalty = torch.zeros_like(lengths)
    if overlong_buffer_len > 0:
        excess = lengths - (max_len - overlong_buffer_len)
        penalty = penalty - overlong_penalty_factor * (excess / overlong_buffer_len).clamp(0.0, 1.0)
    if truncation_penalty:
        penalty = penalty - truncation_penalty * (~ended.bool()).float()
    return penalty


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

    Why: a fixed coefficient is either too weak early or too strong late; this proportional
    controller steers the measured KL towards ``target``:
    ``e = clip(current_kl / target - 1, -0.2, 0.2)``, ``value *= 1 + e * n_steps / horizon``.
    The clip bounds how fast the coefficient can move on a noisy KL estimate.
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


class RunningMoments:
    """Running mean/std of all scores seen so far (Chan et al. parallel update).

    Why: optional reward normalisation needs stable statistics across rollouts, not just the
    current batch. ``update`` folds a batch in with the parallel-variance formula (exact,
    numerically stable) and returns the batch's own mean and std. ``std`` is the sample (unbiased)
    std over all values seen. Stats are kept as python floats (float64) for checkpoints.
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
