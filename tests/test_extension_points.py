"""The extension points are registries that orchestration asks, not names it hard-codes: an entry
registered (here, for the test's duration) is offered by its flag with its help and is used by the
run. The pair-loss registry's end-to-end case is in tests/test_step2_dpo.py, the reward functions' in
tests/test_reward_funcs.py, the policy losses' math in tests/test_losses.py."""

import ast
import contextlib
import io
import os
from types import SimpleNamespace

import pytest
import torch

from step3_ppo.algo.advantages import ESTIMATORS
from step3_ppo.algo.shaping import FixedKLController
from step3_ppo.rollout import engines as rollout_engines
from step3_ppo.trainer import PPOConfig, PPOTrainer
from tests.launch import ROOT
from utils.math import losses


def help_of(parse_args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args(["--help"])
    return " ".join(out.getvalue().split())


def test_each_registry_entry_is_offered_by_its_flag_with_its_help(monkeypatch):
    from step2_dpo.main import parse_args as dpo_args
    from step3_ppo.main import parse_args as rl_args

    monkeypatch.setenv("COLUMNS", "2000")  # argparse wraps at hyphens otherwise
    monkeypatch.setitem(losses.POLICY_LOSSES, "toy_pg", losses.PolicyLoss(losses.policy_loss, "a toy policy loss"))
    monkeypatch.setitem(
        rollout_engines.ROLLOUT_ENGINES,
        "toy_engine",
        rollout_engines.RolloutEngineEntry(rollout_engines.ActorGenerate, "a toy engine"),
    )
    monkeypatch.setitem(
        losses.PAIR_LOSSES,
        "toy_pair",
        losses.PairLoss(
            losses.ipo_pair_loss, "a toy pair loss", options={"toy_margin": losses.PairOption(1.0, "a toy option")}
        ),
    )
    rl, dpo = help_of(rl_args), help_of(dpo_args)
    for name, entry in [*losses.POLICY_LOSSES.items(), *rollout_engines.ROLLOUT_ENGINES.items(), *ESTIMATORS.items()]:
        assert f"{name}: {' '.join(entry.help.split())}" in rl, name
    from step3_ppo.agents.environments import ENVIRONMENTS
    from step3_ppo.agents.tools import TOOL_CALL_PARSERS, TOOLS

    for name, entry in [*ENVIRONMENTS.items(), *TOOLS.items()]:  # listed as the reward built-ins: name (help)
        assert f"{name} ({' '.join(entry.help.split())})" in rl, name
    for name, entry in TOOL_CALL_PARSERS.items():
        assert f"{name}: {' '.join(entry.help.split())}" in rl, name
    for name, entry in losses.PAIR_LOSSES.items():
        assert f"{name}: {' '.join(entry.help.split())}" in dpo, name
    assert "--toy_margin TOY_MARGIN a toy option (--loss_type toy_pair only)" in dpo


def test_a_registered_rollout_engine_generates_the_trainers_rows(monkeypatch):
    """The trainer generates through the `--rollout_engine` entry: the prompts repeated per sample, the
    rollout's settings; its sequences become rows split at the stop token, grouped per prompt."""
    calls = []

    class Scripted:
        def __init__(self, actor, config):
            self.actor = actor

        def generate(self, input_ids, attention_mask, settings):
            calls.append((tuple(input_ids.shape), attention_mask[:, 0].tolist(), settings.max_new_tokens))
            answers = torch.tensor([[7, 8, 2], [9, 2, 0]]).repeat(input_ids.shape[0] // 2, 1)
            return torch.cat([input_ids, answers], dim=1)

    monkeypatch.setitem(
        rollout_engines.ROLLOUT_ENGINES,
        "scripted",
        rollout_engines.RolloutEngineEntry(Scripted, "answers from a script"),
    )
    config = PPOConfig(
        stop_token_ids=(2,),
        pad_token_id=0,
        rollout_engine="scripted",
        n_samples_per_prompt=2,
        advantage_estimator="grpo",
        max_answer_seq_len=3,
    )
    trainer = PPOTrainer(SimpleNamespace(actor="the actor", ref=None, critic=None), config, FixedKLController(0.0), [])
    assert trainer.rollout.actor == "the actor"
    rows = trainer.generate_rows(
        {"input_ids": torch.tensor([[0, 5, 6], [4, 5, 6]]), "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]])}
    )
    assert calls == [((4, 3), [0, 0, 1, 1], 3)]
    assert [r.response_ids.tolist() for r in rows] == [[7, 8, 2], [9, 2]] * 2
    assert [r.group for r in rows] == [0, 0, 1, 1] and [r.prompt_ids.tolist() for r in rows][::2] == [[5, 6], [4, 5, 6]]


ENGINE_FOLDER = "step3_ppo/rollout/"


def docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstring constants of a module, its classes and functions (they may name a product)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def names_and_strings(tree: ast.Module):
    """(line, text) of every imported module, identifier, attribute, keyword, parameter and string constant."""
    skip = docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):  # its names (and an import's) are ast.alias nodes, walked too
            texts = [node.module or ""]
        elif isinstance(node, ast.Constant):
            texts = [node.value] if isinstance(node.value, str) and id(node) not in skip else []
        else:
            texts = [
                getattr(node, field)
                for field in ("id", "attr", "arg", "name")
                if isinstance(getattr(node, field, None), str)
            ]
        yield from ((getattr(node, "lineno", 0), text) for text in texts)


def test_only_the_rollout_folder_names_a_rollout_engine():
    """A server-type rollout engine lives in step3_ppo/rollout/ (its module and its registry line): no step or
    utils module outside it imports vLLM or names it in an identifier, a flag or a string (comments and docstrings
    may mention the product)."""
    from tests.test_layering import STEPS, python_files

    found = []
    for path in [p for folder in (*STEPS, "utils") for p in python_files(folder)]:
        if path.replace(os.sep, "/").startswith(ENGINE_FOLDER):
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        found += [f"{path}:{line}: {text!r}" for line, text in names_and_strings(tree) if "vllm" in text.lower()]
    assert not found, "\n".join(found)
