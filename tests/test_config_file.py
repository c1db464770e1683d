"""`--config FILE.yaml` (utils/train/config_file.py): a file parses to the same flags as the command line it stands
for, for every kind of flag the entry points have; the command line wins, a later file wins over an earlier one;
what a file cannot say is refused in one line naming the file and the key; OUTPUT_DIR/config.yaml parses back to
the run's own flags (every entry point), and the resume check compares the flags, never where they came from."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import pytest
import yaml

from tests.launch import ROOT, subprocess_env
from tests.test_step3_lr0 import write_prompts
from utils.cli import Number
from utils.errors import UsageError
from utils.train.checkpoint import changed_flags, run_flags
from utils.train.config_file import CONFIG_FILE, ConfigFileParser, config_text, write_config, write_run_config

MAINS = ("step1_sft.main", "step2_reward.main", "step2_dpo.main", "step3_ppo.main", "step3_ppo.eval", "chat")
# what each parser requires, so that a parse reaches the flags under test
REQUIRED = {
    "step1_sft.main": ["--model_name_or_path", "m", "--data_path", "d", "--output_dir", "o"],
    "step2_reward.main": ["--model_name_or_path", "m", "--data_path", "d", "--output_dir", "o"],
    "step2_dpo.main": ["--model_name_or_path", "m", "--data_path", "d", "--output_dir", "o"],
    "step3_ppo.main": ["--actor_model_name_or_path", "m", "--data_path", "d", "--output_dir", "o"],
    "step3_ppo.eval": ["--sft_model", "m"],
    "chat": ["--model_name_or_path", "m"],
}


def parser_of(module: str) -> ConfigFileParser:
    return importlib.import_module(module).build_parser()


def yaml_file(tmp_path, text: str, name: str = "run.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def flags_of(module: str, argv: list[str]) -> dict:
    return vars(parser_of(module).parse_args(REQUIRED[module] + argv))


# --------------------------------------------------------------------------- #
# A file says what the command line says, for every flag of every entry point
# --------------------------------------------------------------------------- #
def other_value(action: argparse.Action):
    """(YAML value, command-line tokens) giving the flag of `action` a value other than its default."""
    option = action.option_strings[-1]
    if action.nargs == 0:  # a switch: the value it sets
        return action.const, [option]
    if action.choices is not None:
        choice = next(c for c in reversed(list(action.choices)) if c != action.default)
        return choice, [option, str(choice)]
    if isinstance(action, argparse._AppendAction):
        return ["a=x", "b=y"], [option, "a=x", option, "b=y"]
    if isinstance(action.type, Number):  # two values its range accepts (a negative one where it may be)
        kind = action.type.kind
        tried = ["7", "-3", "3", "1", "0"] if kind is int else ["0.25", "-1.5", "0.75", "1.5", "0"]
        sample = [s for s in tried if action.type.problem(kind(s)) is None and kind(s) != action.default][:2]
    else:
        sample = ["some value", "x"]
    if action.nargs in ("+", "*"):
        return [yaml.safe_load(s) if action.type else s for s in sample], [option, *sample]
    return (yaml.safe_load(sample[0]) if action.type else sample[0]), [option, sample[0]]


@pytest.mark.parametrize("module", MAINS)
def test_every_flag_parses_from_a_file_as_from_the_command_line(module, tmp_path):
    """Each flag alone: int, float, str, choices, switches (store_true and store_false, --do_sample/--greedy sharing
    do_sample), nargs lists, a repeatable flag, per-model prefixed flags, flags whose default is None."""
    parser = parser_of(module)
    required = {a.dest for a in parser._actions if a.required}
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config") or action.dest in required:
            continue
        value, tokens = other_value(action)
        path = yaml_file(tmp_path, yaml.safe_dump({action.dest: value}))
        from_file = flags_of(module, ["--config", path])
        from_command_line = flags_of(module, tokens)
        assert from_file == from_command_line, (action.option_strings, value)
        assert from_file != flags_of(module, []) or parser.get_default(action.dest) == value, action.option_strings
        checked += 1
    assert checked >= len(parser._actions) - len(required) - 2


def test_the_kinds_of_flag_spelled_as_a_person_writes_them(tmp_path):
    path = yaml_file(
        tmp_path,
        """
# a comment
actor_learning_rate: 1e-5          # YAML reads 1e-5 as a string: the flag's own float() reads it
critic_lora_dim: 8                 # per-model prefixed
data_path: [a.jsonl, b.jsonl]      # nargs=+
sft_only_data_path: []             # nargs=*: an empty list
reward_weights: [1.0, -0.5]        # negative numbers in a list
reward_funcs: format               # a scalar for a list flag: one item
format_pattern: '^\\s*\\d+$'
lora_alpha: 16                     # default None
tensorboard_path:                  # empty: the default (None)
lr_scheduler_type: constant        # choices
actor_zero_stage: 3                # int choices
enable_hybrid_engine: yes          # a YAML boolean
rollout_logprobs: false            # the store_false switch --no_rollout_logprobs
do_sample: false                   # --greedy
max_steps: -1                      # a negative value
wandb_run_name: "on"               # quoted: a string, not a boolean
""",
    )
    args = parser_of("step3_ppo.main").parse_args(
        ["--actor_model_name_or_path", "m", "--output_dir", "o", "--config", path]
    )
    assert args.actor_learning_rate == 1e-5 and args.critic_lora_dim == 8
    assert args.data_path == ["a.jsonl", "b.jsonl"] and args.sft_only_data_path == []
    assert args.reward_weights == [1.0, -0.5] and args.reward_funcs == ["format"]
    assert args.format_pattern == "^\\s*\\d+$" and args.lora_alpha == 16.0 and args.tensorboard_path is None
    assert (args.lr_scheduler_type, args.actor_zero_stage) == ("constant", 3)
    assert args.enable_hybrid_engine is True and args.rollout_logprobs is False and args.do_sample is False
    assert args.max_steps == -1 and args.wandb_run_name == "on"
    assert not hasattr(args, "config")


def test_a_yaml_boolean_for_a_string_flag_is_its_text(tmp_path):
    """`--lora_module_name on` on the command line is the string 'on': so is `lora_module_name: on`."""
    path = yaml_file(tmp_path, "lora_module_name: on\nwandb_project: 'off'\n")
    assert flags_of("step1_sft.main", ["--config", path]) == flags_of(
        "step1_sft.main", ["--lora_module_name", "on", "--wandb_project", "off"]
    )


# --------------------------------------------------------------------------- #
# Precedence
# --------------------------------------------------------------------------- #
def test_the_command_line_wins_wherever_it_stands(tmp_path):
    path = yaml_file(
        tmp_path,
        "learning_rate: 1e-3\ndata_path: [file_a, file_b]\noffload: true\nzero_stage: 2\nlora_alpha: 4\n",
    )
    for argv in (
        ["--config", path, "--learning_rate", "2e-5", "--data_path", "c"],
        ["--learning_rate", "2e-5", "--data_path", "c", "--config", path],
        ["--learning_rate=2e-5", "--data_path", "c", f"--config={path}"],
        ["--learning_r", "2e-5", "--data_path", "c", "--config", path],  # an abbreviation argparse accepts
    ):
        args = parser_of("step1_sft.main").parse_args(["--model_name_or_path", "m", "--output_dir", "o", *argv])
        assert args.learning_rate == 2e-5 and args.data_path == ["c"], argv  # a list is replaced, not merged
        assert (args.offload, args.zero_stage, args.lora_alpha) == (True, 2, 4.0)  # the rest from the file


def test_either_switch_of_a_pair_on_the_command_line_wins_over_the_file(tmp_path):
    """--do_sample and --greedy exclude each other: the command line's replaces the file's, not a clash."""
    greedy = yaml_file(tmp_path, "do_sample: false\n", "greedy.yaml")
    sampling = yaml_file(tmp_path, "do_sample: true\ntemperature: 0.5\n", "sampling.yaml")
    assert flags_of("chat", ["--config", greedy, "--do_sample"])["do_sample"] is True
    assert flags_of("step3_ppo.main", ["--config", sampling, "--greedy"])["do_sample"] is False
    assert flags_of("step3_ppo.eval", ["--config", greedy])["do_sample"] is False


def test_a_repeatable_flag_on_the_command_line_replaces_the_files(tmp_path):
    path = yaml_file(tmp_path, "policy: [dpo=out/dpo, kto=out/kto]\n")
    assert flags_of("step3_ppo.eval", ["--config", path])["policy"] == ["dpo=out/dpo", "kto=out/kto"]
    assert flags_of("step3_ppo.eval", ["--config", path, "--policy", "orpo=o"])["policy"] == ["orpo=o"]


def test_a_later_file_wins_and_null_restores_the_default(tmp_path):
    base = yaml_file(tmp_path, "loss_type: sigmoid\nbeta: 0.1\nnll_loss_coef: 1.0\nseed: 7\n", "base.yaml")
    orpo = yaml_file(tmp_path, "loss_type: orpo\nbeta: null\nnll_loss_coef: 0.0\n", "orpo.yaml")
    flags = flags_of("step2_dpo.main", ["--config", base, "--config", orpo])
    assert (flags["loss_type"], flags["beta"], flags["nll_loss_coef"], flags["seed"]) == ("orpo", None, 0.0, 7)
    assert flags_of("step2_dpo.main", ["--config", orpo, "--config", base])["loss_type"] == "sigmoid"


def test_an_empty_file_changes_nothing(tmp_path):
    path = yaml_file(tmp_path, "# nothing yet\n")
    assert flags_of("step1_sft.main", ["--config", path]) == flags_of("step1_sft.main", [])


def test_required_flags_may_come_from_the_file(tmp_path):
    path = yaml_file(tmp_path, "model_name_or_path: m\ndata_path: d\noutput_dir: o\n")
    args = parser_of("step1_sft.main").parse_args(["--config", path])
    assert (args.model_name_or_path, args.data_path, args.output_dir) == ("m", ["d"], "o")


# --------------------------------------------------------------------------- #
# Refusals: one line naming the file and the key
# --------------------------------------------------------------------------- #
REFUSED = [
    (
        "actor_lerning_rate: 1e-5\n",
        r"run.yaml: unknown key 'actor_lerning_rate' \(did you mean --actor_learning_rate\?\)",
    ),
    ("greedy: true\n", r"run.yaml: unknown key 'greedy' \(--greedy is written do_sample: false\)"),
    ("no_whiten_advantages: true\n", r"unknown key 'no_whiten_advantages' \(.* is written whiten_advantages: false\)"),
    ("zzz: 1\n", r"run.yaml: unknown key 'zzz'$"),
    ("config: other.yaml\n", r"run.yaml: key 'config': a file cannot load another"),
    ("seed: 1\nseed: 2\n", r"run.yaml: key 'seed' appears twice"),
    ("- seed\n- 1\n", r"run.yaml: expected flag: value lines \(a mapping\), got a list"),
    ("just text\n", r"run.yaml: expected flag: value lines \(a mapping\), got a value"),
    ("actor:\n  learning_rate: 1e-5\n", r"run.yaml: unknown key 'actor'"),
    ("seed:\n  value: 3\n", r"run.yaml: key 'seed': a nested mapping"),
    ("data_path: [[a, b]]\n", r"run.yaml: key 'data_path': a nested value in the list"),
    ("seed: [1, 2]\n", r"run.yaml: key 'seed': one value expected, got a list"),
    ("seed: 1.5\n", r"run.yaml: key 'seed': invalid int value '1.5'"),
    ("actor_learning_rate: fast\n", r"run.yaml: key 'actor_learning_rate': invalid float value 'fast'"),
    ("actor_zero_stage: 4\n", r"run.yaml: key 'actor_zero_stage': must be in \[0, 3\], got 4"),
    ("dtype: fp8\n", r"run.yaml: key 'dtype': invalid choice 'fp8' \(choose from fp32, bf16, fp16\)"),
    ("offload: 1\n", r"run.yaml: key 'offload': --offload is a switch: true or false, got '1'"),
    ("offload: 'true'\n", r"key 'offload': --offload is a switch: true or false, got 'true'"),
    ("do_sample: [true]\n", r"key 'do_sample': --do_sample / --greedy is a switch: true or false, got a list"),
    ("data_path: []\n", r"run.yaml: key 'data_path': expected at least one value, got \[\]"),
    ("reward_funcs: [format, -x]\n", r"key 'reward_funcs': the list item '-x' would be read as a flag"),
    ("reward_weights: [1, null]\n", r"key 'reward_weights': a null list item"),
    ("seed: [1\n", r"run.yaml: not valid YAML: .*\(line 2\)"),
    ("a: 1\n---\nb: 2\n", r"run.yaml: not valid YAML: .*"),
    ("seed: !!python/object/apply:os.system ['touch pwned']\n", r"run.yaml: not valid YAML: .*"),
]


@pytest.mark.parametrize("text,message", REFUSED)
def test_what_a_file_cannot_say_is_refused_in_one_line(text, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yaml_file(tmp_path, text)
    with pytest.raises(UsageError, match=message) as refused:
        flags_of("step3_ppo.main", ["--config", "run.yaml"])
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "pwned").exists()  # nothing in a file runs


def test_a_missing_or_unreadable_file_is_refused_naming_it(tmp_path):
    for argv in (["--config", "nothere.yaml"], ["--config=nothere.yaml"], ["--conf", "nothere.yaml"]):
        with pytest.raises(UsageError, match=r"^nothere.yaml: no such file \(--config\)$"):
            flags_of("step1_sft.main", argv)
    with pytest.raises(UsageError, match=f"^{tmp_path}: cannot read it"):
        flags_of("step1_sft.main", ["--config", str(tmp_path)])


def test_config_without_a_file_is_argparses_own_error():
    with pytest.raises(UsageError, match=r"^--config: expected one argument \(--help lists the flags\)$"):
        flags_of("step1_sft.main", ["--config", "--seed", "3"])


def test_the_refusal_is_the_programs_one_error_line(tmp_path):
    """Through the entry point: `error: run.yaml: unknown key ...`, one line, no traceback, status 1."""
    (tmp_path / "run.yaml").write_text("actor_lerning_rate: 1e-5\n")
    proc = subprocess.run(
        [sys.executable, "-m", "step3_ppo.main", "--config", "run.yaml"],
        cwd=tmp_path,
        env=subprocess_env(PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: run.yaml: unknown key 'actor_lerning_rate' (did you mean --actor_learning_rate?)"
    ]


# --------------------------------------------------------------------------- #
# OUTPUT_DIR/config.yaml
# --------------------------------------------------------------------------- #
@pytest.fixture
def inputs(tmp_path, tiny_gpt2, tiny_gpt2_reward):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts)
    return {"model": tiny_gpt2, "reward": tiny_gpt2_reward, "data": str(prompts), "out": str(tmp_path / "out")}


def main_argv(module: str, i: dict) -> list[str]:
    """A command line of `module` with flags its checks fill in or change after parsing."""
    single = ["--model_name_or_path", i["model"], "--data_path", i["data"], "--output_dir", i["out"]]
    return {
        "step1_sft.main": single
        + ["--max_steps", "-1", "--learning_rate", "3e-5", "--sft_only_data_path", "--gradient_clipping", "0.5"],
        "step2_reward.main": single + ["--lora_dim", "4", "--only_optimize_lora", "--dropout", "0.1"],
        "step2_dpo.main": single + ["--loss_type", "ipo"],  # --beta left out: the loss's default fills it
        "step3_ppo.main": [
            "--actor_model_name_or_path",
            i["model"],
            "--critic_model_name_or_path",
            i["reward"],
            "--data_path",
            i["data"],
            "--output_dir",
            i["out"],
            "--greedy",  # the sampling knobs are filled in after parsing (1.0, 1.0, 0)
            "--reward_weights",
            "1.0",
            "--actor_lora_dim",
            "2",
            "--local_rank",
            "-1",
        ],
        "step3_ppo.eval": ["--sft_model", i["model"], "--reward_funcs", "format", "--policy", "a=x", "--out", i["out"]],
        "chat": ["--model_name_or_path", i["model"], "--greedy", "--system", "be brief: yes"],
    }[module]


@pytest.mark.parametrize("module", MAINS)
def test_config_yaml_parses_back_to_the_same_flags(module, inputs, tmp_path):
    """parse(argv) -> config.yaml -> parse(--config config.yaml): the same flags, before and after the entry
    point's checks (which fill in some: the file holds them as parsed, so the checks see the same input)."""
    parse_args = importlib.import_module(module).parse_args
    first = parse_args(main_argv(module, inputs))
    path = write_config(str(tmp_path / CONFIG_FILE), first, module)
    again = parse_args(["--config", path])
    assert vars(again) == vars(first)
    assert again.as_parsed == first.as_parsed
    with open(path) as f:
        text = f.read()
    assert text.startswith(f"# The flags of a run of `python -m {module}`") and "config:" not in text
    assert yaml.safe_load(text)["seed"] == first.seed


def test_config_yaml_holds_the_flags_as_parsed_not_as_checked(inputs):
    from step3_ppo.main import parse_args

    args = parse_args(main_argv("step3_ppo.main", inputs))
    assert (args.temperature, args.top_p, args.top_k) == (1.0, 1.0, 0)  # filled in by the checks
    flags = yaml.safe_load(config_text(args, "step3_ppo.main"))
    assert (flags["do_sample"], flags["temperature"], flags["top_k"]) == (False, None, None)
    assert "local_rank" not in flags  # the launcher's, per process


@pytest.mark.parametrize("module,runner", [("step1_sft.main", "start_single_model_run"), ("step3_ppo.main", "setup")])
def test_a_training_run_writes_config_yaml_at_its_start_on_rank_0(module, runner, inputs, monkeypatch):
    """Before the data or a model loads (here: the first thing after the flags stops the run)."""
    main_module = importlib.import_module(module)

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(main_module, runner, stop)
    argv = main_argv(module, inputs)
    with pytest.raises(Stop):
        main_module.main(argv)
    path = os.path.join(inputs["out"], CONFIG_FILE)
    assert vars(main_module.parse_args(["--config", path])) == vars(main_module.parse_args(argv))
    os.remove(path)
    monkeypatch.setenv("RANK", "1")
    assert write_run_config(main_module.parse_args(argv), module) is None and not os.path.exists(path)


def test_eval_writes_its_flags_next_to_its_result(inputs, tmp_path, monkeypatch):
    """--out results/eval.json -> results/eval.config.yaml; without --out nothing is written."""
    from step3_ppo import eval as eval_main

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(eval_main, "other_policies", stop)
    out = tmp_path / "results" / "eval.json"
    with pytest.raises(Stop):
        eval_main.main(["--sft_model", inputs["model"], "--reward_funcs", "format", "--out", str(out)])
    written = tmp_path / "results" / "eval.config.yaml"
    assert yaml.safe_load(written.read_text())["out"] == str(out)
    assert eval_main.parse_args(["--config", str(written)]).out == str(out)


# --------------------------------------------------------------------------- #
# Resume: the flags are compared, not where they came from
# --------------------------------------------------------------------------- #
def test_the_resume_check_compares_flags_from_a_file_like_flags_from_the_command_line(tmp_path):
    parser = parser_of("step1_sft.main")
    argv = REQUIRED["step1_sft.main"] + ["--learning_rate", "1e-4", "--seed", "3"]
    saved = run_flags(parser.parse_args(argv))
    assert "config" not in saved and "as_parsed" not in saved
    same = yaml_file(tmp_path, "learning_rate: 1e-4\nseed: 3\n", "same.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = yaml_file(elsewhere, "learning_rate: 1e-4\nseed: 3\nmax_steps: 9\n", "moved.yaml")  # max_steps: resumable
    for config in (same, moved):
        given = run_flags(parser.parse_args(REQUIRED["step1_sft.main"] + ["--config", config]))
        assert changed_flags(saved, given) == []  # another --config path (or none) is no change
    changed = yaml_file(tmp_path, "learning_rate: 2e-4\nseed: 3\n", "changed.yaml")
    given = run_flags(parser.parse_args(REQUIRED["step1_sft.main"] + ["--config", changed]))
    assert changed_flags(saved, given) == ["--learning_rate 0.0001 (this run: 0.0002)"]


def test_the_config_flag_is_in_every_entry_points_help():
    for module in MAINS:
        assert "--config FILE" in parser_of(module).format_help(), module
