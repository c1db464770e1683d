"""MetricsLogger: the one seam metrics go through (metrics.jsonl, TensorBoard, W&B offline)."""

import glob
import json
import math
import os
import struct
import sys
from types import SimpleNamespace

import pytest
import torch

from utils.errors import UsageError
from utils.train.metrics_logger import WANDB_ID_FILE, MetricsLogger, logger_from_args, read_metrics


def _args(output_dir, **extra):
    """Parsed flags as the mains have them; the wandb ones only when given (getattr defaults)."""
    return SimpleNamespace(
        **{
            "output_dir": str(output_dir),
            "enable_tensorboard": False,
            "tensorboard_path": None,
            "learning_rate": 1e-3,
            **extra,
        }
    )


def test_jsonl_rows(tmp_path):
    logger = logger_from_args(_args(tmp_path))  # args without any wandb attribute
    logger.log(0, {"eval/perplexity": torch.tensor(12.5)})
    logger.log(1, {"train/loss": 0.25, "train/bad": float("nan"), "train/big": float("inf"), "epoch": 0})
    logger.close()
    with open(tmp_path / "metrics.jsonl") as f:
        lines = f.read().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 0, "eval/perplexity": 12.5},
        {"step": 1, "train/loss": 0.25, "train/bad": "nan", "train/big": "inf", "epoch": 0},
    ]
    assert not os.path.exists(tmp_path / WANDB_ID_FILE) and not os.path.exists(tmp_path / "tensorboard")


def test_resume_keeps_rows_up_to_the_checkpoint(tmp_path):
    logger = MetricsLogger(str(tmp_path))
    for step in range(1, 5):
        logger.log(step, {"train/loss": 1.0 / step})
    logger.close()
    resumed = MetricsLogger(str(tmp_path), keep_until_step=2)
    resumed.log(3, {"train/loss": 0.3})
    resumed.close()
    assert [(r["step"], r["train/loss"]) for r in read_metrics(str(tmp_path))] == [(1, 1.0), (2, 0.5), (3, 0.3)]
    fresh = MetricsLogger(str(tmp_path))  # not a resume: a new file
    fresh.close()
    assert read_metrics(str(tmp_path)) == []


def test_extra_backend_gets_every_row(tmp_path):
    class Collect:
        def __init__(self):
            self.rows, self.closed = [], False

        def log(self, step, row):
            self.rows.append((step, row))

        def close(self):
            self.closed = True

    extra = Collect()
    logger = MetricsLogger(str(tmp_path), backends=[extra])
    logger.log(7, {"x": torch.tensor(2.0)})
    logger.close()
    assert extra.rows == [(7, {"step": 7, "x": 2.0})] and extra.closed


def test_tensorboard_writes_an_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb_dir = tmp_path / "tb"
    logger = logger_from_args(_args(tmp_path / "out", enable_tensorboard=True, tensorboard_path=str(tb_dir)))
    logger.log(1, {"train/loss": 0.5, "note": "text is not a scalar"})
    logger.log(2, {"train/loss": 0.25})
    logger.close()
    assert glob.glob(str(tb_dir / "events.out.tfevents.*"))
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    assert events.Tags()["scalars"] == ["train/loss"]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 0.5), (2, 0.25)]


# --- Weights & Biases, offline -------------------------------------------------------------------


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """wandb in offline mode with every file it writes under tmp_path: no network, no ~/.config."""
    wandb = pytest.importorskip("wandb")
    for key in list(os.environ):
        if key.startswith("WANDB_"):
            monkeypatch.delenv(key)
    env = {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DIR": tmp_path / "wandb_root",
        "WANDB_CONFIG_DIR": tmp_path / "wandb_config",
        "WANDB_CACHE_DIR": tmp_path / "wandb_cache",
        "WANDB_DATA_DIR": tmp_path / "wandb_data",
        "WANDB_ARTIFACT_DIR": tmp_path / "wandb_artifacts",
        "HOME": tmp_path / "home",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_MACHINE_INFO": "true",
        "WANDB_X_DISABLE_UPDATE_CHECK": "true",
        "WANDB_X_SAVE_REQUIREMENTS": "false",
    }
    for key, value in env.items():
        monkeypatch.setenv(key, str(value))
    yield wandb
    wandb.teardown()  # finishes any run left open and stops the wandb-core service process


def _wandb_records(path):
    """The records of a .wandb transaction log (a ':W&B' header, then LevelDB-log framed protobufs).
    wandb 0.31 ships no Python reader for it, so this is the ~20-line framing, parsed with wandb's protos."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding up to the next block
            pos += block - pos % block
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _offline_runs(root, run_id):
    """[(config, history rows)] of the offline runs of `run_id` under `root` (offline-run-<time>-<id>,
    with a -1, -2... suffix when two start within the same second)."""

    def key(item):
        return item.key or "/".join(item.nested_key)

    runs = []
    for path in sorted(glob.glob(os.path.join(root, "wandb", f"offline-run-*-{run_id}*", f"run-{run_id}.wandb"))):
        config, history = {}, []
        for record in _wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
                config = {key(item): json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                history.append({key(item): json.loads(item.value_json) for item in record.history.item})
        runs.append((config, history))
    return runs


def test_wandb_offline_receives_the_scalars(tmp_path, wandb_offline):
    out, root = tmp_path / "out", tmp_path / "wandb_runs"
    args = _args(out, enable_wandb=True, wandb_project="rlhf-test", wandb_run_name="tiny", wandb_dir=str(root))
    logger = logger_from_args(args)
    logger.log(1, {"train/loss": torch.tensor(1.5), "note": "not a scalar"})
    logger.log(2, {"train/loss": 0.5, "train/reward": float("nan")})
    run = logger.backends[-1].run
    assert (run.project, run.name, run.config["learning_rate"]) == ("rlhf-test", "tiny", 1e-3)
    assert run.summary["train/loss"] == 0.5 and run.summary["step"] == 2
    logger.close()
    wandb_offline.teardown()  # finish() may return before wandb-core has written the file out; this waits

    run_id = (out / WANDB_ID_FILE).read_text().strip()
    [(config, history)] = _offline_runs(str(root), run_id)
    assert config["learning_rate"] == 1e-3 and config["wandb_project"] == "rlhf-test"
    assert [(h["step"], h["train/loss"]) for h in history] == [(1, 1.5), (2, 0.5)]
    assert "note" not in history[0] and math.isnan(history[1]["train/reward"])  # NaN stays a number there
    assert read_metrics(str(out))[1] == {"step": 2, "train/loss": 0.5, "train/reward": "nan"}  # jsonl too

    # A resumed run continues the same W&B run id (offline: a second offline-run-<time>-<id> dir, which
    # `wandb sync` appends to that run); a fresh run in the same output dir gets a new id.
    resumed = logger_from_args(args, keep_until_step=1)
    resumed.log(2, {"train/loss": 0.4})
    resumed.close()
    wandb_offline.teardown()
    assert (out / WANDB_ID_FILE).read_text().strip() == run_id
    runs = _offline_runs(str(root), run_id)
    assert sorted([(h["step"], h["train/loss"]) for h in history] for _, history in runs) == [
        [(1, 1.5), (2, 0.5)],
        [(2, 0.4)],
    ]
    assert [(r["step"], r["train/loss"]) for r in read_metrics(str(out))] == [(1, 1.5), (2, 0.4)]
    fresh = logger_from_args(args)
    fresh.close()
    assert (out / WANDB_ID_FILE).read_text().strip() != run_id


def test_wandb_missing_stops_with_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(UsageError) as stop:
        logger_from_args(_args(tmp_path, enable_wandb=True))
    assert str(stop.value) == "--enable_wandb needs the wandb package (pip install wandb==0.31.0)"
    assert stop.value.__cause__ is None and stop.value.__suppress_context__
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # stopped before writing anything
    logger = logger_from_args(_args(tmp_path, enable_wandb=False))  # disabled: wandb never imported
    logger.close()
