"""Tests of the arithmetic (GRPO demo) data generator: no model, fast."""

import json
import random
import re

import pytest

from data import make_arithmetic_data as A
from utils.errors import UsageError

EXPR = re.compile(r"^What is (\d+(?: [-+*] \d+)+)\?")


def value_of(question: str) -> int:
    """The question's expression, evaluated independently of the generator."""
    m = EXPR.match(question)
    assert m, question
    return eval(m.group(1), {"__builtins__": {}})  # digits, spaces and + - * only (checked by EXPR)


@pytest.mark.parametrize("difficulty", sorted(A.DIFFICULTIES))
def test_answers_are_correct(difficulty):
    rng = random.Random(1)
    for _ in range(300):
        q, a = A.make_problem(rng, difficulty)
        assert isinstance(a, str) and a == str(value_of(q)) and int(a) >= 0


def test_defaults():
    assert A.DEFAULT_DIFFICULTY in A.DIFFICULTIES
    row = A.build(0, 1, 1)["eval"][0]
    assert [t["role"] for t in row["prompt"]] == ["user"]  # the chat template's default system turn applies
    assert row["prompt"][0]["content"].endswith("? Answer with the number only.")


def test_deterministic_for_a_seed():
    assert A.build(3, 50, 20) == A.build(3, 50, 20)
    assert A.build(3, 50, 20) != A.build(4, 50, 20)
    rng1, rng2 = random.Random(7), random.Random(7)
    assert [A.make_problem(rng1) for _ in range(20)] == [A.make_problem(rng2) for _ in range(20)]


@pytest.mark.parametrize("difficulty", sorted(A.DIFFICULTIES))
def test_train_eval_disjoint(difficulty):
    n_eval = min(40, A.problem_space(difficulty) // 2)
    data = A.build(0, 2000, n_eval, difficulty)
    train_q = [r["prompt"][-1]["content"] for r in data["train"]]
    eval_q = [r["prompt"][-1]["content"] for r in data["eval"]]
    assert len(train_q) == 2000 and len(eval_q) == n_eval
    assert len(set(eval_q)) == len(eval_q)
    assert not set(train_q) & set(eval_q)


def test_train_distinct_when_space_allows():
    data = A.build(0, 500, 50, "add2")  # 8100 problems
    train_q = [r["prompt"][-1]["content"] for r in data["train"]]
    assert len(set(train_q)) == len(train_q)


def test_too_many_eval_problems_is_an_error():
    with pytest.raises(UsageError):
        A.build(0, 10, A.problem_space("add1"), "add1")


def test_row_shape():
    for system in ("Answer with the number only.", ""):
        for row in A.build(0, 20, 10, system=system)["eval"]:
            assert set(row) == {"prompt", "answer"}
            turns = row["prompt"]
            assert [t["role"] for t in turns] == (["system", "user"] if system else ["user"])
            assert all(set(t) == {"role", "content"} and isinstance(t["content"], str) for t in turns)
            if system:
                assert turns[0]["content"] == system
            assert isinstance(row["answer"], str) and row["answer"] == str(value_of(turns[-1]["content"]))


def test_cli_writes_both_files(tmp_path, capsys):
    out = tmp_path / "arith"
    counts = A.main(["--out", str(out), "--train", "30", "--eval", "10", "--seed", "5"])
    assert counts == {"train": 30, "eval": 10}
    assert "train=30" in capsys.readouterr().out
    files = {}
    for split, n in counts.items():
        lines = (out / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        assert len(lines) == n
        files[split] = [json.loads(line) for line in lines]
    assert files == A.build(5, 30, 10)
    A.main(["--out", str(tmp_path / "other"), "--train", "5", "--eval", "5", "--difficulty", "mul1", "--system", ""])
    row = json.loads((tmp_path / "other" / "eval.jsonl").read_text().splitlines()[0])
    assert [t["role"] for t in row["prompt"]] == ["user"] and " * " in row["prompt"][0]["content"]
