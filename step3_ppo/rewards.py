"""Where a rollout's sequence rewards come from, behind ONE interface.

A reward is a callable `reward(rows) -> Tensor [B]` (fp32, one score per row) with an `engine`
attribute: the DeepSpeed engine it runs (for the trainer's one-gather inference phase), or None
for a reward that runs no model. The trained reward model of step 2 is today's implementation;
reward functions of (prompt, completion, the row's other fields), as TRL and OpenRLHF take them,
are the next. step3_ppo/shaping.py turns the scores into per-token rewards.
"""
from __future__ import annotations

from typing import Protocol

import torch

from utils.forward import eval_mode, sequence_scores
from utils.rollout import Row, pack


class Reward(Protocol):
    name: str
    engine: object | None

    def __call__(self, rows: list[Row]) -> torch.Tensor: ...


class RewardModelReward:
    """The step-2 reward model's score of prompt + response: its value at the last real token."""

    name = "reward_model"

    def __init__(self, engine, pad_token_id: int):
        self.engine, self.pad_token_id = engine, pad_token_id

    @torch.no_grad()
    def __call__(self, rows: list[Row]) -> torch.Tensor:
        batch = pack(rows, self.pad_token_id)
        with eval_mode(self.engine):
            return sequence_scores(self.engine, batch["input_ids"], batch["attention_mask"]).cpu()
