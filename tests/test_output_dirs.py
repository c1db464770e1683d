"""One run per output directory, inputs never inside it, deletions never through a symlink. In
process: the checks run in parse_args, before any model loads; the live run holding the
lock is a small subprocess (the lock is an OS lock: it must belong to another process)."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from tests.launch import ROOT, subprocess_env
from utils.errors import UsageError

HOLDER = """import sys, time
from utils.train.output_dir import lock_output_dir
lock_output_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def step1_args(model, out, *extra, data="data.jsonl"):
    return ["--model_name_or_path", model, "--data_path", data, "--output_dir", str(out), *map(str, extra)]


def step3_args(actor, out, *extra, data="prompts.jsonl"):
    return [
        "--actor_model_name_or_path",
        actor,
        "--data_path",
        data,
        "--data_split",
        "0,0,10",
        "--output_dir",
        str(out),
        "--advantage_estimator",
        "grpo",
        "--n_samples_per_prompt",
        "2",
        *map(str, extra),
    ]


@pytest.fixture
def live_run(tmp_path):
    """A process holding the lock of tmp_path/out, as a running run does; killed (not cleaned up) after."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)],
        cwd=ROOT,
        env=subprocess_env(RANK="0"),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "locked"
    yield out, proc
    proc.kill()
    proc.wait()


def test_a_second_run_into_a_running_runs_directory_stops_at_once_naming_it(tiny_gpt2, live_run, capsys, monkeypatch):
    from step1_sft.main import main, parse_args
    from utils.errors import run_main

    monkeypatch.setenv("RANK", "0")
    out, holder = live_run
    with pytest.raises(SystemExit) as stop:
        run_main(main, step1_args(tiny_gpt2, out))
    assert stop.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --output_dir {out} is in use by another run"), lines
    assert f"(pid {holder.pid} on {socket.gethostname()})" in lines[0]
    holder.kill()  # the lock dies with its process: no stale lock to clean up
    holder.wait()
    parse_args(step1_args(tiny_gpt2, out))


def test_a_holder_is_refused_while_this_process_holds_the_lock(tiny_gpt2, tmp_path, monkeypatch):
    from step1_sft.main import parse_args

    monkeypatch.setenv("RANK", "0")
    out = tmp_path / "out"
    parse_args(step1_args(tiny_gpt2, out))
    proc = subprocess.run(
        [sys.executable, "-c", HOLDER, str(out)],
        cwd=ROOT,
        env=subprocess_env(RANK="0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and f"(pid {os.getpid()} on {socket.gethostname()})" in proc.stderr


def test_only_rank0_locks_and_cleans(tiny_gpt2, tmp_path, monkeypatch):
    """Another rank of the same run neither takes the lock (rank 0 has it) nor deletes the previous run's files
    (rank 0 does, holding the lock: a rank of a refused second run must not delete the first run's)."""
    from step1_sft.main import parse_args

    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    monkeypatch.setenv("RANK", "1")
    parse_args(step1_args(tiny_gpt2, out, "--overwrite_output_dir"))
    assert sorted(os.listdir(out)) == ["metrics.jsonl"]
    monkeypatch.setenv("RANK", "0")
    parse_args(step1_args(tiny_gpt2, out, "--overwrite_output_dir"))
    assert sorted(os.listdir(out)) == [".run.lock"]


def test_step3_input_actor_inside_the_output_dir_is_refused(tiny_gpt2, tmp_path):
    """`--actor_model_name_or_path OUT/actor --output_dir OUT --overwrite_output_dir` exported over its input."""
    from step3_ppo.main import parse_args

    out = tmp_path / "out"
    shutil.copytree(tiny_gpt2, out / "actor")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(
        UsageError, match=f"--output_dir {out} holds {out}/actor, the input model of --actor_model_name_or_path"
    ):
        parse_args(step3_args(str(out / "actor"), out, "--reward_funcs", "format", "--overwrite_output_dir"))
    assert (out / "metrics.jsonl").exists() and not (out / ".run.lock").exists()


def test_a_reward_model_directory_as_output_dir_is_refused(tiny_gpt2, tiny_gpt2_reward, tmp_path):
    """The reward model (not the critic) given as --output_dir lost its metrics.jsonl and got actor/."""
    from step3_ppo.main import parse_args

    reward = tmp_path / "reward"
    shutil.copytree(tiny_gpt2_reward, reward)
    (reward / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UsageError, match=f"--output_dir {reward} is the input model of --reward_model_name_or_path"):
        parse_args(step3_args(tiny_gpt2, reward, "--reward_model_name_or_path", reward, "--overwrite_output_dir"))
    with pytest.raises(UsageError, match=f"--output_dir {reward} is the input model of --reward_funcs"):
        parse_args(step3_args(tiny_gpt2, reward, "--reward_funcs", reward, "format", "--overwrite_output_dir"))
    assert (reward / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_data_and_template_inside_the_output_dir_are_refused(tiny_gpt2, tmp_path):
    from step1_sft.main import parse_args

    out = tmp_path / "out"
    out.mkdir()
    (out / "sft.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    (out / "t.jinja").write_text("{{ messages }}")
    with pytest.raises(UsageError, match=r"holds .*sft.jsonl, the input data of --data_path"):
        parse_args(step1_args(tiny_gpt2, out, data=str(out / "sft.jsonl")))
    with pytest.raises(UsageError, match=r"holds .*t.jinja, the input file of --chat_template"):
        parse_args(step1_args(tiny_gpt2, out, "--chat_template", out / "t.jinja"))
    link = tmp_path / "link"  # the same directory reached through a symlink
    link.symlink_to(out)
    with pytest.raises(UsageError, match="the input data of --data_path"):
        parse_args(step1_args(tiny_gpt2, link, data=str(out / "sft.jsonl")))
    parse_args(step1_args(tiny_gpt2, tmp_path / "other", data=str(out / "sft.jsonl")))  # elsewhere: fine


def test_cleaning_unlinks_symlinks_and_keeps_their_targets(tiny_gpt2, tmp_path, monkeypatch):
    from step1_sft.main import parse_args

    monkeypatch.setenv("RANK", "0")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "step-00000001").mkdir(parents=True)
    (elsewhere / "step-00000001" / "precious").write_text("x")
    (elsewhere / "metrics.jsonl").write_text("other run\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoints").symlink_to(elsewhere)
    (out / "tensorboard").symlink_to(elsewhere)
    (out / "metrics.jsonl").symlink_to(elsewhere / "metrics.jsonl")
    parse_args(step1_args(tiny_gpt2, out, "--overwrite_output_dir"))
    assert sorted(os.listdir(out)) == [".run.lock"]
    assert (elsewhere / "step-00000001" / "precious").read_text() == "x"
    assert (elsewhere / "metrics.jsonl").read_text() == "other run\n"


def _checkpoint(root, tag):
    (root / tag).mkdir(parents=True)
    (root / tag / "COMPLETE").write_text("")


def test_pruning_unlinks_a_linked_step_and_never_prunes_through_a_linked_checkpoints_dir(tmp_path, capsys):
    from utils.train.checkpoint import TrainingCheckpoints

    elsewhere = tmp_path / "elsewhere"
    _checkpoint(elsewhere, "precious")
    out = tmp_path / "out"
    store = TrainingCheckpoints(str(out), keep=1)
    os.makedirs(store.root)
    (out / "checkpoints" / "step-00000001").symlink_to(elsewhere / "precious")
    _checkpoint(out / "checkpoints", "step-00000002")
    _checkpoint(out / "checkpoints", "step-00000003")
    store._prune(keep_tag="step-00000003")
    assert sorted(os.listdir(store.root)) == ["step-00000003"]
    assert (elsewhere / "precious" / "COMPLETE").exists()

    other = tmp_path / "other_run_checkpoints"
    for tag in ("step-00000001", "step-00000002", "step-00000003"):
        _checkpoint(other, tag)
    linked = TrainingCheckpoints(str(tmp_path / "out2"), keep=1)
    os.makedirs(tmp_path / "out2")
    os.symlink(other, linked.root)
    linked._prune(keep_tag="step-00000003")
    linked._prune(keep_tag="step-00000003")
    assert sorted(os.listdir(other)) == ["step-00000001", "step-00000002", "step-00000003"]
    said = [line for line in capsys.readouterr().out.splitlines() if "is a symlink" in line]
    assert len(said) == 1 and "not pruned" in said[0]
