"""The presets under configs/: each parses, with the checks of the entry point that runs it, into a run those checks
accept; each says in its first lines what it is and which script uses it; every script passes an existing preset,
and what it launches holds the preset's values (unless its env variables or extra args override them); the
configuration guide lists every preset."""

from __future__ import annotations

import glob
import importlib
import os
import re

import pytest
import yaml

from tests.launch import ROOT
from tests.test_scripts import SCRIPTS, code_lines, launched, parsed, read, run_with_stub
from tests.test_step3_lr0 import write_prompts

PRESETS = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "configs", "**", "*.yaml"), recursive=True)
)
# a preset layered on another (passed after it) is checked on top of it
BASE = {
    "configs/demo/step3_rloo.yaml": "configs/step3_ppo/ppo_cpu.yaml",
    "configs/demo/tools_step1_sft.yaml": "configs/step1_sft/cpu.yaml",
    **{p: "configs/step2_dpo/cpu.yaml" for p in PRESETS if p.startswith("configs/step2_dpo/loss_")},
}
DEMO = "scripts/demo.sh"


def module_of(preset: str) -> str:
    base = BASE.get(preset, preset)
    return f"{base.split('/')[1]}.main"


def preset_paths(text: str) -> list[str]:
    """The configs/... paths a script's code names (a LOSS_TYPE's `loss_$LOSS_TYPE` spelled out per loss)."""
    paths = re.findall(r"--config \"?(configs/[^\s\"]+\.yaml)", code_lines(text))
    losses = re.search(r"^\s*([a-z|]+)\) LOSS=\(--config \"configs/step2_dpo/loss_\$LOSS_TYPE\.yaml\"\)", text, re.M)
    if losses:
        paths = [p for p in paths if "$" not in p]
        paths += [f"configs/step2_dpo/loss_{loss}.yaml" for loss in losses.group(1).split("|")]
    return paths


def users(preset: str) -> list[str]:
    return [script for script in SCRIPTS + [DEMO] if preset in preset_paths(read(script))]


def test_the_presets_are_there():
    assert len(PRESETS) >= 20 and all("/" in p[len("configs/") :] for p in PRESETS)


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_says_what_it_is_and_which_script_uses_it(preset):
    text = read(preset)
    header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
    assert text.startswith("# ") and len(header) > 80, "a preset starts with a comment saying what it is"
    used_by = users(preset)
    assert used_by, f"{preset}: no script passes it"
    for script in used_by:
        assert script in header or (script == DEMO and "scripts/demo.sh" in header), f"{preset}: name {script}"
    flags = yaml.safe_load(text)
    assert isinstance(flags, dict) and flags, preset


@pytest.mark.parametrize("script", SCRIPTS + [DEMO])
def test_each_script_passes_existing_presets(script):
    paths = preset_paths(read(script))
    if script != DEMO:
        assert len([p for p in paths if "/loss_" not in p]) == 1, f"{script}: one preset of its own"
    for path in paths:
        assert os.path.isfile(os.path.join(ROOT, path)), f"{script} passes {path}, which does not exist"


@pytest.fixture
def run_inputs(tmp_path, tiny_gpt2, tiny_gpt2_reward, monkeypatch):
    """Model directories and prompt rows for a preset's checks; the GPU presets' sequence lengths exceed the tiny
    models' position tables, which is the model's limit, not the preset's (so that check is left out)."""
    monkeypatch.chdir(ROOT)
    for module in ("utils.train.flags", "step3_ppo.main"):
        monkeypatch.setattr(importlib.import_module(module), "check_sequence_fits", lambda *a: None)
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts)
    return {"model": tiny_gpt2, "reward": tiny_gpt2_reward, "data": str(prompts), "out": str(tmp_path / "out")}


@pytest.mark.parametrize("preset", PRESETS)
def test_each_preset_parses_and_passes_its_entry_points_checks(preset, run_inputs):
    module = module_of(preset)
    configs = ([BASE[preset]] if preset in BASE else []) + [preset]
    if module == "step3_ppo.main":
        flags = {k: v for c in configs for k, v in yaml.safe_load(read(c)).items()}
        argv = ["--actor_model_name_or_path", run_inputs["model"]]
        if "reward_funcs" not in flags and "tools" not in flags:  # PPO/RLOO on a reward model
            argv += ["--critic_model_name_or_path", run_inputs["reward"]]
    else:
        argv = ["--model_name_or_path", run_inputs["model"]]
    argv += ["--data_path", run_inputs["data"], "--output_dir", run_inputs["out"]]
    argv += [token for c in configs for token in ("--config", c)]
    args = importlib.import_module(module).parse_args(argv)
    for key, value in yaml.safe_load(read(preset)).items():
        if value is not None and key not in ("max_steps",):  # a check may normalise max_steps (-1 -> 0)
            assert getattr(args, key) == (value if not isinstance(value, str) else type(getattr(args, key))(value)), key


# every input given (no model is made); multi_node: this node only (no_ssh), so the stub launcher is the one called
SCRIPT_ENV = {"MODEL": "/m", "ACTOR": "/a", "CRITIC": "/c", "DATA": "/d", "MASTER_PORT": "12345", "NUM_RANKS": "1"}
SCRIPT_ENV["TEACHER"] = "/t"
SCRIPT_ENV.update(MULTI_NODE_MODE="no_ssh", NODE_RANK="0", MASTER_ADDR="127.0.0.1")


@pytest.mark.parametrize("script", SCRIPTS)
def test_what_a_script_launches_holds_its_presets_values(script, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    proc, _ = run_with_stub(tmp_path, script, [str(tmp_path / "out")], HOSTFILE=str(hostfile), **SCRIPT_ENV)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    argv = launched(proc.stdout)
    (preset,) = [p for p in preset_paths(read(script)) if "/loss_" not in p]
    args = parsed(argv)
    preset_only = parsed(argv[: argv.index("--module") + 2] + ["--config", preset, *required_of(argv)])
    assert vars(args) == vars(preset_only)  # nothing but the preset and the inputs: no stray flag in the script
    assert "--data_split" not in argv and args.output_dir == str(tmp_path / "out")


def required_of(argv: list[str]) -> list[str]:
    """The inputs the script adds itself (model paths, data, output directory) from a launch."""
    kept, i = [], argv.index("--module") + 2
    names = ("--model_name_or_path", "--actor_model_name_or_path", "--critic_model_name_or_path", "--output_dir")
    while i < len(argv):
        if argv[i] in names:
            kept += argv[i : i + 2]
            i += 2
        elif argv[i] in ("--data_path", "--teacher_model_name_or_path"):  # one or several paths
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            kept += argv[i:j]
            i = j
        else:
            i += 1
    return kept


def test_the_configuration_guide_lists_every_preset_and_its_scripts():
    text = read("docs/guides/configuration.md")
    for preset in PRESETS:
        row = next((line for line in text.splitlines() if line.startswith("|") and f"`{preset}`" in line), None)
        assert row, f"docs/guides/configuration.md does not list {preset}"
        for script in users(preset):
            assert f"`{script}`" in row or script == DEMO and "`scripts/demo.sh" in row, (preset, script)
