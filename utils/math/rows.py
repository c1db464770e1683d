"""Rollout rows and how they are packed into batches, the same way at rollout, in training and in
evaluation (step 3's PPO and utils/evaluation share them).

A row keeps only real tokens: the prompt without padding, the response up to and including its
first EOS (a multi-turn trajectory: every turn and the environment's replies between them), and one
value per response token (old/ref log-probs, values, rewards, advantages, returns; 0 on an
environment's tokens). Any set of rows is packed into a batch by left-padding prompts and
right-padding responses, with the attention mask marking real tokens and the action mask the
policy's own response tokens. Because
position ids come from the attention mask in every forward, a row's tokens get identical
positions however much padding its batch needs, so log-probs agree between the rollout batch and
any PPO mini-batch (the trlx bug this layout rules out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Row:
    prompt_ids: torch.Tensor  # [p] real prompt tokens
    response_ids: torch.Tensor  # [t] generated tokens up to and including the first EOS
    ended_with_eos: bool
    score: float = 0.0  # the sequence reward of prompt + response (the weighted sum of score_parts)
    per_action: dict = field(default_factory=dict)  # name -> [t] tensor
    group: int = 0  # the samples of one prompt share it (--n_samples_per_prompt); unique within a rank's rollout
    prompt: dict = field(default_factory=dict)  # the prompt row: "prompt" (as given), "origin", "extra" fields
    score_parts: dict = field(default_factory=dict)  # reward component name -> its score (before weighting)
    trained: bool = True  # False: dropped from the loss (truncated, a group without signal, a bad reward)
    # [t] 1 on the policy's tokens, 0 on tokens an environment or tool appended (multi-turn rows,
    # step3_ppo/agents/loop.py); None: every response token is an action (a single answer)
    response_action_mask: torch.Tensor | None = None
    agent: dict | None = None  # a multi-turn trajectory's messages after the prompt and counters (agents.py)
    weight_version: int | None = None  # the policy's optimizer steps when the weights that generated it were synced

    @property
    def length(self) -> int:
        """The row's tokens, prompt and response: what it adds to a padding-free micro-batch."""
        return self.prompt_ids.numel() + self.response_ids.numel()

    @property
    def action_count(self) -> int:
        """The response's actions: its tokens, less those an environment appended."""
        m = self.response_action_mask
        return self.response_ids.numel() if m is None else int(m.sum())


def split_generation(
    sequences: torch.Tensor,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    stop_token_ids,
    samples_per_prompt: int = 1,
) -> list[Row]:
    """Cut `generate` output [B, P+T] into rows: real prompt tokens, response up to the first EOS.

    ``stop_token_ids``: the EOS id, or the ids that end a response (EOS and a chat template's
    end-of-turn token); the response ends at the first of any of them. Tokens after it (HF fills
    finished rows with pad) are dropped, so they are never actions; a response without one
    (length limit reached) keeps all its tokens. With ``samples_per_prompt`` n, ``prompt_ids``
    holds each prompt once and ``sequences`` its n samples one after the other (row i answers
    prompt i // n).
    """
    stops = torch.tensor([stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids))
    sequences, prompt_ids, prompt_mask = sequences.cpu(), prompt_ids.cpu(), prompt_mask.cpu()
    prompt_len = prompt_ids.shape[1]
    rows = []
    for i in range(sequences.shape[0]):
        generated = sequences[i, prompt_len:]
        eos_positions = torch.isin(generated, stops).nonzero().flatten()
        ended = eos_positions.numel() > 0
        response = generated[: eos_positions[0] + 1] if ended else generated
        if response.numel() == 0:
            raise ValueError("generation returned no new token; set --min_answer_seq_len >= 1")
        p = i // samples_per_prompt
        rows.append(
            Row(
                prompt_ids=prompt_ids[p][prompt_mask[p].bool()].clone(),
                response_ids=response.clone(),
                ended_with_eos=bool(ended),
            )
        )
    return rows


def pack(rows: list[Row], pad_token_id: int) -> dict:
    """Batch of rows: input_ids/attention_mask [B, P+T], action_mask [B, P+T-1], loss_mask (the
    action mask of the rows still trained on), and P (CPU tensors).

    Rows and packed batches stay on the CPU: they are small next to the models, live across the
    generation / experience / training phases, and the forward helpers (utils/models/forward.py) move
    each batch to the device of the model that reads it.

    action_mask[b, i] = 1 when token i+1 of row b is one of its actions: a response token the policy
    generated (not one an environment appended: `Row.response_action_mask`), in the per-token layout of
    utils/math/ops.py (position i is about predicting token i+1).
    """
    prompt_len = max(r.prompt_ids.numel() for r in rows)
    response_len = max(r.response_ids.numel() for r in rows)
    length = prompt_len + response_len
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    action_mask = torch.zeros((len(rows), length - 1), dtype=torch.float32)
    for b, row in enumerate(rows):
        p, t = row.prompt_ids.numel(), row.response_ids.numel()
        input_ids[b, prompt_len - p : prompt_len] = row.prompt_ids
        input_ids[b, prompt_len : prompt_len + t] = row.response_ids
        attention_mask[b, prompt_len - p : prompt_len + t] = 1
        action_mask[b, prompt_len - 1 : prompt_len - 1 + t] = (
            1 if row.response_action_mask is None else row.response_action_mask.float()
        )
    trained = torch.tensor([float(r.trained) for r in rows])[:, None]
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "loss_mask": action_mask * trained,
        "prompt_len": prompt_len,
    }


def to_token_layout(rows: list[Row], name: str, prompt_len: int, length: int) -> torch.Tensor:
    """Per-action values of `rows` placed on their action positions of a packed batch [B, length-1]."""
    out = torch.zeros((len(rows), length - 1), dtype=torch.float32)
    for b, row in enumerate(rows):
        values = row.per_action[name]
        out[b, prompt_len - 1 : prompt_len - 1 + values.numel()] = values
    return out


def from_token_layout(rows: list[Row], name: str, values: torch.Tensor, prompt_len: int) -> None:
    """Store a packed batch's per-action values [B, L-1] back into the rows (action positions only)."""
    for b, row in enumerate(rows):
        t = row.response_ids.numel()
        row.per_action[name] = values[b, prompt_len - 1 : prompt_len - 1 + t].detach().float().cpu().clone()


def token_budget_groups(lengths: list[int], budget: int, count: int = 0) -> list[list[int]]:
    """Indices of rows of `lengths` tokens cut into micro-batches of at most `budget` tokens each (padding-free:
    a micro-batch's tokens are its rows' lengths summed), at least `count` of them.

    First fit decreasing: the longest row first, each into the first micro-batch it fits, so that few micro-batches
    are needed; then, while there are fewer than `count` (every rank must run as many micro-batches as the rank
    that needs the most, a collective each), the micro-batch with the most tokens is halved, which keeps every one
    within the budget. Within a micro-batch rows keep their order. Raises ValueError naming a row longer than
    `budget` (it would have to be truncated) and when `count` exceeds the rows.
    """
    if budget < 1:
        raise ValueError(f"the token budget must be >= 1, got {budget}")
    too_long = [(i, n) for i, n in enumerate(lengths) if n > budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"row {i} has {n} tokens, more than the budget of {budget} tokens per micro-batch")
    if count > len(lengths):
        raise ValueError(f"{len(lengths)} rows cannot fill {count} micro-batches")
    groups, totals = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for g, total in enumerate(totals):
            if total + lengths[i] <= budget:
                groups[g].append(i)
                totals[g] += lengths[i]
                break
        else:
            groups.append([i])
            totals.append(lengths[i])
    while len(groups) < max(count, 1 if lengths else 0):
        g = max((g for g in range(len(groups)) if len(groups[g]) > 1), key=lambda g: totals[g])
        rows, half, acc = groups[g], totals[g] / 2, 0
        cut = 1
        for k, i in enumerate(rows[:-1]):  # the first rows holding about half the tokens, at least one
            acc += lengths[i]
            cut = k + 1
            if acc >= half:
                break
        groups[g : g + 1] = [rows[:cut], rows[cut:]]
        totals[g : g + 1] = [sum(lengths[i] for i in rows[:cut]), sum(lengths[i] for i in rows[cut:])]
    return [sorted(g) for g in groups]
