"""The run scripts scripts/step*/run_*.sh (fast, nothing is trained): syntax, the shared helper
(launch_step in scripts/common.sh, which launches through run_logged), one --data_split convention,
and the helper's preamble run against a stub launcher.

The stub replaces `deepspeed` as an exported bash function, not as a file first on PATH: sourcing
scripts/common.sh activates .venv, which puts .venv/bin (and its real deepspeed) in front of PATH,
while a function wins over any PATH entry and needs no change to the scripts.
"""

from __future__ import annotations

import glob
import importlib
import os
import re
import subprocess

import pytest
import yaml

from tests.launch import ROOT, subprocess_env

SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "scripts", "step*", "run_*.sh")))
KINDS = ("cpu", "single_gpu", "single_node", "multi_node")
STEP_DIRS = ("step1_sft", "step2_reward", "step2_dpo", "step3_ppo")
# every variable a run script reads, so the caller's environment cannot leak into a check
SCRIPT_ENV = (
    "MODEL",
    "ACTOR",
    "CRITIC",
    "TEACHER",
    "DATA",
    "NUM_RANKS",
    "MAX_STEPS",
    "DTYPE",
    "HOSTFILE",
    "MULTI_NODE_MODE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "STEP1_DIR",
    "STEP2_DIR",
    "DEMO_DATA",
    "LOSS_TYPE",
)


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def code_lines(text: str) -> str:
    """The script without its comment lines."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


GRPO_KINDS = ("cpu", "single_gpu", "single_node")


def test_the_run_scripts_are_there():
    """Four per step, plus step 3's critic-free GRPO variants, the tool-use demo's step 3 and the distillation
    demo's."""
    assert SCRIPTS == sorted(
        [f"scripts/{d}/run_{k}.sh" for d in STEP_DIRS for k in KINDS]
        + [f"scripts/step3_ppo/run_grpo_{k}.sh" for k in GRPO_KINDS]
        + ["scripts/step3_ppo/run_tools_cpu.sh", "scripts/step3_ppo/run_distill_cpu.sh"]
    )


@pytest.mark.parametrize("script", SCRIPTS + ["scripts/common.sh", "scripts/demo.sh"])
def test_bash_syntax(script):
    proc = subprocess.run(["bash", "-n", os.path.join(ROOT, script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_run_script_is_one_launch_step_call(script):
    text = read(script)
    code = code_lines(text)
    step_dir, name = script.split("/")[1:]
    grpo, tools = name.startswith(("run_grpo_", "run_distill_")), name.startswith("run_tools_")  # arithmetic: both
    prefix = next((p for p in ("run_grpo_", "run_distill_", "run_tools_") if name.startswith(p)), "run_")
    kind = name[len(prefix) : -len(".sh")]
    assert text.startswith("#!/usr/bin/env bash\n# Step ")
    assert "# usage: " in text and "# env: " in text
    assert 'source "$(dirname "$0")/../common.sh"' in code
    calls = re.findall(r"^launch_step (\S+) (\S+) (\S+) ", code, re.M)
    source = "arithmetic" if grpo else "tools" if tools else "sft" if step_dir == "step1_sft" else "pairs"
    assert calls == [(kind, f"{step_dir}.main", source)]
    assert ("grpo_inputs || exit" in code) == grpo
    assert ("tools_inputs || exit" in code) == tools
    assert code.rstrip().endswith('-- "$@"'), "the script's arguments go last, after --"
    for bare in ("| tee", "PIPESTATUS", "deepspeed ", "mkdir", "ensure_demo_data", "shift"):
        assert bare not in code, f"{script} repeats the preamble/launch itself ({bare!r})"


def test_launch_step_launches_through_run_logged():
    common = read("scripts/common.sh")
    body = re.search(r"^launch_step\(\) \{\n(.*?)^\}\n", common, re.M | re.S).group(1)
    assert re.search(r'^\s*run_logged "\$log" "\$\{launcher\[@\]\}" --module', body, re.M)
    assert "| tee" not in code_lines(common)
    assert "python -m utils.runtime.ports" in common and "import socket" not in common


def script_preset(script: str) -> str:
    """The preset (configs/...yaml) the script's launch_step call passes: exactly one."""
    (preset,) = re.findall(r"--config (configs/\S+\.yaml)", code_lines(read(script)))
    return preset


@pytest.mark.parametrize("script", SCRIPTS)
def test_data_split_convention(script):
    """data/demo/sft feeds step 1 only (10,0,0); steps 2 and 3 share data/demo/pairs (0,5,5); the GRPO, tools and
    distillation scripts' prompt rows are all step 3's (0,0,1). The split is the script's preset's, not its own flag."""
    assert "--data_split" not in code_lines(read(script))
    with open(os.path.join(ROOT, script_preset(script))) as f:
        split = yaml.safe_load(f)["data_split"]
    step3_only = any(f"/run_{kind}_" in script for kind in ("grpo", "tools", "distill"))
    assert split == ("0,0,1" if step3_only else "10,0,0" if "/step1_sft/" in script else "0,5,5")


STUB = """#!/bin/sh
for a in "$@"; do echo "ARG $a"; done
exit 3
"""


def run_with_stub(tmp_path, script: str, args: list, **env_extra) -> tuple[subprocess.CompletedProcess, str]:
    stub = tmp_path / "deepspeed_stub"
    stub.write_text(STUB)
    stub.chmod(0o755)
    demo = tmp_path / "demo"  # a demo data folder ensure_demo_data accepts as made
    (demo / "pairs").mkdir(parents=True)
    (demo / "pairs" / "eval.jsonl").write_text("")
    env = subprocess_env()
    for var in SCRIPT_ENV:
        env.pop(var, None)
    env.update({"DEMO_DATA": str(demo), "BASH_FUNC_deepspeed%%": f'() {{ exec "{stub}" "$@"; }}'})
    env.update(env_extra)
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    return proc, str(demo)


def launched(text: str) -> list[str]:
    return [line[len("ARG ") :] for line in text.splitlines() if line.startswith("ARG ")]


def parsed(argv: list[str]):
    """The flags the launched module's parser reads from a launch (its --config presets read from the
    repository root, where the scripts run), before any check."""
    module = argv[argv.index("--module") + 1]
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return importlib.import_module(module).build_parser().parse_args(argv[argv.index("--module") + 2 :])
    finally:
        os.chdir(cwd)


def test_preamble_cpu_step1(tmp_path):
    out = tmp_path / "new" / "out"  # made by the helper, parents included
    proc, demo = run_with_stub(
        tmp_path,
        "scripts/step1_sft/run_cpu.sh",
        [str(out), "--foo", "a b"],
        MODEL="/some/model",
        MAX_STEPS="7",
        NUM_RANKS="1",
        MASTER_PORT="12345",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr  # the launch's status
    log = out / "train.log"
    assert log.is_file()
    argv = launched(log.read_text())
    assert argv == launched(proc.stdout)  # the log is a copy of the launch's output, complete at exit
    assert argv[:9] == [
        "--num_gpus",
        "1",
        "--master_port",
        "12345",
        "--module",
        "step1_sft.main",
        "--model_name_or_path",
        "/some/model",
        "--data_path",
    ]
    assert argv[9:12] == [f"{demo}/sft", "--config", "configs/step1_sft/cpu.yaml"]
    assert argv[-4:] == ["--output_dir", str(out), "--foo", "a b"]  # "$@" extras come last
    assert argv[argv.index("--max_steps") + 1] == "7"  # MAX_STEPS, over the preset's 40
    args = parsed(argv[:-2])
    assert (args.max_steps, args.zero_stage, args.data_split) == (7, 2, "10,0,0")
    assert f"[step1] model /some/model, data {demo}/sft, output {out}" in proc.stdout


def test_preamble_step3_defaults(tmp_path):
    """ACTOR from STEP1_DIR, CRITIC out/step2 (unset); DATA with several sources is split into words."""
    out = tmp_path / "out"
    proc, _ = run_with_stub(
        tmp_path,
        "scripts/step3_ppo/run_single_node.sh",
        [str(out)],
        STEP1_DIR="/s1",
        DATA="/d/a /d/b",
        MASTER_PORT="12345",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    argv = launched(proc.stdout)
    assert argv[:4] == ["--master_port", "12345", "--module", "step3_ppo.main"]
    assert argv[4:11] == [
        "--actor_model_name_or_path",
        "/s1",
        "--critic_model_name_or_path",
        os.path.join(ROOT, "out", "step2"),
        "--data_path",
        "/d/a",
        "/d/b",
    ]
    assert argv[11:13] == ["--config", "configs/step3_ppo/ppo_single_node.yaml"]
    assert argv[-2:] == ["--output_dir", str(out)] and (out / "train.log").is_file()


def test_preamble_multi_node_no_ssh(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "out"
    proc, demo = run_with_stub(
        tmp_path,
        "scripts/step2_reward/run_multi_node.sh",
        [str(out), "--x"],
        MODEL="/m",
        HOSTFILE=str(hostfile),
        MULTI_NODE_MODE="no_ssh",
        NODE_RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="12345",
        DTYPE="fp32",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    log = out / "train.log.node1"
    assert log.is_file() and not (out / "train.log").exists()
    argv = launched(log.read_text())
    assert argv[:11] == [
        "--hostfile",
        str(hostfile),
        "--no_ssh",
        "--node_rank",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "12345",
        "--module",
        "step2_reward.main",
    ]
    assert argv[11:16] == ["--model_name_or_path", "/m", "--data_path", f"{demo}/pairs", "--config"]
    assert argv[argv.index("--dtype") + 1] == "fp32"  # DTYPE, over the preset's bf16
    assert parsed(argv[:-1]).dtype == "fp32"
    assert argv[-3:] == ["--output_dir", str(out), "--x"]


def test_missing_hostfile_stops_before_launch(tmp_path):
    proc, _ = run_with_stub(
        tmp_path,
        "scripts/step1_sft/run_multi_node.sh",
        [str(tmp_path / "out")],
        MODEL="/m",
        HOSTFILE=str(tmp_path / "nothere"),
    )
    assert proc.returncode == 2 and "hostfile" in proc.stderr
    assert not launched(proc.stdout)


def test_preamble_grpo_has_no_critic(tmp_path):
    """The GRPO scripts pass no critic (CRITIC=none), their own prompt rows (DATA) and the function rewards."""
    out = tmp_path / "out"
    proc, _ = run_with_stub(
        tmp_path,
        "scripts/step3_ppo/run_grpo_cpu.sh",
        [str(out), "--max_steps", "1"],
        ACTOR="/a",
        DATA="/d",
        NUM_RANKS="1",
        MASTER_PORT="12345",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    argv = launched(proc.stdout)
    assert argv[4:10] == ["--module", "step3_ppo.main", "--actor_model_name_or_path", "/a", "--data_path", "/d"]
    assert "--critic_model_name_or_path" not in argv
    args = parsed(argv)
    assert args.critic_model_name_or_path is None
    assert (args.reward_funcs, args.reward_weights) == (["math_exact", "format"], [1.0, 0.0])
    assert argv[-4:] == ["--output_dir", str(out), "--max_steps", "1"] and args.max_steps == 1


@pytest.mark.parametrize("kind", ["cpu", "single_gpu", "single_node"])
def test_dpo_scripts_launch_flags_step2_dpo_accepts(kind, tmp_path, tiny_gpt2, monkeypatch):
    """What a DPO script launches parses with step2_dpo's own flags (a misspelt or contradictory flag
    would stop the real run); it announces itself as step2_dpo."""
    from step2_dpo.main import parse_args

    out = tmp_path / "out"
    proc, _ = run_with_stub(
        tmp_path,
        f"scripts/step2_dpo/run_{kind}.sh",
        [str(out), "--max_seq_len", "32"],
        MODEL=tiny_gpt2,
        MASTER_PORT="12345",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"[step2_dpo] model {tiny_gpt2}" in proc.stdout
    argv = launched(proc.stdout)
    assert argv[argv.index("--module") + 1] == "step2_dpo.main"
    monkeypatch.chdir(ROOT)  # the scripts run from the repository root, the presets' paths are relative to it
    args = parse_args(argv[argv.index("--module") + 2 :])
    assert args.output_dir == str(out) and args.beta == 0.1


@pytest.mark.parametrize(
    "loss,beta,nll",
    [("sigmoid", 0.1, 1.0), ("ipo", 0.1, 1.0), ("simpo", 2.0, 1.0), ("orpo", None, 0.0), ("kto", 0.1, 0.0)],
)
def test_dpo_cpu_script_gives_each_loss_its_flags(loss, beta, nll, tmp_path, tiny_gpt2, monkeypatch):
    """LOSS_TYPE (demo.sh --with_dpo LOSS) picks the loss and the flags it takes: ORPO refuses --beta and
    --nll_loss_coef (its own NLL term), SimPO gets its paper's beta; each launch parses with step2_dpo's flags."""
    from step2_dpo.main import parse_args

    proc, _ = run_with_stub(
        tmp_path,
        "scripts/step2_dpo/run_cpu.sh",
        [str(tmp_path / "out")],
        MODEL=tiny_gpt2,
        MASTER_PORT="12345",
        LOSS_TYPE=loss,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    argv = launched(proc.stdout)
    monkeypatch.chdir(ROOT)
    args = parse_args(argv[argv.index("--module") + 2 :])
    assert (args.loss_type, args.nll_loss_coef) == (loss, nll)
    assert args.beta == beta or (beta is None and "--beta" not in argv)


def test_dpo_cpu_script_refuses_an_unknown_loss(tmp_path):
    proc, _ = run_with_stub(tmp_path, "scripts/step2_dpo/run_cpu.sh", [str(tmp_path / "out")], LOSS_TYPE="dop")
    assert proc.returncode == 2 and "LOSS_TYPE must be sigmoid, ipo, simpo, orpo or kto, got dop" in proc.stderr


def test_multi_node_ssh_mode_forwards_the_users_deepspeed_env(tmp_path):
    """The ssh mode hands the launcher its own DS_ENV_FILE, which replaces ~/.deepspeed_env: the user's lines go
    into it too (after the scripts' variables, so they win), or they would silently not reach the other nodes."""
    home, bin_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    bin_dir.mkdir()
    (home / ".deepspeed_env").write_text("NCCL_IB_DISABLE=1\nHF_HUB_OFFLINE=0\n")
    stub = bin_dir / "deepspeed"  # `env DS_ENV_FILE=... deepspeed` runs the one on PATH
    stub.write_text('#!/bin/sh\nsed "s/^/ENV /" "$DS_ENV_FILE"\nexit 3\n')
    stub.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n")
    proc, _ = run_with_stub(
        tmp_path,
        "scripts/step1_sft/run_multi_node.sh",
        [str(tmp_path / "out")],
        MODEL="/m",
        DATA="/d",
        HOSTFILE=str(hostfile),
        HOME=str(home),
        RLHF_USE_CURRENT_ENV="1",  # no venv activation: the stub stays first on PATH
        MASTER_PORT="12345",
        PATH=f"{bin_dir}:{os.environ['PATH']}",
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr
    env_lines = [line[len("ENV ") :] for line in proc.stdout.splitlines() if line.startswith("ENV ")]
    assert env_lines.index("HF_HUB_OFFLINE=1") < env_lines.index("HF_HUB_OFFLINE=0")
    assert "NCCL_IB_DISABLE=1" in env_lines
