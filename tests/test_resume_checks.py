"""What a --resume checks before it continues, in this process:
- the training data's content: a file edited in place (same row count) is refused, naming it, unless
  --resume_ignore_data_change (then one line says so);
- the flags: one that is not declared resumable (utils.train.flags.RESUMABLE_FLAGS) is refused, naming it and
  both values, for every entry point's flags;
- a save that fails (a file size limit, a full disk) stops with one line naming the file and what it was
  to hold, leaves no `.tmp-step-*`, and the next resume continues from the checkpoint before;
- a checkpoint missing its state.json or DeepSpeed's model states falls back to the previous one, or
  names the missing file when none is left.
Runs are `Run`s with no engine (checkpoints of the loop and state only) or a DeepSpeed engine of one
Linear layer: no model loads."""

import argparse
import errno
import glob
import json
import os
import re
import resource

import pytest
import torch

from utils.train.checkpoint import (
    CheckpointError,
    Checkpointing,
    CheckpointWriteError,
    LoopState,
    TrainingCheckpoints,
    changed_flags,
    data_layout,
    run_flags,
)
from utils.train.config_file import write_run_config
from utils.train.run import Run

ROWS = [{"prompt": f"Human: {i}\n\nAssistant:", "response": f" {i % 7}"} for i in range(12)]


class Sampler:
    def set_epoch(self, epoch):
        pass


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def run_args(tmp_path, **flags) -> argparse.Namespace:
    values = dict(
        output_dir=str(tmp_path / "out"),
        data_path=[str(tmp_path / "rows.jsonl")],
        num_train_epochs=1,
        max_steps=2,
        max_bad_steps=3,
        enable_tensorboard=False,
        tensorboard_path=None,
        save_interval=2,
        keep_checkpoints=2,
        resume=False,
        learning_rate=1e-3,
        kl_ctl=0.0,
        seed=1,
        eval_interval=0,
        print_loss=False,
    )
    return argparse.Namespace(**{**values, **flags})


def train(args, rows: int = len(ROWS)) -> Run:
    """A run with no engine over `rows` batches: `max_steps` steps, checkpoints every `save_interval`."""
    run = Run(args, "test", "test", {}, data_layout(args, rows), args.max_steps)
    run.restore()
    for _ in run.steps(list(range(rows)), Sampler()):
        run.after_step({"train/loss": 1.0})
    run.logger.close()
    return run


# -------------------------------------------------------------------------------------------------------- data
def test_a_data_file_edited_in_place_is_refused_naming_it_unless_told(tmp_path, capsys):
    data = write_rows(tmp_path / "rows.jsonl", ROWS)
    train(run_args(tmp_path))
    write_rows(tmp_path / "rows.jsonl", [{**r, "response": " edited"} for r in ROWS])  # same rows count
    with pytest.raises(CheckpointError, match=re.escape(f"trained on other data: {data} (edited)")) as refused:
        train(run_args(tmp_path, resume=True, max_steps=4))
    assert "--resume_ignore_data_change" in str(refused.value) and "\n" not in str(refused.value)

    capsys.readouterr()
    run = train(run_args(tmp_path, resume=True, max_steps=4, resume_ignore_data_change=True))
    printed = capsys.readouterr().out
    assert run.resumed and run.loop.step == 4
    assert f"resuming {run.restored_from} on changed training data ({data} (edited))" in printed
    # the new checkpoint holds the new data's hash: a plain resume of it goes on
    assert train(run_args(tmp_path, resume=True, max_steps=6)).loop.step == 6


def test_with_the_flag_a_changed_row_count_resumes_too(tmp_path):
    write_rows(tmp_path / "rows.jsonl", ROWS)
    train(run_args(tmp_path))
    write_rows(tmp_path / "rows.jsonl", ROWS[:5])
    with pytest.raises(CheckpointError, match="rows.jsonl \\(edited\\)"):
        train(run_args(tmp_path, resume=True, max_steps=4), rows=5)
    run = train(run_args(tmp_path, resume=True, max_steps=4, resume_ignore_data_change=True), rows=5)
    assert run.resumed and run.loop.step == 4  # 2 batches were read before: 3 of the 5 are left in epoch 0


def test_the_data_hash_covers_every_file_a_source_reads(tmp_path):
    """Every file of a directory source is hashed (sha256 hex), and an edit that keeps the size changes it;
    its cost on the demo data is bench/data_hash.py's."""
    from utils.data.sources import content_hashes

    (tmp_path / "data").mkdir()
    write_rows(tmp_path / "data" / "train.jsonl", ROWS)
    write_rows(tmp_path / "data" / "eval.jsonl", ROWS[:2])
    hashes = content_hashes([str(tmp_path / "data")])
    assert sorted(os.path.basename(p) for p in hashes) == ["eval.jsonl", "train.jsonl"]
    assert all(len(h) == 64 and int(h, 16) >= 0 for h in hashes.values())
    path = str(tmp_path / "data" / "eval.jsonl")
    text = open(path).read()
    edited = text.replace("a", "b", 1) if "a" in text else text.replace("1", "2", 1)
    assert len(edited) == len(text) and edited != text
    open(path, "w").write(edited)
    assert content_hashes([str(tmp_path / "data")])[path] != hashes[path]


# -------------------------------------------------------------------------------------------------------- flags
def test_a_changed_flag_is_refused_naming_it_and_both_values(tmp_path):
    write_rows(tmp_path / "rows.jsonl", ROWS)
    train(run_args(tmp_path))
    with pytest.raises(CheckpointError) as refused:
        train(run_args(tmp_path, resume=True, max_steps=4, kl_ctl=0.2, learning_rate=1e-2))
    message = str(refused.value)
    assert "--kl_ctl 0.0 (this run: 0.2)" in message and "--learning_rate 0.001 (this run: 0.01)" in message
    assert "cannot change mid-run" in message and "\n" not in message
    # the declared ones change: length, intervals, logging
    run = train(
        run_args(
            tmp_path, resume=True, max_steps=4, save_interval=1, eval_interval=3, print_loss=True, keep_checkpoints=3
        )
    )
    assert run.resumed and run.loop.step == 4
    assert os.path.basename(TrainingCheckpoints(str(tmp_path / "out")).latest()) == "step-00000004"


def test_a_refused_resume_leaves_the_first_runs_config_yaml_and_an_accepted_one_writes_its_own(tmp_path):
    """config.yaml records the flags a run trained with: a --resume writes it only after the checkpoint's checks."""
    write_rows(tmp_path / "rows.jsonl", ROWS)
    config = tmp_path / "out" / "config.yaml"
    first = run_args(tmp_path)
    write_run_config(first, "step1_sft.main")
    train(first)
    written = config.read_text()
    assert "kl_ctl: 0.0" in written
    refused = run_args(tmp_path, resume=True, max_steps=4, kl_ctl=0.2)
    assert write_run_config(refused, "step1_sft.main") is None  # deferred until the checks pass
    with pytest.raises(CheckpointError):
        train(refused)
    assert config.read_text() == written
    accepted = run_args(tmp_path, resume=True, max_steps=4, save_interval=1)
    write_run_config(accepted, "step1_sft.main")
    train(accepted)
    assert "max_steps: 4" in config.read_text() and "resume: true" in config.read_text()


ENTRY_POINTS = {  # a flag of each that shapes the trained model, changed on resume
    "step1_sft.main": ("--learning_rate", "1e-3", "--train_on_last_turn_only", None),
    "step2_reward.main": ("--learning_rate", "1e-3", "--zero_stage", "2"),
    "step2_dpo.main": ("--beta", "0.5", "--loss_type", "ipo"),
    "step3_ppo.main": (
        "--kl_ctl",
        "0.2",
        "--advantage_estimator",
        "rloo",
        "--n_samples_per_prompt",
        "4",
        "--reward_funcs",
        "length",
        "--actor_learning_rate",
        "1e-3",
    ),
}


def given(flags: tuple) -> list[str]:
    return [f for f in flags if f is not None]


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_every_entry_point_refuses_its_changed_flags_and_takes_the_resumable_ones(module, monkeypatch):
    from tests.test_flags_help import built_parser

    parser = built_parser(module, monkeypatch)
    common = ["--output_dir", "out", "--data_path", "rows.jsonl", "--save_interval", "2"]
    model = ["--actor_model_name_or_path", "m"] if module.startswith("step3") else ["--model_name_or_path", "m"]
    saved = run_flags(parser.parse_args(common + model))
    changes = ENTRY_POINTS[module]
    names = [f for f in changes if f and f.startswith("--")]
    refused = changed_flags(saved, run_flags(parser.parse_args(common + model + given(changes))))
    assert [line.split()[0] for line in refused] == sorted(names), refused
    resumable = [
        "--max_steps",
        "9",
        "--num_train_epochs",
        "3",
        "--save_interval",
        "5",
        "--keep_checkpoints",
        "4",
        "--dist_timeout",
        "60",
        "--resume",
        "--resume_ignore_data_change",
        "--local_rank",
        "1",
    ]
    assert changed_flags(saved, run_flags(parser.parse_args(common + model + resumable))) == []


def test_every_resumable_flag_is_a_flag_of_an_entry_point(monkeypatch):
    """A misspelt name in RESUMABLE_FLAGS would leave the flag it meant refused."""
    from tests.test_flags_help import built_parser
    from utils.train.flags import RESUMABLE_FLAGS

    dests = set()
    for module in ENTRY_POINTS:
        actions = built_parser(module, monkeypatch)._actions
        assert "resume_ignore_data_change" in {a.dest for a in actions}, module
        dests |= {a.dest for a in actions}
    assert sorted(RESUMABLE_FLAGS - dests) == []


# -------------------------------------------------------------------------------------------------------- disk
@pytest.fixture(scope="module")
def dist():
    from utils.runtime.distributed import init_distributed

    init_distributed()


def linear_engine():
    from utils.train.ds_config import train_ds_config
    from utils.train.loop import initialize_engine

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    engine = initialize_engine(model, train_ds_config(0, 1, 2), torch.optim.AdamW(model.parameters(), lr=0.1))
    engine.backward(engine(torch.ones(2, 64)).sum())
    engine.step()
    return engine


def checkpointing(tmp_path, engine, **flags) -> Checkpointing:
    values = dict(output_dir=str(tmp_path / "out"), save_interval=2, keep_checkpoints=3, resume=False, data_path=[])
    args = argparse.Namespace(**{**values, **flags})
    return Checkpointing(args, {"model": engine})


def test_a_save_over_the_file_size_limit_names_the_file_and_leaves_the_previous_checkpoint(dist, tmp_path, capfd):
    engine = linear_engine()
    saving = checkpointing(tmp_path, engine)
    saving.maybe_save(LoopState(step=2))
    capfd.readouterr()  # empties the captured output's file, which the limit applies to as well
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))  # torch's zip writer meets it: "unexpected pos"
    try:
        with pytest.raises(CheckpointWriteError) as failed:
            saving.maybe_save(LoopState(step=4))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    message = str(failed.value)
    root = str(tmp_path / "out" / "checkpoints")
    assert message.startswith(
        "could not write the DeepSpeed checkpoint of engine 'model' to "
        f"{root}/.tmp-step-00000004/model/ds/mp_rank_00_model_states.pt"
    ), message
    assert "files are limited to 8192 bytes here (ulimit -f)" in message and "unexpected pos" not in message
    assert "--resume continues from step-00000002" in message and "\n" not in message
    assert sorted(os.listdir(root)) == ["latest", "step-00000002"]
    restored = checkpointing(tmp_path, engine, resume=True)
    assert restored.restore()[0].step == 2 and restored.last_path.endswith("step-00000002")


def test_a_full_disk_on_the_first_save_says_no_checkpoint_was_written(dist, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointWriteError) as failed:
        checkpointing(tmp_path, linear_engine()).maybe_save(LoopState(step=2))
    message = str(failed.value)
    assert "mp_rank_00_model_states.pt (no space left on device)" in message, message
    assert "no earlier checkpoint exists: start the run again with --overwrite_output_dir" in message
    assert os.listdir(tmp_path / "out" / "checkpoints") == []


@pytest.mark.parametrize("lost", ["state.json", "model/ds/mp_rank_00_model_states.pt"])
def test_a_checkpoint_missing_a_file_falls_back_or_names_it(dist, tmp_path, lost, capsys):
    engine = linear_engine()
    saving = checkpointing(tmp_path, engine)
    for step in (2, 4):
        saving.maybe_save(LoopState(step=step))
    root = tmp_path / "out" / "checkpoints"
    os.remove(root / "step-00000004" / lost)
    restored = checkpointing(tmp_path, engine, resume=True)
    assert restored.restore()[0].step == 2
    assert f"step-00000004/{lost} is missing); trying the previous one" in capsys.readouterr().out
    os.remove(root / "step-00000002" / lost)
    with pytest.raises(CheckpointError, match=f"step-00000002/{lost} is missing.*restore the missing files"):
        checkpointing(tmp_path, engine, resume=True).restore()


def test_a_killed_saves_leftover_is_removed_by_the_next_save(dist, tmp_path):
    saving = checkpointing(tmp_path, linear_engine())
    leftover = tmp_path / "out" / "checkpoints" / ".tmp-step-00000002"
    leftover.mkdir(parents=True)
    saving.maybe_save(LoopState(step=4))
    assert glob.glob(str(tmp_path / "out" / "checkpoints" / ".tmp-*")) == []
