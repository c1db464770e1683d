"""Tokenised data cached on disk (DeepSpeed-Chat's ``--data_output_path``).

Why: reading, normalising and tokenising a data set costs minutes for large sources, and without a
cache every run pays it again, on every rank. With ``--data_output_path DIR`` it is paid once per
data set: rank 0 builds the examples and writes them to DIR; later runs and the other ranks (which
wait at a barrier meanwhile and never tokenise) only read them back.

The key: the caller passes a JSON-serialisable ``key`` holding everything that changes the result
(step, each source with its file size and mtime, the tokenizer's identity, lengths, split, seed,
format flags). The entry's folder name is the sha256 of ``json.dumps(key, sort_keys=True)`` plus
this module's ``FORMAT_VERSION``, so a changed input or a new layout simply misses.

Layout of ``DIR/<sha256>/``:

* ``tensors.safetensors``: per int-list field F, ``F.values`` (all examples' values concatenated,
  int32 when they fit, else int64) and ``F.offsets`` (int64, n+1 cumulative lengths);
* ``meta.json``: the key, the count, the field names, the examples missing a field, every
  example's JSON fields (a prompt row's ``prompt``, ``origin`` and ``extra``), and the build's ``stats``;
* ``COMPLETE``: written last. An entry is built in a temp folder inside DIR and renamed into place,
  so a crash leaves no half entry under the final name; a folder without the marker is rebuilt.

Nothing loaded is pickled: safetensors holds raw tensors and JSON holds the rest, so reading a
cache entry can never run code (the project's promise for every file it loads).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from itertools import chain
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from utils.data.sources import DataError
from utils.runtime import distributed as dist
from utils.runtime.cache_dir import relax_permissions

FORMAT_VERSION = 2
TENSORS, META, MARKER = "tensors.safetensors", "meta.json", "COMPLETE"
JSON_FIELDS = ("extra", "prompt", "origin")  # kept as JSON; every other field is a list of ints
_INT32 = (-(2**31), 2**31 - 1)
_SHARED_INTS_SPAN = 1 << 22  # value ranges up to this share one int object per value (token ids do)

Examples = list[dict]
Built = tuple[Examples, dict]


def cached_examples(
    cache_dir: str | None, key: dict, build: Callable[[], Built], log: Callable[[str], None] = print
) -> Built:
    """``build()``'s ``(examples, stats)``, from the cache entry of ``key`` in ``cache_dir`` when it
    is complete, else built (by rank 0 only when there are several ranks) and written there."""
    if cache_dir is None:
        return build()
    entry = os.path.join(cache_dir, entry_name(key))
    if dist.world_size() > 1:
        return _shared(cache_dir, entry, build, log)
    return _load_or_build(cache_dir, entry, build, log)


def entry_name(key: dict) -> str:
    """The folder name of ``key``'s entry: sha256 of the key and the on-disk format version."""
    text = json.dumps({"format_version": FORMAT_VERSION, "key": key}, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- ranks
def _shared(cache_dir: str, entry: str, build: Callable[[], Built], log) -> Built:
    """Rank 0 loads or builds; all ranks then meet at a barrier whether it worked or not (a raised
    build must not leave the others waiting forever), learn whether it did, and the others read."""
    result, failed = None, False
    if dist.is_rank0():
        try:
            result = _load_or_build(cache_dir, entry, build, log)
        except BaseException:
            failed = True
            _barrier_and_flag(True)
            raise
    if _barrier_and_flag(failed):
        raise DataError(
            f"--data_output_path: rank 0 failed to build the tokenised data in {entry} "
            "(its error is in rank 0's output)"
        )
    if result is not None:
        return result
    if not is_complete(entry):
        raise DataError(
            f"--data_output_path: rank {dist.rank()} does not see the tokenised data rank 0 "
            f"wrote to {entry}; the folder must be on a file system every rank reads"
        )
    return _load_logged(entry, log)


def _barrier_and_flag(failed: bool) -> bool:
    """Wait for every rank, then whether any of them (i.e. rank 0) failed."""
    dist.barrier()
    return dist.all_reduce_max(1.0 if failed else 0.0) > 0


# --------------------------------------------------------------------------- one process
def _load_or_build(cache_dir: str, entry: str, build: Callable[[], Built], log) -> Built:
    _check_dir(cache_dir)
    if is_complete(entry):
        return _load_logged(entry, log)
    start = time.perf_counter()
    examples, stats = build()
    _write(cache_dir, entry, examples, stats)
    log(f"[data] tokenised data cached in {entry} ({len(examples)} examples, {time.perf_counter() - start:.1f} s)")
    return examples, stats


def _load_logged(entry: str, log) -> Built:
    examples, stats = load_entry(entry)
    log(f"[data] tokenised data reused from {entry} ({len(examples)} examples)")
    return examples, stats


def _check_dir(cache_dir: str) -> None:
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        raise DataError(f"--data_output_path {cache_dir}: exists and is not a folder")


def is_complete(entry: str) -> bool:
    """True when ``entry`` was finished: its marker (written last) and its files are there."""
    return all(os.path.isfile(os.path.join(entry, name)) for name in (MARKER, META, TENSORS))


# --------------------------------------------------------------------------- writing
def _write(cache_dir: str, entry: str, examples: Examples, stats: dict) -> None:
    """Write the entry into a temp folder next to it, mark it complete, rename it into place."""
    tmp = _make_temp(cache_dir, os.path.basename(entry))
    try:
        _write_files(tmp, examples, stats)
        _publish(tmp, entry)
        tmp = None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _make_temp(cache_dir: str, name: str) -> str:
    try:
        os.makedirs(cache_dir, exist_ok=True)
        return tempfile.mkdtemp(prefix=f".{name}.tmp.", dir=cache_dir)
    except OSError as e:
        raise DataError(
            f"--data_output_path {cache_dir}: cannot write the tokenised data there ({e.strerror or e})"
        ) from None


def _write_files(folder: str, examples: Examples, stats: dict) -> None:
    fields = _field_names(examples)
    tensors, missing = {}, {}
    for field in fields:
        values, offsets, absent = _flatten(examples, field)
        tensors[f"{field}.values"], tensors[f"{field}.offsets"] = values, offsets
        if absent:
            missing[field] = absent
    json_fields = {
        str(i): {k: ex[k] for k in JSON_FIELDS if k in ex}
        for i, ex in enumerate(examples)
        if any(k in ex for k in JSON_FIELDS)
    }
    meta = {
        "format_version": FORMAT_VERSION,
        "count": len(examples),
        "fields": fields,
        "missing": missing,
        "json_fields": json_fields,
        "stats": stats,
    }
    save_file(tensors, os.path.join(folder, TENSORS))
    with open(os.path.join(folder, META), "w", encoding="utf-8") as f:
        json.dump(meta, f)
    with open(os.path.join(folder, MARKER), "w") as f:
        f.write(f"{time.time()}\n")
    relax_permissions(folder)  # mkdtemp makes a 0700 folder: other users' runs must read it


def _field_names(examples: Examples) -> list[str]:
    """The int-list fields of all examples, in first-seen order (``JSON_FIELDS`` go to JSON)."""
    names = dict.fromkeys(k for ex in examples for k in ex if k not in JSON_FIELDS)
    return list(names)


def _flatten(examples: Examples, field: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """One field of all examples as concatenated values, offsets, and the examples lacking it."""
    seqs = [ex.get(field) for ex in examples]
    absent = [i for i, s in enumerate(seqs) if s is None]
    seqs = [s or [] for s in seqs]
    lengths = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    flat = list(chain.from_iterable(seqs))
    values = torch.tensor(flat) if flat else torch.zeros(0, dtype=torch.int64)
    if values.dtype != torch.int64:
        raise TypeError(f"cannot cache field {field!r}: its values are not all ints ({values.dtype})")
    if flat and _INT32[0] <= int(values.min()) and int(values.max()) <= _INT32[1]:
        values = values.to(torch.int32)
    return values, offsets, absent


def _publish(tmp: str, entry: str) -> None:
    """Rename ``tmp`` to ``entry``; an incomplete leftover is replaced, a complete one (another
    process won the race) is kept and ours discarded."""
    if os.path.isdir(entry) and not is_complete(entry):
        shutil.rmtree(entry, ignore_errors=True)
    try:
        os.rename(tmp, entry)
    except OSError:
        if not is_complete(entry):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- reading
def load_entry(entry: str) -> Built:
    """The examples and stats of a complete entry, equal to what was built."""
    try:
        with open(os.path.join(entry, META), encoding="utf-8") as f:
            meta = json.load(f)
        tensors = load_file(os.path.join(entry, TENSORS))
    except Exception as e:  # noqa: BLE001 - corrupt JSON, truncated safetensors, I/O errors
        raise DataError(f"--data_output_path: cache entry {entry} is unreadable ({e}); delete it to rebuild") from None
    n = meta["count"]
    columns = [_unflatten(tensors, field, n, entry) for field in meta["fields"]]
    examples = [dict(zip(meta["fields"], row)) for row in zip(*columns)] if columns else [{} for _ in range(n)]
    for field, absent in meta["missing"].items():
        for i in absent:
            del examples[i][field]
    for i, values in meta["json_fields"].items():
        examples[int(i)].update(values)
    return examples, meta["stats"]


def _unflatten(tensors: dict, field: str, n: int, entry: str) -> list[list[int]]:
    """One field's lists back from its values and offsets: one conversion each, then slices."""
    values = _python_ints(tensors[f"{field}.values"])
    offsets = tensors[f"{field}.offsets"].tolist()
    if len(offsets) != n + 1 or offsets[-1] != len(values):
        raise DataError(
            f"--data_output_path: cache entry {entry} is inconsistent (field {field!r}); delete it to rebuild"
        )
    return [values[a:b] for a, b in zip(offsets, offsets[1:])]


def _python_ints(values: torch.Tensor) -> list[int]:
    """``values.tolist()``, but with one shared int object per distinct value when the range is small.

    ``tolist`` makes a fresh 32-byte int object for every element (13M tokens: 400 MB per field,
    held by every rank for the whole run); indexing a table of the range's ints (numpy, in C) costs
    the same time and leaves only the list's 8-byte references."""
    if values.numel() == 0:
        return []
    lo, hi = int(values.min()), int(values.max())
    if hi - lo > _SHARED_INTS_SPAN:
        return values.tolist()
    table = np.arange(lo, hi + 1, dtype=np.int64).astype(object)
    return table[values.numpy().astype(np.int64) - lo].tolist()
