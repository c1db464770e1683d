"""The demo script end to end in its quick mode (tiny models): steps 1-3, evaluation table, curves."""

import json
import os
import subprocess

import pytest

from tests.launch import ROOT, forked_commands_env, subprocess_env, zygote_socket


def run_demo(out, *args, fork_server: bool = True) -> subprocess.CompletedProcess:
    """scripts/demo.sh --quick ARGS --output_root OUT, asserted to succeed (the log's tail when not). With
    `fork_server` its `deepspeed` and `python -m` commands run through the tests' fork server (most of a quick
    demo's time is their start-ups); the arithmetic demo keeps the real launcher and fresh interpreters."""
    env = subprocess_env()
    if fork_server and zygote_socket():
        env.update(forked_commands_env(zygote_socket()))
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "demo.sh"), *args, "--quick", "--output_root", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.mark.slow
def test_quick_demo_writes_table_and_curves(tmp_path):
    """With --with_dpo orpo: the step-2 alternative (here the reference-free ORPO, whose flags differ most
    from DPO's) after step 2, and its row in the evaluation beside SFT and RLHF."""
    out = tmp_path / "demo"
    proc = run_demo(out, "--with_dpo", "orpo")
    table = (out / "eval.txt").read_text()
    for column in ("reward (RM)", "judge (VADER)", "KL to SFT", "response len"):
        assert column in table, table
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "CI" not in line]
    assert rows == ["policy", "SFT", "RLHF", "ORPO"], table
    assert "RLHF vs SFT win rate" in table and "ORPO vs SFT win rate" in table
    assert proc.stdout.index("step 2 alternative: DPO (orpo)") < proc.stdout.index("step 3: PPO")
    assert "loss_type: orpo\n" in (out / "step2_dpo" / "config.yaml").read_text()  # the flags the run resolved
    assert (out / "step2_dpo" / "model.safetensors").exists()
    png = out / "step3" / "curves.png"
    assert png.exists() and png.stat().st_size > 10_000
    assert (out / "step3" / "actor" / "model.safetensors").exists()
    # the judged prompts are the test split's, which no step read (steps 1-3 read sft/ and pairs/)
    evaluated = [row["prompt"] for row in json.loads((out / "eval.json").read_text())["per_prompt"]]
    test = [json.loads(line)["prompt"] for line in open(out / "data" / "test" / "prompts.jsonl")]
    assert len(evaluated) == 8 and all(p in test for p in evaluated), evaluated
    assert "on the test split's prompts" in proc.stdout
    data_lines = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith(("[step1] model", "[step2] model", "[step3] actor"))
    ]
    assert len(data_lines) == 3 and not any("data/test" in line for line in data_lines), data_lines


def test_demo_refuses_an_unknown_eval_split():
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--eval_split", "train", "--quick"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--eval_split must be test or dev, got train" in proc.stderr


def test_demo_refuses_an_unknown_preference_loss(tmp_path):
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--with_dpo", "dop", "--quick"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 2 and "--with_dpo: the loss must be sigmoid, ipo, simpo, orpo or kto, got dop" in proc.stderr
    )


@pytest.mark.slow
def test_quick_arithmetic_demo_prints_accuracy_before_and_after(tmp_path):
    """--task arithmetic: the verifiable demo's chain (problems generated, GRPO without critic or reward
    model, the held-out evaluation before and after, the curves) on a tiny model with ChatML."""
    out = tmp_path / "demo"
    proc = run_demo(out, "--task", "arithmetic", fork_server=False)
    assert "eval/accuracy: 0.0000 (step 0) -> " in proc.stdout and "(step 2)" in proc.stdout, proc.stdout[-2000:]
    assert "eval/reward/format_mean" in proc.stdout
    assert (out / "grpo" / "curves.png").exists() and (out / "grpo" / "actor" / "model.safetensors").exists()
    assert not (out / "grpo" / "critic").exists()


@pytest.mark.slow
def test_quick_tools_demo_prints_the_three_models_table(tmp_path):
    """--task tools: the tool-use demo's chain (data generated, the base model evaluated without tools, SFT on
    calculator traces, multi-turn GRPO with the calculator, the table and the curves) on a tiny ChatML model."""
    out = tmp_path / "demo"
    run_demo(out, "--task", "tools")
    table = (out / "tools" / "eval.txt").read_text().splitlines()
    assert "held-out greedy evaluation on 8 word problems" in table[0], table
    assert [line.split("  ")[0].split(",")[0] for line in table[2:]] == ["base model", "after SFT", "after GRPO"]
    assert "(step 0)" in table[3] and "(step 2)" in table[4]
    assert (out / "tools" / "grpo" / "curves.png").exists()
    assert (out / "tools" / "step1" / "model.safetensors").exists()
    assert (out / "tools" / "grpo" / "actor" / "model.safetensors").exists()
    assert not (out / "tools" / "grpo" / "critic").exists()
