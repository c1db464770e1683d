"""Pure tensor math shared by every step: masked reductions, per-token log-probs and entropy, KL
estimators, positions and last indices from masks. No DeepSpeed, no models, no orchestration.

Tensor layout convention (step 3 and every per-token quantity)
---------------------------------------------------------------
Every per-token tensor lives on the *shifted* full sequence and has shape ``[B, L-1]`` for
sequences of length ``L`` (prompt + response, left padded):

* position ``i`` holds quantities about token ``i+1`` predicted from prefix ``0..i``: the
  log-prob of token ``i+1``, the value of state ``i`` (the state in which token ``i+1`` is
  chosen) and the reward of action ``i+1``.
* ``action_mask`` ``[B, L-1]`` (float, bool or long: all accepted) is 1 exactly where token
  ``i+1`` is a generated token, up to and including the first EOS. Prompt tokens, left padding
  and tokens after the EOS are 0. The actions of a row are contiguous (one block per row).

Why this layout: it is what ``logits[:, :-1]`` gathered at ``input_ids[:, 1:]`` gives, so actor
log-probs, reference log-probs and critic values line up position by position without any
further slicing.

Masking: padding positions may hold arbitrary (even non-finite) numbers, so everything here
selects with ``torch.where`` (``select``) instead of multiplying by the mask (``nan * 0 == nan``),
and the losses (utils/math/losses.py) select their inputs BEFORE any arithmetic, so that no gradient
at a pad is ``0 * nan``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.utils.checkpoint
from torch import Tensor

__all__ = [
    "select",
    "masked_sum",
    "masked_mean",
    "LOSS_AGGREGATIONS",
    "aggregate",
    "masked_var",
    "masked_whiten",
    "explained_variance",
    "logprobs_from_logits",
    "entropy_from_logits",
    "chunked_head",
    "KL_ESTIMATORS",
    "kl_estimate",
    "ROLLOUT_CORRECTIONS",
    "rollout_correction_weights",
    "position_ids_from_attention_mask",
    "last_one_index",
    "sequence_score",
]

KL_ESTIMATORS = ("k1", "k2", "k3")


# ---------------------------------------------------------------------------
# masked reductions
# ---------------------------------------------------------------------------
def _weights(mask: Tensor, x: Tensor) -> Tensor:
    """Mask as floating weights in x's dtype (bool/long/float masks all accepted)."""
    dtype = x.dtype if x.is_floating_point() else torch.get_default_dtype()
    return mask.to(dtype=dtype, device=x.device)


def select(x: Tensor, mask: Tensor) -> Tensor:
    """x on masked entries, 0 elsewhere; immune to nan/inf in padding (forward AND backward)."""
    return torch.where(mask.to(x.device) != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of ``x * mask``; padding never leaks in, even if it is nan/inf.

    ``dim=None`` sums everything (scalar), otherwise sums along ``dim``.
    """
    w = _weights(mask, x)
    xs = select(x.to(w.dtype), mask) * w
    return xs.sum() if dim is None else xs.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of ``x`` over the masked entries only.

    Why: PPO losses must average over generated tokens, not over prompt/pad positions, otherwise
    the effective step size depends on padding.

    ``dim=None`` -> one scalar over the whole (mini-)batch (token-level mean); ``dim`` given ->
    per-row means (e.g. ``[B]`` for ``dim=-1``). Zero-count guard: where the mask sums to 0 (an
    empty batch / a row with no action) the numerator is also 0, so only those zero counts are
    replaced by 1 and the result is 0 instead of nan. Non-zero counts (including fractional
    weight sums < 1) are left untouched, which a blanket ``clamp(min=1)`` would not do.
    """
    w = _weights(mask, x)
    total = masked_sum(x, mask, dim=dim)
    count = w.sum() if dim is None else w.sum(dim=dim)
    count = torch.where(count == 0, torch.ones_like(count), count)
    return total / count


LOSS_AGGREGATIONS = ("token_mean", "seq_mean", "constant_norm")


def aggregate(x: Tensor, mask: Tensor, mode: str = "token_mean", constant: float | None = None) -> Tensor:
    """One scalar of a per-token loss over the masked entries, three ways (``--loss_agg``):

    - ``token_mean``: every action of the mini-batch weighs the same (DAPO; PPO's usual mean), so
      long answers carry more of the gradient;
    - ``seq_mean``: each row's own token mean, then the mean over rows (the original GRPO): every
      answer weighs the same, so a long answer's tokens each weigh less;
    - ``constant_norm``: each row's token SUM divided by ``constant`` (the maximum answer length),
      then the mean over rows (Dr. GRPO): no length bias either way.
    Rows whose mask is all 0 (no action, or dropped from the loss) are left out of the row count;
    an all-zero mask gives 0.
    """
    if mode == "token_mean":
        return masked_mean(x, mask)
    row_sums = masked_sum(x, mask, dim=-1)
    counts = _weights(mask, x).sum(dim=-1)
    present = (counts > 0).to(row_sums.dtype)
    if mode == "seq_mean":
        per_row = row_sums / torch.where(counts == 0, torch.ones_like(counts), counts)
    elif mode == "constant_norm":
        if not constant or constant <= 0:
            raise ValueError(f"constant_norm needs a positive constant (the maximum answer length), got {constant}")
        per_row = row_sums / constant
    else:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose from {', '.join(LOSS_AGGREGATIONS)}")
    return (per_row * present).sum() / present.sum().clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over the masked entries (scalar).

    ``unbiased`` applies Bessel's correction n/(n-1) with n = mask sum. Raises ValueError for an
    empty mask (no data: a silent 0/nan would hide a pipeline bug). With a single entry the
    variance is 0 and is returned without the (undefined) correction, so whitening one token
    yields 0 instead of crashing a training step.
    """
    w = _weights(mask, x)
    n = w.sum()
    if n.item() == 0:
        raise ValueError("masked_var: mask is empty (sum == 0), variance undefined")
    mean = masked_mean(x, mask)
    var = masked_mean((x.to(w.dtype) - mean) ** 2, mask)
    if unbiased and n.item() > 1:
        var = var * (n / (n - 1))
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` to zero mean / unit variance using masked entries only.

    Why: advantage whitening must use statistics of real actions only; pad positions would bias
    mean and variance. ``shift_mean=False`` only rescales (keeps the original mean), as used for
    rewards in some recipes. Outputs at unmasked positions are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return select(whitened, mask)


def explained_variance(values: Tensor, returns: Tensor, action_mask: Tensor) -> Tensor:
    """``1 - Var(returns - values) / Var(returns)`` over masked entries (0-d float tensor).

    Why: critic health monitor; 1 = perfect, 0 = no better than a constant, < 0 = worse. nan
    when the returns have zero variance.
    """
    with torch.no_grad():
        r = returns.float()
        var_y = masked_var(r, action_mask, unbiased=False)
        var_diff = masked_var(r - values.float(), action_mask, unbiased=False)
        return 1.0 - var_diff / var_y


# ---------------------------------------------------------------------------
# logits -> per-token quantities
# ---------------------------------------------------------------------------
def _row_chunks(logits: Tensor):
    """Split [..., V] logits into [N, V] chunks of one sequence each (bounded fp32 temp)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    chunk = logits.shape[-2] if logits.dim() >= 3 else max(flat.shape[0], 1)
    return flat, chunk


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] per position, computed in fp32.

    Shapes: logits ``[B, T, V]`` (any leading dims), labels ``[B, T]`` of valid token ids ->
    ``[B, T]`` fp32.

    Why ``gather - logsumexp``: ``log_softmax`` would allocate a full ``[B, T, V]`` output only to
    read one entry per position. For fp32 input no second full copy is kept; for bf16/fp16 input
    the upcast to fp32 (for an accurate logsumexp) is done one sequence at a time so peak extra
    memory is ``T*V`` fp32 instead of ``B*T*V``. Gathering in low precision and then upcasting
    is exact.
    """
    labels = labels.long().to(logits.device)
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1).float()
    if logits.dtype in (torch.float32, torch.float64):
        return picked - torch.logsumexp(logits, dim=-1).float()
    flat, chunk = _row_chunks(logits)
    lse = torch.cat([torch.logsumexp(c.float(), dim=-1) for c in flat.split(chunk, dim=0)])
    return picked - lse.view(picked.shape)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy ``H = logsumexp(z) - sum softmax(z) * z`` in fp32 (fp64 kept), shape ``[B, T]``.

    Why: a monitoring signal (collapse of the policy shows as entropy -> 0), and step 3's
    entropy bonus (differentiable). Computed one sequence at a time to bound the fp32 temporaries.
    """
    flat, chunk = _row_chunks(logits)
    out = []
    for c in flat.split(chunk, dim=0):
        c = c if c.dtype == torch.float64 else c.float()
        p = torch.softmax(c, dim=-1)
        out.append(torch.logsumexp(c, dim=-1) - (p * c).sum(dim=-1))
    return torch.cat(out).view(logits.shape[:-1])


def chunked_head(
    hidden: Tensor, head: Callable, reduce: Callable, chunk_tokens: int, *per_token: Tensor, min_chunks: int = 0
) -> tuple[Tensor, ...]:
    """Per-token quantities of ``reduce(head(h), *per_token)`` over hidden states ``[B, T, H]``, ``chunk_tokens``
    token rows at a time, so that no ``[B, T, V]`` logits tensor exists, forward or backward.

    ``head`` maps ``[n, H]`` hidden states to ``[n, V]`` logits (the LM head module); ``reduce`` maps those
    logits and the chunk's ``[n]`` slices of the ``per_token`` ``[B, T]`` tensors (labels, masks) to a tuple of
    ``[n]`` tensors; the result is that tuple with each entry ``[B, T]``. Rows of every sequence are flattened
    first, so each chunk holds at most ``chunk_tokens`` tokens of one or several sequences.

    With gradients on, each chunk runs inside ``torch.utils.checkpoint`` (non-reentrant): its forward keeps
    only its slice of ``hidden`` (already kept by the model's own backward), and the backward recomputes the
    chunk's logits, so at most one chunk's ``[n, V]`` logits, softmax and their gradient live at a time, for
    one more LM-head matmul per chunk. ``reduce`` must be deterministic (no dropout): the RNG state is not
    replayed. Without gradients the chunks simply run one after the other.

    ``min_chunks``: at least this many head calls, the ones past the tokens on empty slices (a ZeRO-3 head gathers
    its weights at every call, a collective each rank must make as often as the others, forward and backward).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    lead = hidden.shape[:-1]
    flat = hidden.reshape(-1, hidden.shape[-1])
    extra = [t.to(hidden.device).reshape(-1) for t in per_token]

    def run(h: Tensor, *args: Tensor) -> tuple[Tensor, ...]:
        out = reduce(head(h), *args)
        return out if isinstance(out, tuple) else (out,)

    grad = torch.is_grad_enabled()
    count = max(-(-flat.shape[0] // chunk_tokens), min_chunks, 1)  # no token: one empty chunk gives the dtypes
    chunks = []
    for start in range(0, count * chunk_tokens, chunk_tokens):
        args = (flat[start : start + chunk_tokens], *(t[start : start + chunk_tokens] for t in extra))
        if grad:
            chunks.append(torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False))
        else:
            chunks.append(run(*args))
    return tuple(torch.cat(parts).view(lead) for parts in zip(*chunks))


# ---------------------------------------------------------------------------
# KL estimators
# ---------------------------------------------------------------------------
def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of KL(actor || reference) for tokens sampled from the actor.

    This is the KL to the FROZEN SFT REFERENCE model (the RLHF regulariser), NOT the PPO
    importance ratio against the old (rollout) policy. With ``log_ratio = logprobs -
    ref_logprobs`` (Schulman, "Approximating KL divergence"):

    * ``k1 = log_ratio``: unbiased, but can be negative per token.
    * ``k2 = 0.5 * log_ratio**2``: low variance, biased, >= 0.
    * ``k3 = exp(-log_ratio) - 1 + log_ratio``: unbiased and >= 0 (``exp(-log_ratio)`` is the
      ratio ref/actor). Grows exponentially when the actor is much less likely than the
      reference (log_ratio << 0); callers may clamp log_ratio if that matters.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) - 1 + log_ratio


# ---------------------------------------------------------------------------
# generator-trainer mismatch
# ---------------------------------------------------------------------------
ROLLOUT_CORRECTIONS = ("none", "tis", "icepop", "seq_mask_tis")


def rollout_correction_weights(
    old_logprobs: Tensor, rollout_logprobs: Tensor, action_mask: Tensor, mode: str = "none", threshold: float = 2.0
) -> Tensor:
    """Per-action off-policy weights ``[B, L-1]`` (no gradient; 0 off ``action_mask``) for tokens that the
    rollout engine sampled with log-probs ``rollout_logprobs`` and that the trainer's own forward scores
    ``old_logprobs`` (the OLD policy, which the policy loss's ratio is taken against).

    ``w = pi_old / pi_rollout = exp(old - rollout)`` is the importance weight of the distribution the loss
    assumes against the one that drew the token; the two differ by the engines' numerics (kernels, KV
    cache, precision, another engine's weights sync). With ``C = threshold`` (> 1):

    * ``none``: 1 on every action;
    * ``tis``: ``min(w, C)``, truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
      secretly brings you off-policy RL training"; OpenRLHF ``tis``, veRL's token-level rollout IS);
    * ``icepop``: ``w`` where ``1/C <= w <= C``, else 0 (IcePop, Ring-1T: a token whose engines disagree
      that much leaves the gradient instead of being reweighted);
    * ``seq_mask_tis``: every action of a row whose geometric-mean weight ``exp(mean of log w over its
      actions)`` leaves ``[1/C, C]`` gets 0, the other rows' actions ``min(w, C)`` (a whole answer is
      rejected when its engines disagree on it on average; OpenRLHF ``seq-mask-tis``).

    Inputs are selected on the mask before any arithmetic (padding may hold anything).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; choose from {', '.join(ROLLOUT_CORRECTIONS)}")
    if not threshold > 1:
        raise ValueError(f"the rollout correction threshold must be > 1, got {threshold}")
    with torch.no_grad():
        mask = action_mask.to(old_logprobs.device) != 0
        log_w = select(old_logprobs.float(), mask) - select(rollout_logprobs.float().to(mask.device), mask)
        weight = torch.exp(log_w)
        if mode == "none":
            weight = torch.ones_like(weight)
        elif mode == "tis":
            weight = weight.clamp(max=threshold)
        elif mode == "icepop":
            weight = torch.where((weight >= 1 / threshold) & (weight <= threshold), weight, torch.zeros_like(weight))
        else:
            geometric = torch.exp(masked_mean(log_w, mask, dim=-1)).unsqueeze(-1)
            inside = (geometric >= 1 / threshold) & (geometric <= threshold)
            weight = torch.where(inside, weight.clamp(max=threshold), torch.zeros_like(weight))
        return select(weight, mask)


# ---------------------------------------------------------------------------
# positions and indices from masks
# ---------------------------------------------------------------------------
def position_ids_from_attention_mask(attention_mask: Tensor) -> Tensor:
    """Positions counted over real tokens only: `cumsum(mask) - 1`, clipped at 0.

    The same token gets the same position under any left padding, so the rollout forward and
    every training forward agree (models with absolute positions, like GPT-2, depend on it).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_tokens_index(attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(index [N] of a batch's real tokens in its flattened [B, L] layout, in row order; their position ids [N],
    restarting at 0 with each row): the padding-free layout of a batch, every row's real tokens one after the
    other in ONE sequence [1, N].

    transformers' attention reads a restart of the position ids as the start of a new row (its packed-sequence
    mask, or flash-attention's varlen boundaries), so no token attends across rows; the positions are those of
    the padded batch (`position_ids_from_attention_mask`), so every token's output is the padded path's to float
    rounding.
    """
    index = (attention_mask.reshape(-1) != 0).nonzero().squeeze(1)
    return index, position_ids_from_attention_mask(attention_mask).reshape(-1)[index]


def packed_predictions(attention_mask: Tensor, keep: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(predicts [B, L-1] bool, source [P]): where a packed forward's outputs are needed in the per-token layout
    of this module (position i predicts token i+1), and which token of the packed sequence (`packed_tokens_index`'s
    order) each of those P positions is.

    A position predicts when it and the next one are real tokens of its row (a row's last token predicts nothing:
    in the packed sequence the next token is another row's first) and, given `keep` [B, L-1], where keep is True
    (the positions whose prediction is read: a response, the trained labels)."""
    real = attention_mask != 0
    predicts = real[:, :-1] & real[:, 1:]
    if keep is not None:
        predicts = predicts & keep.to(predicts.device).bool()
    order = real.reshape(-1).long().cumsum(0).view(real.shape) - 1  # each real token's place in the sequence
    return predicts, order[:, :-1][predicts]


def scatter_packed(values: Tensor, mask: Tensor) -> Tensor:
    """Per-position values [P, ...] put back on the True positions of `mask` [B, T] -> [B, T, ...], 0 elsewhere
    (differentiable: the inverse of `tensor[mask]`)."""
    out = values.new_zeros((*mask.shape, *values.shape[1:]))
    return out.masked_scatter(mask.view(*mask.shape, *([1] * (values.dim() - 1))).to(values.device), values)


def last_one_index(mask: Tensor) -> Tensor:
    """Index of the last 1 in each row of a 0/1 mask ([B, L] -> [B]), for any padding side.

    Reads the reward model's score at the last real token and places the sequence reward on the
    last action. Raises when a row has no 1, rather than silently reading a pad position.
    """
    mask = mask != 0
    if not bool(mask.any(dim=-1).all()):
        bad = (~mask.any(dim=-1)).nonzero().flatten().tolist()
        raise ValueError(f"rows of the mask without any 1 (empty sequence or no action): {bad}")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=-1).values


def sequence_score(values: Tensor, attention_mask: Tensor) -> Tensor:
    """[B, L] per-token values -> [B] values at the last position where attention_mask is 1.

    The reward model's (and critic's) sequence score: right for left and right padding of any
    amount and for pad == EOS.
    """
    index = last_one_index(attention_mask).to(values.device)
    return values.gather(1, index.unsqueeze(1)).squeeze(1)
