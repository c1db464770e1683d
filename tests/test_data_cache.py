"""Tests of utils/data/token_cache.py: --data_output_path's tokenised-data cache (reuse, keys, half entries,
errors, no pickle on disk, only rank 0 builds)."""

import json
import os

import pytest
import torch

from utils.data import DataError
from utils.data import token_cache as C

EXAMPLES = [
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [], "labels": []},
    {"input_ids": [49151, 0], "labels": [-100, 0], "extra": {"answer": "42", "tags": ["a", "b"], "n": 1.5}},
]
STATS = {"examples": 3, "truncated_prompt": 1, "skipped": {"empty": 2, "too_long": 0}}
KEY = {"step": 1, "sources": [["a.jsonl", 123, 1.5]], "tokenizer": "smol", "max_seq_len": 512}


class Builder:
    """A build() that counts its calls."""

    def __init__(self, examples=EXAMPLES, stats=STATS):
        self.examples, self.stats, self.calls = examples, stats, 0

    def __call__(self):
        self.calls += 1
        return [dict(e) for e in self.examples], dict(self.stats)


def run(cache_dir, key=KEY, builder=None, lines=None):
    builder = builder or Builder()
    out = C.cached_examples(cache_dir, key, builder, log=(lines.append if lines is not None else lambda m: None))
    return out, builder


def entry_dir(cache_dir, key=KEY):
    return os.path.join(str(cache_dir), C.entry_name(key))


# --------------------------------------------------------------------------- reuse
def test_no_cache_dir_just_builds():
    (examples, stats), builder = run(None)
    assert builder.calls == 1 and examples == EXAMPLES and stats == STATS


def test_second_call_reads_the_entry_without_building(tmp_path):
    lines = []
    (ex1, st1), b1 = run(str(tmp_path / "c"), lines=lines)
    (ex2, st2), b2 = run(str(tmp_path / "c"), lines=lines)
    assert (b1.calls, b2.calls) == (1, 0)
    assert ex1 == ex2 == EXAMPLES and st1 == st2 == STATS
    assert all(type(v) is int for ex in ex2 for k, seq in ex.items() if k != "extra" for v in seq)
    path = entry_dir(tmp_path / "c")
    assert lines[0].startswith(f"[data] tokenised data cached in {path} (3 examples, ")
    assert lines[1] == f"[data] tokenised data reused from {path} (3 examples)"


def test_pair_fields_large_ids_missing_fields_and_no_examples(tmp_path):
    pairs = [
        {"chosen_input_ids": [5, 2**40], "rejected_input_ids": [7]},
        {"chosen_input_ids": [9], "rejected_input_ids": [], "extra": {}},
        {"chosen_input_ids": [3]},
    ]
    for i, examples in enumerate([pairs, [], [{"extra": {"only": True}}]]):
        key = {**KEY, "case": i}
        run(str(tmp_path), key, Builder(examples, {}))
        (loaded, stats), builder = run(str(tmp_path), key, Builder(examples, {}))
        assert builder.calls == 0 and loaded == examples and stats == {}


def test_a_different_key_builds_again(tmp_path):
    run(str(tmp_path))
    _, builder = run(str(tmp_path), {**KEY, "max_seq_len": 256})
    assert builder.calls == 1
    assert len([n for n in os.listdir(tmp_path) if not n.startswith(".")]) == 2


def test_key_order_does_not_matter():
    assert C.entry_name({"a": 1, "b": [1, 2]}) == C.entry_name({"b": [1, 2], "a": 1})
    assert C.entry_name({"a": 1}) != C.entry_name({"a": 2})


# --------------------------------------------------------------------------- half entries
def test_entry_without_marker_is_rebuilt_not_read(tmp_path):
    run(str(tmp_path))
    path = entry_dir(tmp_path)
    os.remove(os.path.join(path, C.MARKER))
    with open(os.path.join(path, C.META), "w") as f:
        f.write("half-written")
    (examples, _), builder = run(str(tmp_path))
    assert builder.calls == 1 and examples == EXAMPLES
    assert C.is_complete(path)
    _, builder = run(str(tmp_path))
    assert builder.calls == 0


def test_left_over_temp_folder_is_not_an_entry(tmp_path):
    tmp = tmp_path / f".{C.entry_name(KEY)}.tmp.crashed"
    tmp.mkdir()
    (tmp / C.META).write_text("{}")
    _, builder = run(str(tmp_path))
    assert builder.calls == 1 and C.is_complete(entry_dir(tmp_path))


def test_failed_build_leaves_no_entry(tmp_path):
    def boom():
        raise RuntimeError("tokenizer exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        C.cached_examples(str(tmp_path), KEY, boom, log=lambda m: None)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- errors
def test_cache_path_that_is_a_file_is_a_data_error(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(DataError, match=r"^--data_output_path .*file: exists and is not a folder$"):
        run(str(path))


def test_cache_path_that_cannot_be_created_is_a_data_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match=r"^--data_output_path .*file/sub: cannot write the tokenised data there"):
        run(str(tmp_path / "file" / "sub"))


def test_corrupt_complete_entry_names_itself(tmp_path):
    run(str(tmp_path))
    with open(os.path.join(entry_dir(tmp_path), C.TENSORS), "wb") as f:
        f.write(b"\x00garbage")
    with pytest.raises(DataError, match="unreadable .*delete it to rebuild"):
        run(str(tmp_path))


# --------------------------------------------------------------------------- on disk
def test_entry_holds_safetensors_and_json_only(tmp_path):
    from safetensors.torch import load_file

    run(str(tmp_path))
    path = entry_dir(tmp_path)
    names = set(os.listdir(path))
    assert names == {C.TENSORS, C.META, C.MARKER}
    assert not [n for n in names if n.endswith((".pt", ".pkl", ".bin", ".pickle"))]
    with open(os.path.join(path, C.META)) as f:
        meta = json.load(f)
    assert (
        meta["count"] == 3 and meta["stats"] == STATS and meta["json_fields"] == {"2": {"extra": EXAMPLES[2]["extra"]}}
    )
    tensors = load_file(os.path.join(path, C.TENSORS))
    assert tensors["input_ids.values"].dtype == torch.int32
    assert tensors["input_ids.offsets"].tolist() == [0, 3, 3, 5]


def test_non_int_values_are_refused(tmp_path):
    with pytest.raises(TypeError, match="'scores'"):
        run(str(tmp_path), builder=Builder([{"scores": [0.5, 1.0]}], {}))
    assert not C.is_complete(entry_dir(tmp_path))


# --------------------------------------------------------------------------- two ranks
def _failing_build():
    raise RuntimeError("rank 0 tokenizer exploded")


def _rank_main(rank, port, cache_dir, out_dir):
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        builder = Builder()
        examples, stats = C.cached_examples(cache_dir, KEY, builder, log=lambda m: None)
        try:  # rank 0's build fails: every rank must raise, none may wait forever
            C.cached_examples(cache_dir, {**KEY, "fails": True}, _failing_build, log=lambda m: None)
            failure = None
        except (RuntimeError, DataError) as e:
            failure = f"{type(e).__name__}: {e}"
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"calls": builder.calls, "examples": examples, "stats": stats, "failure": failure}, f)
    finally:
        tdist.barrier()  # leave together: rank 0 hosts the TCP store, and a peer that loses it mid-teardown aborts
        tdist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_only_rank0_builds_and_a_failure_reaches_both(tmp_path):
    import torch.multiprocessing as mp

    from utils.runtime.ports import free_port

    cache_dir = str(tmp_path / "cache")
    try:
        mp.spawn(_rank_main, args=(free_port(), cache_dir, str(tmp_path)), nprocs=2, join=True)
    except mp.ProcessExitedException:  # a rank rarely aborts in gloo's teardown after its work (seen once in
        if not all((tmp_path / f"rank{r}.json").exists() for r in range(2)):  # ~30 runs): judge by the results
            raise
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["calls"] for r in results] == [1, 0]
    assert results[0]["examples"] == results[1]["examples"] == EXAMPLES
    assert results[0]["stats"] == results[1]["stats"] == STATS
    assert results[0]["failure"] == "RuntimeError: rank 0 tokenizer exploded"
    assert results[1]["failure"].startswith("DataError: --data_output_path: rank 0 failed to build")


# --------------------------------------------------------------------------- the steps' use (--data_output_path)
def test_step_examples_reuse_the_cache_until_a_source_changes(tmp_path, tiny_gpt2):
    from step1_sft.main import parse_args
    from utils.data import tokenize_sft
    from utils.models.loading import load_tokenizer
    from utils.train.loop import step_examples

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f" a{i}"}) + "\n" for i in range(20)))
    args = parse_args(
        [
            "--model_name_or_path",
            tiny_gpt2,
            "--data_path",
            str(data),
            "--data_split",
            "1,0,0",
            "--output_dir",
            str(tmp_path / "out"),
            "--data_output_path",
            str(tmp_path / "cache"),
        ]
    )
    tokenizer = load_tokenizer(tiny_gpt2)
    calls = []

    def tokenize(rows):
        calls.append(len(rows))
        return tokenize_sft(rows, tokenizer, 64)

    first = step_examples(args, tokenizer, 1, tokenize, {"max_seq_len": 64})
    assert calls == [18, 2] and len(first[0]) == 18 and len(first[2]) == 2
    assert step_examples(args, tokenizer, 1, tokenize, {"max_seq_len": 64}) == first and calls == [18, 2]
    assert step_examples(args, tokenizer, 1, tokenize, {"max_seq_len": 32})[0] and calls == [18, 2, 18, 2]
    with open(data, "a") as f:  # a changed source misses
        f.write(json.dumps({"prompt": "new", "chosen": " row"}) + "\n")
    train, _, evals, _ = step_examples(args, tokenizer, 1, tokenize, {"max_seq_len": 64})
    assert len(train) + len(evals) == 21 and len(calls) == 6
