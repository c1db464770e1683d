"""Percentile-bootstrap confidence intervals of a mean and of a paired win rate (numpy, vectorised).

With 128 prompts a mean judge score moves by several hundredths from one prompt sample to the next:
an interval says whether an SFT-vs-RLHF difference is larger than that. Deterministic for a seed.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

_CHUNK = 1 << 22  # resampled values held at once (32 MiB of float64)


def bootstrap_means(values: Sequence[float], n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """Means of `n_boot` resamples (with replacement, same size) of `values`."""
    v = np.asarray(values, dtype=np.float64).ravel()
    rng = np.random.default_rng(seed)
    out = np.empty(n_boot)
    per_chunk = max(1, _CHUNK // max(v.size, 1))
    for start in range(0, n_boot, per_chunk):
        stop = min(n_boot, start + per_chunk)
        out[start:stop] = v[rng.integers(0, v.size, size=(stop - start, v.size))].mean(axis=1)
    return out


def bootstrap_mean_ci(
    values: Sequence[float], level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """(low, high) percentile-bootstrap interval of the mean of `values`.

    Clipped to [min, max] of the values (a mean cannot leave it; this makes constant values give
    exactly (c, c) despite float rounding). No values or a NaN among them: (nan, nan).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0 or np.isnan(v).any():
        return math.nan, math.nan
    low, high = np.quantile(bootstrap_means(v, n_boot, seed), [(1 - level) / 2, (1 + level) / 2])
    return float(np.clip(low, v.min(), v.max())), float(np.clip(high, v.min(), v.max()))


def paired_outcomes(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """Per pair: 1 where a > b, 0.5 on a tie, 0 where a < b (the win rate is their mean)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"paired scores differ in length: {x.shape} vs {y.shape}")
    return np.where(x > y, 1.0, np.where(x == y, 0.5, 0.0))


def win_rate_ci(
    a: Sequence[float], b: Sequence[float], level: float = 0.95, n_boot: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """(low, high) bootstrap interval of the win rate of `a` over `b`, resampling the PAIRS (prompts),
    so that the two scores of one prompt stay together."""
    return bootstrap_mean_ci(paired_outcomes(a, b), level, n_boot, seed)
