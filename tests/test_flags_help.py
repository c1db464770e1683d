"""Every command-line flag of every entry point has a help that says what it does.

Two views of the same rule, so neither a flag built from a table (utils/train/flags.py PER_MODEL_FLAGS,
added with `**spec`) nor a flag of a module that is not imported anywhere slips through:
- statically: every `add_argument(` call in the product code carries a non-empty `help=`
  (`help=argparse.SUPPRESS` hides a flag on purpose and must stay rare);
- at run time: each entry point's parser is built (its `parse_args` is intercepted, so no main
  runs and no model loads) and every action has a help; `--help` then prints them, exits 0.
Every command README.md documents stays among those entry points (`python chat.py`, run as a file, once more as
a process); the rlhf-* console scripts are tests/test_package.py's.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import os
import subprocess
import sys

import pytest

from tests.launch import ROOT

PRODUCT_DIRS = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo", "utils", "data")
PRODUCT_FILES = ("chat.py", "plan.py")
MAX_HIDDEN = 2  # flags hidden with help=argparse.SUPPRESS, on purpose


def product_files() -> list[str]:
    """Repository-relative paths of the product's Python files (not bench/, tests/, scripts/)."""
    paths = list(PRODUCT_FILES)
    for top in PRODUCT_DIRS:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
            paths += [os.path.relpath(os.path.join(folder, f), ROOT) for f in sorted(files) if f.endswith(".py")]
    return paths


def parse(rel: str) -> ast.Module:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return ast.parse(f.read(), filename=rel)


def flag_name(call: ast.Call) -> str:
    first = call.args[0] if call.args else None
    if isinstance(first, ast.Constant):
        return str(first.value)
    return ast.unparse(first) if first is not None else "?"


def is_suppress(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "SUPPRESS"


def help_problem(call: ast.Call) -> str | None:
    """Why this add_argument call has no usable help (None: it has one, or hides the flag on purpose)."""
    keywords = {k.arg: k.value for k in call.keywords}
    if "help" not in keywords:
        # `**spec` (a table of flag definitions): its helps are checked on the built parsers below
        return None if None in keywords else "no help="
    value = keywords["help"]
    if isinstance(value, ast.Constant) and (value.value is None or not str(value.value).strip()):
        return "empty help"
    return None


def add_argument_calls(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            yield node


def test_every_add_argument_call_has_a_help():
    missing, hidden = [], []
    for rel in product_files():
        for call in add_argument_calls(parse(rel)):
            problem = help_problem(call)
            if problem:
                missing.append(f"{rel}:{call.lineno} {flag_name(call)} ({problem})")
            if any(k.arg == "help" and is_suppress(k.value) for k in call.keywords):
                hidden.append(f"{rel}:{call.lineno} {flag_name(call)}")
    assert not missing, f"{len(missing)} flags without a help:\n" + "\n".join(missing)
    assert len(hidden) <= MAX_HIDDEN, "flags hidden with help=argparse.SUPPRESS:\n" + "\n".join(hidden)


def entry_points() -> list[str]:
    """Modules that run as a program and read flags: a `__main__` guard and a parser."""
    modules = []
    for rel in product_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            text = f.read()
        if '__name__ == "__main__"' in text and "parse_args(" in text:
            modules.append(rel[:-3].replace(os.sep, "."))
    return modules


ENTRY_POINTS = entry_points()


# The commands README.md and scripts/ tell users to run (`python -m MODULE`, `python chat.py`): each must stay among
# the entry points found above, so that the tests below keep checking its --help
DOCUMENTED_COMMANDS = (
    "step1_sft.main",
    "step2_reward.main",
    "step2_dpo.main",
    "step3_ppo.main",
    "step3_ppo.eval",
    "step2_reward.eval",
    "step1_sft.prompt_eval",
    "step3_ppo.plot",
    "step3_ppo.generation_check",
    "step3_ppo.agents.eval",
    "utils.models.tiny",
    "utils.models.default",
    "data.make_demo_data",
    "data.make_arithmetic_data",
    "data.make_tool_data",
    "chat",
    "plan",
)


def test_entry_points_found():
    missing = [module for module in DOCUMENTED_COMMANDS if module not in ENTRY_POINTS]
    assert not missing, f"documented commands no longer entry points (a __main__ guard and a parser): {missing}"


def test_chat_script_answers_help_from_another_directory(tmp_path):
    """`python chat.py` is the one documented command run as a file, not with -m: its __main__ block (the
    repository on sys.path, run_main) is not what the in-process tests below call."""
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "chat.py"), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0 and "--model_name_or_path" in proc.stdout, proc.stdout + proc.stderr


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def run_entry(module, argv: list[str]):
    """The entry point's own way to its parser: `parse_args(argv)` when it has one, else `main(argv)`."""
    return (module.parse_args if hasattr(module, "parse_args") else module.main)(argv)


def built_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    module = importlib.import_module(name)

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", capture)
        m.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        try:
            run_entry(module, [])
        except _Captured as captured:
            return captured.parser
    raise AssertionError(f"{name}: parsed no flags before doing its work")


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_flag_of_the_entry_point_has_a_help(name, monkeypatch):
    parser = built_parser(name, monkeypatch)
    missing = [
        action.option_strings[0] if action.option_strings else action.dest
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction) and (action.help is None or not str(action.help).strip())
    ]
    assert not missing, f"python -m {name}: {len(missing)} flags without a help: {', '.join(missing)}"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_help_prints_every_flag(name, monkeypatch):
    parser = built_parser(name, monkeypatch)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        run_entry(importlib.import_module(name), ["--help"])
    assert exit_info.value.code in (0, None), f"python -m {name} --help exited {exit_info.value.code}"
    text = out.getvalue()
    for action in parser._actions:
        if action.help != argparse.SUPPRESS and action.option_strings:
            assert action.option_strings[0] in text, f"python -m {name} --help does not show {action.option_strings[0]}"
