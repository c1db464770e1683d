"""Tests of utils/data/sources.py: data folders read by name, more file types, encodings."""

import csv
import gzip
import json
import os

import pytest

from utils import data as D
from utils.data import DataError


def rows(n, tag="r"):
    return [
        {"prompt": f"{tag} prompt {i}", "chosen": f"{tag} good {i}", "rejected": f"{tag} bad {i}"} for i in range(n)
    ]


def write(path, rows_or_text):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    text = rows_or_text if isinstance(rows_or_text, str) else "".join(json.dumps(r) + "\n" for r in rows_or_text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return str(path)


def prompts(records):
    return [obj["prompt"] for obj, _ in records]


# --------------------------------------------------------------------------- folders, by name
def test_folder_with_only_eval_file_is_refused(tmp_path):
    write(tmp_path / "d" / "eval.jsonl", rows(3, "e"))
    write(tmp_path / "d" / "README.md", "about")
    with pytest.raises(DataError, match=r"d: no training file .*the folder has: README\.md, eval\.jsonl"):
        D.load_source(str(tmp_path / "d"))


@pytest.mark.parametrize("name", ["dev", "valid", "validation", "test", "eval"])
def test_held_out_file_is_the_eval_split_never_training(tmp_path, name):
    write(tmp_path / "d" / "train.jsonl", rows(5, "t"))
    write(tmp_path / "d" / f"{name}.jsonl", rows(2, "e"))
    src = D.load_source(str(tmp_path / "d"))
    assert prompts(src.train) == [f"t prompt {i}" for i in range(5)]
    assert prompts(src.eval) == ["e prompt 0", "e prompt 1"]
    assert src.eval[0][1] == f"{tmp_path / 'd' / name}.jsonl:1"


def test_several_held_out_names_are_refused(tmp_path):
    write(tmp_path / "d" / "train.jsonl", rows(5, "t"))
    write(tmp_path / "d" / "dev.jsonl", rows(2, "v"))
    write(tmp_path / "d" / "test.jsonl", rows(2, "e"))
    with pytest.raises(DataError, match=r"several held-out files \(test\.jsonl, dev\.jsonl\)"):
        D.load_source(str(tmp_path / "d"))


def test_other_data_file_beside_train_and_eval_is_refused(tmp_path):
    write(tmp_path / "d" / "train.jsonl", rows(5, "t"))
    write(tmp_path / "d" / "eval.jsonl", rows(2, "e"))
    write(tmp_path / "d" / "extra.jsonl", rows(2, "x"))
    with pytest.raises(DataError, match=r"d: data file\(s\) extra\.jsonl match neither"):
        D.load_source(str(tmp_path / "d"))
    # also beside a lone train file (not merged into the training rows)
    os.remove(tmp_path / "d" / "eval.jsonl")
    with pytest.raises(DataError, match=r"extra\.jsonl match neither"):
        D.load_source(str(tmp_path / "d"))


def test_train_shards_and_incomplete_shards(tmp_path):
    d = tmp_path / "d"
    write(d / "train-00001-of-00002.jsonl", rows(2, "b"))
    write(d / "train-00000-of-00002.jsonl", rows(2, "a"))
    write(d / "validation-00000-of-00001.jsonl", rows(1, "e"))
    src = D.load_source(str(d))
    assert prompts(src.train) == ["a prompt 0", "a prompt 1", "b prompt 0", "b prompt 1"]
    assert prompts(src.eval) == ["e prompt 0"]
    os.remove(d / "train-00001-of-00002.jsonl")
    with pytest.raises(DataError, match=r"incomplete or inconsistent train shards.*train-00001-of-00002"):
        D.load_source(str(d))
    write(d / "train.jsonl", rows(2, "t"))
    with pytest.raises(DataError, match=r"several train files"):
        D.load_source(str(d))


def test_two_training_files_are_refused(tmp_path):
    write(tmp_path / "d" / "train.json", json.dumps(rows(2)))
    write(tmp_path / "d" / "train.jsonl", rows(2))
    with pytest.raises(DataError, match=r"several train files \(train\.json, train\.jsonl\)"):
        D.load_source(str(tmp_path / "d"))


def test_json_train_file_with_own_eval_list_beside_eval_file_is_refused(tmp_path):
    write(tmp_path / "d" / "train.json", json.dumps({"train": rows(3), "test": rows(1, "e")}))
    write(tmp_path / "d" / "eval.jsonl", rows(1, "e"))
    with pytest.raises(DataError, match=r"train\.json: has its own eval split"):
        D.load_source(str(tmp_path / "d"))
    # alone in its folder, its own lists are the splits (as for the file itself)
    os.remove(tmp_path / "d" / "eval.jsonl")
    src = D.load_source(str(tmp_path / "d"))
    assert len(src.train) == 3 and prompts(src.eval) == ["e prompt 0"]


def test_non_data_files_are_ignored(tmp_path):
    d = tmp_path / "d"
    write(d / "train.jsonl", rows(3, "t"))
    write(d / "eval.jsonl", rows(1, "e"))
    write(d / "README.md", "# data")
    write(d / ".gitattributes", "*.jsonl filter=lfs")
    write(d / "dataset_info.json", json.dumps({"description": "x"}))
    os.makedirs(d / "raw")
    src = D.load_source(str(d))
    assert len(src.train) == 3 and len(src.eval) == 1
    # a folder with one other-named data file: it is the training data; metadata is not read as rows
    write(tmp_path / "f" / "data.jsonl", rows(4))
    write(tmp_path / "f" / "dataset_info.json", json.dumps({"description": "x"}))
    src = D.load_source(str(tmp_path / "f"))
    assert len(src.train) == 4 and src.eval is None


def test_demo_folders_still_read(tmp_path):
    from data import make_demo_data

    # data/demo is generated (gitignored), so build a small copy: a clean checkout has none
    make_demo_data.main(
        ["--out", str(tmp_path), "--sft_train", "20", "--sft_eval", "5", "--pairs_train", "20", "--pairs_eval", "5"]
    )
    for name in ("sft", "pairs"):
        src = D.load_source(str(tmp_path / name))
        assert src.train and src.eval
        assert src.train[0][1].endswith(os.path.join(name, "train.jsonl") + ":1")
        assert src.eval[0][1].endswith(os.path.join(name, "eval.jsonl") + ":1")


# --------------------------------------------------------------------------- file types
def test_jsonl_gz_file(tmp_path):
    p = tmp_path / "x.jsonl.gz"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps(rows(1)[0]) + "\n\n" + json.dumps(rows(2)[1]) + "\n")
    src = D.load_source(str(p))
    assert prompts(src.train) == ["r prompt 0", "r prompt 1"] and src.train[1][1] == f"{p}:3"
    with gzip.open(p, "wt", encoding="utf-8") as f:
        f.write(json.dumps(rows(1)[0]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"x\.jsonl\.gz:2: malformed JSON"):
        D.load_source(str(p))
    (tmp_path / "bad.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz: not a valid gzip file"):
        D.load_source(str(tmp_path / "bad.jsonl.gz"))


def test_csv_file_header_strings_and_row_lines(tmp_path):
    p = tmp_path / "x.csv"
    with open(p, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "chosen", "rejected", "score"])
        w.writerow(["Q1", "multi\nline answer", "bad", 3])
        w.writerow(["Q2", "good", "bad", 4])
    src = D.load_source(str(p))
    assert [obj for obj, _ in src.train] == [
        {"prompt": "Q1", "chosen": "multi\nline answer", "rejected": "bad", "score": "3"},
        {"prompt": "Q2", "chosen": "good", "rejected": "bad", "score": "4"},
    ]
    assert [o for _, o in src.train] == [f"{p}:2", f"{p}:4"]  # the line each row starts on
    res = D.build_step_rows([str(p)], "0,1,0", 2, 0, eval_fraction=0, log=lambda m: None)
    assert len(res.train) == 2
    p.write_text("prompt,chosen\nQ1,A1\nQ2,A2,extra\n")
    with pytest.raises(DataError, match=r"x\.csv:3: CSV row has 3 values, the header \(line 1\) has 2"):
        D.load_source(str(p))
    p.write_text('prompt,chosen\nQ1,A1\nQ2,"A"2\n')
    with pytest.raises(DataError, match=r"x\.csv:3: malformed CSV"):
        D.load_source(str(p))


def test_parquet_file(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "x.parquet"
    pq.write_table(pa.Table.from_pylist(rows(2) + [{"prompt": "p", "chosen": None, "rejected": "r"}]), p)
    src = D.load_source(str(p))
    assert [obj for obj, _ in src.train][:2] == rows(2) and src.train[0][1] == f"{p}:row 1"
    with pytest.raises(DataError, match=r"x\.parquet:row 3: missing field 'chosen'"):
        D.build_step_rows([str(p)], "1,0,0", 1, 0, eval_fraction=0, log=lambda m: None)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: cannot read Parquet file"):
        D.load_source(str(tmp_path / "bad.parquet"))


def test_folder_of_csv_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    d = tmp_path / "d"
    write(d / "train.csv", "prompt,chosen\nQ1,A1\nQ2,A2\n")
    pq.write_table(pa.Table.from_pylist([{"prompt": "E", "chosen": "e"}]), d / "test.parquet")
    src = D.load_source(str(d))
    assert prompts(src.train) == ["Q1", "Q2"] and prompts(src.eval) == ["E"]


def test_missing_csv_is_reported_missing(tmp_path):
    with pytest.raises(DataError, match=r"nope\.csv: no such data file"):
        D.load_source("nope.csv")


# --------------------------------------------------------------------------- encodings
def test_utf8_bom_accepted(tmp_path):
    bom = "\ufeff"
    a = write(tmp_path / "a.jsonl", bom + json.dumps(rows(1)[0]) + "\n")
    b = write(tmp_path / "b.json", bom + json.dumps(rows(2)))
    c = write(tmp_path / "c.csv", bom + "prompt,chosen\nQ,A\n")
    assert prompts(D.load_source(a).train) == ["r prompt 0"]
    assert prompts(D.load_source(b).train) == ["r prompt 0", "r prompt 1"]
    assert [obj for obj, _ in D.load_source(c).train] == [{"prompt": "Q", "chosen": "A"}]


def test_non_utf8_names_file_line_and_column(tmp_path):
    p = tmp_path / "data.jsonl"
    p.write_bytes(b'{"prompt": "a", "chosen": "b"}\n\n{"p\xffrompt": "a"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl:3: not valid UTF-8 \(byte 0xff at column 4\)"):
        D.load_source(str(p))
    q = tmp_path / "data.csv"
    q.write_bytes(b"prompt,chosen\r\n\xc3\xa9,ok\r\nQ\xe9,A\r\n")
    with pytest.raises(DataError, match=r"data\.csv:3: not valid UTF-8 \(byte 0xe9 at column 2\)"):
        D.load_source(str(q))
    g = tmp_path / "data.jsonl.gz"
    with gzip.open(g, "wb") as f:
        f.write(b'{"prompt": "\xc3\xa9\xff"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl\.gz:1: not valid UTF-8 \(byte 0xff at column 14\)"):
        D.load_source(str(g))


def test_jsonl_line_separator_inside_string_is_not_a_line_break(tmp_path):
    p = write(
        tmp_path / "x.jsonl",
        json.dumps({"prompt": "a\u2028b", "chosen": "c"}, ensure_ascii=False)
        + "\n"
        + json.dumps({"prompt": "d", "chosen": "e"})
        + "\n",
    )
    src = D.load_source(p)
    assert prompts(src.train) == ["a\u2028b", "d"] and src.train[1][1] == f"{p}:2"
