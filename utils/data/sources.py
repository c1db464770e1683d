"""Reading data sources into raw ``(obj, origin)`` records, with real "path:line" origins."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Sequence

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
