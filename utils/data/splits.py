"""Selecting and normalising the rows of one step: ``--data_split``, validation, splitting, blending."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from utils.data.formats import DEFAULT_FORMAT, RowFormat, SkipRow, normalize_row
from utils.data.sources import DataError, Source, load_source

STEP_NAMES = {1: "step 1 (SFT)", 2: "step 2 (reward model)", 3: "step 3 (PPO)"}


@dataclass
class StepRows:
    """Normalised rows of one step: ``train``, ``eval`` and counting ``stats``."""

    train: list = field(default_factory=list)
    eval: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- #
# --data_split
# --------------------------------------------------------------------------- #
def parse_data_split(s: str) -> list[float]:
    """Parse ``--data_split`` ("2,4,4") into fractions for steps 1, 2, 3."""
    parts = [p.strip() for p in str(s).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise DataError(f"--data_split {s!r}: expected 3 comma-separated numbers, e.g. '2,4,4'") from None
    if len(values) != 3:
        raise DataError(f"--data_split {s!r}: expected 3 numbers (steps 1,2,3), got {len(values)}")
    if any(not v >= 0 or v == float("inf") for v in values) or sum(values) <= 0:
        raise DataError(f"--data_split {s!r}: numbers must be finite, non-negative and sum to > 0")
    total = sum(values)
    return [v / total for v in values]


# --------------------------------------------------------------------------- #
# Normalising rows
# --------------------------------------------------------------------------- #
def _normalize_all(records: Iterable, step: int, fmt: RowFormat, skipped: dict) -> list:
    """Rows of ``records`` (any format, see utils/data/formats.py); skips counted per reason in ``skipped``."""
    rows = []
    for obj, origin in records:
        try:
            rows.append(normalize_row(obj, origin, step, fmt))
        except SkipRow as skip:
            skipped[skip.reason] = skipped.get(skip.reason, 0) + 1
    return rows


def describe_skips(skipped: dict) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(skipped.items()) if n) or "none"


def read_rows(source: str, step: int, fmt: RowFormat = DEFAULT_FORMAT) -> tuple[list[dict], str]:
    """Validated rows of ``step`` from one source, and the split they come from (for evaluation).

    The rows of the source's own eval split when it has one ("eval"), else of
    all its rows ("all"); no ``--data_split`` cut, no held-out fraction.  A row
    that teaches nothing is skipped (SkipRow); any other bad row raises
    DataError naming file:line.
    """
    src = load_source(source, fmt)
    records, split = (src.eval, "eval") if src.eval else (src.train, "all")
    return _normalize_all(records, step, fmt, {}), split


# --------------------------------------------------------------------------- #
# Splitting and blending
# --------------------------------------------------------------------------- #
def _rng(seed: int, *keys: str) -> random.Random:
    """A RNG keyed by seed and strings; stable across processes (unlike hash())."""
    digest = hashlib.sha256("\0".join([str(seed), *keys]).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _source_key(src: Source) -> str:
    """Key for per-source permutations, from the source's content (its row count, first and last rows),
    not its path: the three steps cut a source the same way however each names it ("data/x",
    "./data/x/", an absolute path, a copy in another checkout)."""
    sample = [obj for obj, _ in src.train[:16] + src.train[-16:]]
    text = json.dumps([len(src.train), sample], sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def eval_size(n: int, eval_fraction: float) -> int:
    """Rows held out for eval from a source without an eval split."""
    if n <= 0 or eval_fraction <= 0:
        return 0
    k = int(round(n * eval_fraction))
    return min(n - 1, max(1, k)) if n >= 10 else min(k, n - 1)


def split_bounds(n: int, fractions: Sequence[float]) -> list[int]:
    """Boundaries [0, b1, b2, n] of the 3 contiguous per-step parts."""
    cum, bounds = 0.0, [0]
    for frac in fractions[:-1]:
        cum += frac
        bounds.append(min(n, int(round(cum * n))))
    return bounds + [n]


def split_source(
    src: Source, fractions: Sequence[float], step: int, seed: int, eval_fraction: float
) -> tuple[list, list]:
    """(this step's train records, eval records) of one source.

    The permutation depends only on (seed, the source's content) and is applied to the raw
    records *before* any step-specific validation, so the three steps cut the
    very same order and their parts are disjoint.
    """
    order = list(range(len(src.train)))
    _rng(seed, "split", _source_key(src)).shuffle(order)
    if src.eval is None:
        n_eval = eval_size(len(order), eval_fraction)
        ev = [src.train[i] for i in sorted(order[:n_eval])]
        order = order[n_eval:]
    else:
        ev = src.eval
    b = split_bounds(len(order), fractions)
    return [src.train[i] for i in order[b[step - 1] : b[step]]], ev


def row_key(row: dict, step: int) -> str:
    """What makes two normalised rows the same example: every field but their origin (file:line); before
    step 3 also without the unused extra fields (an id column would make every row unique), while step 3's
    reward functions read them."""
    content = {k: v for k, v in row.items() if k != "origin" and (step == 3 or k != "extra")}
    return json.dumps(content, sort_keys=True, ensure_ascii=False, default=str)


def repeats(train: list, evals: list, step: int) -> tuple[list[int], list[int]]:
    """(indices of training rows equal to an earlier training row, indices of eval rows equal to a training row)."""
    seen: set[str] = set()
    duplicates = []
    for i, row in enumerate(train):
        key = row_key(row, step)
        if key in seen:
            duplicates.append(i)
        seen.add(key)
    return duplicates, [i for i, row in enumerate(evals) if row_key(row, step) in seen]


def report_repeats(
    train: list, evals: list, step: int, dedupe: bool, log: Callable[[str], None]
) -> tuple[list, list, dict]:
    """Count exact duplicate training rows and eval rows also in training, in one line; with ``dedupe``
    drop them (the later copies from training, those rows from eval). Returns (train, eval, counts)."""
    duplicates, overlap = repeats(train, evals, step)
    counts = {"duplicate_train": len(duplicates), "eval_in_train": len(overlap)}
    action = "dropped (--dedupe)" if dedupe else "--dedupe drops them" if duplicates or overlap else "nothing to drop"
    log(
        f"[data] {STEP_NAMES[step]}: {len(duplicates)} of {len(train)} training rows are exact duplicates of "
        f"another, {len(overlap)} of {len(evals)} eval rows are also training rows; {action}"
    )
    if dedupe:
        drop_train, drop_eval = set(duplicates), set(overlap)
        train = [row for i, row in enumerate(train) if i not in drop_train]
        evals = [row for i, row in enumerate(evals) if i not in drop_eval]
    return train, evals, counts


def build_step_rows(
    data_paths: Sequence[str],
    data_split: str,
    step: int,
    seed: int,
    sft_only_data_path: Sequence[str] = (),
    eval_fraction: float = 0.1,
    log: Callable[[str], None] = print,
    fmt: RowFormat = DEFAULT_FORMAT,
    dedupe: bool = False,
) -> StepRows:
    """Train/eval rows of ``step`` (1, 2 or 3) blended from all sources.

    Each source contributes its step part (see ``split_source``) and its whole
    eval split; ``sft_only_data_path`` sources feed step 1 only, with all their
    train rows (their eval split, own or held out, goes to step 1's eval).
    Exact repeats are counted (``report_repeats``), and dropped with ``dedupe``.
    """
    if step not in STEP_NAMES:
        raise DataError(f"step must be 1, 2 or 3, got {step!r}")
    fractions = parse_data_split(data_split)
    data_paths = list(data_paths)
    sft_only = list(sft_only_data_path) if step == 1 else []
    if not data_paths and not sft_only:
        raise DataError(f"{STEP_NAMES[step]}: no data sources given (--data_path)")
    stats = {"step": step, "rows_read": 0, "skipped_empty": 0, "skipped": {}, "sources": {}}
    train, evals = [], []
    for name, whole in [(p, False) for p in data_paths] + [(p, True) for p in sft_only]:
        src = load_source(name, fmt)
        stats["rows_read"] += len(src.train) + len(src.eval or [])
        # sft-only sources are not cut by --data_split: all their train rows go to step 1
        tr_rec, ev_rec = split_source(src, (1.0, 0.0, 0.0) if whole else fractions, step, seed, eval_fraction)
        skipped = {}
        tr, ev = _normalize_all(tr_rec, step, fmt, skipped), _normalize_all(ev_rec, step, fmt, skipped)
        stats["sources"][name] = {
            "read": len(src.train) + len(src.eval or []),
            "train": len(tr),
            "eval": len(ev),
            "sft_only": whole,
            "skipped": skipped,
        }
        for reason, n in skipped.items():
            stats["skipped"][reason] = stats["skipped"].get(reason, 0) + n
        if skipped:
            log(f"[data] {name}: skipped {sum(skipped.values())} of this step's rows ({describe_skips(skipped)})")
        train += tr
        evals += ev
    train, evals, counts = report_repeats(train, evals, step, dedupe, log)
    stats.update(counts)
    _rng(seed, "blend", str(step)).shuffle(train)
    stats.update(train=len(train), eval=len(evals))
    names = data_paths + sft_only
    stats["skipped_empty"] = stats["skipped"].get("empty", 0) + stats["skipped"].get("empty_turn", 0)
    if not train and not evals and stats["skipped"]:
        raise DataError(
            f"{STEP_NAMES[step]}: all {sum(stats['skipped'].values())} rows of this step's share of "
            f"sources {names} were skipped as empty or teaching nothing ({describe_skips(stats['skipped'])}; "
            "empty: a required field empty or whitespace)"
        )
    if not train:
        raise DataError(
            f"{STEP_NAMES[step]}: 0 training rows from sources {names} with "
            f"--data_split {data_split} (fractions {[round(f, 3) for f in fractions]}); "
            f"give this step a larger share or more data"
        )
    log(
        f"[data] {STEP_NAMES[step]}: {len(train)} train / {len(evals)} eval rows from "
        f"{len(names)} source(s); read {stats['rows_read']}, skipped_empty {stats['skipped_empty']}"
        + (f" (all skips: {describe_skips(stats['skipped'])})" if set(stats["skipped"]) - {"empty"} else "")
        + ("" if evals else "; WARNING: eval split is empty")
    )
    return StepRows(train=train, eval=evals, stats=stats)
