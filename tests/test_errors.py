"""Nothing silent, nothing lost, errors a person can read: flags out of range, runs that would train
nothing, an output directory that is an input or holds a previous run, an empty eval split, rows all
skipped as empty, and one `error:` line (no traceback, once for two ranks) for the project's own errors."""

import ast
import json
import os

import pytest

from tests.launch import run_deepspeed, tail
from tests.test_step1_run import common_args, sft_data  # noqa: F401 (fixture)
from tests.test_step3_lr0 import write_prompts
from utils.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step1_args(model, data, out, *extra):
    return [str(a) for a in common_args(model, data, out)] + list(extra)


@pytest.fixture
def step3_models(tiny_gpt2, tiny_gpt2_reward):
    return tiny_gpt2, tiny_gpt2_reward


def step3_args(models, tmp_path, *extra):
    """Step 3's flags on a tiny model (actor) and its reward-model directory (critic)."""
    write_prompts(tmp_path / "prompts.jsonl")
    return [
        "--actor_model_name_or_path",
        models[0],
        "--critic_model_name_or_path",
        models[1],
        "--data_path",
        str(tmp_path / "prompts.jsonl"),
        "--data_split",
        "0,0,10",
        "--output_dir",
        str(tmp_path / "out"),
        *extra,
    ]


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--cliprange", "0"),
        ("--cliprange_value", "-0.1"),
        ("--kl_ctl", "-0.1"),
        ("--top_p", "0"),
        ("--top_p", "1.5"),
        ("--top_k", "-1"),
        ("--actor_lora_dim", "-1"),
        ("--critic_learning_rate", "-1e-5"),
        ("--gamma", "1.5"),
        ("--max_steps", "-2"),
        ("--eval_fraction", "1.0"),
        ("--actor_dropout", "1.0"),
    ],
)
def test_step3_flags_out_of_range_are_refused_before_loading(step3_models, tmp_path, flag, value):
    from step3_ppo.main import parse_args

    with pytest.raises(UsageError, match=f"^{flag}"):
        parse_args(step3_args(step3_models, tmp_path, f"{flag}={value}"))


def test_max_steps_minus_one_means_no_limit(step3_models, tmp_path):
    from step3_ppo.main import parse_args

    assert parse_args(step3_args(step3_models, tmp_path, "--max_steps", "-1")).max_steps == 0


def test_sequences_beyond_the_models_positions_are_refused(tiny_gpt2, step3_models, tmp_path):
    from step1_sft.main import parse_args
    from step3_ppo.main import parse_args as parse_step3

    with pytest.raises(UsageError, match="--max_seq_len = 600 tokens exceeds the 512 positions"):
        parse_args(step1_args(tiny_gpt2, "data.jsonl", str(tmp_path / "o"), "--max_seq_len", "600"))
    with pytest.raises(UsageError, match="exceeds the 512 positions"):
        parse_step3(step3_args(step3_models, tmp_path, "--max_prompt_seq_len", "400", "--max_answer_seq_len", "200"))


def test_accumulation_longer_than_an_epoch_is_refused():
    from utils.train.loop import micro_batch_schedule

    args = type(
        "Args",
        (),
        dict(per_device_train_batch_size=4, seed=1, num_train_epochs=1, gradient_accumulation_steps=8, max_steps=0),
    )()
    with pytest.raises(UsageError, match="no optimizer step would be taken: 3 micro-batches"):
        micro_batch_schedule(list(range(12)), lambda rows: rows, args)
    args.gradient_accumulation_steps = 2
    assert micro_batch_schedule(list(range(12)), lambda rows: rows, args)[2] == 1  # 3 micro-batches // 2
    args.num_train_epochs = 3
    assert micro_batch_schedule(list(range(12)), lambda rows: rows, args)[2] == 4  # 9 // 2: the count runs on


def test_output_dir_that_is_the_input_model_is_refused(tiny_gpt2, tmp_path):
    from step1_sft.main import parse_args

    with pytest.raises(UsageError, match="is the input model of --model_name_or_path"):
        parse_args(step1_args(tiny_gpt2, "data.jsonl", tiny_gpt2))


def test_used_output_dir_is_refused_unless_resume_or_overwrite(tiny_gpt2, tmp_path):
    from step1_sft.main import parse_args

    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "train.log").write_text("the launch script's log\n")
    args = step1_args(tiny_gpt2, "data.jsonl", str(out))
    with pytest.raises(UsageError, match="holds a previous run .*--resume.*--overwrite_output_dir"):
        parse_args(args)
    with pytest.raises(UsageError, match="--resume finds no checkpoint .* stopped before its first save"):
        parse_args(args + ["--resume"])  # no checkpoint to resume from (e.g. the first save failed)
    (out / "checkpoints" / "latest").write_text("step-00000001")
    parse_args(args + ["--resume"])
    parse_args(args + ["--overwrite_output_dir"])
    assert sorted(os.listdir(out)) == [".run.lock", "train.log"]  # the old run's outputs are gone, the log stays
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "train.log").write_text("log\n")
    parse_args(step1_args(tiny_gpt2, "data.jsonl", str(fresh)))  # a log alone is not a run


def test_empty_eval_split_is_refused_before_training(tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """In process (the check comes before any model loads; run_main's one-line printing is tested below)."""
    from step1_sft.main import main

    with pytest.raises(UsageError, match="^no held-out examples to evaluate"):
        main([str(a) for a in common_args(tiny_gpt2, sft_data, str(tmp_path / "out")) + ["--eval_fraction", "0"]])
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


def test_rows_all_skipped_as_empty_say_so(tmp_path):
    from utils.data import DataError, build_step_rows

    path = tmp_path / "empty.jsonl"
    path.write_text("".join(json.dumps({"prompt": "  ", "chosen": "a"}) + "\n" for _ in range(4)))
    with pytest.raises(DataError, match="all 4 rows .* were skipped as empty"):
        build_step_rows([str(path)], "1,0,0", step=1, seed=1, eval_fraction=0.1)


@pytest.mark.slow
def test_a_known_error_is_one_line_once_for_two_ranks(tiny_gpt2, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Human: hi\n\nAssistant:", "response": " yes"}) + "\n{not json\n")
    proc = run_deepspeed("step1_sft.main", common_args(tiny_gpt2, str(bad), str(tmp_path / "out")), num_ranks=2)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "error:" in line and "bad.jsonl" in line]
    assert len(lines) == 1 and ":2" in lines[0], tail(proc)
    assert "Traceback" not in proc.stdout + proc.stderr, tail(proc)


def test_run_main_turns_known_errors_into_one_line(capsys):
    from utils.data import DataError
    from utils.errors import run_main

    def main(argv):
        raise DataError("data.jsonl:3: field 'prompt' is missing")

    with pytest.raises(SystemExit) as exc:
        run_main(main)
    assert exc.value.code == 1
    assert capsys.readouterr().err == "error: data.jsonl:3: field 'prompt' is missing\n"

    def bug(argv):
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        run_main(bug)


def test_project_errors_share_one_base_that_run_main_catches(capsys):
    """Every error of the project is a ProjectError (keeping its built-in base: callers catching ValueError or
    RuntimeError still do), so run_main needs no list of them; a reward function's error is one line too."""
    from step3_ppo.rewards.functions import RewardFunctionError
    from utils.data import DataError
    from utils.errors import ProjectError, run_main
    from utils.models.loading import ModelLoadError
    from utils.train.checkpoint import BrokenCheckpoint, CheckpointError, NonFiniteUpdates

    for error, builtin in (
        (CheckpointError, RuntimeError),
        (BrokenCheckpoint, RuntimeError),
        (DataError, ValueError),
        (ModelLoadError, ValueError),
        (RewardFunctionError, Exception),
        (UsageError, Exception),
        (NonFiniteUpdates, Exception),
    ):
        assert issubclass(error, ProjectError) and issubclass(error, builtin), error

    def main(argv):
        raise RewardFunctionError("math_exact", "the rows have no  'answer' field", "p.jsonl:2")

    with pytest.raises(SystemExit) as exc:
        run_main(main)
    assert exc.value.code == 1
    assert (
        capsys.readouterr().err
        == "error: reward function math_exact: the rows have no 'answer' field (row p.jsonl:2)\n"
    )


def test_errors_module_imports_nothing_of_the_project():
    """utils.errors is imported by the modules that define the errors: importing it loads no other project module."""
    import subprocess
    import sys

    code = (
        "import sys; import utils.errors; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('utils', 'step1_sft', 'step2_reward', "
        "'step2_dpo', 'step3_ppo', 'bench')))"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True).stdout
    assert out.strip() == "['utils', 'utils.errors']"


def starts_with_text(node) -> str | None:
    """The literal text an expression starts with, however the source spells it: "a", f"a{x}", "a" + x,
    "a %s" % x, "a {}".format(x); None when it starts with no literal."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return starts_with_text(node.values[0]) if node.values else ""
    if isinstance(node, ast.BinOp):
        return starts_with_text(node.left)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return starts_with_text(node.func.value)
    return None


def error_exits(source: str, name: str = "<source>") -> list[str]:
    """`name:line` of each `SystemExit("error...")` or `sys.exit("error...")` in `source`."""

    def is_error_exit(node) -> bool:
        if not isinstance(node, ast.Call) or not node.args:
            return False
        func = node.func
        exits = (isinstance(func, ast.Name) and func.id == "SystemExit") or (
            isinstance(func, ast.Attribute)
            and func.attr == "exit"
            and isinstance(func.value, ast.Name)
            and func.value.id == "sys"
        )
        return exits and (starts_with_text(node.args[0]) or "").lower().startswith("error")

    lines = sorted(node.lineno for node in ast.walk(ast.parse(source, name)) if is_error_exit(node))
    return [f"{name}:{line}" for line in lines]


def project_python_files() -> list[str]:
    """The repository's .py files, without hidden folders (.venv, .cache, .git) or other virtual environments."""
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".")
            and d != "__pycache__"
            and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg"))
        ]
        found += [os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py")]
    return sorted(found)


@pytest.mark.parametrize(
    "source, found",
    [
        ('raise SystemExit("error: x")', True),
        ("raise SystemExit(f'error: {x}')", True),
        ('sys.exit("error: " + x)', True),
        ('raise SystemExit("Error: %s" % x)', True),
        ('raise SystemExit("""error: {}""".format(x)) from None', True),
        ("raise SystemExit(2)", False),
        ('raise SystemExit(f"{x}: error")', False),
        ("raise SystemExit(message)", False),
    ],
)
def test_error_exits_reads_every_spelling(source, found):
    assert bool(error_exits(source)) == found


def test_no_code_stops_with_a_systemexit_error_string():
    """Known failures are ProjectErrors printed by run_main, the one path (utils/errors.py): a new
    `raise SystemExit("error: ...")` would be a second one."""
    found = []
    for rel in project_python_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            found += error_exits(f.read(), rel)
    assert not found, (
        "raise a ProjectError (utils.errors.UsageError, or utils.train.flags.fail) instead:\n" + "\n".join(found)
    )
