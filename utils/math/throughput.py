"""Token counts, rates and model FLOPs utilisation (MFU): the arithmetic behind `tokens/*` and `perf/*`.

A training forward + backward costs about 6 FLOPs per parameter per token, a forward-only pass (generation,
scoring, reference log-probs) about 2 (Kaplan et al.'s estimate; attention's own FLOPs left out). N is the
model's parameters less its input embeddings (`non_embedding_params`): an embedding lookup is no matmul. MFU
is those model FLOPs over the phase's wall seconds, against the devices' peak FLOP/s (every rank's device).
Rates count real (non-padding) tokens: padding computed is work wasted, which `tokens/padding_fraction` shows.
"""

from __future__ import annotations

import torch

TRAIN_FLOPS_PER_PARAM = 6  # forward (2) + backward (4) per parameter per token
FORWARD_FLOPS_PER_PARAM = 2


def token_metrics(real: float, processed: float) -> dict:
    """{"tokens/real", "tokens/processed", "tokens/padding_fraction"}: the non-padding tokens and all positions
    the training forwards processed; {} when none were counted."""
    if processed <= 0:
        return {}
    return {
        "tokens/real": real,
        "tokens/processed": processed,
        "tokens/padding_fraction": 1.0 - real / processed,
    }


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """The model FLOPs done over `seconds`, as a fraction of `peak_flops` (all devices together)."""
    return flops / (seconds * peak_flops) if seconds > 0 and peak_flops > 0 else 0.0


def phase_rate_metrics(phase: str, tokens: float, flops: float, seconds: float, peak_flops: float) -> dict:
    """{"perf/<phase>_tokens_per_s", "perf/<phase>_mfu"} of a phase that processed `tokens` real tokens with
    `flops` model FLOPs in `seconds` (wall); {} when it took no time."""
    if seconds <= 0:
        return {}
    return {f"perf/{phase}_tokens_per_s": tokens / seconds, f"perf/{phase}_mfu": mfu(flops, seconds, peak_flops)}


def packed_tokens(lengths: list[int]) -> tuple[int, int]:
    """(real, processed) tokens of a batch of sequences of `lengths` padded to the longest."""
    return sum(lengths), len(lengths) * max(lengths, default=0)


def mask_tokens(attention_mask: torch.Tensor) -> tuple[int, int]:
    """(real, processed) tokens of a batch: its attention mask's ones and all its positions."""
    return int(attention_mask.sum()), attention_mask.numel()


def non_embedding_params(module) -> int:
    """The parameters of `module` less those of its nn.Embedding layers (the input embeddings; a tied output
    head shares them, so its matmul is left out too: a small undercount). A ZeRO-3 partitioned parameter counts
    whole (`ds_numel`)."""
    if module is None:
        return 0
    embedded = {id(p) for m in module.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if id(p) not in embedded)


class PhaseTokens:
    """Per phase of one optimizer step (RL iteration): the real tokens, the model FLOPs and the wall seconds,
    and the training forwards' real and processed tokens; `take()` reads and clears them."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.phases: dict[str, list[float]] = {}  # phase -> [tokens, flops, seconds]
        self.real = self.processed = 0

    def add(self, phase: str, tokens: float, flops_per_token: float, seconds: float) -> None:
        entry = self.phases.setdefault(phase, [0.0, 0.0, 0.0])
        entry[0] += tokens
        entry[1] += tokens * flops_per_token
        entry[2] += seconds

    def add_trained(self, real: int, processed: int) -> None:
        self.real += real
        self.processed += processed

    def take(self) -> tuple[dict, tuple[int, int]]:
        """({phase: [tokens, flops, seconds]}, (real, processed)) since the last call; clears them."""
        out = (self.phases, (self.real, self.processed))
        self.clear()
        return out
