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
