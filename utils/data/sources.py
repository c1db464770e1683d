"""Reading data sources into raw ``(obj, origin)`` records, with real "path:line" origins."""

from __future__ import annotations

import codecs
import csv
import gzip
import hashlib
import io
import json
import os
import re
import sys
import zlib
from dataclasses import dataclass

from utils.errors import ProjectError

JSON_EXTS = (".json", ".jsonl")
# every file type read directly (with file:line origins); anything else goes to ``datasets``
DATA_EXTS = (".json", ".jsonl", ".jsonl.gz", ".csv", ".parquet")
EVAL_SPLIT_NAMES = ("eval", "test", "validation")
# file names (without extension) of a data folder's held-out split; see ``_read_folder``
FOLDER_EVAL_NAMES = ("eval", "test", "dev", "valid", "validation")
# metadata of a ``datasets`` folder, never data
DATASETS_META_FILES = ("dataset_info.json", "dataset_dict.json", "state.json")


class DataError(ProjectError, ValueError):
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


def _decode(raw: bytes, path: str) -> str:
    """UTF-8 text of a file's bytes (a leading BOM is dropped); bad bytes raise
    DataError naming the file, line and column (not a byte offset)."""
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        pos = e.start
        breaks = list(re.finditer(rb"\r\n|\r|\n", raw[:pos]))
        line, line_start = len(breaks) + 1, (breaks[-1].end() if breaks else 0)
        column = len(raw[line_start:pos].decode("utf-8", errors="replace")) + 1
        raise DataError(f"{path}:{line}: not valid UTF-8 (byte 0x{raw[pos]:02x} at column {column})") from None


def _read_bytes(path: str) -> bytes:
    try:
        if path.lower().endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            return f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: not a valid gzip file ({e})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read data file ({e})") from None


def _read_text(path: str) -> str:
    """Text of a (possibly gzipped) UTF-8 file; a BOM is accepted."""
    return _decode(_read_bytes(path), path)


_LINE_BREAK = re.compile(r"\r\n|\r|\n")  # JSON strings cannot hold a raw CR/LF, but may hold U+2028


def _read_jsonl(path: str) -> list:
    """Records of a .jsonl (or .jsonl.gz) file; blank lines are allowed, bad lines raise.

    Lines end at \\n, \\r\\n or \\r only (a U+2028 inside a JSON string is not a line break)."""
    records = []
    for lineno, line in enumerate(_LINE_BREAK.split(_read_text(path)), 1):
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
    raise DataError(
        f"{path}: expected a JSON list of rows, or an object with one list of rows (or 'train'/'eval' lists)"
    )


def _read_csv(path: str) -> list:
    """Records of a .csv file: the header row gives the field names, every value
    is a string; blank lines are skipped; origins and errors name the row's line."""
    text = _read_text(path)
    old_limit = csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # long responses are normal
    try:
        reader = csv.reader(io.StringIO(text, newline=""), strict=True)
        header, header_line, records, line = None, 0, [], 1
        try:
            for values in reader:
                start, line = line, reader.line_num + 1  # a quoted value may span lines
                if not values:  # blank line
                    continue
                if header is None:
                    header, header_line = values, start
                    dup = sorted({v for v in values if values.count(v) > 1})
                    if dup:
                        raise DataError(f"{path}:{start}: CSV header repeats column(s) {dup}")
                    continue
                if len(values) != len(header):
                    raise DataError(
                        f"{path}:{start}: CSV row has {len(values)} values, the header "
                        f"(line {header_line}) has {len(header)} columns"
                    )
                records.append((dict(zip(header, values)), f"{path}:{start}"))
        except csv.Error as e:
            raise DataError(f"{path}:{reader.line_num}: malformed CSV ({e})") from None
    finally:
        csv.field_size_limit(old_limit)
    return records


def _read_parquet(path: str) -> list:
    """Records of a .parquet file (rows as dicts); origins are "path:row N"."""
    try:
        import pyarrow.parquet as pq  # lazy: optional (pyarrow), only Parquet sources need it
    except ImportError:
        raise DataError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...; the user needs the file name
        raise DataError(f"{path}: cannot read Parquet file ({type(e).__name__}: {e})") from None
    return [(row, f"{path}:row {i}") for i, row in enumerate(rows, 1)]


def _data_ext(name: str) -> str | None:
    """The data extension (one of DATA_EXTS) ``name`` ends with, if any."""
    return next((ext for ext in DATA_EXTS if name.lower().endswith(ext)), None)


def _read_data_file(path: str) -> tuple[list, list | None]:
    """(train, eval-or-None) records of one file of a DATA_EXTS type."""
    ext = _data_ext(path)
    if ext in (".jsonl", ".jsonl.gz"):
        return _read_jsonl(path), None
    if ext == ".json":
        return _read_json(path)
    if ext == ".csv":
        return _read_csv(path), None
    if ext == ".parquet":
        return _read_parquet(path), None
    raise DataError(f"{path}: not a data file (expected one of {', '.join(DATA_EXTS)})")


_SHARD_RE = re.compile(r"^(?P<split>.+?)-(?P<index>\d+)-of-(?P<total>\d+)$")


def _folder_data_files(folder: str, names: list) -> list:
    """The data files of a folder: plain files with a DATA_EXTS extension, less
    hidden files and ``datasets`` metadata (README.md etc. are not data)."""
    return sorted(
        n
        for n in names
        if _data_ext(n)
        and not n.startswith(".")
        and n not in DATASETS_META_FILES
        and os.path.isfile(os.path.join(folder, n))
    )


def _split_files(folder: str, split: str, names: list) -> list:
    """The file(s) of one split: one ``split.EXT`` or a complete set of
    ``split-00000-of-0000N.EXT`` shards (sorted by shard index)."""
    plain = [n for n in names if not _SHARD_RE.match(n[: -len(_data_ext(n))])]
    shards = {}
    for n in names:
        m = _SHARD_RE.match(n[: -len(_data_ext(n))])
        if m:
            shards.setdefault((int(m["index"]), int(m["total"])), []).append(n)
    if len(plain) > 1 or (plain and shards):
        raise DataError(
            f"{folder}: several {split} files ({', '.join(names)}); keep one "
            f"(or shards named {split}-00000-of-00002.jsonl, {split}-00001-of-00002.jsonl)"
        )
    if plain:
        return plain
    totals = {total for _, total in shards}
    dup = [n for ns in shards.values() if len(ns) > 1 for n in ns]
    missing = sorted({(i, t) for t in totals for i in range(t)} - set(shards))
    if dup or len(totals) > 1 or missing or any(i >= t for i, t in shards):
        want = ", ".join(f"{split}-{i:05d}-of-{t:05d}.*" for i, t in missing) or "none"
        raise DataError(f"{folder}: incomplete or inconsistent {split} shards ({', '.join(names)}; missing: {want})")
    return [shards[k][0] for k in sorted(shards)]


def _read_folder(folder: str, names: list) -> tuple[list, list | None]:
    """A data folder, read by file name.

    * Data files are those with a DATA_EXTS extension (.json, .jsonl,
      .jsonl.gz, .csv, .parquet); other files (README.md, .gitattributes,
      hidden files, ``datasets`` metadata such as dataset_info.json) and
      sub-folders are ignored.
    * Training file: ``train.EXT``, or shards ``train-00000-of-00002.EXT``,
      ``train-00001-of-00002.EXT`` (the set must be complete).
    * Held-out file: ``eval``, ``test``, ``dev``, ``valid`` or ``validation``
      (``.EXT``, or shards likewise).  It is the source's eval split and is
      never merged into training.  Only one held-out name may be present:
      several (e.g. dev.jsonl and test.jsonl) are refused, naming them, since
      which one is the eval split is the user's call.  Without a held-out
      file, a fraction of the training rows is held out (``--eval_fraction``).
    * A folder with a train or held-out name must have a training file (a
      folder with only eval.jsonl is refused, naming the folder and its
      files), and every other data file in it is refused, naming it.
    * Backward compatibility: a folder where no data file has a train or
      held-out name (e.g. only data.jsonl, or a.jsonl and b.jsonl) is all
      training data (files in sorted order).
    * A single training file and no held-out file: the file is read as if
      given alone (a .json with ``train``/``eval`` lists gives both splits);
      otherwise a .json training file may not carry its own eval list (with
      a held-out file or several training files it would be ambiguous), and
      a held-out .json file holds one list of rows.
    """
    files = _folder_data_files(folder, names)
    by_split: dict = {}
    others = []
    for n in files:
        stem = n[: -len(_data_ext(n))]
        m = _SHARD_RE.match(stem)
        split = (m["split"] if m else stem).lower()
        if split == "train" or split in FOLDER_EVAL_NAMES:
            by_split.setdefault(split, []).append(n)
        else:
            others.append(n)
    if not by_split:  # no split names at all: every data file is training data
        train_names, eval_names = files, []
    else:
        if "train" not in by_split:
            raise DataError(
                f"{folder}: no training file (train.jsonl, train.json, train.csv, ... or "
                f"train-00000-of-00001.* shards); the folder has: {', '.join(sorted(names))}"
            )
        if others:
            raise DataError(
                f"{folder}: data file(s) {', '.join(others)} match neither the training "
                f"name (train.*) nor a held-out name ({'/'.join(FOLDER_EVAL_NAMES)}.*); "
                f"rename them or move them out of the folder"
            )
        held_out = [s for s in FOLDER_EVAL_NAMES if s in by_split]
        if len(held_out) > 1:
            named = ", ".join(n for s in held_out for n in by_split[s])
            raise DataError(
                f"{folder}: several held-out files ({named}); keep one as the eval split "
                f"(eval/test/dev/valid/validation) and move the others out of the folder"
            )
        train_names = _split_files(folder, "train", by_split["train"])
        eval_names = _split_files(folder, held_out[0], by_split[held_out[0]]) if held_out else []
    if len(train_names) == 1 and not eval_names:  # one file: its own splits, as when given alone
        return _read_data_file(os.path.join(folder, train_names[0]))
    train: list = []
    for n in train_names:
        recs, ev = _read_data_file(os.path.join(folder, n))
        if ev is not None:
            raise DataError(
                f"{os.path.join(folder, n)}: has its own eval split, but the folder "
                + ("has a held-out file" if eval_names else "has several training files")
                + "; put held-out rows in one eval.* file"
            )
        train += recs
    if not eval_names:
        return train, None
    evals: list = []
    for n in eval_names:
        recs, ev = _read_data_file(os.path.join(folder, n))
        if ev is not None:
            raise DataError(f"{os.path.join(folder, n)}: a held-out file holds one list of rows, not train/eval lists")
        evals += recs
    return train, evals


def _read_hf_dataset(source: str) -> tuple[list, list | None]:
    """Records of a ``datasets`` dataset (hub name, local datasets folder or
    ``save_to_disk`` output).  Imported lazily: most runs use local JSON."""
    try:
        import datasets  # lazy: +1 s on every --help (datasets)

        if os.path.isdir(source) and any(
            os.path.exists(os.path.join(source, m)) for m in ("dataset_dict.json", "state.json")
        ):
            ds = datasets.load_from_disk(source)
        else:
            ds = datasets.load_dataset(source)
    except Exception as e:  # datasets raises many types; the user needs the source name
        raise DataError(
            f"{source}: not a JSON file/folder and datasets could not load it ({type(e).__name__}: {e})"
        ) from None
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
    return (
        _data_ext(source) is not None
        or source.startswith((".", "/", "~"))
        or source.count("/") >= 2
        or ("/" in source and os.path.isdir(first))
    )


def load_source(source: str, fmt=None) -> Source:
    """Read one data source into raw records (no field validation yet, but a file mixing preference pairs and
    unpaired feedback rows is refused: ``utils.data.formats.check_shapes`` with ``fmt``, a RowFormat, whose
    key names default to "chosen", "rejected" and "label").

    A file of a DATA_EXTS type (.json, .jsonl, .jsonl.gz, .csv, .parquet) or a
    folder holding such files (read by name, see ``_read_folder``) is read
    directly (with line numbers); anything else is handed to ``datasets``
    (as is a ``save_to_disk`` folder).
    """
    from utils.data.formats import DEFAULT_FORMAT, check_shapes  # lazy: formats imports this module (DataError)
    from utils.data.reasoning_gym import generate, is_reasoning_gym  # lazy: it imports this module (DataError)

    if is_reasoning_gym(source):  # rows generated by reasoning-gym's tasks, no file (utils/data/reasoning_gym.py)
        train, ev = generate(source, (fmt or DEFAULT_FORMAT).key("prompt"))
        return Source(name=source, train=train, eval=ev)
    path = os.path.expanduser(source)
    if os.path.isfile(path) and _data_ext(path):
        train, ev = _read_data_file(path)
    elif (
        os.path.isdir(path)
        and _folder_data_files(path, _listdir(path))
        and not any(n in ("dataset_dict.json", "state.json") for n in _listdir(path))
    ):
        train, ev = _read_folder(path, _listdir(path))
    elif os.path.exists(path) or not _looks_like_path(source):
        train, ev = _read_hf_dataset(path if os.path.exists(path) else source)
    else:
        raise DataError(f"{source}: no such data file or folder")
    check_shapes(train + (ev or []), fmt or DEFAULT_FORMAT)
    return Source(name=source, train=train, eval=ev)


def _listdir(path: str) -> list:
    try:
        return os.listdir(path)
    except OSError as e:
        raise DataError(f"{path}: cannot list data folder ({e})") from None


def source_fingerprint(source: str) -> list:
    """What identifies a source's content for the tokenised-data cache: its absolute path and the
    size and mtime of each file in it (a folder's files recursively), or a hub name as given (a reasoning_gym:
    source with the library's version)."""
    from utils.data.reasoning_gym import fingerprint, is_reasoning_gym  # lazy: it imports this module (DataError)

    if is_reasoning_gym(source):
        return fingerprint(source)
    path = os.path.abspath(os.path.expanduser(source))
    if os.path.isfile(path):
        st = os.stat(path)
        return [path, st.st_size, st.st_mtime_ns]
    if os.path.isdir(path):
        files = []
        for folder, dirs, names in os.walk(path):
            dirs.sort()
            for name in sorted(names):
                st = os.stat(os.path.join(folder, name))
                files.append([os.path.relpath(os.path.join(folder, name), path), st.st_size, st.st_mtime_ns])
        return [path, files]
    return [source]


def source_files(source: str) -> list[str]:
    """The local files ``load_source`` reads for ``source``: the file itself, a data folder's data files
    (``_read_folder`` reads them or refuses the source), every file of a ``datasets`` folder; none for a
    hub name (nothing local to read)."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        return [source]
    if not os.path.isdir(path):
        return []
    names = _listdir(path)
    data_files = _folder_data_files(path, names)
    if data_files and not any(n in ("dataset_dict.json", "state.json") for n in names):
        return [os.path.join(source, n) for n in data_files]
    return sorted(
        os.path.join(source, os.path.relpath(os.path.join(folder, n), path))
        for folder, _, files in os.walk(path)
        for n in files
    )


def content_hashes(sources: list[str]) -> dict[str, str]:
    """{file: sha256 of its bytes} of the files the ``sources`` are read from (``source_files``): what a
    resumed run compares to its checkpoint's, since an in-place edit can keep the size and row count.
    One streaming read per file, no parsing (2.2 MB of demo data: a few ms)."""
    hashes = {}
    for source in sources:
        for path in source_files(source):
            try:
                with open(os.path.expanduser(path), "rb") as f:
                    hashes[path] = hashlib.file_digest(f, "sha256").hexdigest()
            except OSError as e:
                raise DataError(f"{path}: cannot read data file ({e})") from None
    return hashes
