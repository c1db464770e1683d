"""Data layer of the RLHF pipeline (DeepSpeed-Chat's data contract).

Three steps share the same sources: step 1 (SFT) trains on prompt+chosen,
step 2 (reward model) on prompt+chosen+rejected pairs, step 3 (PPO) on
prompts only.  Like DeepSpeed-Chat, every source's train rows are cut into
three disjoint parts by ``--data_split`` so that no step sees another step's
training rows, while the eval split is shared.

The module has three layers, each usable on its own:

* reading sources (``load_source``) into raw records with an ``origin``
  ("path:line") so that every error can point at the offending line;
* selecting and normalising the rows of one step (``build_step_rows``);
* tokenising rows (``tokenize_sft``/``tokenize_pairs``/``tokenize_prompts``)
  and padding batches (``SFTCollator``/``PairCollator``/``PromptCollator``).

Nothing is dropped silently: skipped or truncated rows are counted in the
returned stats and summarised through ``log``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

IGNORE_INDEX = -100
STEP_FIELDS = {1: ("prompt", "chosen"), 2: ("prompt", "chosen", "rejected"), 3: ("prompt",)}
STEP_NAMES = {1: "step 1 (SFT)", 2: "step 2 (reward model)", 3: "step 3 (PPO)"}
JSON_EXTS = (".json", ".jsonl")
EVAL_SPLIT_NAMES = ("eval", "test", "validation")


class DataError(ValueError):
    """A data problem the user must fix; the message names file, line and field."""


@dataclass
class Source:
    """Raw records of one source: lists of ``(obj, origin)`` per split.

    ``eval`` is None when the source has no eval split of its own, in which
    case a held-out fraction of ``train`` is used.
    """

    name: str
    train: list
    eval: list | None = None


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
# Reading sources
# --------------------------------------------------------------------------- #
def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _array_item_offsets(text: str, start: int) -> list[int]:
    """Character offsets of the items of the (valid) JSON array at ``start``.

    Used only to report real line numbers for rows of a .json file.
    """
    dec = json.JSONDecoder()
    offsets, i = [], _skip_ws(text, start + 1)
    if i < len(text) and text[i] == "]":
        return offsets
    while True:
        offsets.append(i)
        _, i = dec.raw_decode(text, i)
        i = _skip_ws(text, i)
        if text[i] == "]":
            return offsets
        i = _skip_ws(text, i + 1)  # skip ','


def _object_value_offsets(text: str, start: int) -> dict:
    """Character offsets of the values of the (valid) JSON object at ``start``."""
    dec = json.JSONDecoder()
    offsets, i = {}, _skip_ws(text, start + 1)
    if i < len(text) and text[i] == "}":
        return offsets
    while True:
        key, i = dec.raw_decode(text, i)
        i = _skip_ws(text, _skip_ws(text, i) + 1)  # skip ':'
        offsets[key] = i
        _, i = dec.raw_decode(text, i)
        i = _skip_ws(text, i)
        if text[i] == "}":
            return offsets
        i = _skip_ws(text, i + 1)


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read data file ({e})") from None


def _read_jsonl(path: str) -> list:
    """Records of a .jsonl file; blank lines are allowed, bad lines raise."""
    records = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: malformed JSON ({e})") from None
        records.append((obj, f"{path}:{lineno}"))
    return records


def _read_json(path: str) -> tuple[list, list | None]:
    """(train, eval-or-None) records of a .json file.

    Accepted shapes: a list of rows; an object with exactly one list value
    (e.g. ``{"data": [...]}``); or an object with a ``train`` list and an
    optional ``eval``/``test``/``validation`` list.
    """
    text = _read_text(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines saved as .json, as datasets accepts
            return _read_jsonl(path), None
        raise DataError(f"{path}:{e.lineno}: malformed JSON ({e})") from None
    start = _skip_ws(text, 0)

    def items(values: list, at: int) -> list:
        lines = [_line_of(text, o) for o in _array_item_offsets(text, at)]
        return [(obj, f"{path}:{line}") for obj, line in zip(values, lines)]

    if isinstance(doc, list):
        return items(doc, start), None
    if isinstance(doc, dict):
        at = _object_value_offsets(text, start)
        if isinstance(doc.get("train"), list):
            ev = next((k for k in EVAL_SPLIT_NAMES if isinstance(doc.get(k), list)), None)
            return items(doc["train"], at["train"]), (items(doc[ev], at[ev]) if ev else None)
        lists = [k for k, v in doc.items() if isinstance(v, list)]
        if len(lists) == 1:
            return items(doc[lists[0]], at[lists[0]]), None
    raise DataError(f"{path}: expected a JSON list of rows, or an object with one list of rows "
                    f"(or 'train'/'eval' lists)")


def _read_json_file(path: str) -> tuple[list, list | None]:
    return (_read_jsonl(path), None) if path.endswith(".jsonl") else _read_json(path)


def _split_file(folder: str, names: Sequence[str], stem_names: Sequence[str]) -> str | None:
    for stem in stem_names:
        for ext in JSON_EXTS:
            if stem + ext in names:
                return os.path.join(folder, stem + ext)
    return None


def _read_folder(folder: str, names: list) -> tuple[list, list | None]:
    """A folder of .json/.jsonl files: train/eval(test) files give the splits,
    otherwise every file (sorted, for determinism) is train data."""
    train_file = _split_file(folder, names, ("train",))
    eval_file = _split_file(folder, names, EVAL_SPLIT_NAMES)
    if train_file and eval_file:
        return _read_json_file(train_file)[0], _read_json_file(eval_file)[0]
    train: list = []
    for name in sorted(n for n in names if n.endswith(JSON_EXTS)):
        recs, ev = _read_json_file(os.path.join(folder, name))
        train += recs + (ev or [])
    return train, None


def _read_hf_dataset(source: str) -> tuple[list, list | None]:
    """Records of a ``datasets`` dataset (hub name, local datasets folder or
    ``save_to_disk`` output).  Imported lazily: most runs use local JSON."""
    try:
        import datasets

        if os.path.isdir(source) and any(
            os.path.exists(os.path.join(source, m)) for m in ("dataset_dict.json", "state.json")
        ):
            ds = datasets.load_from_disk(source)
        else:
            ds = datasets.load_dataset(source)
    except Exception as e:  # datasets raises many types; the user needs the source name
        raise DataError(f"{source}: not a JSON file/folder and datasets could not load it "
                        f"({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.Dataset):
        ds = {"train": ds}
    if "train" not in ds:
        raise DataError(f"{source}: dataset has no 'train' split (splits: {sorted(ds)})")

    def records(split: str) -> list:
        return [(dict(row), f"{source}[{split}]:{i + 1}") for i, row in enumerate(ds[split])]

    ev = next((k for k in EVAL_SPLIT_NAMES if k in ds), None)
    return records("train"), (records(ev) if ev else None)


def _looks_like_path(source: str) -> bool:
    """True when a missing ``source`` is clearly meant as a local path (so we
    report it missing instead of asking the hub for a dataset of that name)."""
    first = source.replace(os.sep, "/").split("/")[0]
    return (source.endswith(JSON_EXTS) or source.startswith((".", "/", "~"))
            or source.count("/") >= 2 or ("/" in source and os.path.isdir(first)))


def load_source(source: str) -> Source:
    """Read one data source into raw records (no field validation yet).

    A .json/.jsonl file or a folder holding such files is read directly (with
    line numbers); anything else is handed to ``datasets``.
    """
    path = os.path.expanduser(source)
    if os.path.isfile(path) and path.endswith(JSON_EXTS):
        train, ev = _read_json_file(path)
    elif os.path.isdir(path) and any(n.endswith(JSON_EXTS) for n in _listdir(path)) and not any(
        n in ("dataset_dict.json", "state.json") for n in _listdir(path)
    ):
        train, ev = _read_folder(path, _listdir(path))
    elif os.path.exists(path) or not _looks_like_path(source):
        train, ev = _read_hf_dataset(path if os.path.exists(path) else source)
    else:
        raise DataError(f"{source}: no such data file or folder")
    return Source(name=source, train=train, eval=ev)


def _listdir(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError as e:
        raise DataError(f"{path}: cannot list data folder ({e})") from None


# --------------------------------------------------------------------------- #
# Normalising rows
# --------------------------------------------------------------------------- #
def normalize_row(obj, origin: str, required: Sequence[str]) -> dict | None:
    """Validate one raw record; return the normalised row, or None if a
    required field is empty/whitespace (the caller counts the skip).

    ``response`` is a synonym of ``chosen``.  Required fields must be strings;
    optional non-string fields are recorded as None.
    """
    if not isinstance(obj, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(obj).__name__}")
    values = {
        "prompt": obj.get("prompt"),
        "chosen": obj.get("chosen") if obj.get("chosen") is not None else obj.get("response"),
        "rejected": obj.get("rejected"),
    }
    for name in required:
        if values[name] is None:
            hint = " (or 'response')" if name == "chosen" else ""
            raise DataError(f"{origin}: missing field '{name}'{hint}")
        if not isinstance(values[name], str):
            raise DataError(f"{origin}: field '{name}' must be a string, got {type(values[name]).__name__}")
    if any(not values[name].strip() for name in required):
        return None
    row = {k: (v if isinstance(v, str) else None) for k, v in values.items()}
    row["origin"] = origin
    return row


def _normalize_all(records: Iterable, required: Sequence[str], stats: dict) -> list:
    rows = []
    for obj, origin in records:
        row = normalize_row(obj, origin, required)
        if row is None:
            stats["skipped_empty"] += 1
        else:
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- #
# Splitting and blending
# --------------------------------------------------------------------------- #
def _rng(seed: int, *keys: str) -> random.Random:
    """A RNG keyed by seed and strings; stable across processes (unlike hash())."""
    digest = hashlib.sha256("\0".join([str(seed), *keys]).encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _source_key(source: str) -> str:
    """Key for per-source permutations: "data/x/" and "./data/x" agree."""
    return os.path.normpath(source) if _looks_like_path(source) or os.path.exists(source) else source


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


def split_source(src: Source, fractions: Sequence[float], step: int, seed: int,
                 eval_fraction: float) -> tuple[list, list]:
    """(this step's train records, eval records) of one source.

    The permutation depends only on (seed, source) and is applied to the raw
    records *before* any step-specific validation, so the three steps cut the
    very same order and their parts are disjoint.
    """
    order = list(range(len(src.train)))
    _rng(seed, "split", _source_key(src.name)).shuffle(order)
    if src.eval is None:
        n_eval = eval_size(len(order), eval_fraction)
        ev = [src.train[i] for i in sorted(order[:n_eval])]
        order = order[n_eval:]
    else:
        ev = src.eval
    b = split_bounds(len(order), fractions)
    return [src.train[i] for i in order[b[step - 1]:b[step]]], ev


def build_step_rows(data_paths: Sequence[str], data_split: str, step: int, seed: int,
                    sft_only_data_path: Sequence[str] = (), eval_fraction: float = 0.1,
                    log: Callable[[str], None] = print) -> StepRows:
    """Train/eval rows of ``step`` (1, 2 or 3) blended from all sources.

    Each source contributes its step part (see ``split_source``) and its whole
    eval split; ``sft_only_data_path`` sources feed step 1 only, with all their
    train rows (their eval split, own or held out, goes to step 1's eval).
    """
    if step not in STEP_FIELDS:
        raise DataError(f"step must be 1, 2 or 3, got {step!r}")
    fractions = parse_data_split(data_split)
    data_paths = list(data_paths)
    sft_only = list(sft_only_data_path) if step == 1 else []
    if not data_paths and not sft_only:
        raise DataError(f"{STEP_NAMES[step]}: no data sources given (--data_path)")
    required = STEP_FIELDS[step]
    stats = {"step": step, "rows_read": 0, "skipped_empty": 0, "sources": {}}
    train, evals = [], []
    for name, whole in [(p, False) for p in data_paths] + [(p, True) for p in sft_only]:
        src = load_source(name)
        stats["rows_read"] += len(src.train) + len(src.eval or [])
        # sft-only sources are not cut by --data_split: all their train rows go to step 1
        tr_rec, ev_rec = split_source(src, (1.0, 0.0, 0.0) if whole else fractions, step, seed, eval_fraction)
        tr, ev = _normalize_all(tr_rec, required, stats), _normalize_all(ev_rec, required, stats)
        stats["sources"][name] = {"read": len(src.train) + len(src.eval or []),
                                  "train": len(tr), "eval": len(ev), "sft_only": whole}
        train += tr
        evals += ev
    _rng(seed, "blend", str(step)).shuffle(train)
    stats.update(train=len(train), eval=len(evals))
    names = data_paths + sft_only
    if not train:
        raise DataError(f"{STEP_NAMES[step]}: 0 training rows from sources {names} with "
                        f"--data_split {data_split} (fractions {[round(f, 3) for f in fractions]}); "
                        f"give this step a larger share or more data")
    log(f"[data] {STEP_NAMES[step]}: {len(train)} train / {len(evals)} eval rows from "
        f"{len(names)} source(s); read {stats['rows_read']}, skipped_empty {stats['skipped_empty']}"
        + ("" if evals else "; WARNING: eval split is empty"))
    return StepRows(train=train, eval=evals, stats=stats)


# --------------------------------------------------------------------------- #
# Tokenisation
# --------------------------------------------------------------------------- #
def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens: the templates decide what is added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def bos_prefix(tokenizer) -> list[int]:
    """[bos] only when the tokenizer's own config adds one (e.g. Llama)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and getattr(tokenizer, "add_bos_token", False) else []


def _eos(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("tokenizer has no eos_token_id")
    return eos


def fit_prompt(prefix: list, prompt: list, longest_tail: int, max_len: int) -> tuple[list, bool]:
    """Left-truncate the prompt body so prefix+prompt+tail fits (>= 1 prompt token kept).

    Left truncation keeps the end of the prompt ("...Assistant:"), which is
    what the response continues.
    """
    over = len(prefix) + len(prompt) + longest_tail - max_len
    drop = max(0, min(over, len(prompt) - 1))
    return prefix + prompt[drop:], drop > 0


def fit_tail(prompt_ids: list, tail: list, max_len: int) -> tuple[list, bool]:
    """Right-truncate response+eos to what is left after the prompt."""
    keep = max(0, max_len - len(prompt_ids))
    return tail[:keep], keep < len(tail)


def _check_len(max_len: int, tokenizer) -> None:
    if max_len < len(bos_prefix(tokenizer)) + 2:
        raise DataError(f"max sequence length {max_len} is too small (need >= prompt token + response token)")


def tokenize_sft(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """SFT examples: ids = prompt + response + eos; loss only on response + eos."""
    _check_len(max_seq_len, tokenizer)
    eos, prefix = _eos(tokenizer), bos_prefix(tokenizer)
    stats = {"examples": 0, "truncated_prompt": 0, "truncated_response": 0, "skipped_empty": 0}
    out = []
    for row in rows:
        if not (row.get("chosen") or "").strip() or not (row.get("prompt") or "").strip():
            stats["skipped_empty"] += 1
            continue
        tail = encode(tokenizer, row["chosen"]) + [eos]
        p, cut_p = fit_prompt(prefix, encode(tokenizer, row["prompt"]), len(tail), max_seq_len)
        tail, cut_r = fit_tail(p, tail, max_seq_len)
        stats["truncated_prompt"] += cut_p
        stats["truncated_response"] += cut_r
        out.append({"input_ids": p + tail, "labels": [IGNORE_INDEX] * len(p) + tail})
    stats["examples"] = len(out)
    return out, stats


def tokenize_pairs(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """Reward-model pairs: chosen and rejected sequences share one prompt.

    The prompt is truncated once, for the longer side, so both sequences have
    the identical prompt prefix (the reward model compares them after it).
    Pairs with an empty side or chosen == rejected teach nothing: skipped.
    """
    _check_len(max_seq_len, tokenizer)
    eos, prefix = _eos(tokenizer), bos_prefix(tokenizer)
    stats = {"examples": 0, "truncated_prompt": 0, "truncated_response": 0, "skipped_bad_pairs": 0}
    out = []
    for row in rows:
        c, r = (row.get("chosen") or "").strip(), (row.get("rejected") or "").strip()
        if not c or not r or c == r or not (row.get("prompt") or "").strip():
            stats["skipped_bad_pairs"] += 1
            continue
        tails = [encode(tokenizer, row[k]) + [eos] for k in ("chosen", "rejected")]
        p, cut_p = fit_prompt(prefix, encode(tokenizer, row["prompt"]), max(map(len, tails)), max_seq_len)
        stats["truncated_prompt"] += cut_p
        seqs = []
        for tail in tails:
            tail, cut_r = fit_tail(p, tail, max_seq_len)
            stats["truncated_response"] += cut_r
            seqs.append(p + tail)
        out.append({"chosen_input_ids": seqs[0], "rejected_input_ids": seqs[1]})
    stats["examples"] = len(out)
    return out, stats


def tokenize_prompts(rows: Sequence[dict], tokenizer, max_prompt_seq_len: int) -> tuple[list, dict]:
    """PPO prompts; long prompts keep their last tokens (the part the answer follows)."""
    prefix = bos_prefix(tokenizer)
    if max_prompt_seq_len < len(prefix) + 1:
        raise DataError(f"max prompt length {max_prompt_seq_len} is too small")
    stats = {"examples": 0, "truncated_prompt": 0}
    out = []
    for row in rows:
        ids, cut = fit_prompt(prefix, encode(tokenizer, row["prompt"]), 0, max_prompt_seq_len)
        stats["truncated_prompt"] += cut
        out.append({"input_ids": ids})
    stats["examples"] = len(out)
    return out, stats


# --------------------------------------------------------------------------- #
# Collators
# --------------------------------------------------------------------------- #
def pad_batch(seqs: Sequence[Sequence[int]], pad_value: int, side: str = "right",
              length: int | None = None) -> torch.Tensor:
    """Pad lists of ints to one length on ``side`` -> LongTensor [B, L]."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    length = max(map(len, seqs)) if length is None else length
    out = torch.full((len(seqs), length), pad_value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            start = 0 if side == "right" else length - len(s)
            out[i, start:start + len(s)] = torch.as_tensor(list(s), dtype=torch.long)
    return out


def _mask(seqs: Sequence[Sequence[int]], side: str) -> torch.Tensor:
    return pad_batch([[1] * len(s) for s in seqs], 0, side)


class SFTCollator:
    """Right-pads SFT examples: input_ids (pad id), attention_mask, labels (-100)."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: Sequence[dict]) -> dict:
        ids = [ex["input_ids"] for ex in batch]
        return {"input_ids": pad_batch(ids, self.pad_token_id),
                "attention_mask": _mask(ids, "right"),
                "labels": pad_batch([ex["labels"] for ex in batch], IGNORE_INDEX)}


class PairCollator:
    """Pairs -> [2B, L]: the B chosen rows first, then the B rejected rows
    (DeepSpeed-Chat's layout: one forward pass, split the rewards in half)."""

    def __init__(self, pad_token_id: int, padding_side: str = "right"):
        self.pad_token_id = pad_token_id
        self.padding_side = padding_side

    def __call__(self, batch: Sequence[dict]) -> dict:
        seqs = [ex["chosen_input_ids"] for ex in batch] + [ex["rejected_input_ids"] for ex in batch]
        return {"input_ids": pad_batch(seqs, self.pad_token_id, self.padding_side),
                "attention_mask": _mask(seqs, self.padding_side)}


class PromptCollator:
    """Left-pads prompts so generation continues right after each prompt."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: Sequence[dict]) -> dict:
        ids = [ex["input_ids"] for ex in batch]
        return {"input_ids": pad_batch(ids, self.pad_token_id, "left"),
                "attention_mask": _mask(ids, "left")}


# --------------------------------------------------------------------------- #
# Plain text (step 3's pretraining mix, PPO-ptx)
# --------------------------------------------------------------------------- #
def read_texts(path: str) -> list[str]:
    """Texts for the language-modelling term: one per non-empty line of a .txt file, or the `text`
    field (else prompt + chosen) of each JSON/JSONL row; errors name the file and line."""
    if not path.endswith(JSON_EXTS):
        return [line for line in _read_text(path).splitlines() if line.strip()]
    texts = []
    for obj, origin in _read_json_file(path)[0]:
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            texts.append(obj["text"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("chosen"), str):
            texts.append(obj["prompt"] + obj["chosen"])
        else:
            raise DataError(f"{origin}: missing field 'text' (or 'prompt' and 'chosen')")
    if not texts:
        raise DataError(f"{path}: no text rows")
    return texts


def tokenize_texts(texts: Sequence[str], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """Every token trained; a text longer than `max_seq_len` is cut into several examples (nothing dropped)."""
    eos, prefix = _eos(tokenizer), bos_prefix(tokenizer)
    stats = {"examples": 0, "split_texts": 0}
    out = []
    for text in texts:
        ids = prefix + encode(tokenizer, text) + [eos]
        chunks = [ids[i:i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
        stats["split_texts"] += len(chunks) > 1
        out += [{"input_ids": c, "labels": list(c)} for c in chunks if len(c) > 1]
    stats["examples"] = len(out)
    return out, stats


def distributed_loader(examples: Sequence, batch_size: int, collate_fn, seed: int, drop_last: bool = False):
    """(sampler, loader): this rank's shuffled share of `examples`, the order fixed by (seed, epoch).

    The loader gets its own generator: a DataLoader otherwise draws its base seed from the GLOBAL
    torch RNG each time an epoch's iterator is created, which would shift dropout and sampling
    randomness after a resume.
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    sampler = DistributedSampler(examples, num_replicas=ranks, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(examples, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last,
                        generator=torch.Generator().manual_seed(seed))
    return sampler, loader
