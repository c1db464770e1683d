"""Step 3's reward functions (step3_ppo/rewards/functions.py): the built-ins and their registry (loader, flag help,
the reference page's list), loading specs, the batch call's checks (count, finiteness, raise, timeout, skip_bad)
and the weighted combination (step3_ppo/rewards/components.py). Pure Python, fast."""

import itertools
import math
import os
import random
import signal
import sys
import threading
import time

import numpy as np
import pytest
import torch

from scripts import gen_reference
from step3_ppo.rewards.combine import combine
from step3_ppo.rewards.components import FunctionReward, RewardModelReward
from step3_ppo.rewards.functions import (
    BUILTINS,
    Builtin,
    RewardFunction,
    RewardFunctionError,
    final_answer,
    is_function_spec,
    load_reward_function,
    math_exact,
    score_batch,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_LIST = "## Built-in reward functions"  # the heading of the reference page's table of the built-ins


def batch(completions, **extra):
    n = len(completions)
    return dict(
        prompts=[f"p{i}" for i in range(n)],
        completions=list(completions),
        completion_ids=[[i] for i in range(n)],
        extra={k: list(v) for k, v in extra.items()},
        origins=[f"data/x.jsonl:{i + 10}" for i in range(n)],
    )


def fn_of(f, name="f"):
    return RewardFunction(name, f, spec=f"my_rewards.py:{name}")


def assert_one_line(exc, *parts):
    text = str(exc)
    assert "\n" not in text, text
    for part in parts:
        assert part in text, (part, text)


# ---------------------------------------------------------------- math_exact / final_answer


@pytest.mark.parametrize(
    "text, answer, expected",
    [
        ("so the answer is 42.", 42, 1.0),
        ("\\boxed{3.5}", "3.5", 1.0),
        ("12 + 30 = 42, then 7", 42, 0.0),
        ("-5", -5, 1.0),
        ("the total is 1,234", 1234, 1.0),
        ("the total is 1,234.", "1,234", 1.0),
        ("no number here", 42, 0.0),
        ("\\boxed{12} although 99 came up later", 12, 1.0),
        ("\\boxed{12} although 99 came up later", 99, 0.0),
        ("it is 0.5", 0.5000000001, 1.0),
        ("it is 0.5", 0.51, 0.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("\\boxed{ x + 1 }", "x + 1", 1.0),
        ("3 - 5 gives", 5, 1.0),  # a minus between numbers is subtraction, not a sign
        ("answer: 7", None, 0.0),  # a row lacking the field among others that have it
    ],
)
def test_math_exact_hand_cases(text, answer, expected):
    assert math_exact(completions=[text], answer=[answer]) == [expected]


def test_final_answer_extraction():
    assert final_answer("so the answer is 42.") == "42"
    assert final_answer("x = -3.25, done") == "-3.25"
    assert final_answer("1,234,567 apples") == "1234567"
    assert final_answer("\\boxed{a{b}c} and 5") == "a{b}c"
    assert final_answer("\\boxed{1} then \\boxed{2}") == "2"
    assert final_answer("\\boxed{7} then \\boxed{unclosed 3") == "7"  # a truncated last box does not count
    assert final_answer("no digits") is None
    assert final_answer("") is None


def test_math_exact_needs_answer_field_and_is_accuracy():
    func = load_reward_function("math_exact")
    assert func.name == "math_exact" and func.is_accuracy
    with pytest.raises(RewardFunctionError) as info:
        score_batch(func, skip_bad=True, **batch(["42"]))  # a setup error: not skipped
    assert_one_line(info.value, "math_exact", "'answer' field")


# ---------------------------------------------------------------- format


def test_format_default_and_custom_pattern():
    default = load_reward_function("format")
    assert not default.is_accuracy and default.name == "format"
    assert default.fn(completions=["so \\boxed{4}.", "so 4.", "\\boxed{}"]) == [1.0, 0.0, 0.0]
    custom = load_reward_function("format", format_pattern=r"<think>.*</think>\s*<answer>.*</answer>")
    assert custom.fn(completions=["<think>a\nb</think> <answer>4</answer>", "<answer>4</answer>"]) == [1.0, 0.0]


def test_format_invalid_regex_fails_at_load():
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("format", format_pattern="(unclosed")
    assert_one_line(info.value, "format", "(unclosed", "--format_pattern")


# ---------------------------------------------------------------- the registry


def test_registry_entries():
    assert list(BUILTINS)[:3] == ["math_exact", "format", "sentiment"]  # the order of --help and the docs
    assert [name for name, b in BUILTINS.items() if b.is_accuracy] == ["math_exact", "math_verify", "reasoning_gym"]
    for name, builtin in BUILTINS.items():
        assert name.isidentifier(), name  # the spec is the log name: reward/<name>_mean
        assert builtin.help and "\n" not in builtin.help and callable(builtin.make)


def test_components_say_whether_they_are_an_accuracy():
    assert FunctionReward(load_reward_function("math_exact"), tokenizer=None).is_accuracy is True
    assert FunctionReward(load_reward_function("format"), tokenizer=None).is_accuracy is False
    assert RewardModelReward(engine=None, pad_token_id=0).is_accuracy is False


def make_toy(max_answer_seq_len=None):
    """A toy built-in's factory: it declares the one option it needs."""

    def toy_len(completions, **kwargs):
        return [len(c) / max_answer_seq_len for c in completions]

    return toy_len


def test_a_registered_builtin_loads_by_name_and_shows_in_the_flag_help(monkeypatch, capsys):
    from step3_ppo import main

    monkeypatch.setitem(BUILTINS, "toy_len", Builtin(make_toy, "len(completion) / --max_answer_seq_len, 100% toy"))
    assert is_function_spec("toy_len")
    func = load_reward_function("toy_len", max_answer_seq_len=4, format_pattern="(unused: not declared")
    assert func.name == "toy_len" and func.spec == "toy_len" and not func.is_accuracy
    assert func.fn(completions=["ab", "abcd"]) == [0.5, 1.0]
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("not_a_builtin")
    assert_one_line(info.value, "math_exact, format, sentiment, math_verify, reasoning_gym, toy_len")
    with pytest.raises(SystemExit):
        main.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "toy_len (len(completion) / --max_answer_seq_len, 100% toy)" in shown
    assert "math_exact (the last number or \\boxed{} equals the row's 'answer')" in shown


def test_a_factory_taking_kwargs_gets_every_option(monkeypatch):
    seen = {}

    def make_any(**options):
        seen.update(options)
        return lambda completions, **kw: [0.0] * len(completions)

    monkeypatch.setitem(BUILTINS, "toy_any", Builtin(make_any, "toy", is_accuracy=True))
    func = load_reward_function("toy_any", spec="a flag named spec", format_pattern=None)
    assert seen == {"spec": "a flag named spec", "format_pattern": None} and func.is_accuracy


def test_the_reference_page_lists_exactly_the_builtins():
    """docs/reference/registries.md (kept equal to the generator's output by tests/test_docs_reference.py) has one row
    per built-in, in BUILTINS' order, with its help, whether it is an accuracy and the flags its factory reads."""
    with open(os.path.join(ROOT, gen_reference.REGISTRIES_PAGE)) as f:
        lines = f.read().splitlines()
    start = lines.index(REFERENCE_LIST)
    section = itertools.takewhile(lambda line: not line.startswith("## "), lines[start + 1 :])
    listed = [line for line in section if line.startswith("| `")]
    expected = [
        f"| `{name}` | {gen_reference.cell(b.help)} | {'yes' if b.is_accuracy else 'no'} | "
        + (", ".join(f"`--{o}`" for o in gen_reference.builtin_options(b.make)) or gen_reference.NONE)
        + " |"
        for name, b in BUILTINS.items()
    ]
    assert listed == expected, (
        f"{gen_reference.REGISTRIES_PAGE}'s list of built-in reward functions differs from BUILTINS; regenerate it "
        f"with: {gen_reference.COMMAND}"
    )
    assert gen_reference.builtin_options(BUILTINS["format"].make) == ["format_pattern"]


def test_a_registered_builtin_shows_on_the_reference_page(monkeypatch):
    monkeypatch.setitem(BUILTINS, "toy_len", Builtin(make_toy, "len(completion) / --max_answer_seq_len"))
    page = gen_reference.registries_page()
    assert "| `toy_len` | len(completion) / `--max_answer_seq_len` | no | `--max_answer_seq_len` |" in page


# ---------------------------------------------------------------- loading


def test_load_from_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "from dataclasses import dataclass\n@dataclass\nclass C:\n    x: int = 1\n"
        "def length_reward(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    func = load_reward_function(f"{path}:length_reward")
    assert func.name == "length_reward" and not func.is_accuracy
    assert func.spec == f"{path}:length_reward"
    scores, bad = score_batch(func, **batch(["ab", "abcd"]))
    assert scores.tolist() == [2.0, 4.0] and bad == []
    assert is_function_spec(f"{path}:length_reward")


def test_load_from_file_can_import_a_helper_next_to_it(tmp_path):
    (tmp_path / "helper_for_rewards.py").write_text("VALUE = 3.0\n")
    (tmp_path / "uses_helper.py").write_text(
        "import helper_for_rewards\n"
        "def r(completions, **kw):\n"
        "    return [helper_for_rewards.VALUE] * len(completions)\n"
    )
    func = load_reward_function(f"{tmp_path / 'uses_helper.py'}:r")
    assert func.fn(completions=["a"]) == [3.0]
    assert str(tmp_path) not in sys.path


def test_two_files_with_the_same_name_do_not_clash(tmp_path):
    for sub, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "rewards.py").write_text(
            f"def r(completions, **kw):\n    return [{value}] * len(completions)\n"
        )
    fa = load_reward_function(f"{tmp_path / 'a' / 'rewards.py'}:r")
    fb = load_reward_function(f"{tmp_path / 'b' / 'rewards.py'}:r")
    assert fa.fn(completions=["x"]) == [1.0] and fb.fn(completions=["x"]) == [2.0]


def test_load_from_module(tmp_path, monkeypatch):
    pkg = tmp_path / "rwpkg_test"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def const(completions, **kwargs):\n    return [0.25] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    func = load_reward_function("rwpkg_test.scoring:const")
    assert func.name == "const"
    assert func.fn(completions=["a", "b"]) == [0.25, 0.25]
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function("rwpkg_test.nope:const")
    assert_one_line(info.value, "rwpkg_test.nope:const", "no module named")


@pytest.mark.parametrize(
    "content, attr, expected",
    [
        (None, "f", "no such file"),
        ("def g(**kw):\n    return []\n", "f", "has no function 'f'"),
        ("def f(:\n", "f", "syntax error at line 1"),
        ("f = 3\n", "f", "not a function"),
        ("import module_that_does_not_exist_xyz\n", "f", "ModuleNotFoundError"),
        ("raise RuntimeError('boom\\nsecond line')\n", "f", "RuntimeError: boom second line"),
    ],
)
def test_load_file_errors_are_one_line_with_the_spec(tmp_path, content, attr, expected):
    path = tmp_path / "bad_rewards.py"
    if content is not None:
        path.write_text(content)
    spec = f"{path}:{attr}"
    with pytest.raises(RewardFunctionError) as info:
        load_reward_function(spec)
    assert_one_line(info.value, spec, expected)


def test_load_spec_form_errors(tmp_path):
    path = tmp_path / "r.py"
    path.write_text("def f(**kw):\n    return []\n")
    for spec, expected in (
        (str(path), "':function'"),
        (f"{path}:", "function"),
        ("not_a_builtin", "math_exact, format, sentiment"),
    ):
        with pytest.raises(RewardFunctionError) as info:
            load_reward_function(spec)
        assert_one_line(info.value, spec, expected)
    assert "package.module:function" in str(info.value)


def test_is_function_spec(tmp_path):
    assert is_function_spec("math_exact") and is_function_spec("format") and is_function_spec("sentiment")
    assert is_function_spec("pkg.mod:f") and is_function_spec("x.py")
    assert not is_function_spec(str(tmp_path))  # a reward-model directory
    weird = tmp_path / "dir:with_colon"
    weird.mkdir()
    assert not is_function_spec(str(weird))
    assert not is_function_spec("some/model_dir")


# ---------------------------------------------------------------- the batch call


def test_extra_fields_reach_the_function_aligned():
    seen = {}

    def equal(prompts, completions, completion_ids, answer, **kwargs):
        seen.update(prompts=prompts, ids=completion_ids, kwargs=kwargs)
        return [float(a == c) for a, c in zip(answer, completions)]

    rng = random.Random(0)
    pairs = [(str(i), str(i) if i % 3 else "wrong") for i in range(12)]
    rng.shuffle(pairs)
    answers, completions = zip(*pairs)
    b = batch(completions, answer=answers, level=[None] * 12)
    scores, bad = score_batch(fn_of(equal), **b)
    assert scores.dtype == torch.float32 and scores.shape == (12,)
    assert scores.tolist() == [float(a == c) for a, c in pairs]
    assert 0 < scores.sum() < 12 and bad == []
    assert seen["prompts"] == b["prompts"] and seen["ids"] == b["completion_ids"]
    assert seen["kwargs"] == {"level": [None] * 12}


@pytest.mark.parametrize(
    "result",
    [
        [1, 2.5, True],
        (1, 2.5, 1),
        torch.tensor([1.0, 2.5, 1.0]),
        np.array([1.0, 2.5, 1.0]),
        [np.float64(1.0), torch.tensor(2.5), np.int64(1)],
    ],
)
def test_accepted_result_types(result):
    scores, bad = score_batch(fn_of(lambda **kw: result), **batch(["a", "b", "c"]))
    assert scores.tolist() == [1.0, 2.5, 1.0] and bad == []


def test_raising_function():
    def boom(completions, **kw):
        raise KeyError("x" * 500 + "\nmore")

    with pytest.raises(RewardFunctionError) as info:
        score_batch(fn_of(boom, "boom"), **batch(["a", "b"]))
    assert_one_line(info.value, "my_rewards.py:boom", "KeyError", "data/x.jsonl:10")
    assert len(str(info.value)) < 400
    told = []
    scores, bad = score_batch(fn_of(boom, "boom"), skip_bad=True, on_skip=told.append, **batch(["a", "b"]))
    assert bad == [0, 1] and torch.isnan(scores).all() and told == [str(info.value)]


@pytest.mark.parametrize("result", [[1.0], [1.0, 2.0, 3.0, 4.0], 1.0, "1,2,3", torch.ones(3, 1)])
def test_wrong_count_or_shape(result):
    func = fn_of(lambda **kw: result, "counted")
    with pytest.raises(RewardFunctionError) as info:
        score_batch(func, **batch(["a", "b", "c"]))
    assert_one_line(info.value, "my_rewards.py:counted", "3")
    scores, bad = score_batch(func, skip_bad=True, **batch(["a", "b", "c"]))
    assert bad == [0, 1, 2] and torch.isnan(scores).all()


@pytest.mark.parametrize(
    "value, word",
    [
        (float("nan"), "not a finite"),
        (float("inf"), "not a finite"),
        (-float("inf"), "not a finite"),
        (None, "None"),
        ("0.5", "str"),
        (1e300, "not a finite"),
    ],
)
def test_bad_rows(value, word):
    func = fn_of(lambda completions, **kw: [1.0, value, 0.5, value], "rowwise")
    with pytest.raises(RewardFunctionError) as info:
        score_batch(func, **batch(["a", "b", "c", "d"]))
    assert_one_line(info.value, "my_rewards.py:rowwise", word, "data/x.jsonl:11", "index 1", "1 more")
    told = []
    scores, bad = score_batch(func, skip_bad=True, on_skip=told.append, **batch(["a", "b", "c", "d"]))
    assert bad == [1, 3] and told == [str(info.value)]
    assert scores[0] == 1.0 and scores[2] == 0.5 and math.isnan(scores[1]) and math.isnan(scores[3])


def test_misaligned_inputs_are_a_caller_bug():
    b = batch(["a", "b"], answer=["1"])
    with pytest.raises(ValueError, match="answer"):
        score_batch(fn_of(lambda **kw: [0.0, 0.0]), **b)


# ---------------------------------------------------------------- timeout


def sleepy(completions, **kw):
    time.sleep(5)
    return [0.0] * len(completions)


def test_timeout_stops_the_call_and_restores_the_handler():
    def mine(signum, frame):
        pass

    old = signal.signal(signal.SIGALRM, mine)
    try:
        start = time.monotonic()
        with pytest.raises(RewardFunctionError) as info:
            score_batch(fn_of(sleepy, "sleepy"), timeout=0.3, **batch(["a", "b"]))
        assert time.monotonic() - start < 2
        assert_one_line(info.value, "my_rewards.py:sleepy", "--reward_timeout 0.3 s", "data/x.jsonl:10")
        assert signal.getsignal(signal.SIGALRM) is mine
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)

        start = time.monotonic()
        scores, bad = score_batch(fn_of(sleepy, "sleepy"), timeout=0.3, skip_bad=True, **batch(["a", "b", "c"]))
        assert time.monotonic() - start < 2
        assert bad == [0, 1, 2] and torch.isnan(scores).all()
        assert signal.getsignal(signal.SIGALRM) is mine

        scores, bad = score_batch(
            fn_of(lambda completions, **kw: [1.0] * len(completions)), timeout=0.3, **batch(["a"])
        )
        assert scores.tolist() == [1.0] and signal.getsignal(signal.SIGALRM) is mine
        time.sleep(0.4)  # no stray alarm fires after a fast call

        signal.setitimer(signal.ITIMER_REAL, 30)  # someone else's timer survives the call
        score_batch(fn_of(lambda completions, **kw: [1.0]), timeout=0.3, **batch(["a"]))
        assert 29 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_timeout_off_the_main_thread_falls_back_to_a_thread():
    out = {}

    def run():
        start = time.monotonic()
        try:
            score_batch(fn_of(sleepy, "sleepy"), timeout=0.3, **batch(["a"]))
        except RewardFunctionError as exc:
            out["error"] = str(exc)
        out["elapsed"] = time.monotonic() - start
        out["ok"] = score_batch(fn_of(lambda completions, **kw: [2.0]), timeout=1.0, **batch(["a"]))[0].tolist()

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(5)
    assert "--reward_timeout" in out["error"] and out["elapsed"] < 2 and out["ok"] == [2.0]


# ---------------------------------------------------------------- combine


def test_combine_weights_and_nan():
    scores = {"a": torch.tensor([1.0, 2.0, float("nan")]), "b": torch.tensor([10.0, 20.0, 30.0])}
    assert combine(scores, None)[:2].tolist() == [11.0, 22.0]
    total = combine(scores, [0.5, -1.0])
    assert total[:2].tolist() == [-9.5, -19.0] and math.isnan(total[2])
    with pytest.raises(ValueError) as info:
        combine(scores, [1.0])
    assert_one_line(info.value, "--reward_weights", "expected 2")


# ---------------------------------------------------------------- sentiment


def test_sentiment_orders_positive_above_negative():
    func = load_reward_function("sentiment")
    assert func.name == "sentiment"
    scores, bad = score_batch(
        func, **batch(["What a wonderful, lovely day, I love it!", "This is terrible, awful and I hate it."])
    )
    assert scores[0] > 0.3 > -0.3 > scores[1] and bad == []
