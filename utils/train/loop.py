"""What the three steps share to train an engine: optimizer, schedule, DeepSpeed init, the loop of steps 1-2.

The flags are defined in utils/train/flags.py."""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Iterable, Iterator

import torch

from utils.data import (
    DataError,
    RowFormat,
    build_step_rows,
    cached_examples,
    describe_skips,
    distributed_loader,
    source_fingerprint,
    tokenizer_fingerprint,
)
from utils.errors import UsageError
from utils.math.rows import token_budget_groups
from utils.math.throughput import TRAIN_FLOPS_PER_PARAM, mask_tokens, non_embedding_params
from utils.models.loading import apply_lora, load_tokenizer
from utils.runtime.distributed import all_reduce_max, all_reduce_sum, start_process, world_size
from utils.train.ds_config import train_ds_config
from utils.train.flags import PER_MODEL_FLAGS
from utils.train.metrics_logger import print_rank0


def optimizer_param_groups(
    model: torch.nn.Module, weight_decay: float, learning_rate: float, lora_learning_rate: float
) -> list[dict]:
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
    result = [
        {"params": groups["decay"], "weight_decay": weight_decay, "lr": learning_rate},
        {"params": groups["no_decay"], "weight_decay": 0.0, "lr": learning_rate},
        {"params": groups["lora"], "weight_decay": 0.0, "lr": lora_learning_rate},
    ]
    return [g for g in result if g["params"]]


def build_optimizer(param_groups: list[dict], learning_rate: float, offload: bool):
    """torch's fused AdamW (no JIT compile); DeepSpeed's CPU Adam when the optimizer is offloaded.

    Fused: one vectorised pass over each tensor instead of a chain of element-wise ops; on one CPU
    thread a 67M-parameter step (a SmolLM2 ZeRO partition) takes 0.036 s instead of 0.24 s
    (bench/optimizer_step.py). Falls back to the default implementation where fused is unsupported.
    """
    betas = (0.9, 0.95)
    if offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # lazy: +0.5 s on every --help (deepspeed)

        return DeepSpeedCPUAdam(param_groups, lr=learning_rate, betas=betas, adamw_mode=True)
    try:
        return torch.optim.AdamW(param_groups, lr=learning_rate, betas=betas, fused=True)
    except (RuntimeError, ValueError):  # a dtype or device without a fused kernel
        return torch.optim.AdamW(param_groups, lr=learning_rate, betas=betas)


def build_scheduler(optimizer, name: str, num_warmup_steps: int, num_training_steps: int):
    from transformers import get_scheduler  # lazy: +0.8 s on every --help (transformers)

    return get_scheduler(
        name, optimizer=optimizer, num_warmup_steps=num_warmup_steps, num_training_steps=max(num_training_steps, 1)
    )


def initialize_engine(model, ds_config: dict, optimizer=None, lr_scheduler=None):
    import deepspeed  # lazy: +0.5 s on every --help (deepspeed)

    engine, *_ = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=lr_scheduler, config=ds_config, dist_init_required=False
    )
    return engine


def build_frozen_engine(model, ds_config: dict):
    """A DeepSpeed engine without optimizer, in eval mode, every parameter frozen: a reference or
    reward model (ds_config from utils.train.ds_config.eval_ds_config)."""
    engine = initialize_engine(model, ds_config)
    engine.eval()
    for param in engine.module.parameters():
        param.requires_grad_(False)
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


def start_single_model_run(args, step: int, tokenize, settings: dict):
    """Steps 1-2: process group, seeds, the model's tokenizer and this step's tokenised examples;
    returns (tokenizer, train examples, their stats, eval examples, their stats)."""
    start_process(args)
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code, chat_template=args.chat_template)
    return (tokenizer, *step_examples(args, tokenizer, step, lambda rows: tokenize(rows, tokenizer), settings))


def step_examples(args, tokenizer, step: int, tokenize, settings: dict, with_eval: bool = True):
    """(train examples, stats, eval examples, stats) of ``step``: its rows (``build_step_rows``)
    through ``tokenize(rows) -> (examples, stats)``, cached in ``--data_output_path`` when given
    (one rank builds, every rank and later run reads). ``settings``: what else changes the
    result (lengths, options), part of the cache key."""
    fmt = RowFormat.from_args(args)
    sft_only = list(getattr(args, "sft_only_data_path", []) or []) if step == 1 else []
    cache_dir = getattr(args, "data_output_path", None)
    dedupe = getattr(args, "dedupe", False)
    # the key (a hash of the whole vocabulary, a walk of every source folder) only when there is a cache
    key = (
        {
            "step": step,
            "sources": [source_fingerprint(p) for p in args.data_path],
            "sft_only": [source_fingerprint(p) for p in sft_only],
            "data_split": args.data_split,
            "seed": args.seed,
            "eval_fraction": args.eval_fraction,
            "format": asdict(fmt),
            "tokenizer": tokenizer_fingerprint(tokenizer),
            "with_eval": with_eval,
            **settings,
            **({"dedupe": True} if dedupe else {}),
        }
        if cache_dir
        else {}
    )  # absent when off: older caches still match

    def build():
        rows = build_step_rows(
            args.data_path,
            args.data_split,
            step=step,
            seed=args.seed,
            sft_only_data_path=sft_only,
            eval_fraction=args.eval_fraction,
            log=print_rank0,
            fmt=fmt,
            dedupe=dedupe,
        )
        train, train_stats = tokenize(rows.train)
        evals, eval_stats = tokenize(rows.eval) if with_eval else ([], {})
        return train + evals, {"n_train": len(train), "train": train_stats, "eval": eval_stats}

    examples, stats = cached_examples(cache_dir, key, build, print_rank0)
    n = stats["n_train"]
    return examples[:n], stats["train"], examples[n:], stats["eval"]


def check_pair_splits(train_pairs: list, train_stats: dict, eval_pairs: list) -> None:
    """The step-2 trainers (reward model, DPO) stop before any model loads when a split is empty."""
    if not train_pairs:
        raise DataError(
            f"no usable training pairs (skipped_bad_pairs {train_stats['skipped_bad_pairs']}, "
            f"other skips: {describe_skips(train_stats['skipped'])})"
        )
    if not eval_pairs:
        raise UsageError(
            "no held-out pairs to evaluate (the eval split is empty: --eval_fraction 0, or "
            "too few rows); give --eval_fraction > 0 or a source with an eval/test file"
        )


def total_training_steps(updates: int, args) -> int:
    """Optimizer steps (PPO iterations in step 3) of the run: all `updates` of its epochs, cut at --max_steps."""
    return min(updates, args.max_steps) if args.max_steps else updates


@dataclass
class TokenBudget:
    """`--max_tokens_per_micro_batch` in steps 1-2: the examples of each optimizer step (its window of
    `--gradient_accumulation_steps` loader batches) re-cut into micro-batches of at most `limit` tokens
    (utils.math.rows.token_budget_groups, first fit decreasing), as many on every rank as the rank that needs
    the most (each forward and backward of a ZeRO engine is a collective); `tokens(example)`: the tokens an
    example adds to its collated micro-batch (a pair is one example: its two sequences are never split)."""

    limit: int
    tokens: Callable[[Any], int]
    collate: Callable[[list], dict]

    def micro_batches(self, examples: list) -> list[dict]:
        """The window's `examples` as collated micro-batches within the budget."""
        lengths = [self.tokens(example) for example in examples]
        return [self.collate([examples[i] for i in group]) for group in budget_groups(lengths, self.limit)]


def budget_groups(lengths: list[int], limit: int) -> list[list[int]]:
    """utils.math.rows.token_budget_groups of this rank's rows, as many groups on every rank as the rank that needs
    the most (one all-reduce): each micro-batch's forward and backward is a collective under ZeRO. The first fit is
    redone, with the count, only on a rank that needs fewer."""
    groups = token_budget_groups(lengths, limit)
    count = int(all_reduce_max(float(len(groups))))
    return groups if count == len(groups) else token_budget_groups(lengths, limit, count)


def token_budget(args, examples: list, collator, tokens: Callable[[Any], int], what: str) -> TokenBudget | None:
    """Steps 1-2: the run's TokenBudget (None without `--max_tokens_per_micro_batch`). An example longer than the
    budget stops the run here, before any model loads, naming the first one (`what` and its index in the training
    split) and its tokens: a micro-batch never truncates."""
    limit = getattr(args, "max_tokens_per_micro_batch", 0)
    if not limit:
        return None
    lengths = [tokens(example) for example in examples]
    over = [i for i, n in enumerate(lengths) if n > limit]
    if over:
        raise UsageError(
            f"--max_tokens_per_micro_batch {limit}: {what} {over[0]} of the training split has {lengths[over[0]]} "
            f"tokens ({len(over)} of {len(examples)} are over the budget, the longest {max(lengths)}); examples are "
            f"never truncated: raise the budget to at least {max(lengths)} or lower --max_seq_len"
        )
    return TokenBudget(limit, tokens, collator)


def micro_batch_schedule(examples: list, collator, args, budget: TokenBudget | None = None):
    """Steps 1-2: the rank's sampler and loader, and the optimizer steps the run will take. With a `budget`
    (token_budget) the loader yields lists of examples, which train_micro_batches cuts and collates per
    optimizer step.

    DeepSpeed's accumulation counter runs on across epochs, so the run takes exactly
    (micro-batches per epoch x epochs) // accumulation steps updates; none at all is refused here,
    before any model loads, instead of a run that trains nothing and exits 0."""
    collate = list if budget is not None else collator
    sampler, loader = distributed_loader(examples, args.per_device_train_batch_size, collate, args.seed)
    updates = len(loader) * args.num_train_epochs // args.gradient_accumulation_steps
    if updates == 0:
        raise UsageError(
            f"no optimizer step would be taken: {len(loader)} micro-batches per rank per epoch x "
            f"{args.num_train_epochs} epochs is less than --gradient_accumulation_steps "
            f"{args.gradient_accumulation_steps} ({len(examples)} examples, --per_device_train_batch_size "
            f"{args.per_device_train_batch_size})"
        )
    return sampler, loader, total_training_steps(updates, args)


def train_ds_config_from_args(args) -> dict:
    """Steps 1-2: the DeepSpeed config of the one trained engine, from the common flags."""
    return train_ds_config(
        args.zero_stage,
        world_size(),
        args.per_device_train_batch_size,
        args.gradient_accumulation_steps,
        args.dtype,
        args.offload,
        args.gradient_clipping,
    )


def spec_from_args(args, prefix: str = "") -> EngineSpec:
    """The EngineSpec of one trained model: its own flags (utils.train.flags.PER_MODEL_FLAGS, read as
    `--{prefix}name`: step 3's actor_/critic_) and the run's shared ones (`--name`)."""
    return EngineSpec(
        **{f.name: getattr(args, (prefix if f.name in PER_MODEL_FLAGS else "") + f.name) for f in fields(EngineSpec)}
    )


def add_lora(model: torch.nn.Module, spec: EngineSpec) -> torch.nn.Module:
    """LoRA on a causal LM, or on the backbone of a reward model/critic (its v_head stays plain)."""
    if spec.lora_dim <= 0:
        return model
    if hasattr(model, "backbone"):
        model.backbone = apply_lora(
            model.backbone, spec.lora_dim, spec.lora_module_name, spec.lora_alpha, spec.only_optimize_lora
        )
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
    share_master_weights(engine)
    engine.train()  # from_pretrained returns eval mode: without this, dropout would silently stay off
    return engine


def share_master_weights(engine) -> int:
    """A ZeRO-3 engine trained in fp32: its optimizer's fp32 master partition made the SAME memory as the rank's
    parameter partition (what DeepSpeed does itself when the two have one dtype and device, and misses on CPU,
    where it compares the device 'cpu' as a string with torch.device('cpu')); returns the bytes freed (0 when
    there is nothing to share: another stage or dtype, an offloaded optimizer).

    The weights stay bit for bit the same: the optimizer updates the master partition in place and DeepSpeed's
    copy of it into the parameter partition after each step becomes a copy onto itself. A SmolLM2-135M engine on
    2 ranks frees 0.25 GiB per rank.
    """
    optimizer = getattr(engine, "optimizer", None)
    low = getattr(optimizer, "fp16_partitioned_groups_flat", None)
    high = getattr(optimizer, "fp32_partitioned_groups_flat", None)
    if engine.zero_optimization_stage() != 3 or not low or not high or getattr(optimizer, "offload_optimizer", True):
        return 0
    freed = 0
    for lp, hp in zip(low, high):
        if (
            lp is None
            or hp.grad is not None
            or (lp.dtype, lp.device, lp.shape) != (hp.dtype, hp.device, hp.shape)
            or lp.untyped_storage().data_ptr() == hp.untyped_storage().data_ptr()
            or not torch.equal(lp, hp)
        ):
            continue
        freed += hp.untyped_storage().nbytes()
        hp.data = lp.data  # the same tensor object: the optimizer's state and param groups still refer to it
    return freed


APPLIED, OVERFLOW = "applied", "overflow"


def backward_and_step(engine, loss, boundary: bool | None = None) -> str | None:
    """One micro-batch's `engine.backward` and `engine.step`. Returns None inside a gradient
    accumulation, else at the boundary APPLIED, or OVERFLOW when DeepSpeed's fp16 dynamic loss
    scaler skipped the update (the gradients overflowed: it lowers the scale and training goes on;
    a skip to count, not a bad step). The boundary is read BEFORE `step()`: after it, DeepSpeed's
    `is_gradient_accumulation_boundary()` already describes the next micro-batch. `boundary` (True /
    False) sets it for this micro-batch instead of DeepSpeed's counter (a window of our own: the last
    partial one of a PPO iteration, a skipped micro-batch); None keeps the counter's.
    """
    if boundary is not None:
        engine.set_gradient_accumulation_boundary(boundary)
    boundary = engine.is_gradient_accumulation_boundary()
    engine.backward(loss)
    engine.step()
    if not boundary:
        return None
    return APPLIED if engine.was_step_applied() else OVERFLOW


# --------------------------------------------------------------------------- #
# One normalisation over the whole optimizer step
# --------------------------------------------------------------------------- #
def accumulation_windows(items: Iterable, size: int) -> Iterator[list]:
    """`items` in consecutive lists of `size` (the micro-batches of one optimizer step); the last may be
    shorter. Reading a window ahead is what lets its counts be known before its first backward."""
    window = []
    for item in items:
        window.append(item)
        if len(window) == size:
            yield window
            window = []
    if window:
        yield window


def window_totals(counts: list[dict]) -> dict:
    """{unit: count} of each micro-batch of a window (the units its loss terms are averaged over: trained
    tokens, trained sequences, pairs) summed over the window and over every rank, in ONE all-reduce
    (every rank passes the same units in the same window)."""
    units = sorted(counts[0]) if counts else []
    return dict(zip(units, all_reduce_sum([sum(c[u] for c in counts) for u in units])))


def step_normalised_loss(terms: dict, counts: dict, totals: dict, accumulation: int, ranks: int) -> tuple:
    """(the loss one micro-batch hands to `engine.backward`, its part of the step's loss to log).

    `terms` maps a unit to a loss term averaged over this micro-batch's `counts[unit]` units (an SFT
    loss per trained token, a policy loss per trained token or sequence, a DPO loss per pair); the
    step's loss is each term averaged over the `totals[unit]` units of the whole window on every rank.
    DeepSpeed divides every micro-batch's loss by the accumulation steps (`engine.backward`) and
    averages the gradients over the data-parallel ranks, so the term is scaled by
    accumulation x ranks x count / total: the gradient is then that of the step's token (sequence,
    pair) mean, however the units fall on micro-batches and ranks, and a partial window divides by its
    own total. With equal counts everywhere the factor is exactly 1.0 (the loss is unchanged bit for
    bit). The logged part is term x count / total; summed over the window and the ranks it is the
    step's loss.
    """
    loss, logged = 0.0, 0.0
    for unit, term in terms.items():
        total = totals[unit]
        loss = loss + term * (accumulation * ranks * counts[unit] / total if total else 0.0)
        logged += term.item() * (counts[unit] / total if total else 0.0)
    return loss, logged


@contextlib.contextmanager
def counted(run, batch, flops_per_token: float, padding_free: bool = False):
    """Count a micro-batch's tokens (its `attention_mask`: real and all positions; `padding_free`: the real ones
    only are processed) and its seconds in the run's "training" phase (`Run.tokens`, logged as `tokens/*` and
    `perf/training_*`); a batch without a mask is not counted."""
    start = time.time()
    try:
        yield
    finally:
        mask = batch.get("attention_mask") if isinstance(batch, dict) else None
        if mask is not None:
            real, processed = mask_tokens(mask)
            processed = real if padding_free else processed
            run.tokens.add_trained(real, processed)
            run.tokens.add("training", real, flops_per_token, time.time() - start)


def train_micro_batches(
    run, engine, loader, sampler, micro_step, step_metrics, counts=None, budget=None, padding_free: bool = False
) -> None:
    """The optimisation of steps 1-2 and DPO over `run` (a utils.train.run.Run, restored): micro-batches with
    gradient accumulation, resumable from the run's position.

    `micro_step(batch) -> (loss, extra_stats)`; a non-finite loss (on any rank) skips its micro-batch. At
    each accumulation boundary `step_metrics(means) -> (metrics, postfix, line)` turns [loss, extra
    stats...] over the accumulated micro-batches and all ranks into the step's `train/*` figures, the
    progress bar's postfix and the `--print_loss` line; the learning rate is added and `run.after_step`
    logs, evaluates, checkpoints. An update the fp16 loss scaler skipped counts in `loop.overflow_steps`;
    the micro-batches' peak memory is the "training" phase, and so are their tokens and seconds (`counted`).

    `counts(batch) -> {unit: count}` (steps 1 and DPO; step 2 with a token budget) makes the loss ONE mean over
    the optimizer step:
    `micro_step` then returns `{unit: loss term averaged over this micro-batch's units}`, the window of
    `gradient_accumulation_steps` micro-batches is read ahead, its totals are all-reduced once, and each
    term is weighted by step_normalised_loss (the boundary is the window's last micro-batch); the logged
    loss is the step's mean, the extra stats the micro-batches' means. A non-finite last micro-batch
    still closes its window: the first finite one of the window is replayed with weight 0. Without
    `counts`, each micro-batch's loss weighs the same (DeepSpeed's 1 / accumulation steps, the ranks'
    mean) and DeepSpeed's counter sets the boundaries.

    `budget` (a TokenBudget, `--max_tokens_per_micro_batch`; needs `counts`): the loader yields lists of
    examples and each window's examples are re-cut into micro-batches of at most `budget.limit` tokens, as many
    on every rank, collated here; the step's loss is the same one mean over its units, the boundary its last
    micro-batch. `padding_free`: the training forwards process the real tokens only (the `tokens/*` figures)."""
    if budget is not None and counts is None:
        raise ValueError("a token budget needs the micro-batches' counts: the step's loss is one mean over them")
    loop, accumulated, ranks = run.loop, [], world_size()
    flops_per_token = TRAIN_FLOPS_PER_PARAM * non_embedding_params(getattr(engine, "module", None))
    size = engine.gradient_accumulation_steps() if counts else 1
    for window in accumulation_windows(run.steps(loader, sampler), size):
        batches = [batch for (batch,) in window]
        if budget is not None:
            batches = budget.micro_batches([example for examples in batches for example in examples])
        local = [counts(batch) for batch in batches] if counts else []
        totals = window_totals(local) if counts else {}
        replay = None  # a micro-batch of this window already trained on
        for j, batch in enumerate(batches):
            last = j == len(batches) - 1
            with run.memory.phase("training"), counted(run, batch, flops_per_token, padding_free):
                loss, extra = micro_step(batch)
                logged = None
                if counts:
                    loss, logged = step_normalised_loss(loss, local[j], totals, size, ranks)
                if not run.guard.all_finite(loss):
                    print_rank0(f"[{run.name}] skipped a batch with a non-finite loss ({loop.bad_steps} so far)")
                    if not (counts and last and replay is not None):
                        continue
                    terms, _ = micro_step(replay[0])  # the window's update still happens, without this batch
                    loss = 0.0 * step_normalised_loss(terms, replay[1], totals, size, ranks)[0]
                else:
                    replay = replay or (batch, local[j] if counts else None)
                    accumulated.append((loss.item() if logged is None else logged, *extra))
                outcome = backward_and_step(engine, loss, last if counts else None)
            if outcome is None:
                continue
            if outcome == OVERFLOW:
                loop.overflow_steps += 1
            columns = list(zip(*accumulated))
            accumulated = []
            if not columns:
                continue
            local_means = [sum(column) / len(column) for column in columns]
            if counts:
                local_means[0] = sum(columns[0])  # each micro-batch's part of the step's loss
            summed = all_reduce_sum(local_means)
            means = [summed[0] if counts else summed[0] / ranks] + [value / ranks for value in summed[1:]]
            metrics, postfix, line = step_metrics(means)
            run.after_step({**metrics, "train/lr": engine.get_lr()[0]}, postfix, line)
