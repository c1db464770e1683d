"""Several reward components' scores -> one sequence reward per row (`--reward_weights`, `--reward_norm`), and
the groups whose rewards carry no signal. Pure tensors: the group statistics are the estimators' own
(step3_ppo/algo/advantages.py)."""

from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import Tensor

from step3_ppo.algo.advantages import group_normalized, group_stats

REWARD_NORMS = ("sum_then_normalize", "normalize_then_sum")


def combine(
    scores: Dict[str, Tensor],
    weights: Sequence[float] | None = None,
    group_ids: Tensor | None = None,
    mode: str = "sum_then_normalize",
) -> Tensor:
    """One sequence reward [B] of several reward components' scores ([B] each, by name).

    ``sum_then_normalize``: the weighted sum (weights 1.0 by default, in ``scores``' order); the
    estimator's baseline then normalises the sum (GRPO's z-score in the group). ``normalize_then_sum``
    (GDPO, Liu et al. 2026, 2601.05242; TRL's ``multi_objective_aggregation``): each component is first
    z-scored within its group, ``(r_k - group mean) / (group std + 1e-6)`` (``group_normalized``), then
    weighted and summed. Why: normalising only the sum maps distinct combinations to the same
    advantage (answers scoring (1, 0) and (0, 1) on two rewards both sum to 1), and a component with
    a large spread drowns the others; normalised apart, each reward's ordering counts in its own units.
    NaN (a skipped score) stays NaN, on its own row only: each component's group statistics are over
    its finite scores.
    """
    if not scores:
        raise ValueError("combine: no reward scores to combine")
    if mode not in REWARD_NORMS:
        raise ValueError(f"unknown reward normalisation {mode!r}; choose from {', '.join(REWARD_NORMS)}")
    names = list(scores)
    if weights is None:
        weights = [1.0] * len(names)
    if len(weights) != len(names):
        raise ValueError(
            f"--reward_weights has {len(weights)} values, expected {len(names)} (one per reward: {', '.join(names)})"
        )
    shapes = {tuple(t.shape) for t in scores.values()}
    if len(shapes) != 1:
        raise ValueError(f"combine: reward scores of different shapes {sorted(shapes)}")
    if mode == "normalize_then_sum" and group_ids is None:
        raise ValueError("combine: normalize_then_sum needs the rows' group ids")
    total = torch.zeros(shapes.pop(), dtype=torch.float32)
    for name, weight in zip(names, weights):
        part = scores[name].detach().float().cpu()
        if mode == "normalize_then_sum":
            finite, normalized = ~torch.isnan(part), torch.full_like(part, float("nan"))
            normalized[finite] = group_normalized(part[finite], group_ids.cpu()[finite])
            part = normalized
        total = total + float(weight) * part
    return total


def zero_variance_groups(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Rows [B] (bool) whose group has more than one row and all rewards equal: with a group
    baseline their advantages are all 0, so they carry no signal (DAPO's dynamic sampling drops
    them)."""
    _, std, size = group_stats(scores, group_ids)
    return (size > 1) & (std == 0)
