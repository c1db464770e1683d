"""The distribution a sampler actually draws from: softmax(logits / T) after top-k and top-p truncation.

With `--top_k` or `--top_p` the generator samples from the tempered softmax renormalised over the tokens it keeps,
and a generator's "processed" log-probs (vLLM's `logprobs_mode="processed_logprobs"`) are that distribution's. The
plain tempered log-prob of a kept token is lower by -log(kept mass), so a trainer that compares its own log-probs
with the generator's (the mismatch metric, TIS / ICEPOP weights) must apply the same truncation first.

The rule is the one of vLLM (vllm/v1/sample/ops/topk_topp_sampler.py `apply_top_k_top_p`) and of transformers'
warpers (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper), in that order:
- temperature first: logits / T, in fp32;
- top-k keeps every token whose logit is >= the k-th largest (ties at the k-th value are all kept); k >= V keeps all;
- top-p then sorts the kept tokens ascending, takes the cumulative probability of their renormalised softmax and
  drops those whose cumulative probability is <= 1 - p; the most likely token is always kept.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# What a comparison of processed log-probs counts a -inf one as (a token the truncation left out): log of the
# smallest normal fp32 number, about -87.3, so that a distance stays finite and a weight exp(.) is ~0.
PROCESSED_LOGPROB_FLOOR = math.log(torch.finfo(torch.float32).tiny)


def truncates(top_k: int, top_p: float) -> bool:
    """Whether sampling with `top_k` (0: off) and `top_p` (1: off) leaves tokens out."""
    return top_k > 0 or top_p < 1.0


def kept_tokens(logits: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """bool [..., V]: the tokens top-k then top-p sampling keeps, for (already tempered) `logits` [..., V]."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        keep = logits >= logits.topk(top_k, dim=-1).values[..., -1:]
    else:
        keep = torch.ones_like(logits, dtype=torch.bool)
    if top_p < 1.0:
        ordered, order = logits.masked_fill(~keep, float("-inf")).sort(dim=-1)  # ascending
        drop = ordered.softmax(dim=-1).cumsum(dim=-1) <= 1 - top_p
        drop[..., -1] = False  # at least the most likely token
        keep = keep & ~drop.scatter(-1, order, drop)
    return keep


def processed_logprobs(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """[..., V] fp32: log softmax(logits / `temperature`) over the tokens top-k then top-p keep (kept_tokens),
    -inf elsewhere: the log-probs of the distribution sampled. Without truncation, the plain tempered log-softmax."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    if truncates(top_k, top_p):
        logits = logits.masked_fill(~kept_tokens(logits, top_k, top_p), float("-inf"))
    return logits.log_softmax(dim=-1)


def processed_token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> Tensor:
    """[...] fp32: processed_logprobs of `logits` [..., V] at `tokens` [...] (-inf for a token left out)."""
    full = processed_logprobs(logits, temperature, top_k, top_p)
    return full.gather(-1, tokens.long().to(full.device).unsqueeze(-1)).squeeze(-1)
