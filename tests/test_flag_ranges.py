"""Every numeric flag of every entry point is checked when it is parsed: finite, inside its range (utils.cli.Number),
refused in one line (a UsageError); and a flag that would do nothing with the chosen engine, loss or estimator stops
the run.

The walk: each entry point's parser (built as its `parse_args` builds it), each numeric flag, with NaN, +-inf, 1e39,
0, -1 and the values just outside its bounds; a value its Number refuses must end the parse with ONE line naming
the flag, a value it accepts must parse to itself. Then the probes of the bad-input round through the
entry points' own checks (cross-flag rules): each one line, before any model is loaded."""

from __future__ import annotations

import argparse
import math

import pytest

from tests.test_flags_help import ENTRY_POINTS, built_parser
from utils.cli import FP32_MAX, FlagParser, Number
from utils.errors import UsageError

# Runs as a plain script under vLLM's interpreter, importing nothing of the project; the trainer passes it only
# values its own (checked) flags hold.
INTERNAL = {"step3_ppo.rollout.vllm_worker"}
WALKED = [name for name in ENTRY_POINTS if name not in INTERNAL]


def numeric_actions(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and (a.type in (int, float) or isinstance(a.type, Number))]


def probes(number: Number) -> list[str]:
    values = ["0", "-1", "1", "1000000000000"]
    if number.kind is float:
        values += ["nan", "inf", "-inf", "1e39", "-1e39", "0.5", "1e-9"]
    for bound in (number.low, number.high, number.above, number.below):
        if bound is not None:
            step = 1 if number.kind is int else 1e-6
            values += [repr(number.kind(bound)), repr(number.kind(bound - step)), repr(number.kind(bound + step))]
    return list(dict.fromkeys(values))


def required_argv(parser: argparse.ArgumentParser) -> list[str]:
    """Values for the parser's required flags and positionals, so that a parse reaches the flag under test."""
    argv = []
    for action in parser._actions:
        value = str(action.choices[0]) if action.choices else "x"
        if not action.option_strings and action.dest != "help" and action.nargs not in ("?", "*"):
            argv.append(value)
        elif action.option_strings and action.required:
            argv += [action.option_strings[0], value]
    return argv


def parse_outcome(parser: argparse.ArgumentParser, argv: list[str]):
    """(parsed namespace or None, the error line or None)."""
    try:
        return parser.parse_args(argv), None
    except UsageError as exc:
        return None, str(exc)


def test_number_refuses_what_it_should():
    assert Number(float, above=0)("0.5") == 0.5
    for text in ("0", "-1", "nan", "inf", "-inf", "1e39"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"must be > 0, got "):
            Number(float, above=0)(text)
    assert Number(float)("-1e38") == -1e38 and Number(float).problem(FP32_MAX * 1.01) is not None
    assert Number(float, low=0, below=1).describe() == "in [0, 1)"
    assert Number(int, low=0, also=(-1,)).describe() == ">= 0, or -1" and Number(int, low=0, also=(-1,))("-1") == -1
    assert Number(int, low=1, high=3)("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match=r"must be in \[1, 3\], got 4"):
        Number(int, low=1, high=3)("4")
    with pytest.raises(ValueError):  # argparse's own "invalid int value"
        Number(int)("1.5")


@pytest.mark.parametrize("name", WALKED)
def test_every_numeric_flag_declares_its_range(name, monkeypatch):
    parser = built_parser(name, monkeypatch)
    assert isinstance(parser, FlagParser), f"python -m {name}: its parser refuses a flag in argparse's usage block"
    bare = [a.option_strings[0] for a in numeric_actions(parser) if not isinstance(a.type, Number)]
    assert not bare, f"python -m {name}: numeric flags without a range (utils.cli.Number): {bare}"


@pytest.mark.parametrize("name", WALKED)
def test_every_numeric_flag_refuses_out_of_range_values_in_one_line(name, monkeypatch):
    parser = built_parser(name, monkeypatch)
    base = required_argv(parser)
    walked = 0
    for action in numeric_actions(parser):
        if not isinstance(action.type, Number):
            continue  # test_every_numeric_flag_declares_its_range names it
        flag, number = action.option_strings[0], action.type
        for text in probes(number):
            args, line = parse_outcome(parser, base + [f"{flag}={text}"])  # "-inf" is no flag
            refused = number.problem(number.kind(float(text)) if number.kind is float else int(text)) is not None
            if refused:
                assert line is not None, f"python -m {name} {flag} {text}: accepted"
                assert "\n" not in line and line.startswith(f"{flag} must be "), (flag, text, line)
            else:
                assert line is None, f"python -m {name} {flag} {text}: refused in range: {line}"
                got = getattr(args, action.dest)
                got = got[0] if isinstance(got, list) else got
                assert got == number.kind(float(text)) or (number.kind is int and got == int(text)), (flag, text)
            walked += 1
    assert walked or not numeric_actions(parser)


def test_the_walk_covers_the_training_flags(monkeypatch):
    """The flags the bad-input round named are among those walked, with the ranges that refuse its values."""
    parser = built_parser("step3_ppo.main", monkeypatch)
    types = {a.dest: a.type for a in numeric_actions(parser)}
    for dest, text in [
        ("cliprange", "nan"),
        ("cliprange_low", "1.5"),
        ("vllm_kv_cache_gib", "0"),
        ("vllm_kv_cache_gib", "-1"),
        ("vllm_gpu_memory_utilization", "2.0"),
        ("clip_reward_value", "1e39"),
        ("gamma", "1.5"),
        ("top_p", "0"),
        ("temperature", "0"),
    ]:
        assert types[dest].problem(float(text)) is not None, (dest, text)
    dpo = {a.dest: a.type for a in numeric_actions(built_parser("step2_dpo.main", monkeypatch))}
    assert dpo["simpo_gamma"].problem(math.nan) and dpo["orpo_lambda"].problem(0.0) and dpo["beta"].problem(0.0)


# --------------------------------------------------------------------------- #
# Through the entry points' own checks: the cross-flag rules
# --------------------------------------------------------------------------- #
@pytest.fixture
def step3_argv(tiny_gpt2, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 1 =", "answer": "2"}\n' * 8)
    return [
        "--actor_model_name_or_path",
        tiny_gpt2,
        "--data_path",
        str(data),
        "--reward_funcs",
        "math_exact",
        "--advantage_estimator",
        "grpo",
        "--n_samples_per_prompt",
        "2",
        "--output_dir",
        str(tmp_path / "out"),
    ]


def step3_line(argv) -> str:
    import step3_ppo.main as step3  # lazy: the step's imports only for these tests

    with pytest.raises(UsageError) as failure:
        step3.parse_args(argv)
    return str(failure.value)


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--policy_loss", "gspo", "--cliprange", "0.5"], "--cliprange does nothing with --policy_loss gspo"),
        (["--cliprange", "1.5"], "lower clip 1 - 1.5 <= 0"),
        (["--vllm_sleep"], "--vllm_sleep does nothing with --rollout_engine hf (read by vllm)"),
        (["--vllm_kv_cache_gib", "2"], "--vllm_kv_cache_gib does nothing with --rollout_engine hf"),
        (["--lam", "0.9"], "--lam does nothing with --advantage_estimator grpo (no critic)"),
        (["--critic_learning_rate", "1e-4"], "--critic_learning_rate does nothing with --advantage_estimator grpo"),
        (["--kl_target", "3"], "--kl_target does nothing without --adaptive_kl"),
        (["--unsup_coef", "1"], "--unsup_coef does nothing without --unsupervised_dataset_name"),
        (["--max_sampling_rounds", "2"], "--max_sampling_rounds does nothing without --dynamic_sampling"),
        (["--rollout_correction_threshold", "3"], "does nothing without --rollout_correction"),
        (["--overlong_penalty_factor", "2"], "does nothing without --overlong_buffer_len"),
        (["--print_answers_interval", "2"], "does nothing without --print_answers"),
    ],
)
def test_step3_refuses_a_flag_that_would_do_nothing(step3_argv, extra, says):
    line = step3_line(step3_argv + extra)
    assert says in line and "\n" not in line, line


def test_step3_vllm_flags_are_checked_with_the_vllm_engine(step3_argv, monkeypatch):
    import step3_ppo.rollout.vllm_engine as vllm_engine  # lazy: the step's imports only for these tests

    monkeypatch.setattr(vllm_engine, "vllm_missing", lambda python: None)  # CI may have no vLLM
    vllm = step3_argv + ["--rollout_engine", "vllm", "--max_prompt_seq_len", "64", "--max_answer_seq_len", "32"]
    assert "--vllm_max_model_len 8 is below --max_prompt_seq_len + --max_answer_seq_len = 96" in step3_line(
        vllm + ["--vllm_max_model_len", "8"]
    )
    if not vllm_engine.torch.cuda.is_available():
        assert "vLLM refuses it on CPU" in step3_line(vllm + ["--vllm_sleep"])


def test_step3_accepts_the_defaults_and_the_flags_it_reads(step3_argv):
    """The refusals above are about flags the run does not read; the same values where it reads them parse."""
    import step3_ppo.main as step3  # lazy: the step's imports only for these tests

    args = step3.parse_args(step3_argv + ["--adaptive_kl", "--kl_target", "3", "--policy_loss", "gspo"])
    assert args.kl_target == 3 and args.policy_loss == "gspo"
