"""Reliability: a crash while saving leaves the previous checkpoint usable; a changed world size is
refused with a clear message, or converted through the universal checkpoint. The helpers here run a
job, kill it with SIGKILL after a checkpoint and resume it: steps 1-2's loop (tests/test_step2_dpo.py,
2 ranks, ZeRO-3, dropout on) and step 3's (tests/test_step3_robustness.py) resume to the same metrics
as an uninterrupted run."""

import glob
import json
import math
import os
import re
import time

import pytest

from tests.launch import kill_group, metrics, run_deepspeed, run_module, start_deepspeed, tail
from tests.test_step1_run import common_args, sft_data  # noqa: F401  (fixture)

IGNORED = ("time/", "samples_per_s", "mem/", "perf/")  # the machine's state, not the run's


def comparable(rows: list[dict], after_step: int) -> dict:
    out = {}
    for row in rows:
        if row["step"] > after_step:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not key.startswith(IGNORED):
                    out[(row["step"], key)] = value
    return out


def max_relative_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(abs(a[k] - b[k]) / max(abs(a[k]), abs(b[k]), 1e-12) for k in a)


def whole_rows(out: str) -> list[dict]:
    """metrics.jsonl's complete lines (a killed writer may leave half a line)."""
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


def kill_after_row_and_resume(module, args, out, tmp_path, kill_at: int, timeout: float = 300.0):
    """Start the run, SIGKILL it once it has logged step `kill_at`, resume it. The killed run's rows after
    its last checkpoint are what an uninterrupted run writes (the process that saved went on from memory),
    so a SIGKILL test needs two launches, not three. Returns (the checkpoint's step, the killed run's whole
    rows, the resumed run's process)."""
    proc = start_deepspeed(module, args, log_path=str(tmp_path / "killed.log"))
    try:
        deadline = time.time() + timeout
        while not any(r["step"] >= kill_at for r in whole_rows(out)):
            assert proc.poll() is None, open(tmp_path / "killed.log").read()[-3000:]
            assert time.time() < deadline, f"no step {kill_at} in time"
            time.sleep(0.05)
    finally:
        kill_group(proc)
    rows = whole_rows(out)
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        resumed_at = int(f.read().strip().split("-")[1])
    proc = run_deepspeed(module, args + ["--resume"], log_path=str(tmp_path / "resumed.log"))
    return resumed_at, rows, proc


def step1(args: list) -> None:
    """Step 1 in this process: no interpreter start or imports to pay (each subprocess run costs ~7 s)."""
    from step1_sft.main import main

    main([str(a) for a in args])


@pytest.mark.slow
def test_crash_while_saving_keeps_previous_checkpoint(tiny_gpt2, sft_data, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "out")
    base = common_args(tiny_gpt2, sft_data, out, steps=4) + ["--zero_stage", 0, "--save_interval", 2]
    step1(base)
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step-00000004"
    # a longer run over the same directory dies (SIGKILL) while writing its step-6 checkpoint,
    # after the files and before the rename: step 4 stays the latest and resumes cleanly
    longer = common_args(tiny_gpt2, sft_data, out, steps=8) + ["--zero_stage", 0, "--save_interval", 6, "--resume"]
    proc = run_module("step1_sft.main", longer, env=_env(RLHF_CRASH_AT="before_rename"))
    assert proc.returncode != 0
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step-00000004"
    capsys.readouterr()
    step1(longer)
    printed = capsys.readouterr().out
    assert "resumed from" in printed and "step-00000004" in printed
    assert [r["step"] for r in metrics(out) if "train/loss" in r] == list(range(1, 9))


def _env(**extra):
    from tests.launch import subprocess_env

    return subprocess_env(**extra)


@pytest.mark.slow
def test_resume_with_another_data_layout_is_refused(tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """A resume reads the rows after the checkpoint's position in the loader: another batch size, seed or
    data would skip or repeat rows silently, so it is refused, naming what differs (one checkpoint, two
    refused resumes). Another number of ranks is refused too, naming --universal_checkpoint: checked in
    test_resume_on_another_world_size_through_the_universal_checkpoint on its 2-rank checkpoint, in this
    process (one 2-rank launch less, to keep the suite short)."""
    out = str(tmp_path / "out")
    args = common_args(tiny_gpt2, sft_data, out, steps=2) + ["--zero_stage", 0, "--save_interval", 2]
    step1(args)

    proc = run_module(
        "step1_sft.main", args + ["--resume", "--max_steps", 4, "--per_device_train_batch_size", 4, "--seed", 8]
    )
    assert proc.returncode == 1, tail(proc)
    message = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(message) == 1 and "another data layout" in message[0], tail(proc)
    assert "--per_device_train_batch_size 8 (this run: 4)" in message[0] and "--seed 7 (this run: 8)" in message[0]
    assert "Traceback" not in proc.stderr

    from utils.train.checkpoint import CheckpointError  # a flag that shapes the model (not resumable), in this process

    with pytest.raises(CheckpointError, match=re.escape("--learning_rate 0.003 (this run: 0.01)")):
        step1(args + ["--resume", "--max_steps", 4, "--learning_rate", 0.01])


@pytest.mark.slow
def test_a_checkpoint_with_a_missing_file_falls_back_to_the_previous_one(tiny_gpt2, sft_data, tmp_path, capsys):  # noqa: F811
    out = str(tmp_path / "out")
    args = common_args(tiny_gpt2, sft_data, out, steps=4) + [
        "--zero_stage",
        2,
        "--save_interval",
        2,
        "--keep_checkpoints",
        3,
    ]
    step1(args)
    latest = os.path.join(out, "checkpoints", "step-00000004")
    optimizer_states = glob.glob(os.path.join(latest, "model", "**", "*optim_states.pt"), recursive=True)
    assert optimizer_states
    os.remove(optimizer_states[0])  # an interrupted copy
    capsys.readouterr()
    step1(args + ["--resume", "--max_steps", 6])
    printed = capsys.readouterr().out
    assert "step-00000004 is broken" in printed and "is missing" in printed
    assert "resumed from" in printed and "step-00000002" in printed
    steps = [r["step"] for r in metrics(out) if "train/loss" in r]
    assert steps == [1, 2, 3, 4, 5, 6], steps


@pytest.mark.slow
def test_resume_on_another_world_size_through_the_universal_checkpoint(tiny_gpt2, sft_data, tmp_path, capsys):  # noqa: F811
    """ZeRO-2 on 2 ranks, resumed on 1 with --universal_checkpoint: the checkpoint is converted once
    (deepspeed.checkpoint.ds_to_universal) and loaded with DeepSpeed's universal loading. The weights come
    back exactly; the rows after the checkpoint are re-sharded, so the losses are close to, not equal to,
    the uninterrupted 2-rank run's."""
    import shutil

    from safetensors.torch import load_file

    from utils.train.safe_loading import safe_torch_load

    out = str(tmp_path / "out")
    args = common_args(tiny_gpt2, sft_data, out, steps=4) + ["--zero_stage", 2, "--save_interval", 2]
    proc = run_deepspeed("step1_sft.main", args, log_path=str(tmp_path / "two_ranks.log"))
    full = [r for r in metrics(out) if "train/loss" in r]
    assert [r["step"] for r in full] == [1, 2, 3, 4], tail(proc)
    # as if the 2-rank run had died after its step-2 checkpoint
    checkpoints = os.path.join(out, "checkpoints")
    shutil.rmtree(os.path.join(checkpoints, "step-00000004"))
    with open(os.path.join(checkpoints, "latest"), "w") as f:
        f.write("step-00000002")
    engine_dir = os.path.join(checkpoints, "step-00000002", "model")

    from utils.train.checkpoint import (
        CheckpointError,  # without --universal_checkpoint: refused, naming the way through
    )

    with pytest.raises(CheckpointError, match=r"written by 2 ranks but this run has 1(.|\n)*--universal_checkpoint"):
        step1(args + ["--resume", "--max_steps", 2])
    assert not os.path.isdir(os.path.join(engine_dir, "universal"))

    resume = ["--resume", "--universal_checkpoint"]
    capsys.readouterr()
    step1(args + resume + ["--max_steps", 2])  # restore, train nothing, export
    printed = capsys.readouterr().out
    assert "converting" in printed and os.path.isdir(os.path.join(engine_dir, "universal")), printed
    assert "re-sharded" in printed, printed
    saved = safe_torch_load(os.path.join(engine_dir, "ds", "mp_rank_00_model_states.pt"))["module"]
    exported = load_file(os.path.join(out, "model.safetensors"))
    assert exported and all(exported[k].equal(saved[k]) for k in exported)  # the step-2 weights, exactly

    step1(args + resume)
    assert "converting" not in capsys.readouterr().out  # converted once, reused
    resumed = [r for r in metrics(out) if "train/loss" in r]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4], resumed
    for before, after in zip(full[2:], resumed[2:]):
        assert math.isfinite(after["train/loss"]) and after["train/lr"] == before["train/lr"]
    # the first resumed step starts from exactly the checkpoint's weights, on half of the 2-rank step's rows
    # (later steps drift apart: each 1-rank update sees other rows)
    assert abs(resumed[2]["train/loss"] - full[2]["train/loss"]) <= 0.02 * full[2]["train/loss"], (full, resumed)
