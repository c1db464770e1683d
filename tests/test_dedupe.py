"""Exact duplicate training rows and eval rows that are also training rows: counted in one
line at data load, dropped with --dedupe, which is part of the data layout a resume compares and of the
tokenised cache's key."""

import argparse
import json
import os

import pytest

from utils.data import build_step_rows


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


@pytest.fixture
def source(tmp_path):
    """12 distinct training rows, 3 of them twice more (6 duplicates: 18 rows); an eval split of 4 rows,
    2 of them training rows. The duplicates differ only in an unused `id` field and their line."""
    distinct = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(12)]
    train = [{**row, "id": n} for n, row in enumerate(distinct + distinct[:3] + distinct[:3])]
    evals = [
        distinct[0],
        distinct[5],
        {"prompt": "e1", "chosen": "x", "rejected": "y"},
        {"prompt": "e2", "chosen": "x", "rejected": "y"},
    ]
    write_jsonl(tmp_path / "src" / "train.jsonl", train)
    write_jsonl(tmp_path / "src" / "eval.jsonl", evals)
    return str(tmp_path / "src")


@pytest.mark.parametrize("step", [1, 2])
def test_repeats_are_counted_in_one_line_and_kept_without_dedupe(source, step):
    said = []
    whole = build_step_rows([source], "1,0,0" if step == 1 else "0,1,0", step, seed=0, log=said.append)
    counted = [line for line in said if "exact duplicates" in line]
    assert len(counted) == 1
    assert counted[0] == (
        f"[data] {'step 1 (SFT)' if step == 1 else 'step 2 (reward model)'}: 6 of 18 training "
        f"rows are exact duplicates of another, 2 of 4 eval rows are also training rows; "
        f"--dedupe drops them"
    )
    assert whole.stats["duplicate_train"] == 6 and whole.stats["eval_in_train"] == 2
    assert len(whole.train) == 18 and len(whole.eval) == 4  # counted, not dropped


def test_dedupe_drops_the_later_copies_and_the_eval_rows_seen_in_training(source):
    said = []
    kept = build_step_rows([source], "1,0,0", 1, seed=0, log=said.append)
    rows = build_step_rows([source], "1,0,0", 1, seed=0, log=said.append, dedupe=True)
    assert len(rows.train) == 12 and len(rows.eval) == 2
    assert {r["prompt"] for r in rows.train} == {f"p{i}" for i in range(12)}
    assert {r["prompt"] for r in rows.eval} == {"e1", "e2"}
    assert said[-2].endswith("; dropped (--dedupe)") and "12 train / 2 eval rows" in said[-1]
    assert len(kept.train) == 18


def test_step3_rows_differing_in_a_field_the_reward_functions_read_are_not_duplicates(tmp_path):
    path = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": "2+2=", "answer": "4"}, {"prompt": "2+2=", "answer": "four"}, {"prompt": "2+2=", "answer": "4"}]
        + [{"prompt": f"q{i}"} for i in range(7)],
    )
    rows = build_step_rows([path], "0,0,1", 3, seed=0, eval_fraction=0, log=lambda line: None, dedupe=True)
    assert rows.stats["duplicate_train"] == 1 and len(rows.train) == 9
    assert sorted(r["extra"].get("answer", "") for r in rows.train if r["prompt"] == "2+2=") == ["4", "four"]


def test_the_flag_reaches_every_entry_point_the_layout_and_the_cache_key(source, tiny_gpt2, tiny_gpt2_reward, tmp_path):
    from step1_sft.main import parse_args as step1
    from step2_dpo.main import parse_args as dpo
    from step2_reward.main import parse_args as step2
    from step3_ppo.main import parse_args as step3
    from utils.train.checkpoint import data_layout

    common = ["--data_path", source, "--dedupe"]
    for parse, out in ((step1, "s1"), (step2, "s2"), (dpo, "dpo")):
        args = parse(["--model_name_or_path", tiny_gpt2, "--output_dir", str(tmp_path / out), *common])
        assert args.dedupe and data_layout(args, 12)["--dedupe"] is True
    args = step3(
        [
            "--actor_model_name_or_path",
            tiny_gpt2,
            "--critic_model_name_or_path",
            tiny_gpt2_reward,
            "--output_dir",
            str(tmp_path / "s3"),
            *common,
        ]
    )
    assert args.dedupe and data_layout(args, 12)["--dedupe"] is True


def test_the_tokenised_cache_keeps_deduped_and_whole_data_apart(source, tiny_gpt2, tmp_path):
    from utils.models.loading import load_tokenizer
    from utils.train.flags import add_data_args
    from utils.train.loop import step_examples

    parser = argparse.ArgumentParser()
    add_data_args(parser)
    parser.add_argument("--seed", type=int, default=0)
    tokenizer = load_tokenizer(tiny_gpt2)

    def tokenize(rows):
        return [{"input_ids": tokenizer(r["prompt"]).input_ids} for r in rows], {}

    def train_rows(*flags):
        args = parser.parse_args(
            ["--data_path", source, "--data_split", "1,0,0", "--data_output_path", str(tmp_path / "cache"), *flags]
        )
        return len(step_examples(args, tokenizer, 1, tokenize, {})[0])

    assert train_rows() == 18
    assert train_rows("--dedupe") == 12
    assert train_rows() == 18
    assert len(os.listdir(tmp_path / "cache")) == 2
