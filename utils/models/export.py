"""Exporting trained engines: plain `from_pretrained` directories (safetensors, LoRA merged).

A naive `save_pretrained` of a ZeRO-3 model writes EMPTY tensors without any error (shared/notes),
so the full weights are first consolidated on rank 0, loaded into a fresh unpartitioned copy of
the model, LoRA merged there, and only that copy is saved. Every step's final output goes through
here (policies: `export_hf_model`; reward models and critics: utils/models/reward_model.py), apart from
the resumable training checkpoints of utils/train/checkpoint.py, which keep DeepSpeed's own format.
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

from utils.models.forward import eval_mode
from utils.models.loading import hf_zero3_disabled, is_4bit, is_4bit_layer
from utils.runtime.distributed import all_reduce_sum, barrier, is_rank0


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
    with eval_mode(engine):
        expected = forward(engine, batch).float()
    diff = 0.0
    if is_rank0():
        with hf_zero3_disabled():
            reloaded = reload().eval()
        actual = forward(reloaded, batch).float()
        diff = (actual - expected.to(actual.device)).abs().max().item()
    return all_reduce_sum([diff])[0]
