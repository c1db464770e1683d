"""Exporting trained engines, and training checkpoints that resume a crashed run exactly.

Export: plain `from_pretrained` directories (safetensors, LoRA merged).

A naive `save_pretrained` of a ZeRO-3 model writes EMPTY tensors without any error (shared/notes),
so the full weights are first consolidated on rank 0, loaded into a fresh unpartitioned copy of
the model, LoRA merged there, and only that copy is saved.
"""
from __future__ import annotations

import copy
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
from torch import nn

from utils import accelerator
from utils.distributed import barrier, is_rank0, rank, world_size
from utils.model import hf_zero3_disabled


def is_zero3(engine) -> bool:
    return engine.zero_optimization_stage() == 3


def gather_full_state_dict(engine) -> dict | None:
    """Full state dict on rank 0 (None on other ranks). Collective under ZeRO-3: call on all ranks."""
    if is_zero3(engine):
        return engine._zero3_consolidated_16bit_state_dict()
    if not is_rank0():
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in engine.module.state_dict().items()}


def _fresh_hf_model(hf_model: nn.Module) -> nn.Module:
    """An unpartitioned fp32 copy of `hf_model`'s architecture (weights to be loaded)."""
    with hf_zero3_disabled():
        return type(hf_model)._from_config(copy.deepcopy(hf_model.config), dtype=torch.float32)


def plain_copy(module: nn.Module, state_dict: dict) -> nn.Module:
    """A plain HF model holding `state_dict`, with LoRA adapters merged when `module` is a PeftModel."""
    from peft import PeftModel, get_peft_model

    if isinstance(module, PeftModel):
        fresh = _fresh_hf_model(module.get_base_model())
        peft_config = copy.deepcopy(module.peft_config["default"])
        fresh = get_peft_model(fresh, peft_config)
        fresh.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
        return fresh.merge_and_unload()
    fresh = _fresh_hf_model(module)
    fresh.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    return fresh


def export_hf_model(engine, tokenizer, out_dir: str) -> None:
    """Write engine.module as a from_pretrained directory (config, safetensors, tokenizer) from rank 0."""
    state_dict = gather_full_state_dict(engine)
    if is_rank0():
        model = plain_copy(engine.module, state_dict)
        model.config.use_cache = True
        os.makedirs(out_dir, exist_ok=True)
        model.save_pretrained(out_dir)
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)
    barrier()


@torch.no_grad()
def reload_max_abs_diff(engine, reload, forward, batch: dict) -> float:
    """Max |forward(reloaded) - forward(engine)| on `batch`: does the exported directory hold the engine's
    model (LoRA merged)? `reload()` builds it on rank 0 only, unpartitioned. Call on ALL ranks."""
    from utils.distributed import all_reduce_sum
    from utils.forward import eval_mode

    with eval_mode(engine):
        expected = forward(engine, batch).float()
    diff = 0.0
    if is_rank0():
        with hf_zero3_disabled():
            reloaded = reload().eval()
        actual = forward(reloaded, batch).float()
        diff = (actual - expected.to(actual.device)).abs().max().item()
    return all_reduce_sum([diff])[0]


# --------------------------------------------------------------------------- #
# Training checkpoints: resume exactly after a crash
# --------------------------------------------------------------------------- #
LATEST_FILE = "latest"
COMPLETE_FILE = "COMPLETE"
STATE_FILE = "state.json"
DS_TAG = "ds"


class CheckpointError(RuntimeError):
    pass


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
        raise BrokenCheckpoint(f"{path} cannot be read ({' '.join(str(e).split())[:160]})") from None
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

    def latest(self) -> str | None:
        pointer = os.path.join(self.root, LATEST_FILE)
        if not os.path.exists(pointer):
            return None
        with open(pointer) as f:
            tag = f.read().strip()
        path = os.path.join(self.root, tag)
        if not os.path.exists(os.path.join(path, COMPLETE_FILE)):
            raise CheckpointError(f"{pointer} names {tag!r}, which is missing or incomplete")
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

    def load(self, engines: dict, path: str | None = None, layout: dict | None = None) -> tuple[dict, dict]:
        """Restore every engine from the latest (or given) checkpoint; returns (shared, this rank's) state.

        `layout` (data_layout) must match the one the checkpoint was written with, else the run is
        refused before any engine is touched: the resumed run would skip the wrong rows."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint under {self.root}")
        with open(os.path.join(path, STATE_FILE)) as f:
            shared = json.load(f)
        if shared["world_size"] != world_size():
            raise CheckpointError(
                f"checkpoint {path} was written by {shared['world_size']} ranks but this run has {world_size()}: "
                f"ZeRO optimizer states are partitioned per rank, so resume with {shared['world_size']} ranks "
                f"(or start a new run from exported weights)")
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
                    raise BrokenCheckpoint(f"{weights} cannot be read ({' '.join(str(exc).split())[:160]})") from exc
                continue
            with weights_only_loading(engine):
                loaded, _ = engine.load_checkpoint(os.path.join(path, name), tag=DS_TAG)
            if loaded is None:
                raise BrokenCheckpoint(f"DeepSpeed found no model states under {os.path.join(path, name)}")
        rank_state = safe_torch_load(os.path.join(path, f"rank{rank():05d}.pt"))
        return shared, rank_state

    def _prune(self, keep_tag: str) -> None:
        tags = sorted(t for t in os.listdir(self.root) if t.startswith("step-"))
        for tag in tags[:-self.keep] if self.keep > 0 else []:
            if tag != keep_tag:
                shutil.rmtree(os.path.join(self.root, tag), ignore_errors=True)


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
        self.last_path: str | None = None

    def restore(self) -> tuple[LoopState, dict, dict]:
        """The latest checkpoint, or, when one of its files is missing or unreadable, the newest intact
        one before it (every rank agrees on which: a file missing on one rank moves all of them)."""
        from utils.distributed import all_reduce_max
        from utils.logging import print_rank0

        if not self.resume or not os.path.exists(os.path.join(self.store.root, LATEST_FILE)):
            return LoopState(), {}, {}
        with open(os.path.join(self.store.root, LATEST_FILE)) as f:
            pointed = os.path.join(self.store.root, f.read().strip())
        # the one `latest` names, then the intact ones before it (a newer one the pointer never reached
        # is a save that did not finish)
        candidates = [p for p in self.store.complete() if os.path.basename(p) <= os.path.basename(pointed)]
        problems = [] if pointed in candidates else [f"{pointed} (named by {LATEST_FILE}) is missing or incomplete"]
        for path in candidates:
            try:
                shared, rank_state = self.store.load(self.engines, path, self.layout)
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
        set_rng_state(rank_state.pop("rng"))
        loop = LoopState(**shared.pop("loop"))
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
