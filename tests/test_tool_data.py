"""Tests of the tool-use demo's data generator (data/make_tool_data.py): fast, the tiny chat model only."""

import json
import os
import re
import subprocess
import sys

import pytest

from data import make_tool_data as T
from step3_ppo.agents.tools import calculator, load_tools, parse_hermes, tool_system_prompt
from utils.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAIN = re.compile(r"^What is \d+ [*+] \d+( \+ \d+ \+ \d+)?\?$")


def numbers_of(question: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", question)]


def value_of(question: str) -> int:
    """The question's answer, computed apart from the generator: two numbers (a 3-digit and a 2-digit one)
    are a product, four 2-digit ones a sum, whatever the wording."""
    numbers = numbers_of(question)
    if len(numbers) == 2:
        assert sorted(len(str(n)) for n in numbers) == [2, 3], question
        return numbers[0] * numbers[1]
    assert len(numbers) == 4 and all(10 <= n <= 99 for n in numbers), question
    return sum(numbers)


def wording_of(question: str, wordings: dict) -> str | None:
    """The template of `wordings` the question was written from (None: none of them)."""
    for templates in wordings.values():
        for template in templates:
            pattern = re.escape(template)
            for name in "abcd":
                pattern = pattern.replace(re.escape("{" + name + "}"), r"\d+")
            if re.fullmatch(pattern, question):
                return template
    return None


def question_of(row: dict) -> str:
    turns = row["messages"] if "messages" in row else row["prompt"]
    return next(t["content"] for t in turns if t["role"] == "user")


@pytest.fixture(scope="module")
def data():
    return T.build(0, 120, 300, 60)


def test_deterministic_for_a_seed(data):
    assert T.build(0, 120, 300, 60) == data
    assert T.build(1, 120, 300, 60) != data
    # eval is drawn first: other --sft/--train counts leave it as it is
    assert T.build(0, 7, 11, 60)["eval"] == data["eval"]


def test_counts_and_kinds(data):
    assert {k: len(v) for k, v in data.items()} == {"sft": 120, "train": 300, "eval": 60}
    for rows in data.values():
        products = sum(1 for r in rows if len(numbers_of(question_of(r))) == 2)
        sums = sum(1 for r in rows if len(numbers_of(question_of(r))) == 4)
        assert products == sums == len(rows) // 2


def test_answers_are_correct(data):
    for split in ("train", "eval"):
        for row in data[split]:
            assert set(row) == {"prompt", "answer"}
            assert row["prompt"] == [{"role": "user", "content": row["prompt"][0]["content"]}]  # no system turn
            assert isinstance(row["answer"], str) and row["answer"] == str(value_of(question_of(row)))
    for row in data["sft"]:
        assert row["messages"][-1]["content"] == f"The answer is {value_of(question_of(row))}."


def test_eval_disjoint_and_distinct(data):
    """No problem twice, and no held-out problem in sft or train, whatever its wording (compared by numbers)."""
    problems = {split: [tuple(sorted(numbers_of(question_of(r)))) for r in rows] for split, rows in data.items()}
    for split, keys in problems.items():
        assert len(set(keys)) == len(keys), split
    assert not set(problems["eval"]) & (set(problems["train"]) | set(problems["sft"]))
    assert not set(problems["sft"]) & set(problems["train"])


def test_sft_rows_are_calculator_traces(data):
    system = tool_system_prompt([load_tools(["calculator"])[0].schema])
    for row in data["sft"]:
        messages = row["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) for m in messages)
        assert messages[0]["content"] == system
        question = messages[1]["content"]
        calls = parse_hermes(messages[2]["content"])
        assert len(calls) == 1 and calls[0].error is None
        assert calls[0].name == "calculator" and set(calls[0].arguments) == {"expression"}
        expression = calls[0].arguments["expression"]
        assert sorted(numbers_of(expression)) == sorted(numbers_of(question))  # the story's numbers, no others
        if PLAIN.match(question):
            assert question == f"What is {expression}?"
        assert messages[2]["content"] == (
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "' + expression + '"}}\n</tool_call>'
        )
        assert messages[3]["content"] == calculator(expression) == str(value_of(question))
        assert messages[4]["content"] == f"The answer is {messages[3]['content']}."


def test_wordings(data):
    """RL and eval rows are word problems in the RL wordings; SFT rows half plain questions, half word problems
    in other wordings, so the RL wordings are new to the SFT model."""
    for split in ("train", "eval"):
        assert all(wording_of(question_of(r), T.WORDED) for r in data[split]), split
    sft = [question_of(r) for r in data["sft"]]
    plain = [q for q in sft if PLAIN.match(q)]
    worded = [q for q in sft if wording_of(q, T.SFT_WORDED)]
    assert len(plain) == len(worded) == len(sft) // 2
    assert not any(wording_of(q, T.WORDED) for q in sft)
    used = {wording_of(question_of(r), T.WORDED) for r in data["train"]}
    assert used == {t for templates in T.WORDED.values() for t in templates}  # every wording is drawn


def test_too_many_problems_is_an_error():
    with pytest.raises(UsageError):
        T.build(0, 0, T.problem_space("mul") + 2, 0)  # one product more than half


def test_sft_rows_render_and_train_on_assistant_turns(data, tiny_chat_llama):
    """Step 1 reads the rows (messages, assistant-only loss) and the ChatML template renders them."""
    from utils.data.chat import assistant_spans, render
    from utils.data.formats import normalize_row
    from utils.models.loading import load_tokenizer

    tokenizer = load_tokenizer(tiny_chat_llama)
    for i, row in enumerate(data["sft"][:8]):
        normalized = normalize_row(row, f"sft.jsonl:{i + 1}", step=1)
        assert normalized["messages"] == row["messages"]
        ids = render(tokenizer, row["messages"])
        spanned, spans = assistant_spans(tokenizer, row["messages"])  # SkipRow if a prefix renders otherwise
        assert spanned == ids and len(spans) == 2  # the call and the final answer; not the tool's output
        trained = [tokenizer.decode(ids[start:end]) for start, end in spans]
        assert trained == [m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant"]
        text = tokenizer.decode(ids)
        assert "<|im_start|>tool\n" in text and "<tool_call>" in text


def test_cli_writes_three_files(tmp_path, capsys):
    out = tmp_path / "tools"
    counts = T.main(["--out", str(out), "--sft", "6", "--train", "10", "--eval", "4", "--seed", "5"])
    assert counts == {"sft": 6, "train": 10, "eval": 4}
    assert "sft=6" in capsys.readouterr().out
    files = {}
    for split, n in counts.items():
        path = out / "sft" / "train.jsonl" if split == "sft" else out / "rl" / f"{split}.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines()
        assert len(lines) == n
        files[split] = [json.loads(line) for line in lines]
    assert files == T.build(5, 6, 10, 4)


def test_help_answers_without_torch():
    probe = (
        "import runpy, sys; sys.argv = ['make_tool_data', '--help']\n"
        "try:\n    runpy.run_module('data.make_tool_data', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported for --help'\n"
        "assert 'transformers' not in sys.modules, 'transformers imported for --help'\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout and "--sft" in out.stdout
