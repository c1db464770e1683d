"""Exporting trained engines: plain `from_pretrained` directories (safetensors, LoRA merged).

A naive `save_pretrained` of a ZeRO-3 model writes EMPTY tensors without any error (shared/notes),
so the full weights are first consolidated on rank 0, loaded into a fresh unpartitioned copy of
the model, LoRA merged there, and only that copy is saved. Every step's final output goes through
here (policies: `export_hf_model`; reward models and critics: utils/models/reward_model.py), apart from
the resumable training checkpoints of utils/train/checkpoint.py, which keep DeepSpeed's own format.

The directory is written whole or not at all (`write_model_dir`): into a temporary folder on the target's
filesystem, moved into place only once every file is written. A write that fails (a full disk, a file size
limit, a quota) raises ExportWriteError on every rank, one line naming the directory, what failed and why,
with the temporary folder removed and an older export in the directory as it was.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
import re
import resource
import shutil
from typing import Callable

import torch
from safetensors import SafetensorError
from torch import nn

from utils.errors import ProjectError, one_line
from utils.models.forward import eval_mode
from utils.models.loading import hf_zero3_disabled, is_4bit, is_4bit_layer
from utils.runtime.distributed import all_reduce_sum, from_rank0, is_rank0

EXPORT_TMP, EXPORT_OLD = ".export-tmp", ".export-old"  # inside an existing target: the new files, the replaced ones
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' SafetensorError names the OS error it wraps


class ExportWriteError(ProjectError):
    """The final model directory could not be written (a full disk, a file size limit, a quota): str() names the
    directory, what failed and why; the directory holds what it held before (a run's `finish` adds where a
    --resume continues from)."""


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
    """An unpartitioned fp32 copy of `hf_model`'s architecture (weights to be loaded), never quantised: a 4-bit
    model's quantization_config is left out, so the export is a plain full-precision directory."""
    config = copy.deepcopy(hf_model.config)
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attr):
            delattr(config, attr)
    with hf_zero3_disabled():
        return type(hf_model)._from_config(config, dtype=torch.float32)


def dequantized_state_dict(module: nn.Module, state_dict: dict, target: nn.Module) -> dict:
    """`state_dict` of a model with 4-bit base weights (--load_in_4bit) as plain fp32 tensors for `target`, its
    unquantised twin: each Linear4bit's packed NF4 weight dequantised (the weights the engine computed with) and its
    quantisation constants (`weight.absmax`, `weight.quant_map`, ...) dropped; other entries as they are. A layer
    that is a Conv1D in `target` (GPT-2's) was quantised as a Linear, [out, in]: its weight is transposed back."""
    import bitsandbytes.functional as bnb_functional  # lazy: +1 s, and only 4-bit models need it
    from transformers.pytorch_utils import Conv1D  # lazy: +0.8 s on every --help (transformers)

    result = dict(state_dict)
    for name, layer in module.named_modules():
        if not is_4bit_layer(layer):
            continue
        key = f"{name}.weight"
        for extra in [k for k in result if k.startswith(key + ".")]:
            del result[extra]
        weight = bnb_functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        if isinstance(target.get_submodule(name), Conv1D):
            weight = weight.t()
        result[key] = weight.detach().to("cpu", torch.float32).contiguous()
    return result


def plain_copy(module: nn.Module, state_dict: dict) -> nn.Module:
    """A plain HF model holding `state_dict`, with LoRA adapters merged when `module` is a PeftModel. A model
    with 4-bit base weights gives full-precision weights: dequantised NF4 plus the merged adapters in fp32."""
    from peft import PeftModel, get_peft_model  # lazy: +3 s on every --help (peft)

    peft = isinstance(module, PeftModel)
    fresh = _fresh_hf_model(module.get_base_model() if peft else module)
    if peft:
        fresh = get_peft_model(fresh, copy.deepcopy(module.peft_config["default"]))
    if is_4bit(module):
        state_dict = dequantized_state_dict(module, state_dict, fresh)
    fresh.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=True)
    return fresh.merge_and_unload() if peft else fresh


def export_hf_model(engine, tokenizer, out_dir: str) -> None:
    """Write engine.module as a from_pretrained directory (config, safetensors, tokenizer) from rank 0, whole or
    not at all (`write_model_dir`). Call on ALL ranks (the gather is collective under ZeRO-3); a failed write
    raises ExportWriteError on every rank."""
    state_dict = gather_full_state_dict(engine)
    failure = None
    if is_rank0():
        model = plain_copy(engine.module, state_dict)
        model.config.use_cache = True
        writes = [("the model's weights and config", model.save_pretrained)]
        if tokenizer is not None:
            writes.append(("the tokenizer", tokenizer.save_pretrained))
        failure = write_failure(lambda: write_model_dir(out_dir, writes))
    agree_on_export(failure)


def write_failure(write: Callable[[], None]) -> str | None:
    """`write()`'s ExportWriteError as its message, returned rather than raised (`agree_on_export`)."""
    try:
        write()
    except ExportWriteError as exc:
        return str(exc)
    return None


def agree_on_export(failure: str | None) -> None:
    """Collective, in place of a barrier after rank 0 wrote: every rank raises rank 0's ExportWriteError."""
    failure = from_rank0(failure)
    if failure is not None:
        raise ExportWriteError(failure)


def write_model_dir(out_dir: str, writes: list[tuple[str, Callable[[str], None]]]) -> None:
    """Each `write(folder)` of `writes` ((what it writes, write) pairs) into a temporary folder on `out_dir`'s
    filesystem, then moved into place: a new `out_dir` is the folder renamed; an existing one (a run's output
    directory, with its checkpoints and metrics) gets the folder's files, each older file of the same name moved
    aside first and put back if a move fails. A write or move that fails (OSError, safetensors' SafetensorError
    wrapping one) raises ExportWriteError naming `out_dir`, what failed and why, once the temporary folder is
    removed; `out_dir` then holds what it held before. Rank 0 only (no collective)."""
    existing = os.path.isdir(out_dir)
    parent = os.path.dirname(os.path.abspath(out_dir))
    tmp = (
        os.path.join(out_dir, EXPORT_TMP)
        if existing
        else os.path.join(parent, f".{os.path.basename(out_dir)}{EXPORT_TMP}")
    )
    what = "the temporary folder"
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # a killed export's leftover
        os.makedirs(tmp)
        for what, write in writes:
            write(tmp)
        what = "the finished export (moving it into place)"
        if existing:
            _move_into(tmp, out_dir)
        else:
            os.rename(tmp, out_dir)
    except (OSError, SafetensorError) as exc:
        why = _why_not_written(exc)
        if why is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        before = "as it was before the export" if existing else "not created"
        raise ExportWriteError(
            f"could not write {what} to {out_dir} ({why}); the partial export was removed, {out_dir} is {before}"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _move_into(tmp: str, out_dir: str) -> None:
    """Every entry of `tmp` into `out_dir` (os.replace: renames on one filesystem); an entry of the same name
    already there is moved to `out_dir`/.export-old first. A move that fails (or a Ctrl-C between two) puts
    everything back as it was."""
    old = os.path.join(out_dir, EXPORT_OLD)
    shutil.rmtree(old, ignore_errors=True)
    os.makedirs(old)
    moved_aside, moved_in = [], []
    try:
        for name in sorted(os.listdir(tmp)):
            target = os.path.join(out_dir, name)
            if os.path.lexists(target):
                os.replace(target, os.path.join(old, name))
                moved_aside.append(name)
            os.replace(os.path.join(tmp, name), target)
            moved_in.append(name)
    except BaseException:  # a failed move, or a Ctrl-C between two moves
        with contextlib.suppress(OSError):
            for name in reversed(moved_in):
                os.replace(os.path.join(out_dir, name), os.path.join(tmp, name))
            for name in reversed(moved_aside):
                os.replace(os.path.join(old, name), os.path.join(out_dir, name))
            os.rmdir(old)  # only once every older file is back: else they stay in .export-old
        raise
    shutil.rmtree(old, ignore_errors=True)


def _why_not_written(exc: BaseException) -> str | None:
    """The OS's reason for a failed write (a file size limit named with its `ulimit -f`), None when `exc` is not
    a failed write (a SafetensorError about the tensors themselves: a bug, kept as a traceback)."""
    if isinstance(exc, SafetensorError):
        match = _OS_ERROR.search(str(exc))
        if match is None:
            return None
        code = int(match.group(1))
    elif exc.errno is not None:
        code = exc.errno
    else:
        return one_line(exc, 160)
    reason = os.strerror(code).lower()
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if code == errno.EFBIG and limit != resource.RLIM_INFINITY:
        reason += f": files are limited to {limit} bytes here (ulimit -f)"
    filename = getattr(exc, "filename", None)
    return f"{reason}: {filename}" if filename else reason


@torch.no_grad()
def reload_max_abs_diff(engine, reload, forward, batch: dict) -> float:
    """Max |forward(reloaded) - forward(engine)| on `batch`: does the exported directory hold the engine's
    model (LoRA merged)? `reload()` builds it on rank 0 only, unpartitioned. Call on ALL ranks."""
    with eval_mode(engine):
        expected = forward(engine, batch).float()
    diff = 0.0
    if is_rank0():
        with hf_zero3_disabled():
            reloaded = reload().eval()
        actual = forward(reloaded, batch).float()
        diff = (actual - expected.to(actual.device)).abs().max().item()
    return all_reduce_sum([diff])[0]
