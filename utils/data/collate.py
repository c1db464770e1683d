"""Padding batches (SFT, pair, preference, unpaired (KTO) and prompt collators) and the distributed data loader."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from utils.data.tokenize import IGNORE_INDEX


def pad_batch(
    seqs: Sequence[Sequence[int]], pad_value: int, side: str = "right", length: int | None = None
) -> torch.Tensor:
    """Pad lists of ints to one length on ``side`` -> LongTensor [B, L]."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    length = max(map(len, seqs)) if length is None else length
    out = torch.full((len(seqs), length), pad_value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            start = 0 if side == "right" else length - len(s)
            out[i, start : start + len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out


def _mask(seqs: Sequence[Sequence[int]], side: str) -> torch.Tensor:
    return pad_batch([[1] * len(s) for s in seqs], 0, side)


class SFTCollator:
    """Right-pads SFT examples: input_ids (pad id), attention_mask, labels (-100)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: Sequence[dict]) -> dict:
        ids = [ex["input_ids"] for ex in batch]
        return {
            "input_ids": pad_batch(ids, self.pad_token_id),
            "attention_mask": _mask(ids, "right"),
            "labels": pad_batch([ex["labels"] for ex in batch], IGNORE_INDEX),
        }


class PairCollator:
    """Pairs -> [2B, L]: the B chosen rows first, then the B rejected rows
    (DeepSpeed-Chat's layout: one forward pass, split the rewards in half)."""

    def __init__(self, pad_token_id: int, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, batch: Sequence[dict]) -> dict:
        seqs = [ex["chosen_input_ids"] for ex in batch] + [ex["rejected_input_ids"] for ex in batch]
        return {
            "input_ids": pad_batch(seqs, self.pad_token_id, self.padding_side),
            "attention_mask": _mask(seqs, self.padding_side),
        }


class PreferenceCollator:
    """DPO pairs -> [2B, L] (the B chosen sequences first, then the B rejected: one forward) with
    ``action_mask`` [2B, L-1] on each response's tokens in utils/math/ops.py's layout (position i is 1
    when token i+1 is a response token), padded on ``padding_side``; a pair's sequence log-probs do
    not depend on either, since positions come from the attention mask. Examples carrying reference
    log-probs (``ref_chosen_logp`` / ``ref_rejected_logp``, set by a run that precomputed them) give
    ``ref_logps`` [2B] in the same order."""

    def __init__(self, pad_token_id: int, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, batch: Sequence[dict]) -> dict:
        sides = ("chosen", "rejected")
        prompts = [ex["prompt_input_ids"] for ex in batch] * 2
        responses = [ex[f"{side}_response_ids"] for side in sides for ex in batch]
        out = response_rows(prompts, responses, self.pad_token_id, self.padding_side)
        if all("ref_chosen_logp" in ex for ex in batch):
            out["ref_logps"] = torch.tensor(
                [ex[f"ref_{side}_logp"] for side in sides for ex in batch], dtype=torch.float32
            )
        return out


def response_rows(prompts: Sequence, responses: Sequence, pad_token_id: int, padding_side: str = "right") -> dict:
    """Rows prompt + response, padded, with ``action_mask`` [N, L-1] on each response's tokens (utils/math/ops.py's
    layout: position i is 1 when token i+1 is a response token): what sequence_logprobs sums."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    input_ids = pad_batch(seqs, pad_token_id, padding_side)
    length = input_ids.shape[1]
    action_mask = torch.zeros((len(seqs), length - 1), dtype=torch.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        start = (0 if padding_side == "right" else length - len(p) - len(r)) + len(p) - 1
        action_mask[b, start : start + len(r)] = 1
    return {"input_ids": input_ids, "attention_mask": _mask(seqs, padding_side), "action_mask": action_mask}


class UnpairedCollator:
    """KTO's labelled examples -> [2B, L]: the B examples (prompt + its completion) first, then B
    MISMATCHED rows, prompt i with the completion of example i - 1 (mod B; TRL's shift), from which
    KTO estimates its reference point (utils.math.losses.kto_reference_point); ``desirable`` [B] bool. A
    mismatched row longer than ``max_seq_len`` keeps the completion's first tokens (it is only scored,
    never trained). A batch of one pairs its prompt with its own completion: the run refuses
    --per_device_train_batch_size 1."""

    def __init__(self, pad_token_id: int, max_seq_len: int, padding_side: str = "right"):
        self.pad_token_id, self.max_seq_len, self.padding_side = pad_token_id, max_seq_len, padding_side

    def __call__(self, batch: Sequence[dict]) -> dict:
        prompts = [ex["prompt_input_ids"] for ex in batch]
        completions = [ex["completion_response_ids"] for ex in batch]
        shifted = completions[-1:] + completions[:-1]
        mismatched = [c[: max(self.max_seq_len - len(p), 1)] for p, c in zip(prompts, shifted)]
        out = response_rows(prompts * 2, completions + mismatched, self.pad_token_id, self.padding_side)
        out["desirable"] = torch.tensor([ex["desirable"] for ex in batch], dtype=torch.bool)
        return out


def split_pair_batch(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The [2B, ...] layout of PairCollator and PreferenceCollator -> (chosen [B, ...], rejected [B, ...])."""
    if values.shape[0] % 2:
        raise ValueError(f"a pair batch has an even number of rows, got {values.shape[0]}")
    half = values.shape[0] // 2
    return values[:half], values[half:]


class PromptCollator:
    """Left-pads prompts so generation continues right after each prompt; ``rows`` keeps each
    prompt row's ``prompt``, ``origin`` and ``extra`` fields, aligned with the batch, for reward
    functions."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: Sequence[dict]) -> dict:
        ids = [ex["input_ids"] for ex in batch]
        return {
            "input_ids": pad_batch(ids, self.pad_token_id, "left"),
            "attention_mask": _mask(ids, "left"),
            "rows": [
                {"prompt": ex.get("prompt"), "origin": ex.get("origin", ""), "extra": ex.get("extra", {})}
                for ex in batch
            ],
        }


def distributed_loader(examples: Sequence, batch_size: int, collate_fn, seed: int, drop_last: bool = False):
    """(sampler, loader): this rank's shuffled share of `examples`, the order fixed by (seed, epoch).

    The loader gets its own generator: a DataLoader otherwise draws its base seed from the GLOBAL
    torch RNG each time an epoch's iterator is created, which would shift dropout and sampling
    randomness after a resume.
    """
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = DistributedSampler(examples, num_replicas=ranks, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(
        examples,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
    )
    return sampler, loader
