"""The project as an installed package (pyproject.toml): one list of dependencies, and entry points that run from
any directory without PYTHONPATH once scripts/setup.sh has installed it editable into the venv.

The tests that run commands fail, rather than skip, in a venv without that install: saying how to make it."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.launch import ROOT, metrics, rank_command, subprocess_env, tail
from tests.test_step1_run import common_args, sft_data  # noqa: F401  (sft_data: step 1's fixture)

DISTRIBUTION = "rlhf-pipeline"
COMMANDS = {
    "rlhf-sft": "step1_sft.main",
    "rlhf-rm": "step2_reward.main",
    "rlhf-dpo": "step2_dpo.main",
    "rlhf-rl": "step3_ppo.main",
    "rlhf-eval": "step3_ppo.eval",
    "rlhf-chat": "chat",
    "rlhf-plan": "plan",
    "rlhf-reward-server": "step3_ppo.rewards.server",
}


def pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def pins(requirements_file: str) -> list[str]:
    """The requirement lines of a requirements file, in order, without comments and blank lines."""
    with open(os.path.join(ROOT, requirements_file)) as f:
        return [line for line in (raw.split("#", 1)[0].strip() for raw in f) if line]


def pinned_name(requirement: str) -> str:
    return re.split(r"[=<>!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_dependencies_are_the_pins_of_requirements_txt():
    """requirements.txt is what setup.sh installs, pyproject's dependencies what `pip install .` would: one list."""
    assert pyproject()["project"]["dependencies"] == pins("requirements.txt"), (
        "pyproject.toml's [project] dependencies differ from requirements.txt: change both"
    )


def test_extras_agree_with_the_requirement_files():
    extras = pyproject()["project"]["optional-dependencies"]
    assert extras["vllm"] == pins("requirements-vllm-cpu.txt"), (
        "pyproject.toml's vllm extra differs from requirements-vllm-cpu.txt: change both"
    )
    required = {pinned_name(r): r for r in pins("requirements.txt")}
    drifted = [r for r in extras["dev"] if pinned_name(r) in required and required[pinned_name(r)] != r]
    assert not drifted, f"the dev extra pins other versions than requirements.txt: {drifted}"
    # installed with --no-deps by setup.sh: as a dependency pip would install what they declare
    no_deps = {pinned_name(r) for r in pins("requirements-nodeps.txt")}
    assert not no_deps & {pinned_name(r) for r in pyproject()["project"]["dependencies"]}


def test_console_scripts_are_the_documented_commands():
    assert pyproject()["project"]["scripts"] == {name: f"{module}:cli" for name, module in COMMANDS.items()}


@pytest.fixture(scope="module")
def editable_install() -> None:
    """This checkout installed editable in the running venv, with the commands of its current pyproject.toml."""
    how = "run `bash scripts/setup.sh` (it runs `pip install --no-deps --no-build-isolation -e .` into .venv)"
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is None:
        pytest.fail(f"{DISTRIBUTION} is not installed in {sys.prefix}: {how}", pytrace=False)
    origin = json.loads(dist.read_text("direct_url.json") or "{}")
    if not origin.get("dir_info", {}).get("editable") or origin.get("url") != Path(ROOT).as_uri():
        pytest.fail(
            f"{DISTRIBUTION} in {sys.prefix} is not this checkout's editable install ({origin.get('url')}): {how}",
            pytrace=False,
        )
    installed = {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"}
    if installed != pyproject()["project"]["scripts"]:
        pytest.fail(
            f"{DISTRIBUTION} was installed from an older pyproject.toml (commands {sorted(installed)}): {how}",
            pytrace=False,
        )


def env_without_pythonpath() -> dict:
    env = subprocess_env()
    env.pop("PYTHONPATH", None)
    return env


def test_commands_answer_help_from_another_directory(editable_install, tmp_path):
    """Each console script and `python -m step1_sft.main`, started in tmp_path with PYTHONPATH unset. All at once:
    each imports torch, DeepSpeed and transformers for its parser (about 4 s each on a loaded machine)."""
    bin_dir = os.path.dirname(sys.executable)
    commands = {name: [os.path.join(bin_dir, name), "--help"] for name in COMMANDS}
    commands["python -m step1_sft.main"] = [sys.executable, "-m", "step1_sft.main", "--help"]
    env = env_without_pythonpath()
    running = {
        name: subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for name, command in commands.items()
    }
    failed = []
    for name, proc in running.items():
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0 or "usage:" not in out:
            failed.append(f"{name} --help: exit status {proc.returncode}\n{(out + err)[-1500:]}")
    assert not failed, "\n\n".join(failed)


@pytest.mark.slow
def test_two_rank_step1_run_through_the_launcher_from_another_directory(
    editable_install, tiny_gpt2, sft_data, tmp_path
):  # noqa: F811
    """`deepspeed --module step1_sft.main` from tmp_path, PYTHONPATH unset, output_dir relative to tmp_path."""
    command = rank_command("step1_sft.main", common_args(tiny_gpt2, sft_data, "out", steps=2), launcher=True)
    # the launcher's script run by this venv's python, as its ranks then are: a venv copied from another one keeps
    # the other's python on its scripts' first line, whose install is not this checkout's
    proc = subprocess.run(
        [sys.executable, *command],
        cwd=tmp_path,
        env=env_without_pythonpath(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists(), tail(proc)
    assert any("train/loss" in row for row in metrics(str(out))), tail(proc)
