"""Advantage estimators of step 3, chosen by name in ONE place (pure tensors, no models).

`ESTIMATORS` maps a name (`--advantage_estimator`) to a function of the rollout's per-token
tensors (layout of utils/ops.py) returning `(advantages, returns)`, and says whether the
estimator needs a critic: step 3 builds, scores and trains a critic only when `needs_critic`.
GAE is today's estimator; a critic-free one (GRPO, RLOO, REINFORCE++) is one more entry here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch
from torch import Tensor

from utils.ops import select


def gae_advantages_and_returns(values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float,
                               lam: float) -> Tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the action positions of each row.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma*lam*A_{t+1}``, where the
    step after a row's last action is terminal (``V = 0``, ``A = 0``). Why masking by the *next*
    position: rows end at different places (EOS then padding) and start at different offsets
    (left padding); whatever sits in padding must neither bootstrap the last action nor leak into
    the recursion. Outputs are 0 outside the mask; ``returns = advantages + values`` on actions
    (the critic's regression target). Both are detached. Vectorised over the batch, sequential
    over time.
    """
    with torch.no_grad():
        m = action_mask != 0
        v = select(values.float(), m)
        r = select(rewards.float(), m)
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
        returns = select(adv + v, m)
        out_dtype = values.dtype if values.is_floating_point() else adv.dtype
        return adv.to(out_dtype), returns.to(out_dtype)


# --------------------------------------------------------------------------- critic-free (issue 16: pure parts;
# the trainer does not offer them yet: it still passes per-token rewards only, not scores and group ids)
def group_stats(scores: Tensor, group_ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(mean, unbiased std, size) of each row's group, per row [B]. Rows of a group share an id
    (the n samples of one prompt); a group of one has std 0. Unbiased (Bessel), as OpenRLHF's and
    TRL's GRPO use ``Tensor.std``."""
    scores = scores.float()
    _, inverse = torch.unique(group_ids, return_inverse=True)
    groups = int(inverse.max()) + 1 if inverse.numel() else 0
    size = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, torch.ones_like(scores))
    total = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = (total / size)[inverse]
    squares = torch.zeros(groups, dtype=scores.dtype).index_add_(0, inverse, (scores - mean) ** 2)
    var = squares / (size - 1).clamp(min=1)
    return mean, var.sqrt()[inverse], size[inverse]


def _on_actions(per_row: Tensor, action_mask: Tensor) -> Tensor:
    """A per-row value [B] on every action of its row [B, T], 0 elsewhere."""
    return select(per_row[:, None].expand(action_mask.shape).to(torch.float32), action_mask != 0)


def grpo_advantages(scores: Tensor, group_ids: Tensor, action_mask: Tensor, scale_by_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024): ``(r_i - mean_group) / (std_group + eps)`` on every action of row i.
    ``scale_by_std=False`` is Dr. GRPO's (Liu et al. 2025): no division, which would weight the
    groups whose answers barely differ the most. A group of equal rewards gets 0 everywhere."""
    mean, std, _ = group_stats(scores, group_ids)
    centred = scores.float() - mean
    return _on_actions(centred / (std + eps) if scale_by_std else centred, action_mask)


def rloo_advantages(scores: Tensor, group_ids: Tensor, action_mask: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j`` over row i's group, on every action;
    the baseline leaves the row itself out, so it is unbiased. A group of one gets 0."""
    mean, _, size = group_stats(scores, group_ids)
    others = (mean * size - scores.float()) / (size - 1).clamp(min=1)
    return _on_actions(torch.where(size > 1, scores.float() - others, torch.zeros_like(mean)), action_mask)


def returns_to_go(rewards: Tensor, action_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """REINFORCE++ (Hu 2025): the discounted sum of the per-token rewards (KL penalty on every action,
    the score on the last) from each action to its row's end; 0 outside the mask. The caller whitens
    over the batch (and for ``reinforce_pp_baseline`` subtracts the group mean from the scores first)."""
    m = action_mask != 0
    r = select(rewards.float(), m)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[..., 0])
    for t in range(r.shape[-1] - 1, -1, -1):
        running = torch.where(m[..., t], r[..., t] + gamma * running, torch.zeros_like(running))
        out[..., t] = running
    return out


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator: `compute(values, rewards, action_mask, gamma, lam) -> (advantages, returns)`."""
    compute: Callable[..., Tuple[Tensor, Tensor]]
    needs_critic: bool
    help: str


ESTIMATORS = {
    "gae": Estimator(gae_advantages_and_returns, needs_critic=True,
                     help="GAE(gamma, lambda) on the critic's values (PPO, InstructGPT)"),
}


def get_estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def needs_critic(name: str) -> bool:
    """Whether step 3 needs a critic (its engine, its no-grad values and its training) for `name`."""
    return get_estimator(name).needs_critic
