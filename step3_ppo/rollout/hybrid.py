"""The actor's two modes: generation (fast sampling) and training (ZeRO partitioned).

DeepSpeed's own hybrid engine needs CUDA inference kernels (it raises on CPU, shared/notes), so the
project has its own generation mode. Under ZeRO-3 a plain `generate` re-gathers every layer for
every new token through the engine's module hooks; here the parameters are gathered ONCE for the
whole `generate` call and the hooks are lifted while it runs, then restored, and the parameters
are partitioned again on the way out (gathered memory released). LoRA adapters are merged into the
weights while generating (one matmul per layer instead of three) and the original weights are put
back bit for bit afterwards. Step 3 also scores the rollout on models gathered once (`gathered`):
the no-grad forwards need no per-layer fetch and release either.
"""

from __future__ import annotations

import contextlib

import torch

from utils.models.forward import eval_mode
from utils.models.forward import generate as forward_generate


def _zero3_offload(engine):
    """DeepSpeed's ZeRO-3 parameter manager of an engine (None below stage 3)."""
    if engine.zero_optimization_stage() != 3:
        return None
    optimizer = engine.optimizer
    return getattr(optimizer, "parameter_offload", optimizer)


@contextlib.contextmanager
def _hooks_lifted(offload):
    """DeepSpeed's ZeRO-3 module hooks taken out, then put back exactly (same callables, same order).

    Not `_remove_module_hooks` + `setup_zero_stage3_hooks`: re-registering invalidates DeepSpeed's
    recorded parameter trace, and the next training step runs without prefetching (SmolLM2: 607
    all-gathers instead of 270, about +1 s per step, bench/README.md).
    """
    handles = [*offload.forward_hooks, *offload.backward_hooks, offload.fwd_pre_hook]
    dicts = {}
    for handle in handles:
        for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
            hooks = ref()
            if hooks is not None:
                dicts[id(hooks)] = hooks
    saved = {key: list(hooks.items()) for key, hooks in dicts.items()}
    for handle in handles:
        handle.remove()
    try:
        yield
    finally:
        for key, hooks in dicts.items():
            hooks.clear()
            hooks.update(saved[key])


def partitioned_params(module_or_params) -> list:
    """The ZeRO-3 parameters of a module (or among a list of parameters, each once) whose data lives split
    across ranks now (not gathered, not persistent)."""
    from deepspeed.runtime.zero.partition_parameters import (
        ZeroParamStatus,  # lazy: +0.5 s on step 3's --help (deepspeed)
    )

    params = module_or_params.parameters() if hasattr(module_or_params, "parameters") else module_or_params
    unique = {id(p): p for p in params}.values()
    return [p for p in unique if getattr(p, "ds_status", None) == ZeroParamStatus.NOT_AVAILABLE]


@contextlib.contextmanager
def gathered(engine):
    """The whole model on every rank for no-grad work, in ONE gather; a no-op below ZeRO-3.

    Under ZeRO-3 each partitioned parameter is gathered once, DeepSpeed's module hooks are lifted
    (no per-layer fetch and release) and the parameters are partitioned again on exit. Parameters
    DeepSpeed keeps whole (below the persistence threshold) are left as they are. Costs one full
    copy of the model per rank while inside.
    """
    offload = _zero3_offload(engine)
    if offload is None:
        yield
        return
    import deepspeed  # lazy: +0.5 s on step 3's --help (deepspeed)

    with (
        deepspeed.zero.GatheredParameters(partitioned_params(engine.module)),
        _hooks_lifted(offload),
        _plain_parameter_dicts(engine.module),
    ):
        yield


@contextlib.contextmanager
def _plain_parameter_dicts(module):
    """Each module's ZeROOrderedDict of parameters replaced by a plain dict holding the same tensors.

    The ZeRO dict's `__getitem__` only matters when a parameter may be partitioned; inside `gathered`
    none is, and the plain dict is the dict torch's modules use. The originals go back on exit; a
    parameter added or replaced meanwhile would be lost with the plain dict, so that raises.
    """
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict  # lazy: +0.5 s on step 3's --help (deepspeed)

    swapped = [(m, m._parameters) for m in module.modules() if isinstance(m._parameters, ZeROOrderedDict)]
    for m, params in swapped:
        m._parameters = dict(params.items())
    try:
        yield
    finally:
        changed = [
            m
            for m, params in swapped
            if m._parameters.keys() != params.keys() or any(m._parameters[k] is not v for k, v in params.items())
        ]
        for m, params in swapped:
            m._parameters = params
        if changed:
            raise RuntimeError(
                f"parameters of {type(changed[0]).__name__} were replaced while the model was "
                f"gathered; ZeRO-3 would not see them"
            )


@contextlib.contextmanager
def _lora_merged(module):
    """peft LoRA merged into the base weights and the wrappers replaced by their base layers; the
    exact original weights and the wrappers restored on exit."""
    from peft import PeftModel  # lazy: +3 s on step 3's --help (peft)
    from peft.tuners.lora import LoraLayer  # lazy: +3 s on step 3's --help (peft)

    if not isinstance(module, PeftModel):
        yield
        return
    wrapped = [
        (parent, name, child)
        for parent in module.modules()
        for name, child in parent.named_children()
        if isinstance(child, LoraLayer)
    ]
    layers = [child for _, _, child in wrapped]
    plain_lora = not any(layer.lora_variant for layer in layers)  # DoRA & co. keep state unmerge resets
    saved = [m.get_base_layer().weight.detach().clone() for m in layers]
    module.merge_adapter()
    for parent, name, child in wrapped:
        setattr(parent, name, child.get_base_layer())
    try:
        yield
    finally:
        for parent, name, child in wrapped:
            setattr(parent, name, child)
        if not plain_lora:
            module.unmerge_adapter()
        with torch.no_grad():  # the saved weights back (plain LoRA: instead of unmerge, a second B @ A per layer)
            for layer, weight in zip(layers, saved):
                layer.get_base_layer().weight.copy_(weight)
                layer.merged_adapters.clear()


@contextlib.contextmanager
def generation_mode(engine, hybrid: bool, merge_lora: bool = True):
    """Eval mode for sampling; with `hybrid`, parameters gathered once and LoRA merged."""
    with eval_mode(engine), contextlib.ExitStack() as stack:
        if hybrid:
            stack.enter_context(gathered(engine))
        if hybrid and merge_lora:
            stack.enter_context(_lora_merged(engine.module))
        yield


def needs_synced_gpus(engine, hybrid: bool) -> bool:
    """Plain ZeRO-3 generate is collective per token: ranks must keep stepping until all finish."""
    return (
        not hybrid
        and _zero3_offload(engine) is not None
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


@torch.no_grad()
def generate(
    engine,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    hybrid: bool,
    merge_lora: bool = True,
    logprob_temperature: float | None = None,
    **generation_kwargs,
):
    """Sequences [B, P + T] for left-padded prompts [B, P], in the actor's generation mode; with
    `logprob_temperature`, also the generator's log-probs [B, T] of its tokens (utils.models.forward.generate).

    `generation_kwargs` come from utils.models.forward.generation_kwargs (KV cache on).
    """
    with generation_mode(engine, hybrid, merge_lora):
        return forward_generate(
            engine.module,
            input_ids,
            attention_mask,
            logprob_temperature=logprob_temperature,
            synced_gpus=needs_synced_gpus(engine, hybrid),
            **generation_kwargs,
        )
