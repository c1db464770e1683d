"""Metrics: one JSON object per logged step in OUTPUT_DIR/metrics.jsonl, TensorBoard on request."""
from __future__ import annotations

import json
import math
import os

from utils.distributed import is_rank0


def print_rank0(*args, **kwargs) -> None:
    if is_rank0():
        print(*args, **kwargs, flush=True)


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible as strings
    return value


class MetricsLogger:
    """Writes on rank 0 only; every row carries `step` so runs can be compared row by row."""

    def __init__(self, output_dir: str, enable_tensorboard: bool = False, tensorboard_dir: str | None = None,
                 keep_until_step: int | None = None):
        """A new run starts a new metrics.jsonl; a resumed one keeps the rows up to `keep_until_step`."""
        self.active = is_rank0()
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.writer = None
        if not self.active:
            return
        os.makedirs(output_dir, exist_ok=True)
        kept = []
        if keep_until_step is not None and os.path.exists(self.path):
            kept = [row for row in read_metrics(output_dir) if row["step"] <= keep_until_step]
        with open(self.path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in kept)
        if enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir or os.path.join(output_dir, "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_metrics(output_dir: str) -> list[dict]:
    path = os.path.join(output_dir, "metrics.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def progress_bar(total: int, done: int, desc: str):
    """A tqdm bar of training steps on rank 0 (None elsewhere); `done` counts steps before a resume."""
    if not is_rank0():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, dynamic_ncols=True)
