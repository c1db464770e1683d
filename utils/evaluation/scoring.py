"""Scoring for evaluation: reward-model scores, response log-probabilities and the KL to a reference."""

from __future__ import annotations

from typing import Sequence

import torch

from utils.math.ops import masked_sum
from utils.math.rows import Row, pack, to_token_layout
from utils.models.forward import LOGPROB_CHUNK_TOKENS, eval_mode, sequence_scores, token_logprobs


def _batches(rows: Sequence[Row], batch_size: int):
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(rows), batch_size):
        yield list(rows[start : start + batch_size])


@torch.no_grad()
def reward_scores(reward_model, tokenizer, rows: Sequence[Row], batch_size: int = 8) -> list[float]:
    """Reward-model score of each prompt + response: the value at its last real token.

    Rows are packed (`pack`: left-padded prompt, right-padded response) with the tokenizer's pad id.
    """
    scores: list[float] = []
    with eval_mode(reward_model):
        for chunk in _batches(rows, batch_size):
            batch = pack(chunk, tokenizer.pad_token_id)
            scores += sequence_scores(reward_model, batch["input_ids"], batch["attention_mask"]).cpu().tolist()
    return scores


def _pad_id(model) -> int:
    config = model.config
    for value in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            return value
    return 0


@torch.no_grad()
def sequence_logprobs(
    model,
    rows: Sequence[Row],
    batch_size: int = 8,
    pad_token_id: int | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> list[torch.Tensor]:
    """Per row, log p(response token | prefix) of each response token ([t] fp32 tensors); the LM head
    `chunk_tokens` tokens at a time (utils.models.forward.token_logprobs; 0: the whole logits)."""
    pad = _pad_id(model) if pad_token_id is None else pad_token_id
    out: list[torch.Tensor] = []
    with eval_mode(model):
        for chunk in _batches(rows, batch_size):
            batch = pack(chunk, pad)
            logprobs = token_logprobs(model, batch, chunk_tokens=chunk_tokens).cpu()
            p = batch["prompt_len"]
            for b, row in enumerate(chunk):
                out.append(logprobs[b, p - 1 : p - 1 + row.response_ids.numel()].clone())
    return out


@torch.no_grad()
def kl_to_reference(
    policy,
    reference,
    rows: Sequence[Row],
    batch_size: int = 8,
    pad_token_id: int | None = None,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
) -> list[float]:
    """Per row: sum over its response tokens of log p_policy - log p_reference (k1).

    Evaluated on the POLICY's own responses this estimates KL(policy || reference) per sequence
    (unbiased when the responses were sampled from the policy; a single greedy answer gives the
    log-ratio of that answer). Both models see the same packed batch, mask-derived positions and
    `pack`'s action mask (response tokens up to and including the first EOS). Rows that carry the
    policy's own log-probs from generation (`per_action["logprobs"]`, `generate_answers(logprobs=True)`)
    skip the policy's forward (`policy` may then be None). Each forward runs the LM head `chunk_tokens` tokens
    at a time (utils.models.forward.token_logprobs; 0: the whole logits).
    """
    pad = _pad_id(reference) if pad_token_id is None else pad_token_id
    out: list[float] = []
    with eval_mode(*(m for m in (policy, reference) if m is not None)):
        for chunk in _batches(rows, batch_size):
            batch = pack(chunk, pad)
            if all("logprobs" in row.per_action for row in chunk):
                lp = to_token_layout(chunk, "logprobs", batch["prompt_len"], batch["input_ids"].shape[1])
            else:
                lp = token_logprobs(policy, batch, chunk_tokens=chunk_tokens).cpu()
            lr = token_logprobs(reference, batch, chunk_tokens=chunk_tokens).cpu()
            out += masked_sum(lp - lr, batch["action_mask"], dim=-1).tolist()
    return out
