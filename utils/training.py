"""What the three steps share to train an engine: arguments, optimizer, schedule, DeepSpeed init."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch


def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument("--data_path", nargs="+", required=True,
                   help="JSON/JSONL files, folders of them, or datasets names; several are blended")
    g.add_argument("--data_split", default="2,4,4", help="shares of each source for steps 1,2,3")
    g.add_argument("--sft_only_data_path", nargs="*", default=[], help="sources used whole by step 1 only")
    g.add_argument("--eval_fraction", type=float, default=0.1,
                   help="held-out share of a source that has no eval/test split of its own")


def add_model_args(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    g = parser.add_argument_group("model")
    g.add_argument(f"--{prefix}model_name_or_path", required=True, help="local from_pretrained directory or hub name")
    g.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped with the model")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimisation and DeepSpeed")
    g.add_argument("--per_device_train_batch_size", type=int, default=8)
    g.add_argument("--per_device_eval_batch_size", type=int, default=8)
    g.add_argument("--max_seq_len", type=int, default=512)
    g.add_argument("--learning_rate", type=float, default=1e-5)
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--num_train_epochs", type=int, default=1)
    g.add_argument("--max_steps", type=int, default=0, help="stop after this many optimizer steps (0: no limit)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--lr_scheduler_type", default="cosine",
                   choices=["linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"])
    g.add_argument("--num_warmup_steps", type=int, default=0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--gradient_checkpointing", action="store_true")
    g.add_argument("--dropout", type=float, default=None, help="override every dropout of the model")
    g.add_argument("--zero_stage", type=int, default=0, choices=[0, 1, 2, 3])
    g.add_argument("--offload", action="store_true", help="ZeRO offload of optimizer (and ZeRO-3 params) to CPU")
    g.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    g.add_argument("--gradient_clipping", type=float, default=1.0)
    g.add_argument("--dist_timeout", type=int, default=600, help="seconds a rank waits on a dead peer")
    g.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    g = parser.add_argument_group("LoRA")
    g.add_argument("--lora_dim", type=int, default=0, help="LoRA rank; 0 disables LoRA")
    g.add_argument("--lora_alpha", type=float, default=None, help="LoRA alpha (default: lora_dim, scaling 1)")
    g.add_argument("--lora_module_name", default="", help="substring of the layer names that get LoRA")
    g.add_argument("--only_optimize_lora", action="store_true", help="freeze the base weights")
    g.add_argument("--lora_learning_rate", type=float, default=5e-4)
    add_checkpoint_args(parser)
    g = parser.add_argument_group("output")
    g.add_argument("--output_dir", required=True)
    g.add_argument("--enable_tensorboard", action="store_true")
    g.add_argument("--tensorboard_path", default=None)


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoints and robustness")
    g.add_argument("--save_interval", type=int, default=0,
                   help="write a resumable checkpoint every N steps under OUTPUT_DIR/checkpoints (0: never)")
    g.add_argument("--keep_checkpoints", type=int, default=2, help="how many checkpoints to keep")
    g.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in OUTPUT_DIR when there is one (else start fresh)")
    g.add_argument("--max_bad_steps", type=int, default=5,
                   help="stop after this many consecutive updates with a non-finite loss or reward")


def validate_engine_args(args) -> None:
    """Reject impossible combinations before any model is loaded."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                 "max_seq_len", "num_train_epochs"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name} must be >= 1, got {getattr(args, name)}")
    if args.only_optimize_lora and args.lora_dim <= 0:
        raise SystemExit("error: --only_optimize_lora needs --lora_dim > 0")
    if args.offload and args.zero_stage == 0:
        raise SystemExit("error: --offload needs --zero_stage 1, 2 or 3")


def optimizer_param_groups(model: torch.nn.Module, weight_decay: float, learning_rate: float,
                           lora_learning_rate: float) -> list[dict]:
    """No decay on biases and norms; LoRA weights get their own learning rate (as DeepSpeed-Chat)."""
    groups = {"decay": [], "no_decay": [], "lora": []}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if "lora_" in name:
            groups["lora"].append(param)
        elif name.endswith("bias") or "norm" in name.lower() or "ln_" in name:
            groups["no_decay"].append(param)
        else:
            groups["decay"].append(param)
    result = [{"params": groups["decay"], "weight_decay": weight_decay, "lr": learning_rate},
              {"params": groups["no_decay"], "weight_decay": 0.0, "lr": learning_rate},
              {"params": groups["lora"], "weight_decay": 0.0, "lr": lora_learning_rate}]
    return [g for g in result if g["params"]]


def build_optimizer(param_groups: list[dict], learning_rate: float, offload: bool):
    """torch's fused AdamW (no JIT compile); DeepSpeed's CPU Adam when the optimizer is offloaded.

    Fused: one vectorised pass over each tensor instead of a chain of element-wise ops; on one CPU
    thread a 67M-parameter step (a SmolLM2 ZeRO partition) takes 0.036 s instead of 0.24 s
    (bench/optimizer_step.py). Falls back to the default implementation where fused is unsupported.
    """
    betas = (0.9, 0.95)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(param_groups, lr=learning_rate, betas=betas, adamw_mode=True)
    try:
        return torch.optim.AdamW(param_groups, lr=learning_rate, betas=betas, fused=True)
    except (RuntimeError, ValueError):  # a dtype or device without a fused kernel
        return torch.optim.AdamW(param_groups, lr=learning_rate, betas=betas)


def build_scheduler(optimizer, name: str, num_warmup_steps: int, num_training_steps: int):
    from transformers import get_scheduler

    return get_scheduler(name, optimizer=optimizer, num_warmup_steps=num_warmup_steps,
                         num_training_steps=max(num_training_steps, 1))


def initialize_engine(model, ds_config: dict, optimizer=None, lr_scheduler=None):
    import deepspeed

    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler,
                                      config=ds_config, dist_init_required=False)
    return engine


def enable_gradient_checkpointing(model) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@dataclass
class EngineSpec:
    """How one trained model becomes a DeepSpeed engine (step 1, step 2, step 3's actor and critic)."""
    learning_rate: float
    weight_decay: float = 0.0
    lora_dim: int = 0
    lora_module_name: str = ""
    lora_alpha: float | None = None
    only_optimize_lora: bool = False
    lora_learning_rate: float = 5e-4
    gradient_checkpointing: bool = False
    offload: bool = False
    lr_scheduler_type: str = "cosine"
    num_warmup_steps: int = 0


def total_training_steps(steps_per_epoch: int, args) -> int:
    """Optimizer steps (PPO iterations in step 3) of the run: the epochs, cut at --max_steps."""
    total = steps_per_epoch * args.num_train_epochs
    return min(total, args.max_steps) if args.max_steps else total


def micro_batch_schedule(examples: list, collator, args):
    """Steps 1-2: the rank's sampler and loader, and the optimizer steps the run will take."""
    import math

    from utils.data import distributed_loader

    sampler, loader = distributed_loader(examples, args.per_device_train_batch_size, collator, args.seed)
    return sampler, loader, total_training_steps(math.ceil(len(loader) / args.gradient_accumulation_steps), args)


def train_ds_config_from_args(args) -> dict:
    """Steps 1-2: the DeepSpeed config of the one trained engine, from the common flags."""
    from utils.distributed import world_size
    from utils.ds_config import train_ds_config

    return train_ds_config(args.zero_stage, world_size(), args.per_device_train_batch_size,
                           args.gradient_accumulation_steps, args.dtype, args.offload, args.gradient_clipping)


def spec_from_args(args, prefix: str = "") -> EngineSpec:
    """Read `--{prefix}name` flags, falling back to the unprefixed `--name` (step 3's actor_/critic_)."""
    values = {}
    for name in EngineSpec.__dataclass_fields__:
        if hasattr(args, prefix + name):
            values[name] = getattr(args, prefix + name)
        elif hasattr(args, name):
            values[name] = getattr(args, name)
    return EngineSpec(**values)


def add_lora(model: torch.nn.Module, spec: EngineSpec) -> torch.nn.Module:
    """LoRA on a causal LM, or on the backbone of a reward model/critic (its v_head stays plain)."""
    from utils.model import apply_lora

    if spec.lora_dim <= 0:
        return model
    if hasattr(model, "backbone"):
        model.backbone = apply_lora(model.backbone, spec.lora_dim, spec.lora_module_name, spec.lora_alpha,
                                    spec.only_optimize_lora)
        return model
    return apply_lora(model, spec.lora_dim, spec.lora_module_name, spec.lora_alpha, spec.only_optimize_lora)


def build_trained_engine(model: torch.nn.Module, ds_config: dict, spec: EngineSpec, total_steps: int):
    """LoRA, gradient checkpointing, AdamW param groups, LR schedule and deepspeed.initialize."""
    model = add_lora(model, spec)
    if spec.gradient_checkpointing:
        enable_gradient_checkpointing(getattr(model, "backbone", model))
    groups = optimizer_param_groups(model, spec.weight_decay, spec.learning_rate, spec.lora_learning_rate)
    optimizer = build_optimizer(groups, spec.learning_rate, spec.offload)
    scheduler = build_scheduler(optimizer, spec.lr_scheduler_type, spec.num_warmup_steps, total_steps)
    engine = initialize_engine(model, ds_config, optimizer, scheduler)
    engine.train()  # from_pretrained returns eval mode: without this, dropout would silently stay off
    return engine


def run_micro_batches(engine, loader, sampler, loop, total_steps: int, num_epochs: int, guard, micro_step,
                      on_step, name: str) -> None:
    """The training loop of steps 1 and 2, resumable from `loop`'s position.

    `micro_step(batch) -> (loss, extra_stats)`; a non-finite loss (on any rank) skips its update.
    At each gradient-accumulation boundary `loop.step` advances and `on_step([mean loss, mean
    extra stats...])` gets the means over the accumulated micro-batches and all ranks.
    """
    from utils.distributed import all_reduce_sum, world_size
    from utils.logging import print_rank0

    accumulated = []
    while loop.step < total_steps and loop.epoch < num_epochs:
        sampler.set_epoch(loop.epoch)
        for index, batch in enumerate(loader):
            if index < loop.batches_in_epoch:
                continue  # consumed before the checkpoint this run resumed from
            loop.batches_in_epoch = index + 1
            loss, extra = micro_step(batch)
            if not guard.all_finite(loss):
                print_rank0(f"[{name}] skipped a batch with a non-finite loss ({loop.bad_steps} so far)")
                continue
            engine.backward(loss)
            engine.step()
            accumulated.append((loss.item(), *extra))
            if not engine.is_gradient_accumulation_boundary():
                continue
            loop.step += 1
            local_means = [sum(column) / len(accumulated) for column in zip(*accumulated)]
            accumulated = []
            on_step([value / world_size() for value in all_reduce_sum(local_means)])
            if loop.step >= total_steps:
                break
        else:
            loop.epoch, loop.batches_in_epoch = loop.epoch + 1, 0
