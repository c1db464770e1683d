"""Training checkpoints that resume a crashed run exactly (weights, optimizer, scheduler, RNG, loop).

Exporting the trained model as a `from_pretrained` directory is utils/export.py.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import random
import re
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np
import torch

from utils import accelerator
from utils.distributed import barrier, is_rank0, rank, world_size
from utils.errors import ProjectError, one_line
from utils.export import gather_full_state_dict, is_zero3

LATEST_FILE = "latest"
COMPLETE_FILE = "COMPLETE"
STATE_FILE = "state.json"
DS_TAG = "ds"
UNIVERSAL_TAG = "universal"  # <checkpoint>/<engine>/universal: the DeepSpeed checkpoint in the universal format


class CheckpointError(ProjectError, RuntimeError):
    """A checkpoint that cannot be resumed from (refused, incomplete, of another layout); str() names it."""


class BrokenCheckpoint(CheckpointError):
    """A checkpoint with a missing or unreadable file (an interrupted copy, a full disk): a resume falls
    back to the previous intact checkpoint. A file refused for what it holds is NOT this: that stops."""


def _deepspeed_state_classes() -> list:
    """The few classes DeepSpeed pickles into its checkpoint states besides tensors and containers:
    plain data, rebuilt from numbers/bools/dtypes only (found by saving ZeRO 0-3 checkpoints in fp32
    and bf16, with and without offload/LoRA, and asking `get_unsafe_globals_in_checkpoint`):
    - LossScaler: the ZeRO optimizers' `loss_scaler` (fp32/bf16): `cur_scale`, `dynamic`.
    - DynamicLossScaler: the same under fp16 dynamic loss scaling (scale, iteration counters,
      window, hysteresis, a torch dtype).
    - ZeroStageEnum: an int Enum, the ZeRO optimizers' `zero_stage`.
    - fragment_address: a dataclass of two ints (`numel`, `start`), ZeRO 1-2's param slice mappings.
    Unpickling one only calls the class with those values or sets its attributes: no code runs."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_torch_load(path: str, map_location=None):
    """`torch.load(weights_only=True)` admitting DeepSpeed's plain state classes only; a file holding
    anything else (a planted pickle whose `__reduce__` calls os.system, ...) raises CheckpointError
    before any of it runs."""
    try:
        with torch.serialization.safe_globals(_deepspeed_state_classes()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise BrokenCheckpoint(f"{path} is missing") from None
    except (EOFError, RuntimeError) as e:  # a truncated zip: "PytorchStreamReader failed reading ..."
        raise BrokenCheckpoint(f"{path} cannot be read ({one_line(e, 160)})") from None
    except pickle.UnpicklingError as e:
        refused = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = f" ({refused.group(1)})" if refused else ""
        raise CheckpointError(f"{path} holds objects other than tensors and plain data{what} "
                              f"and was not loaded") from None


class WeightsOnlyCheckpointEngine:
    """An engine's own DeepSpeed checkpoint engine, except that `load` goes through `safe_torch_load`
    (DeepSpeed's TorchCheckpointEngine loads with weights_only=False: any pickle in a .pt file would
    run on --resume). Every other attribute and method is the wrapped engine's."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return safe_torch_load(path, map_location=map_location)


@contextmanager
def weights_only_loading(engine):
    """`engine.load_checkpoint` inside this block reads every file with `safe_torch_load`: the model
    states (state_dict_factory's loaders), the ZeRO optimizer partitions (`_get_all_zero_checkpoints`)
    and MoE expert/optimizer files all go through `engine.checkpoint_engine.load`."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(original)
    try:
        yield
    finally:
        engine.checkpoint_engine = original


def rng_state() -> dict:
    """This rank's random generators, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    device_state = accelerator.rng_state()
    if device_state is not None:
        state["accelerator"] = device_state
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy(), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    accelerator.set_rng_state(state.get("accelerator"))


class TrainingCheckpoints:
    """`OUTPUT_DIR/checkpoints/step-00000012/`: every trained engine (DeepSpeed checkpoint: weights,
    optimizer, scheduler), each rank's RNG and loop state, and the run's shared state (JSON).

    A checkpoint is written under a temporary name, marked COMPLETE, renamed, and only then does the
    `latest` pointer move (atomic replace), so a crash while saving leaves the previous checkpoint
    the latest one. Older checkpoints beyond `keep` are removed after the pointer moved.
    """

    def __init__(self, output_dir: str, keep: int = 2):
        self.root = os.path.join(output_dir, "checkpoints")
        self.keep = keep

    def complete(self) -> list[str]:
        """The complete checkpoints, newest first."""
        if not os.path.isdir(self.root):
            return []
        tags = sorted((t for t in os.listdir(self.root) if t.startswith("step-")), reverse=True)
        return [os.path.join(self.root, t) for t in tags if os.path.exists(os.path.join(self.root, t, COMPLETE_FILE))]

    def pointed(self) -> str | None:
        """The checkpoint the `latest` pointer names (None without a pointer), complete or not."""
        pointer = os.path.join(self.root, LATEST_FILE)
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            return os.path.join(self.root, f.read().strip())

    def latest(self) -> str | None:
        path = self.pointed()
        if path is not None and not os.path.exists(os.path.join(path, COMPLETE_FILE)):
            raise CheckpointError(f"{os.path.join(self.root, LATEST_FILE)} names {os.path.basename(path)!r}, "
                                  f"which is missing or incomplete")
        return path

    def save(self, step: int, engines: dict, shared_state: dict, rank_state: dict) -> str:
        """Collective: every rank calls it with its own `rank_state` (loop position, RNG, ...)."""
        tag = f"step-{step:08d}"
        final, tmp = os.path.join(self.root, tag), os.path.join(self.root, f".tmp-{tag}")
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        barrier()
        for name, engine in engines.items():
            if _has_optimizer(engine):
                engine.save_checkpoint(os.path.join(tmp, name), tag=DS_TAG, save_latest=False)
            else:
                _save_weights(engine, os.path.join(tmp, f"{name}.safetensors"))
        torch.save(rank_state, os.path.join(tmp, f"rank{rank():05d}.pt"))
        barrier()
        if is_rank0():
            with open(os.path.join(tmp, STATE_FILE), "w") as f:
                json.dump({**shared_state, "step": step, "world_size": world_size(), "engines": sorted(engines)}, f)
            open(os.path.join(tmp, COMPLETE_FILE), "w").close()
            _fail_point("before_rename")
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            _fail_point("before_pointer")
            pointer_tmp = os.path.join(self.root, f".{LATEST_FILE}.tmp")
            with open(pointer_tmp, "w") as f:
                f.write(tag)
            os.replace(pointer_tmp, os.path.join(self.root, LATEST_FILE))
            self._prune(keep_tag=tag)
        barrier()
        return final

    def load(self, engines: dict, path: str | None = None, layout: dict | None = None,
             universal: bool = False) -> tuple[dict, dict]:
        """Restore every engine from the latest (or given) checkpoint; returns (shared, this rank's) state.

        `layout` (data_layout) must match the one the checkpoint was written with, else the run is
        refused before any engine is touched: the resumed run would skip the wrong rows.
        A checkpoint of another world size is refused unless `universal`: then each ZeRO (stage 1-3)
        engine's DeepSpeed checkpoint is converted to the universal format (rank 0, once, kept in the
        checkpoint) and loaded from it; ZeRO-0 and weights-only engines load as they are."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint under {self.root}")
        with open(os.path.join(path, STATE_FILE)) as f:
            shared = json.load(f)
        resharded = shared["world_size"] != world_size()
        if resharded and not universal:
            raise CheckpointError(
                f"checkpoint {path} was written by {shared['world_size']} ranks but this run has {world_size()}: "
                f"ZeRO optimizer states are partitioned per rank, so resume with {shared['world_size']} ranks, "
                f"or add --universal_checkpoint to convert the checkpoint to DeepSpeed's universal format and "
                f"load it on {world_size()} (or start a new run from exported weights)")
        saved = shared.get("layout")
        if layout is not None and saved is not None:
            differ = [f"{key} {saved[key]!r} (this run: {value!r})" for key, value in layout.items()
                      if key in saved and saved[key] != value]
            if differ:
                raise CheckpointError(
                    f"checkpoint {path} was written with another data layout: {'; '.join(differ)}. The resumed run "
                    f"would skip or repeat the wrong rows: resume with the checkpoint's settings, or start a new "
                    f"run (--overwrite_output_dir)")
        if sorted(engines) != shared["engines"]:
            raise CheckpointError(f"checkpoint {path} holds engines {shared['engines']}, this run has {sorted(engines)}")
        for name, engine in engines.items():
            if not _has_optimizer(engine):
                weights = os.path.join(path, f"{name}.safetensors")
                try:
                    _load_weights(engine, weights)
                except Exception as exc:  # missing or truncated safetensors
                    raise BrokenCheckpoint(f"{weights} cannot be read ({one_line(exc, 160)})") from exc
                continue
            if resharded and engine.zero_optimization():  # partitioned optimizer states: universal format
                _convert_to_universal(os.path.join(path, name))
                with weights_only_loading(engine), universal_loading(engine):
                    loaded, _ = engine.load_checkpoint(os.path.join(path, name), tag=UNIVERSAL_TAG)
            else:
                with weights_only_loading(engine):
                    loaded, _ = engine.load_checkpoint(os.path.join(path, name), tag=DS_TAG)
            if loaded is None:
                raise BrokenCheckpoint(f"DeepSpeed found no model states under {os.path.join(path, name)}")
        if resharded and rank() >= shared["world_size"]:
            # a rank the checkpoint had not: rank 0's state without its RNG (this rank keeps its own)
            rank_state = safe_torch_load(os.path.join(path, f"rank{0:05d}.pt"))
            rank_state.pop("rng", None)
        else:
            rank_state = safe_torch_load(os.path.join(path, f"rank{rank():05d}.pt"))
        return shared, rank_state

    def _prune(self, keep_tag: str) -> None:
        tags = sorted(t for t in os.listdir(self.root) if t.startswith("step-"))
        for tag in tags[:-self.keep] if self.keep > 0 else []:
            if tag != keep_tag:
                shutil.rmtree(os.path.join(self.root, tag), ignore_errors=True)


@contextmanager
def universal_loading(engine):
    """`engine.load_checkpoint` inside this block reads a universal checkpoint: DeepSpeed's
    `checkpoint.load_universal` setting, read from `engine._config` at each load, switched on for
    that load only (so the engine's own config at `deepspeed.initialize` needs no change)."""
    original = engine._config.load_universal_checkpoint
    engine._config.load_universal_checkpoint = True
    try:
        yield
    finally:
        engine._config.load_universal_checkpoint = original


def _convert_to_universal(engine_dir: str) -> str:
    """`engine_dir/universal` from `engine_dir/ds` (deepspeed.checkpoint.ds_to_universal), converted by rank 0
    the first time (into a temporary folder, then renamed) and reused after; collective: the other ranks
    wait. Every file read goes through `safe_torch_load` first (the converter and DeepSpeed's universal
    loader use torch.load(weights_only=False)): the source files before converting, the converted ones
    before any rank loads them. A missing or unreadable source file raises BrokenCheckpoint on every rank."""
    from utils.distributed import all_reduce_max
    from utils.logging import print_rank0

    source, target = os.path.join(engine_dir, DS_TAG), os.path.join(engine_dir, UNIVERSAL_TAG)
    failure, message = 0.0, ""
    if is_rank0():
        try:
            if not os.path.isdir(target):
                for file in sorted(glob.glob(os.path.join(source, "*.pt"))):
                    safe_torch_load(file)
                if not glob.glob(os.path.join(source, "*optim_states.pt")):
                    raise BrokenCheckpoint(f"{source} holds no ZeRO optimizer states")
                tmp = os.path.join(engine_dir, f".tmp-{UNIVERSAL_TAG}")
                shutil.rmtree(tmp, ignore_errors=True)
                print_rank0(f"[checkpoint] converting {source} to DeepSpeed's universal checkpoint format in {target}")
                from deepspeed.checkpoint import ds_to_universal

                # one process (no worker pool forked from a rank); the ZeRO info DeepSpeed only writes for
                # tensor-parallel models is injected
                ds_to_universal.main(argparse.Namespace(
                    input_folder=source, output_folder=tmp, num_extract_workers=1, num_merge_workers=1,
                    keep_temp_folder=False, strict=True, inject_missing_state=True))
                os.rename(tmp, target)
            for file in sorted(glob.glob(os.path.join(target, "**", "*.pt"), recursive=True)):
                safe_torch_load(file)
        except BrokenCheckpoint as exc:
            failure, message = 1.0, str(exc)
        except CheckpointError as exc:
            failure, message = 2.0, str(exc)
        except Exception as exc:  # the converter's own errors (an unsupported layout, a full disk, ...)
            failure, message = 2.0, f"converting {source} to the universal format failed: {type(exc).__name__}: {exc}"
    failure = all_reduce_max(failure)  # every rank raises the same kind (restore() falls back on all or none)
    if failure:
        message = message or f"converting {source} to the universal format failed on rank 0"
        raise (BrokenCheckpoint if failure == 1.0 else CheckpointError)(message)
    return target


def _has_optimizer(engine) -> bool:
    """DeepSpeed checkpoints need an optimizer; weights-only engines (the actor's EMA) are saved directly."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload

    return engine.optimizer is not None and not isinstance(engine.optimizer, DeepSpeedZeRoOffload)


def _save_weights(engine, path: str) -> None:
    from safetensors.torch import save_file

    state_dict = gather_full_state_dict(engine)
    if is_rank0():  # tied weights share storage, which safetensors refuses: store copies
        save_file({k: v.detach().clone().contiguous() for k, v in state_dict.items()}, path)


@torch.no_grad()
def _load_weights(engine, path: str) -> None:
    import deepspeed
    from safetensors.torch import load_file

    zero3 = is_zero3(engine)
    state_dict = load_file(path) if is_rank0() or not zero3 else None
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=zero3):
            if state_dict is not None:
                param.data.copy_(state_dict[name])


def _fail_point(name: str) -> None:
    """Crash injection for tests: RLHF_CRASH_AT=<name> kills this process at that point of a save."""
    if os.environ.get("RLHF_CRASH_AT") == name:
        os.kill(os.getpid(), 9)


@dataclass
class LoopState:
    """Where a training loop stands; saved with every checkpoint."""
    step: int = 0  # optimizer steps (steps 1, 2) or PPO iterations (step 3) done
    epoch: int = 0
    batches_in_epoch: int = 0  # loader batches of `epoch` already consumed
    bad_steps: int = 0  # updates skipped for a non-finite loss or reward
    overflow_steps: int = 0  # updates DeepSpeed's fp16 loss scaler skipped (gradient overflow)
    bad_in_a_row: int = 0


# What decides which rows a resumed run reads next (the loader's order, batch boundaries, the rows).
DATA_LAYOUT_FLAGS = ("data_path", "data_split", "sft_only_data_path", "eval_fraction", "seed", "max_seq_len",
                     "max_prompt_seq_len", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "per_device_generation_batch_size", "generation_batches", "per_device_training_batch_size")


def data_layout(args, rows: int) -> dict:
    """The run's data layout, saved with each checkpoint and compared on --resume: the flags of
    DATA_LAYOUT_FLAGS it has (as given) and the number of training rows (a changed file changes it).
    The world size is compared separately."""
    return {**{f"--{name}": getattr(args, name) for name in DATA_LAYOUT_FLAGS if hasattr(args, name)},
            "training rows": rows}


class Checkpointing:
    """A run's checkpoint policy: `--save_interval`, `--keep_checkpoints`, `--resume`.

    `restore()` continues from the latest checkpoint when `--resume` is given and one exists
    (otherwise the run starts fresh); the RNG states of every rank come back with it, so a resumed
    run draws the same samples and dropout masks as an uninterrupted one.
    """

    def __init__(self, args, engines: dict, layout: dict | None = None):
        self.interval = getattr(args, "save_interval", 0)
        self.resume = getattr(args, "resume", False)
        self.store = TrainingCheckpoints(args.output_dir, getattr(args, "keep_checkpoints", 2))
        self.engines = engines
        self.layout = layout
        self.universal = getattr(args, "universal_checkpoint", False)
        self.last_path: str | None = None

    def restore(self) -> tuple[LoopState, dict, dict]:
        """The latest checkpoint, or, when one of its files is missing or unreadable, the newest intact
        one before it (every rank agrees on which: a file missing on one rank moves all of them)."""
        from utils.distributed import all_reduce_max
        from utils.logging import print_rank0

        pointed = self.store.pointed() if self.resume else None
        if pointed is None:
            return LoopState(), {}, {}
        # the one `latest` names, then the intact ones before it (a newer one the pointer never reached
        # is a save that did not finish)
        candidates = [p for p in self.store.complete() if os.path.basename(p) <= os.path.basename(pointed)]
        problems = [] if pointed in candidates else [f"{pointed} (named by {LATEST_FILE}) is missing or incomplete"]
        for path in candidates:
            try:
                shared, rank_state = self.store.load(self.engines, path, self.layout, self.universal)
                broken = 0.0
            except BrokenCheckpoint as exc:
                problems.append(str(exc))
                broken = 1.0
            if all_reduce_max(broken) == 0.0:
                break
            print_rank0(f"[checkpoint] {path} is broken ({problems[-1] if problems else 'on another rank'}); "
                        f"trying the previous one")
        else:
            raise CheckpointError(f"no intact checkpoint under {self.store.root} ({'; '.join(problems) or 'none complete'}"
                                  f"): start a new run with --overwrite_output_dir, or restore the files")
        shared.pop("layout", None)
        rng = rank_state.pop("rng", None)
        if rng is not None:
            set_rng_state(rng)
        loop = LoopState(**shared.pop("loop"))
        if shared["world_size"] != world_size():
            # each rank had read `batches_in_epoch` batches of its shard (DistributedSampler: rank r takes
            # every n-th row of the epoch's order), so the first saved_ranks * batches_in_epoch batches'
            # rows are done: on the new ranks that is this many batches of each one's new shard
            consumed = loop.batches_in_epoch * shared["world_size"]
            loop.batches_in_epoch = consumed // world_size()
            exact = "" if consumed % world_size() == 0 else (
                f"; {consumed % world_size()} batch(es) of rows are read again (not divisible)")
            print_rank0(f"[checkpoint] resuming {shared['world_size']} ranks' checkpoint on {world_size()} ranks "
                        f"(universal checkpoint): weights, optimizer and scheduler are restored exactly, the rest of "
                        f"epoch {loop.epoch} is re-sharded (each rank skips {loop.batches_in_epoch} batches{exact}), so "
                        f"the row order differs from an uninterrupted run")
        self.last_path = path
        return loop, shared, rank_state

    def metrics_logger(self, args, loop: LoopState):
        """The run's MetricsLogger (metrics.jsonl, TensorBoard, W&B): a resumed run keeps the jsonl rows up
        to the step it resumed from and continues the same W&B run."""
        from utils.logging import logger_from_args

        return logger_from_args(args, keep_until_step=loop.step if self.last_path else None)

    def maybe_save(self, loop: LoopState, shared: dict | None = None, rank_state: dict | None = None,
                   force: bool = False) -> None:
        if not force and (self.interval <= 0 or loop.step % self.interval):
            return
        shared = {**(shared or {}), "loop": asdict(loop), **({"layout": self.layout} if self.layout else {})}
        rank_state = {**(rank_state or {}), "rng": rng_state()}
        self.last_path = self.store.save(loop.step, self.engines, shared, rank_state)


class BadStepGuard:
    """Skips updates whose loss or reward is NaN/inf on ANY rank (ranks must agree under ZeRO),
    counts them, and stops the run after `max_in_a_row` consecutive ones."""

    def __init__(self, loop: LoopState, max_in_a_row: int, checkpointing: Checkpointing | None = None):
        self.loop, self.max_in_a_row, self.checkpointing = loop, max_in_a_row, checkpointing

    def all_finite(self, *values: torch.Tensor) -> bool:
        from utils.distributed import all_reduce_max

        bad = any(not torch.isfinite(torch.as_tensor(v)).all() for v in values)
        if all_reduce_max(float(bad)) == 0.0:
            self.loop.bad_in_a_row = 0
            return True
        self.loop.bad_steps += 1
        self.loop.bad_in_a_row += 1
        if self.loop.bad_in_a_row >= self.max_in_a_row:
            where = self.checkpointing.last_path if self.checkpointing else None
            raise SystemExit(f"error: {self.loop.bad_in_a_row} consecutive updates had a non-finite loss or reward "
                             f"(--max_bad_steps {self.max_in_a_row}); stopping. Last checkpoint: {where or 'none'}")
        return False
