"""Advantage estimators of step 3, chosen by name in ONE place (pure tensors, no models).

`ESTIMATORS` maps a name (`--advantage_estimator`, OpenRLHF's names accepted as aliases) to an
`Estimator`: the per-row baseline its sequence reward gets (GRPO's group normalisation, RLOO's
leave-one-out, ...), whether it needs a critic (step 3 builds, scores and trains one only then),
whether its advantages are whitened, and its default loss aggregation. The per-token layout is
utils/math/ops.py's. Before the baseline, step3_ppo/rewards/combine.py makes one sequence reward of several
reward components (`--reward_weights`, `--reward_norm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Tuple

import torch
from torch import Tensor

from utils.math.ops import select


def gae_advantages_and_returns(
    values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float, lam: float
) -> Tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over the action positions of each row.

    ``delta_t = r_t + gamma * V_{t+1} - V_t``, ``A_t = delta_t + gamma*lam*A_{t+1}``, where the
    step after a row's last action is terminal (``V = 0``, ``A = 0``). Why masking by the *next*
    action: rows end at different places (EOS then padding) and start at different offsets
    (left padding); whatever sits in padding must neither bootstrap the last action nor leak into
    the recursion. A multi-turn row has an environment's tokens (mask 0) between its turns: the
    recursion steps over them, so a turn's last action bootstraps from the next turn's first
    (the episode goes on) and only the row's last action is terminal. Outputs are 0 outside the mask; ``returns =
    advantages + values`` on actions (the critic's regression target). Both are detached. Vectorised over the batch,
    sequential over time.
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
            # next_*: the next action's (0 after the row's last action); non-actions carry them over
            delta = r[..., t] + gamma * next_v * next_m - v[..., t]
            a_t = delta + gamma * lam * next_adv * next_m
            here = m[..., t]
            adv[..., t] = torch.where(here, a_t, torch.zeros_like(a_t))
            next_adv = torch.where(here, a_t, next_adv)
            next_v = torch.where(here, v[..., t], next_v)
            next_m = torch.where(here, torch.ones_like(next_m), next_m)
        returns = select(adv + v, m)
        out_dtype = values.dtype if values.is_floating_point() else adv.dtype
        return adv.to(out_dtype), returns.to(out_dtype)


# --------------------------------------------------------------------------- critic-free: per-row baselines
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


def group_normalized(scores: Tensor, group_ids: Tensor, scale_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al. 2024): ``(r_i - mean_group) / (std_group + eps)`` per row.
    ``scale_by_std=False`` is Dr. GRPO's (Liu et al. 2025) and REINFORCE++-baseline's centring: no
    division, which would weight the groups whose answers barely differ the most. A group of
    equal rewards gets 0."""
    mean, std, _ = group_stats(scores, group_ids)
    centred = scores.float() - mean
    return centred / (std + eps) if scale_by_std else centred


def leave_one_out(scores: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j`` over row i's group; the baseline
    leaves the row itself out, so it is unbiased. A group of one gets 0."""
    mean, _, size = group_stats(scores, group_ids)
    others = (mean * size - scores.float()) / (size - 1).clamp(min=1)
    return torch.where(size > 1, scores.float() - others, torch.zeros_like(mean))


def returns_to_go(rewards: Tensor, action_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """The discounted sum of the per-token rewards (KL penalty on every action, the sequence
    reward on the last) from each action to its row's end; 0 outside the mask. The advantage of
    every critic-free estimator (REINFORCE++, Hu 2025; and, with no KL in the reward, the group
    advantage itself on every action). An environment's tokens between two turns (mask 0) are
    stepped over: a turn's actions get the rest of the episode's rewards."""
    m = action_mask != 0
    r = select(rewards.float(), m)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[..., 0])
    for t in range(r.shape[-1] - 1, -1, -1):
        running = torch.where(m[..., t], r[..., t] + gamma * running, running)
        out[..., t] = torch.where(m[..., t], running, torch.zeros_like(running))
    return out


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator.

    ``baseline(scores, group_ids) -> [B]``: the sequence reward each row's last action gets (None:
    the score as it is); the per-token rewards (that, plus the KL penalty) then give the
    advantages: GAE on the critic's values when ``needs_critic``, else the return-to-go.
    ``whiten``: advantages whitened over the rollout (``--no_whiten_advantages`` turns it off).
    ``loss_agg``: the default of ``--loss_agg``.
    """

    baseline: Callable[[Tensor, Tensor], Tensor] | None
    needs_critic: bool
    whiten: bool
    loss_agg: str
    help: str
    groups: bool = False  # the baseline compares the samples of a prompt: needs --n_samples_per_prompt > 1


def advantages_and_returns(
    estimator: Estimator, values: Tensor, rewards: Tensor, action_mask: Tensor, gamma: float, lam: float
) -> Tuple[Tensor, Tensor]:
    """(advantages, returns) of per-token rewards: GAE with a critic, else the return-to-go (both)."""
    if estimator.needs_critic:
        return gae_advantages_and_returns(values, rewards, action_mask, gamma, lam)
    returns = returns_to_go(rewards, action_mask, gamma)
    return returns, returns


ESTIMATORS = {
    "gae": Estimator(
        None,
        needs_critic=True,
        whiten=True,
        loss_agg="token_mean",
        help="GAE(gamma, lambda) on a critic's values (PPO, InstructGPT; the default)",
    ),
    "grpo": Estimator(
        group_normalized,
        needs_critic=False,
        whiten=False,
        loss_agg="seq_mean",
        groups=True,
        help="GRPO: (r - group mean) / group std, no critic; loss per-sequence mean",
    ),
    "dr_grpo": Estimator(
        lambda r, g: group_normalized(r, g, scale_by_std=False),
        needs_critic=False,
        whiten=False,
        loss_agg="constant_norm",
        groups=True,
        help="Dr. GRPO: r - group mean, no std; token sums over the max answer length",
    ),
    "rloo": Estimator(
        leave_one_out,
        needs_critic=False,
        whiten=False,
        loss_agg="token_mean",
        groups=True,
        help="RLOO: r - mean of the group's other samples",
    ),
    "reinforce_pp": Estimator(
        None,
        needs_critic=False,
        whiten=True,
        loss_agg="token_mean",
        help="REINFORCE++: return-to-go of score + per-token KL penalty, whitened over the batch",
    ),
    "reinforce_pp_baseline": Estimator(
        lambda r, g: group_normalized(r, g, scale_by_std=False),
        needs_critic=False,
        whiten=True,
        loss_agg="token_mean",
        groups=True,
        help="REINFORCE++ with the group mean subtracted from the score first",
    ),
}
# OpenRLHF's names for the same estimators
ALIASES = {"group_norm": "grpo", "reinforce": "reinforce_pp", "reinforce_baseline": "reinforce_pp_baseline"}


def estimator_name(name: str) -> str:
    """The canonical name of ``name`` (an OpenRLHF alias resolved)."""
    name = ALIASES.get(name, name)
    if name not in ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; choose from {', '.join(list(ESTIMATORS) + list(ALIASES))}"
        )
    return name


def get_estimator(name: str) -> Estimator:
    return ESTIMATORS[estimator_name(name)]


def needs_critic(name: str) -> bool:
    """Whether step 3 needs a critic (its engine, its no-grad values and its training) for `name`."""
    return get_estimator(name).needs_critic
