"""Training checkpoints that resume a crashed run exactly (weights, optimizer, scheduler, RNG, loop).

Exporting the trained model as a `from_pretrained` directory is utils/models/export.py.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import random
import re
import resource
import shutil
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from utils.data.sources import content_hashes
from utils.errors import ProjectError, one_line
from utils.models.export import gather_full_state_dict, is_zero3
from utils.runtime import accelerator
from utils.runtime.distributed import all_reduce_max, is_rank0, rank, world_size
from utils.train.flags import DERIVED_ATTRIBUTES, RESUMABLE_FLAGS
from utils.train.metrics_logger import logger_from_args, print_rank0
from utils.train.output_dir import remove_entry
from utils.train.safe_loading import BrokenCheckpoint, CheckpointError, safe_torch_load, weights_only_loading

LATEST_FILE = "latest"
COMPLETE_FILE = "COMPLETE"
STATE_FILE = "state.json"
DS_TAG = "ds"
UNIVERSAL_TAG = "universal"  # <checkpoint>/<engine>/universal: the DeepSpeed checkpoint in the universal format


class CheckpointWriteError(CheckpointError):
    """A checkpoint that could not be written (a full disk, a file size limit): str() names the file, what
    it was to hold and why, and says where a --resume would continue from."""


def rng_state() -> dict:
    """This rank's random generators, in types `torch.load(weights_only=True)` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.copy()), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }
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
            raise CheckpointError(
                f"{os.path.join(self.root, LATEST_FILE)} names {os.path.basename(path)!r}, "
                f"which is missing or incomplete"
            )
        return path

    def save(self, step: int, engines: dict, shared_state: dict, rank_state: dict) -> str:
        """Collective: every rank calls it with its own `rank_state` (loop position, RNG, ...). A write that
        fails on any rank (a full disk, a file size limit) raises CheckpointWriteError on every rank, naming
        the file and what it was to hold, once the partial checkpoint is removed."""
        tag = f"step-{step:08d}"
        final, tmp = os.path.join(self.root, tag), os.path.join(self.root, f".tmp-{tag}")
        failure = None
        if is_rank0():
            self._remove_partial_saves()
            failure = _write_failure(lambda: _make_folder(tmp))
        self._agree(failure, tmp)  # the barrier before every rank writes into tmp
        self._agree(_write_failure(lambda: _write_rank_files(tmp, engines, rank_state)), tmp)
        if is_rank0():
            state = {**shared_state, "step": step, "world_size": world_size(), "engines": sorted(engines)}
            failure = _write_failure(lambda: self._publish(tmp, final, tag, state))
        self._agree(failure, tmp)
        return final

    def _publish(self, tmp: str, final: str, tag: str, state: dict) -> None:
        """Rank 0: the run's state and the COMPLETE marker into `tmp`, renamed to `final`; then the pointer."""
        with _writing("the run's state", os.path.join(tmp, STATE_FILE)) as path, open(path, "w") as f:
            json.dump(state, f)
        with _writing("the COMPLETE marker", os.path.join(tmp, COMPLETE_FILE)) as path:
            open(path, "w").close()
        _fail_point("before_rename")
        shutil.rmtree(final, ignore_errors=True)
        with _writing("the renamed checkpoint", final):
            os.rename(tmp, final)
        _fail_point("before_pointer")
        pointer_tmp = os.path.join(self.root, f".{LATEST_FILE}.tmp")
        with _writing(f"the {LATEST_FILE} pointer", pointer_tmp) as path, open(path, "w") as f:
            f.write(tag)
        os.replace(pointer_tmp, os.path.join(self.root, LATEST_FILE))
        self._prune(keep_tag=tag)

    def _remove_partial_saves(self) -> None:
        """Rank 0, before a save: the `.tmp-step-*` folders of saves that never finished (a killed run)."""
        for leftover in glob.glob(os.path.join(self.root, ".tmp-step-*")):
            shutil.rmtree(leftover, ignore_errors=True)

    def _agree(self, failure: CheckpointWriteError | None, tmp: str) -> None:
        """Collective, in place of a barrier: when a write failed on any rank, rank 0 removes the partial
        checkpoint and every rank raises the failure of the lowest failing rank (rank 0 prints it), saying
        where a --resume would continue from instead."""
        failures = _gathered(str(failure) if failure is not None else None)
        first = next((f for f in failures if f is not None), None)
        if first is None:
            return
        if is_rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        pointed = self.pointed()
        where = (
            f"--resume continues from {os.path.basename(pointed)}, the latest checkpoint"
            if pointed
            else "no earlier checkpoint exists: start the run again with --overwrite_output_dir"
        )
        raise CheckpointWriteError(f"{first}; the partial checkpoint {tmp} was removed; {where}")

    def load(
        self,
        engines: dict,
        path: str | None = None,
        layout: dict | None = None,
        universal: bool = False,
        flags: dict | None = None,
    ) -> tuple[dict, dict]:
        """Restore every engine from the latest (or given) checkpoint; returns (shared, this rank's) state.

        `layout` (data_layout) must match the one the checkpoint was written with, else the run is
        refused before any engine is touched: the resumed run would skip the wrong rows. So must
        `flags` (run_flags), but for utils.train.flags.RESUMABLE_FLAGS: the run would go on under other settings.
        A checkpoint of another world size is refused unless `universal`: then each ZeRO (stage 1-3)
        engine's DeepSpeed checkpoint is converted to the universal format (rank 0, once, kept in the
        checkpoint) and loaded from it; ZeRO-0 and weights-only engines load as they are."""
        path = path or self.latest()
        if path is None:
            raise CheckpointError(f"no checkpoint under {self.root}")
        shared = self.read_state(path)
        check_writer(path, shared.get("flags"), flags)
        resharded = shared["world_size"] != world_size()
        if resharded and not universal:
            raise CheckpointError(
                f"checkpoint {path} was written by {shared['world_size']} ranks but this run has {world_size()}: "
                f"ZeRO optimizer states are partitioned per rank, so resume with {shared['world_size']} ranks, "
                f"or add --universal_checkpoint to convert the checkpoint to DeepSpeed's universal format and "
                f"load it on {world_size()} (or start a new run from exported weights)"
            )
        saved = shared.get("layout")
        if layout is not None and saved is not None:
            differ = [
                f"{key} {saved[key]!r} (this run: {value!r})"
                for key, value in layout.items()
                if key in saved and saved[key] != value
            ]
            if differ:
                raise CheckpointError(
                    f"checkpoint {path} was written with another data layout: {'; '.join(differ)}. The resumed run "
                    f"would skip or repeat the wrong rows: resume with the checkpoint's settings, or start a new "
                    f"run (--overwrite_output_dir)"
                )
        check_same_flags(path, shared.get("flags"), flags)
        if sorted(engines) != shared["engines"]:
            raise CheckpointError(
                f"checkpoint {path} holds engines {shared['engines']}, this run has {sorted(engines)}"
            )
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

    @staticmethod
    def read_state(path: str) -> dict:
        """The run's state of checkpoint `path` (its state.json); missing or unreadable: BrokenCheckpoint."""
        file = os.path.join(path, STATE_FILE)
        try:
            with open(file) as f:
                return json.load(f)
        except FileNotFoundError:
            raise BrokenCheckpoint(f"{file} is missing") from None
        except (OSError, ValueError) as exc:
            raise BrokenCheckpoint(f"{file} cannot be read ({one_line(exc, 160)})") from None

    @staticmethod
    def check_files(engines: dict, path: str, shared: dict) -> None:
        """BrokenCheckpoint naming the first of this rank's files of checkpoint `path` that is missing:
        each engine's DeepSpeed model states (DeepSpeed itself stops on an assertion) or weights, and
        this rank's state. A checkpoint of another world size is checked while it is converted."""
        if shared["world_size"] != world_size():
            return
        files = [os.path.join(path, f"rank{rank():05d}.pt")]
        for name, engine in engines.items():
            files.append(
                engine._get_ckpt_name(os.path.join(path, name), DS_TAG)
                if _has_optimizer(engine)
                else os.path.join(path, f"{name}.safetensors")
            )
        for file in files:
            if not os.path.isfile(file):
                raise BrokenCheckpoint(f"{file} is missing")

    def _prune(self, keep_tag: str) -> None:
        """Remove the checkpoints beyond `keep`, never through a symlink out of the output directory: a
        linked step folder is unlinked, its target kept; a linked checkpoints/ is not pruned at all (what
        it points at may be another run's), said once."""
        if os.path.islink(self.root):
            if not getattr(self, "_said_link", False):
                print(
                    f"[checkpoint] {self.root} is a symlink to {os.path.realpath(self.root)}: old checkpoints "
                    f"there are not pruned",
                    flush=True,
                )
                self._said_link = True
            return
        tags = sorted(t for t in os.listdir(self.root) if t.startswith("step-"))
        for tag in tags[: -self.keep] if self.keep > 0 else []:
            if tag != keep_tag:
                remove_entry(os.path.join(self.root, tag))


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
                from deepspeed.checkpoint import ds_to_universal  # lazy: +0.5 s on every --help (deepspeed)

                # one process (no worker pool forked from a rank); the ZeRO info DeepSpeed only writes for
                # tensor-parallel models is injected
                ds_to_universal.main(
                    argparse.Namespace(
                        input_folder=source,
                        output_folder=tmp,
                        num_extract_workers=1,
                        num_merge_workers=1,
                        keep_temp_folder=False,
                        strict=True,
                        inject_missing_state=True,
                    )
                )
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


def _write_rank_files(tmp: str, engines: dict, rank_state: dict) -> None:
    """This rank's part of a checkpoint: each engine's DeepSpeed checkpoint (or weights) and its own state."""
    for name, engine in engines.items():
        if _has_optimizer(engine):
            folder = os.path.join(tmp, name)
            with keeping_write_failures(engine, f"the DeepSpeed checkpoint of engine {name!r}", folder):
                engine.save_checkpoint(folder, tag=DS_TAG, save_latest=False)
        else:
            with _writing(f"the weights of engine {name!r}", os.path.join(tmp, f"{name}.safetensors")) as path:
                _save_weights(engine, path)
    with _writing(f"rank {rank()}'s loop and RNG state", os.path.join(tmp, f"rank{rank():05d}.pt")) as path:
        torch.save(rank_state, path)


def _make_folder(path: str) -> None:
    with _writing("the checkpoint's folder", path):
        os.makedirs(path)


def _write_failure(write) -> CheckpointWriteError | None:
    """`write()`'s CheckpointWriteError, returned rather than raised (the ranks agree on it first)."""
    try:
        write()
    except CheckpointWriteError as exc:
        return exc
    return None


def _gathered(value) -> list:
    """`value` of every rank, in rank order (a plain list of one without a process group)."""
    if not torch.distributed.is_initialized() or world_size() == 1:
        return [value]
    values = [None] * world_size()
    torch.distributed.all_gather_object(values, value)
    return values


# torch's zip writer reports a failed write (a full disk, a file size limit) as a RuntimeError of its own
_TORCH_WRITE_FAILURE = re.compile(r"inline_container|PytorchStreamWriter|file write failed|unexpected pos")


@contextmanager
def _writing(what: str, path: str):
    """Yields `path`; a write into it that fails raises CheckpointWriteError naming `what`, the path and why."""
    try:
        yield path
    except OSError as exc:
        raise CheckpointWriteError(f"could not write {what} to {path} ({_why_not_written(exc, path)})") from None
    except RuntimeError as exc:
        if not _TORCH_WRITE_FAILURE.search(str(exc)):
            raise
        raise CheckpointWriteError(f"could not write {what} to {path} ({_why_not_written(exc, path)})") from None


def _why_not_written(exc: BaseException, path: str) -> str:
    """The OS's reason, else the likely one: a disk with no space left, or a file size limit."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    limited = f"files are limited to {limit} bytes here (ulimit -f)" if limit != resource.RLIM_INFINITY else ""
    if isinstance(exc, OSError) and exc.errno is not None:
        reason = os.strerror(exc.errno).lower()
        return f"{reason}: {limited}" if exc.errno == errno.EFBIG and limited else reason
    folder = os.path.dirname(path)
    while folder and not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    free = shutil.disk_usage(folder or ".").free
    if free < 1 << 20:
        return f"no space left on the device: {free} bytes free"
    return limited or f"{one_line(exc, 120)}; {free} bytes free on the device"


class _WriteFailureKeepingEngine:
    """An engine's DeepSpeed checkpoint engine whose `save` keeps a failed write instead of raising it, so
    that DeepSpeed's save_checkpoint still reaches its own barrier on every rank; its later files are
    skipped. Every other attribute and method is the wrapped engine's."""

    def __init__(self, inner, what: str):
        self._inner, self._what, self.failure = inner, what, None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def save(self, state_dict, path: str):
        if self.failure is not None:
            return None
        try:
            with _writing(self._what, path):
                return self._inner.save(state_dict, path)
        except CheckpointWriteError as exc:
            self.failure = exc
            return None


@contextmanager
def keeping_write_failures(engine, what: str, folder: str):
    """`engine.save_checkpoint` inside this block raises the first failed file write (CheckpointWriteError
    naming it as `what`) after DeepSpeed's own collectives, not in the middle of them."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = _WriteFailureKeepingEngine(original, what)
    try:
        with _writing(what, folder):  # DeepSpeed's own writes (its recovery scripts)
            yield
        if engine.checkpoint_engine.failure is not None:
            raise engine.checkpoint_engine.failure
    finally:
        engine.checkpoint_engine = original


def _has_optimizer(engine) -> bool:
    """DeepSpeed checkpoints need an optimizer; weights-only engines (the actor's EMA) are saved directly."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload  # lazy: +0.5 s on every --help

    return engine.optimizer is not None and not isinstance(engine.optimizer, DeepSpeedZeRoOffload)


def _save_weights(engine, path: str) -> None:
    state_dict = gather_full_state_dict(engine)
    if is_rank0():  # tied weights share storage, which safetensors refuses: store copies
        save_file({k: v.detach().clone().contiguous() for k, v in state_dict.items()}, path)


@torch.no_grad()
def _load_weights(engine, path: str) -> None:
    import deepspeed  # lazy: +0.5 s on every --help (deepspeed)

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
DATA_LAYOUT_FLAGS = (
    "data_path",
    "data_split",
    "sft_only_data_path",
    "eval_fraction",
    "seed",
    "max_seq_len",
    "dedupe",
    "max_prompt_seq_len",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "per_device_generation_batch_size",
    "generation_batches",
    "per_device_training_batch_size",
)


def data_layout(args, rows: int) -> dict:
    """The run's data layout, saved with each checkpoint and compared on --resume: the flags of
    DATA_LAYOUT_FLAGS it has (as given) and the number of training rows (a changed file changes it).
    The world size is compared separately."""
    return {
        **{f"--{name}": getattr(args, name) for name in DATA_LAYOUT_FLAGS if hasattr(args, name)},
        "training rows": rows,
    }


def run_flags(args) -> dict:
    """The run's parsed flags as JSON values, saved with each checkpoint and compared on --resume."""
    flags = {}
    for name, value in sorted(vars(args).items()):
        try:
            flags[name] = json.loads(json.dumps(value))  # tuples read back as lists, like the saved ones
        except (TypeError, ValueError):
            continue
    return flags


# Which entry point wrote a checkpoint, told by a flag only its parser has (every checkpoint saves the run's flags)
WRITERS = (
    ("train_on_last_turn_only", "step 1 (SFT, step1_sft.main)"),
    ("margin", "step 2's reward-model trainer (step2_reward.main)"),
    ("precompute_ref_log_probs", "step 2's DPO trainer (step2_dpo.main)"),
    ("actor_model_name_or_path", "step 3 (step3_ppo.main)"),
)


def checkpoint_writer(flags: dict | None) -> str | None:
    """The entry point whose run saved `flags` (run_flags of a checkpoint, or of this run); None when not known."""
    return next((writer for name, writer in WRITERS if name in (flags or {})), None)


def check_writer(path: str, saved: dict | None, given: dict | None) -> None:
    """CheckpointError when checkpoint `path` was written by another step than this run's (its saved flags tell):
    another step's engines and state would not load (a reward model's value head, step 1's plain LM), or
    load silently under the wrong meaning."""
    written_by, this = checkpoint_writer(saved), checkpoint_writer(given)
    if written_by and this and written_by != this:
        raise CheckpointError(
            f"checkpoint {path} was written by {written_by}, and this is {this}: --resume continues a run of the "
            f"same step only; give this step its own --output_dir (or --overwrite_output_dir to start over there)"
        )


def check_same_flags(path: str, saved: dict | None, given: dict | None) -> None:
    """CheckpointError naming each flag whose value differs from checkpoint `path`'s (changed_flags)."""
    changed = changed_flags(saved, given)
    if changed:
        raise CheckpointError(
            f"checkpoint {path} was written with other settings, which cannot change mid-run: {'; '.join(changed)}. "
            f"Resume with the checkpoint's values, or start a new run (--overwrite_output_dir)"
        )


def check_resume_early(args) -> None:
    """With --resume, the checkpoint `latest` names checked against this run's flags as the entry point's checks
    end, before any model loads or a rollout worker starts (a minute on CPU): another step's checkpoint, or a flag
    that cannot change mid-run, stops the run now. `Checkpointing.restore` checks again when it loads (and reports
    a broken checkpoint, looking for an intact one before it): a state it cannot read is left to it."""
    if not getattr(args, "resume", False):
        return
    path = TrainingCheckpoints(args.output_dir, getattr(args, "keep_checkpoints", 2)).pointed()
    if path is None:
        return
    try:
        saved = TrainingCheckpoints.read_state(path).get("flags")
    except BrokenCheckpoint:
        return
    given = run_flags(args)
    check_writer(path, saved, given)
    layout = set(DATA_LAYOUT_FLAGS)  # left to the load's data-layout check, whose line says what a change there does
    check_same_flags(path, {k: v for k, v in (saved or {}).items() if k not in layout}, given)


def changed_flags(saved: dict | None, given: dict | None) -> list[str]:
    """`--name saved (this run: given)` for each flag both runs have whose value differs, but for
    utils.train.flags.RESUMABLE_FLAGS and the attributes derived from flags."""
    if not saved or not given:
        return []
    skip = RESUMABLE_FLAGS | DERIVED_ATTRIBUTES
    return [
        f"--{name} {saved[name]!r} (this run: {given[name]!r})"
        for name in sorted(saved)
        if name in given and name not in skip and saved[name] != given[name]
    ]


# Flags naming the files a run trains on (their content is hashed: data_hashes)
DATA_FILE_FLAGS = ("data_path", "sft_only_data_path", "unsupervised_dataset_name")


def data_hashes(args) -> dict[str, str]:
    """{file: sha256} of the local files the run's training data is read from (a hub data set has none)."""
    sources = []
    for name in DATA_FILE_FLAGS:
        value = getattr(args, name, None) or []
        sources += [value] if isinstance(value, str) else list(value)
    return content_hashes(sources)


def changed_data(saved: dict | None, given: dict | None) -> list[str]:
    """The files whose content differs between the checkpoint's `saved` hashes and this run's, each with how."""
    if saved is None or given is None:
        return []
    changed = [f"{path} (edited)" for path in sorted(saved) if path in given and saved[path] != given[path]]
    return (
        changed
        + [f"{path} (gone)" for path in sorted(set(saved) - set(given))]
        + [f"{path} (new)" for path in sorted(set(given) - set(saved))]
    )


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
        self.ignore_data_change = getattr(args, "resume_ignore_data_change", False)
        self.flags = run_flags(args)
        self.data: dict | None = None  # data_hashes, read by `restore` when the run saves or resumes
        self.args = args
        self.last_path: str | None = None

    def restore(self) -> tuple[LoopState, dict, dict]:
        """The latest checkpoint, or, when one of its files is missing or unreadable, the newest intact
        one before it (every rank agrees on which: a file missing on one rank moves all of them)."""
        if self.interval > 0 or self.resume:
            self.data = data_hashes(self.args)
        pointed = self.store.pointed() if self.resume else None
        if pointed is None:
            return LoopState(), {}, {}
        # the one `latest` names, then the intact ones before it (a newer one the pointer never reached
        # is a save that did not finish)
        candidates = [p for p in self.store.complete() if os.path.basename(p) <= os.path.basename(pointed)]
        problems = [] if pointed in candidates else [f"{pointed} (named by {LATEST_FILE}) is missing or incomplete"]
        for path in candidates:  # another step's checkpoint has other engines' files: said before they are missed
            with suppress(BrokenCheckpoint):
                check_writer(path, self.store.read_state(path).get("flags"), self.flags)
        for path in candidates:
            problem = self._missing_file(path)
            if all_reduce_max(float(problem is not None)) == 0.0:  # every rank's files are there: load
                try:
                    shared, rank_state = self._load(path)
                except BrokenCheckpoint as exc:
                    problem = str(exc)
                if all_reduce_max(float(problem is not None)) == 0.0:
                    break
            problems.append(problem or f"{path} is broken on another rank")
            if path != candidates[-1]:
                print_rank0(f"[checkpoint] {path} is broken ({problems[-1]}); trying the previous one")
        else:
            raise CheckpointError(
                f"no intact checkpoint under {self.store.root} ({'; '.join(problems) or 'none complete'}"
                f"): restore the missing files from a copy of the checkpoint, or start a new run "
                f"with --overwrite_output_dir"
            )
        for key in ("layout", "flags", "data"):
            shared.pop(key, None)
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
            exact = (
                ""
                if consumed % world_size() == 0
                else (f"; {consumed % world_size()} batch(es) of rows are read again (not divisible)")
            )
            print_rank0(
                f"[checkpoint] resuming {shared['world_size']} ranks' checkpoint on {world_size()} ranks "
                f"(universal checkpoint): weights, optimizer and scheduler are restored exactly, the rest of "
                f"epoch {loop.epoch} is re-sharded (each rank skips {loop.batches_in_epoch} batches{exact}), so "
                f"the row order differs from an uninterrupted run"
            )
        self.last_path = path
        return loop, shared, rank_state

    def _missing_file(self, path: str) -> str | None:
        """What is missing or unreadable of this rank's files of checkpoint `path` (None: nothing)."""
        try:
            self.store.check_files(self.engines, path, self.store.read_state(path))
        except BrokenCheckpoint as exc:
            return str(exc)
        return None

    def _load(self, path: str) -> tuple[dict, dict]:
        """`store.load` after the data check: a changed data file is refused, naming it, unless
        --resume_ignore_data_change (then the row count may change too, and one line says so)."""
        layout = self.layout
        changed = changed_data(self.store.read_state(path).get("data"), self.data)
        if changed and not self.ignore_data_change:
            raise CheckpointError(
                f"checkpoint {path} was trained on other data: {', '.join(changed)}. The resumed run would read "
                f"other rows than the checkpoint's position assumes: restore the data, add "
                f"--resume_ignore_data_change to go on with the new data, or start a new run (--overwrite_output_dir)"
            )
        if self.ignore_data_change and layout is not None:
            layout = {k: v for k, v in layout.items() if k != "training rows"}
        loaded = self.store.load(self.engines, path, layout, self.universal, self.flags)
        if changed:
            print_rank0(
                f"[checkpoint] --resume_ignore_data_change: resuming {path} on changed training data "
                f"({', '.join(changed)})"
            )
        return loaded

    def metrics_logger(self, args, loop: LoopState):
        """The run's MetricsLogger (metrics.jsonl, TensorBoard, W&B): a resumed run keeps the jsonl rows up
        to the step it resumed from and continues the same W&B run."""
        return logger_from_args(args, keep_until_step=loop.step if self.last_path else None)

    def maybe_save(
        self, loop: LoopState, shared: dict | None = None, rank_state: dict | None = None, force: bool = False
    ) -> None:
        if not force and (self.interval <= 0 or loop.step % self.interval):
            return
        shared = {
            **(shared or {}),
            "loop": asdict(loop),
            **({"layout": self.layout} if self.layout else {}),
            "flags": self.flags,
            **({"data": self.data} if self.data is not None else {}),
        }
        rank_state = {**(rank_state or {}), "rng": rng_state()}
        self.last_path = self.store.save(loop.step, self.engines, shared, rank_state)


class NonFiniteUpdates(ProjectError):
    """--max_bad_steps consecutive updates were skipped as non-finite: the run stops, naming its last checkpoint."""


class BadStepGuard:
    """Skips updates whose loss or reward is NaN/inf on ANY rank (ranks must agree under ZeRO),
    counts them, and stops the run after `max_in_a_row` consecutive ones."""

    def __init__(self, loop: LoopState, max_in_a_row: int, checkpointing: Checkpointing | None = None):
        self.loop, self.max_in_a_row, self.checkpointing = loop, max_in_a_row, checkpointing

    def all_finite(self, *values: torch.Tensor) -> bool:
        bad = any(not torch.isfinite(torch.as_tensor(v)).all() for v in values)
        if all_reduce_max(float(bad)) == 0.0:
            self.loop.bad_in_a_row = 0
            return True
        self.loop.bad_steps += 1
        self.loop.bad_in_a_row += 1
        if self.loop.bad_in_a_row >= self.max_in_a_row:
            where = self.checkpointing.last_path if self.checkpointing else None
            raise NonFiniteUpdates(
                f"{self.loop.bad_in_a_row} consecutive updates had a non-finite loss or reward "
                f"(--max_bad_steps {self.max_in_a_row}); stopping. Last checkpoint: "
                f"{where or 'none'}"
            )
        return False
