"""Metrics: the ONE place a run's metrics go.

`MetricsLogger.log(step, metrics)` builds one row `{"step": step, **metrics}` and hands it to each
backend. Backends (rank 0 only):
  * metrics.jsonl in OUTPUT_DIR (always): one JSON object per logged row;
  * TensorBoard (`enable_tensorboard`, `tensorboard_dir`);
  * Weights & Biases (`enable_wandb`, ...), an OPTIONAL dependency imported only when enabled.
A new backend is one small class with `log(step, row)` and `close()` (see `Backend`); pass extra
ones with `MetricsLogger(..., backends=[...])`.
"""

from __future__ import annotations

import json
import math
import os
import uuid
from typing import Protocol

from tqdm import tqdm

from utils.errors import UsageError
from utils.runtime.distributed import is_rank0

WANDB_VERSION = "0.31.0"  # the version pinned in requirements.txt (named in the missing-package error)
WANDB_ID_FILE = "wandb_run_id.txt"


def print_rank0(*args, **kwargs) -> None:
    if is_rank0():
        print(*args, **kwargs, flush=True)


def _plain(value):
    """Tensors / numpy scalars -> Python numbers; everything else unchanged."""
    if hasattr(value, "item"):
        value = value.item()
    return value


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


def _scalars(row: dict) -> dict:
    """The numeric entries of a row except `step` (what chart backends plot)."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


class Backend(Protocol):
    """Receives every row (`row["step"] == step`; values are plain Python, floats may be NaN/inf)."""

    def log(self, step: int, row: dict) -> None: ...

    def close(self) -> None: ...


class JsonlBackend:
    """OUTPUT_DIR/metrics.jsonl. A new run starts a new file; a resumed one keeps the rows up to
    `keep_until_step` (the rows logged after the checkpoint it resumes from are dropped)."""

    def __init__(self, output_dir: str, keep_until_step: int | None = None):
        self.path = os.path.join(output_dir, "metrics.jsonl")
        os.makedirs(output_dir, exist_ok=True)
        kept = []
        if keep_until_step is not None and os.path.exists(self.path):
            kept = [row for row in read_metrics(output_dir) if row["step"] <= keep_until_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)

    def log(self, step: int, row: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")

    def close(self) -> None:
        pass


class TensorBoardBackend:
    """One scalar per numeric entry, at `step`, under `log_dir` (default OUTPUT_DIR/tensorboard)."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # lazy: +0.2 s on every --help (tensorboard)

        self.writer = SummaryWriter(log_dir)

    def log(self, step: int, row: dict) -> None:
        for key, value in _scalars(row).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def import_wandb():
    """`import wandb`, or stop with one readable line when it is not installed."""
    try:
        import wandb  # lazy: optional, +0.5 s on every --help
    except ImportError:
        raise UsageError(f"--enable_wandb needs the wandb package (pip install wandb=={WANDB_VERSION})") from None
    return wandb


def _config_value(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_config_value(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _config_value(v) for k, v in value.items()}
    return str(value)


class WandbBackend:
    """A W&B run; its charts use the training `step` (logged as the `step` metric) as x axis.

    Run identity: a new run draws a fresh id and writes it to OUTPUT_DIR/wandb_run_id.txt; a resumed
    run (`resume=True`) reads that file and continues the SAME W&B run (`resume="allow"`), so a
    restart does not show up as a second run. Because the x axis is `step` (not W&B's internal
    `_step`, which only grows), the steps between the checkpoint and the crash are not dropped on
    resume: they appear twice on the chart, the old values and the recomputed ones (metrics.jsonl
    keeps only the recomputed ones). Offline runs (WANDB_MODE=offline) land in
    WANDB_DIR/wandb/offline-run-*-<id>/ and are uploaded with `wandb sync`.
    """

    def __init__(
        self,
        output_dir: str,
        project: str | None = None,
        run_name: str | None = None,
        entity: str | None = None,
        wandb_dir: str | None = None,
        mode: str | None = None,
        config: dict | None = None,
        resume: bool = False,
        wandb=None,
    ):
        wandb = wandb or import_wandb()
        id_path = os.path.join(output_dir, WANDB_ID_FILE)
        run_id = None
        if resume and os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        if run_id is None:
            run_id = uuid.uuid4().hex[:16]
            os.makedirs(output_dir, exist_ok=True)
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        wandb_dir = wandb_dir or output_dir
        os.makedirs(wandb_dir, exist_ok=True)
        self.run = wandb.init(
            project=project,
            entity=entity,
            name=run_name,
            dir=wandb_dir,
            mode=mode,
            id=run_id,
            resume="allow",
            allow_val_change=True,
            config=_config_value(dict(config or {})),
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, row: dict) -> None:
        self.run.log({"step": step, **_scalars(row)})

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    """Writes on rank 0 only; every row carries `step` so runs can be compared row by row."""

    def __init__(
        self,
        output_dir: str,
        enable_tensorboard: bool = False,
        tensorboard_dir: str | None = None,
        keep_until_step: int | None = None,
        *,
        enable_wandb: bool = False,
        wandb_project: str | None = None,
        wandb_run_name: str | None = None,
        wandb_entity: str | None = None,
        wandb_dir: str | None = None,
        wandb_mode: str | None = None,
        config: dict | None = None,
        backends: list[Backend] | None = None,
    ):
        """A new run starts a new metrics.jsonl; a resumed one (`keep_until_step` given) keeps the rows
        up to `keep_until_step` and continues the same W&B run. `config` (e.g. vars(args)) goes to W&B."""
        self.active = is_rank0()
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.backends: list[Backend] = []
        wandb = import_wandb() if enable_wandb else None  # every rank: a missing package stops them all
        if not self.active:
            return
        self.backends.append(JsonlBackend(output_dir, keep_until_step))
        if enable_tensorboard:
            self.backends.append(TensorBoardBackend(tensorboard_dir or os.path.join(output_dir, "tensorboard")))
        if enable_wandb:
            self.backends.append(
                WandbBackend(
                    output_dir,
                    wandb_project,
                    wandb_run_name,
                    wandb_entity,
                    wandb_dir,
                    wandb_mode,
                    config,
                    resume=keep_until_step is not None,
                    wandb=wandb,
                )
            )
        self.backends.extend(backends or [])

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        for backend in self.backends:
            backend.log(step, row)

    def close(self) -> None:
        backends, self.backends = self.backends, []
        for backend in backends:
            backend.close()


def logger_from_args(args, keep_until_step: int | None = None) -> MetricsLogger:
    """The run's MetricsLogger from its parsed flags. Reads args.output_dir, args.enable_tensorboard,
    args.tensorboard_path and, when present, args.enable_wandb, args.wandb_project, args.wandb_run_name
    (default: the output directory's name, as the flag's help says), args.wandb_entity, args.wandb_dir,
    args.wandb_mode; vars(args) becomes the W&B run config."""
    return MetricsLogger(
        args.output_dir,
        args.enable_tensorboard,
        args.tensorboard_path,
        keep_until_step=keep_until_step,
        enable_wandb=getattr(args, "enable_wandb", False),
        wandb_project=getattr(args, "wandb_project", None),
        wandb_run_name=getattr(args, "wandb_run_name", None) or os.path.basename(os.path.normpath(args.output_dir)),
        wandb_entity=getattr(args, "wandb_entity", None),
        wandb_dir=getattr(args, "wandb_dir", None),
        wandb_mode=getattr(args, "wandb_mode", None),
        config=dict(vars(args)) if hasattr(args, "__dict__") else None,
    )


def read_metrics(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_bar(total: int, done: int, desc: str):
    """A tqdm bar of training steps on rank 0 (None elsewhere); `done` counts steps before a resume."""
    if not is_rank0():
        return None
    return tqdm(total=total, initial=done, desc=desc, dynamic_ncols=True)
