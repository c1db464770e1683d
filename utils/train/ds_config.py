"""DeepSpeed configuration dictionaries for training and frozen (inference-only) engines."""

from __future__ import annotations

DTYPES = ("fp32", "bf16", "fp16")
# The gradient bucket each trained engine allocates whole and keeps (ZeRO >= 1), in elements: DeepSpeed's default
# (5e8) is 1.9 GiB in fp32, of which a 135M model's backward touches 0.54 GB per engine; 5e7 (200 MB fp32) saved
# 1.0-1.1 GB peak RSS per SmolLM2 step-3 rank at 0.98x the time, 1e7 (40 MB) a further 0.15 GiB per trained engine
# (bench/memory_step3.py): a few more reduce-scatters per backward (14 instead of 3 for 135M parameters), each a
# fraction of a millisecond beside seconds of backward on CPU. A parameter larger than the bucket is reduced from
# its own gradient.
REDUCE_BUCKET_ELEMENTS = 10_000_000


def _zero_section(stage: int, offload_params: bool, offload_optimizer: bool) -> dict:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    section = {
        "stage": stage,
        "offload_param": {"device": "cpu" if offload_params and stage == 3 else "none"},
        "offload_optimizer": {"device": "cpu" if offload_optimizer and stage > 0 else "none"},
    }
    if stage > 0:
        section["reduce_bucket_size"] = REDUCE_BUCKET_ELEMENTS
    if stage == 3:
        section.update(
            {
                # Small models: keep parameters below this size unpartitioned (fewer gathers).
                "stage3_param_persistence_threshold": 1e4,
                "stage3_max_live_parameters": 3e7,
                "stage3_prefetch_bucket_size": 3e7,
                "stage3_gather_16bit_weights_on_model_save": False,
                "memory_efficient_linear": False,
            }
        )
    return section


def _precision_sections(dtype: str) -> dict:
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {DTYPES}, got {dtype!r}")
    return {
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16", "loss_scale_window": 100, "initial_scale_power": 16},
    }


def train_ds_config(
    zero_stage: int,
    world_size: int,
    micro_batch_size: int,
    gradient_accumulation_steps: int = 1,
    dtype: str = "fp32",
    offload: bool = False,
    gradient_clipping: float = 1.0,
) -> dict:
    """Config of an engine that trains: ZeRO stage, precision, clipping, accumulation, optional CPU offload."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "train_batch_size": micro_batch_size * gradient_accumulation_steps * world_size,
        "gradient_clipping": gradient_clipping,
        "zero_optimization": _zero_section(zero_stage, offload, offload),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **_precision_sections(dtype),
    }


def eval_ds_config(
    zero_stage: int, world_size: int, micro_batch_size: int = 1, dtype: str = "fp32", offload: bool = False
) -> dict:
    """Config of a frozen engine (reference, reward model): no optimizer; ZeRO-3 partitions it, else stage 0.

    `offload` puts its parameters in CPU memory, fetched layer by layer for each forward: that is
    ZeRO-3's parameter offload, so an offloaded frozen model is a ZeRO-3 engine whatever the
    trained model's stage (DeepSpeed-Chat kept stage 0 below an actor at ZeRO-3 and so offloaded
    nothing while its flags said it did). Each rank keeps its ZeRO-3 partition in CPU memory.
    """
    stage = 3 if zero_stage == 3 or offload else 0
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "train_batch_size": micro_batch_size * world_size,
        "zero_optimization": _zero_section(stage, offload, False),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        **_precision_sections(dtype),
    }
