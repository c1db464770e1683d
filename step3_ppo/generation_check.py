"""Checks and times the actor's generation modes on the current world (run it through the launcher).

    deepspeed --num_gpus 2 --module step3_ppo.generation_check --model_name_or_path DIR --out result.json

Builds the actor as step 3 does (ZeRO stage, optional LoRA), then generates greedily from the same
left-padded prompts (1) with plain `generate` (ZeRO-3: `synced_gpus`), (2) in the hybrid generation
mode with LoRA merged and (3) without merging. Rank 0 writes whether the tokens agree, whether the
parameters are partitioned again afterwards, whether the weights came back bit for bit, whether
DeepSpeed's module hooks and recorded parameter trace survived the hybrid mode unchanged, how far a
forward in `hybrid.gathered` (how step 3 scores the rollout) is from the hooked ZeRO-3 forward
(how it trains), whether the generation mode runs plain layers (no LoRA wrappers, no ZeRO parameter
dicts) and restores the same module objects afterwards, plus tokens per second per rank (median
over --repeats after a warm-up).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from step3_ppo.rollout.hybrid import gathered, generate, generation_mode
from utils.cli import FlagParser, Number
from utils.models.forward import GenerationSettings, causal_lm_logits, eval_mode, generation_kwargs
from utils.models.loading import load_causal_lm, load_tokenizer
from utils.runtime.distributed import init_distributed, is_rank0, set_seed, world_size
from utils.train.ds_config import train_ds_config
from utils.train.loop import EngineSpec, build_trained_engine


def parse_args(argv=None):
    p = FlagParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path", required=True, help="causal LM directory or hub name to generate with")
    p.add_argument(
        "--zero_stage",
        type=Number(int, low=0, high=3),
        default=3,
        help="DeepSpeed ZeRO stage of the engine (default %(default)s)",
    )
    p.add_argument(
        "--lora_dim",
        type=Number(int, low=0),
        default=0,
        help="LoRA rank (0: no LoRA); the adapters get non-zero weights so merging them matters",
    )
    p.add_argument("--batch_size", type=Number(int, low=1), default=4, help="prompts per rank")
    p.add_argument(
        "--prompt_len", type=Number(int, low=1), default=16, help="longest prompt in tokens (others shorter)"
    )
    p.add_argument(
        "--new_tokens",
        type=Number(int, low=1),
        default=16,
        help="new tokens generated per prompt (exactly, no EOS stop)",
    )
    p.add_argument(
        "--repeats",
        type=Number(int, low=1),
        default=1,
        help="timed generate calls per mode after one warm-up (the median is reported)",
    )
    p.add_argument(
        "--modes",
        default="hybrid,hybrid_unmerged,plain",
        help="hybrid first: plain ZeRO-3 generate invalidates DeepSpeed's trace itself",
    )
    p.add_argument("--dtype", default="fp32", help="engine precision: fp32, bf16 or fp16 (default %(default)s)")
    p.add_argument("--out", default=None, help="JSON result file (rank 0)")
    p.add_argument("--local_rank", type=Number(int, low=-1), default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def make_prompts(tokenizer, batch_size: int, prompt_len: int, seed: int) -> dict:
    """Left-padded random prompts of different lengths (same on every rank for a seed)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = min(len(tokenizer), 5000)
    rows = []
    for i in range(batch_size):
        length = max(1, prompt_len - (i * prompt_len) // (2 * batch_size))
        rows.append(torch.randint(100, vocab, (length,), generator=generator))
    input_ids = torch.full((batch_size, prompt_len), tokenizer.pad_token_id)
    attention_mask = torch.zeros((batch_size, prompt_len), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, prompt_len - row.numel() :] = row
        attention_mask[i, prompt_len - row.numel() :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def partitioned(engine) -> bool:
    """True when every ZeRO-3 parameter that is not persistent holds no local data (released)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus  # lazy: +0.5 s on --help (deepspeed)

    params = [p for p in engine.module.parameters() if hasattr(p, "ds_status") and not getattr(p, "ds_persist", False)]
    return bool(params) and all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.data.numel() == 0 for p in params)


def full_weights(engine) -> list[torch.Tensor]:
    import deepspeed  # lazy: +0.5 s on --help (deepspeed)

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return [p.detach().clone() for p in params]


def zero3_hook_state(engine):
    """The module hooks of every submodule and DeepSpeed's trace mode: what hybrid mode must leave as it was."""
    hooks = [(list(m._forward_pre_hooks), list(m._forward_hooks)) for m in engine.module.modules()]
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    trace = "complete" if coordinator.is_complete_trace() else "invalid" if coordinator.is_invalid_trace() else "record"
    return hooks, trace


def module_tree_state(engine) -> dict:
    """What the actor runs per token: peft LoRA wrappers, ZeRO-3 parameter dicts, merged adapters."""
    from peft.tuners.lora import LoraLayer  # lazy: +3 s on --help (peft)

    modules = list(engine.module.modules())
    return {
        "lora_wrappers": sum(isinstance(m, LoraLayer) for m in modules),
        "merged_wrappers": sum(isinstance(m, LoraLayer) and m.merged for m in modules),
        "zero_parameter_dicts": sum(type(m._parameters).__name__ == "ZeROOrderedDict" for m in modules),
        "identity": [id(m) for m in modules] + [id(m._parameters) for m in modules],
    }


def generation_mode_tree(engine) -> dict:
    """The module tree before, inside and after the hybrid generation mode (LoRA merged): inside it
    must run plain layers (no wrappers, no ZeRO dicts); afterwards it must be the same objects again."""
    before = module_tree_state(engine)
    with generation_mode(engine, hybrid=True, merge_lora=True):
        inside = module_tree_state(engine)
    after = module_tree_state(engine)
    return {
        "before": {k: v for k, v in before.items() if k != "identity"},
        "inside": {k: v for k, v in inside.items() if k != "identity"},
        "after": {k: v for k, v in after.items() if k != "identity"},
        "restored": after == before,
    }


def gathered_forward_max_abs_diff(engine, sequences: torch.Tensor, mask: torch.Tensor) -> float:
    """Max |logit difference| between a forward inside `hybrid.gathered` and the hooked forward."""
    with torch.no_grad(), eval_mode(engine):
        hooked = causal_lm_logits(engine, sequences, mask)
        with gathered(engine):
            whole = causal_lm_logits(engine, sequences, mask)
    return float((hooked - whole).abs().max())


def main(argv=None):
    args = parse_args(argv)
    init_distributed()
    set_seed(0)
    tokenizer = load_tokenizer(args.model_name_or_path, padding_side="left")
    config = train_ds_config(args.zero_stage, world_size(), args.batch_size, dtype=args.dtype)
    model = load_causal_lm(args.model_name_or_path, tokenizer, config, dropout=0.0)
    spec = EngineSpec(learning_rate=0.0, lora_dim=args.lora_dim, lora_learning_rate=0.0)
    engine = build_trained_engine(model, config, spec, total_steps=1)
    prompts = make_prompts(tokenizer, args.batch_size, args.prompt_len, seed=1)
    if args.zero_stage == 3:  # training steps (lr 0) first, so DeepSpeed has recorded its parameter trace
        for _ in range(2):
            engine.backward(causal_lm_logits(engine, prompts["input_ids"], prompts["attention_mask"]).mean() * 0.0)
            engine.step()
    if args.lora_dim:  # non-zero LoRA weights, so merging really changes the weights (set after the steps:
        # the optimizer's fp32 copy would undo them)
        import deepspeed  # lazy: +0.5 s on --help (deepspeed)

        with torch.no_grad():
            for name, p in engine.module.named_parameters():
                if "lora_B" in name:
                    with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=args.zero_stage == 3):
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    greedy = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    kwargs = generation_kwargs(greedy, tokenizer.eos_token_id, tokenizer.pad_token_id)
    settings = {"plain": (False, True), "hybrid": (True, True), "hybrid_unmerged": (True, False)}
    weights_before = full_weights(engine)
    result = {
        "world_size": world_size(),
        "zero_stage": args.zero_stage,
        "lora_dim": args.lora_dim,
        "batch_size": args.batch_size,
        "new_tokens": args.new_tokens,
        "modes": {},
    }
    tokens = {}
    for mode in args.modes.split(","):
        hybrid, merge = settings[mode]
        hook_state = zero3_hook_state(engine) if args.zero_stage == 3 else None
        times = []
        for _ in range(args.repeats + 1):  # the first call is a warm-up
            start = time.perf_counter()
            out = generate(
                engine, prompts["input_ids"], prompts["attention_mask"], hybrid=hybrid, merge_lora=merge, **kwargs
            )
            times.append(time.perf_counter() - start)
        tokens[mode] = out[:, args.prompt_len :]
        seconds = statistics.median(times[1:])
        result["modes"][mode] = {
            "seconds": seconds,
            "tokens_per_s_per_rank": args.batch_size * args.new_tokens / seconds,
            "partitioned_after": partitioned(engine) if args.zero_stage == 3 else None,
        }
        if hook_state is not None:
            hooks_after, trace_after = zero3_hook_state(engine)
            result["modes"][mode].update(
                hooks_unchanged=hooks_after == hook_state[0], trace_before=hook_state[1], trace_after=trace_after
            )
    result["generation_mode_tree"] = generation_mode_tree(engine)
    if args.zero_stage == 3:
        result["gathered_forward_max_abs_diff"] = gathered_forward_max_abs_diff(
            engine, out, torch.cat([prompts["attention_mask"], torch.ones_like(out[:, args.prompt_len :])], dim=1)
        )
    weights_after = full_weights(engine)
    first = next(iter(tokens.values()))
    result["tokens_equal"] = all(torch.equal(first, t) for t in tokens.values())
    result["weights_unchanged"] = all(torch.equal(a, b) for a, b in zip(weights_before, weights_after))
    result["tokens"] = {m: t.tolist() for m, t in tokens.items()}
    if is_rank0():
        print(json.dumps({k: v for k, v in result.items() if k != "tokens"}, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)


if __name__ == "__main__":
    main()
