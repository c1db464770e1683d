"""The reference pages (docs/reference/) and README.md's "Algorithms at a glance" block are what
scripts/gen_reference.py writes from the code now: every flag of every entry point's parser, every registry entry
with its one-line help, and no path of the machine that wrote them. Pure Python, about two seconds (the mains'
imports)."""

import argparse
import os
import re
import sys

import pytest

from scripts import gen_reference as gen
from step2_dpo.main import REFERENCE_KINDS
from step3_ppo.agents.environments import ENVIRONMENTS
from step3_ppo.agents.tools import TOOL_CALL_PARSERS, TOOLS
from step3_ppo.algo.advantages import ALIASES, ESTIMATORS
from step3_ppo.rewards.functions import BUILTINS
from step3_ppo.rollout.engines import ROLLOUT_ENGINES
from tests.launch import ROOT
from utils.math.losses import PAIR_LOSSES, POLICY_LOSSES
from utils.train.flags import PER_MODEL_FLAGS


@pytest.fixture(scope="module")
def generated() -> dict:
    return gen.outputs()


def section(text: str, heading: str) -> str:
    """The lines under `heading` up to the next heading of the same level."""
    level = heading.split(" ")[0] + " "
    start = text.index(heading + "\n")
    after = text[start + len(heading) + 1 :]
    end = re.search(rf"^{re.escape(level)}", after, re.M)
    return after[: end.start()] if end else after


def test_the_generated_files_are_current(generated):
    stale = gen.stale(generated)
    assert not stale, gen.stale_message(stale)


def test_every_flag_of_every_entry_point_is_listed(generated):
    page = generated[gen.FLAGS_PAGE]
    commands = gen.entry_points()
    assert {"rlhf-sft", "rlhf-rm", "rlhf-dpo", "rlhf-rl", "rlhf-eval", "rlhf-chat"} <= {c for c, _ in commands}
    for command, module in commands:
        listed = section(page, f"## {command}")
        parser = gen.parser_of(module)
        actions = gen.documented_actions(parser)
        hidden = [a for a in parser._actions if a.help == argparse.SUPPRESS and a.option_strings]
        positionals = gen.positional_actions(parser)
        assert len(actions) + len(hidden) + len(positionals) + 1 == len(parser._actions)  # + --help
        assert all(f"Positional: `{a.metavar or a.dest}`" in listed for a in positionals)
        missing = [
            a.option_strings[-1]
            for a in actions
            if f"| {', '.join(f'`{s}`' for s in a.option_strings)} |" not in listed
        ]
        assert not missing, f"{command}: {missing}"


REGISTRIES = {
    "advantage estimator": {name: e.help for name, e in ESTIMATORS.items()},
    "policy loss": {name: e.help for name, e in POLICY_LOSSES.items()},
    "pair loss": {name: e.help for name, e in PAIR_LOSSES.items()},
    "DPO reference kind": REFERENCE_KINDS,
    "reward function": {name: b.help for name, b in BUILTINS.items()},
    "rollout engine": {name: e.help for name, e in ROLLOUT_ENGINES.items()},
    "environment": {name: e.help for name, e in ENVIRONMENTS.items()},
    "tool": {name: t.help for name, t in TOOLS.items()},
    "tool-call parser": {name: p.help for name, p in TOOL_CALL_PARSERS.items()},
}


@pytest.mark.parametrize("registry", sorted(REGISTRIES))
def test_every_registry_entry_is_listed_with_its_help(generated, registry):
    page = generated[gen.REGISTRIES_PAGE]
    missing = [name for name, text in REGISTRIES[registry].items() if f"| `{name}` | {gen.cell(text)} |" not in page]
    assert not missing, f"{registry} entries not on {gen.REGISTRIES_PAGE}: {missing}"


def test_aliases_and_per_model_flags_are_listed(generated):
    page = generated[gen.REGISTRIES_PAGE]
    assert all(f"`{alias}` = `{name}`" in page for alias, name in ALIASES.items())
    assert all(f"| `--{name}` |" in page for name in PER_MODEL_FLAGS)


def machine_strings() -> list[str]:
    home = os.path.expanduser("~")
    found = {ROOT, os.path.realpath(ROOT), sys.prefix, sys.executable}
    return sorted(found | ({home, os.path.realpath(home)} if home not in ("", "/") else set()))


def test_no_machine_path_in_the_output(generated):
    for path, text in generated.items():
        leaked = [s for s in machine_strings() if s in text]
        assert not leaked, f"{path} holds {leaked}"
        assert not re.search(r"/(home|Users)/\w", text), path


def test_a_default_under_the_checkout_or_home_is_shown_symbolically():
    parser = argparse.ArgumentParser()
    under_repo = parser.add_argument("--cache", default=os.path.join(gen.REPO_ROOT, ".cache", "x"))
    python = parser.add_argument("--python", default=sys.executable)
    assert gen.default_of(under_repo) == "`<repo>/.cache/x`"
    assert gen.default_of(python) == "`python`"
    home = os.path.expanduser("~")
    if home not in ("", "/"):
        under_home = parser.add_argument("--conf", default=os.path.join(home, ".config", "y"))
        assert gen.default_of(under_home) == "`~/.config/y`"


def test_cells_escape_the_table_and_markdown():
    assert gen.cell("KL(actor||ref) * 2, <tool_call>, \\boxed{}, see --flag_name") == (
        "KL(actor\\|\\|ref) \\* 2, &lt;tool_call>, \\\\boxed{}, see `--flag_name`"
    )
    assert gen.cell("snake_case stays, _emphasis_ does not") == "snake_case stays, \\_emphasis\\_ does not"
    assert gen.code("a|b") == "`a\\|b`"


def test_the_readme_block_is_replaced_only_between_its_markers():
    text = f"# Title\n\nprose\n{gen.README_START}\nold\nlines\n{gen.README_END}\nafter\n"
    assert (
        gen.readme_with_block(text)
        == f"# Title\n\nprose\n{gen.README_START}\n{gen.readme_block()}{gen.README_END}\nafter\n"
    )
    assert gen.readme_with_block("# Title\nno markers\n") is None
    assert gen.readme_with_block(f"{gen.README_END}\n{gen.README_START}\n") is None


def test_the_readme_block_names_every_algorithm_in_a_few_lines():
    block = gen.readme_block()
    assert len(block.splitlines()) <= 15
    for registry in (ESTIMATORS, POLICY_LOSSES, PAIR_LOSSES, BUILTINS, ROLLOUT_ENGINES, ENVIRONMENTS, TOOLS):
        assert all(f"`{name}`" in block for name in registry)


def test_check_names_the_stale_file_and_the_command(monkeypatch, capsys):
    real_read = gen._read
    monkeypatch.setattr(gen, "_read", lambda path: "stale" if path == gen.FLAGS_PAGE else real_read(path))
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {gen.FLAGS_PAGE} is stale; regenerate with: {gen.COMMAND}"]
