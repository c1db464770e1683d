"""Benchmark of the actor's generation modes against the unsharded limit (CPU, DeepSpeed ZeRO-3).

    python bench/generation.py                 # SmolLM2-135M-shaped model, batch 8/rank, prompt 64, 64 new tokens
    python bench/generation.py --tiny          # tiny random llama (seconds)
    python bench/generation.py --save bench/results/2026-11-30-generation.txt
    python bench/generation.py --sweep 64,128,256       # limit vs hybrid only, per answer length

In ONE run (all greedy, same left-padded prompts as step3_ppo/generation_check.py):
  (1)  limit:  plain HF `generate` of the unsharded model in ONE process, OMP_NUM_THREADS=1
               (same threads per process as a rank; no DeepSpeed engine, no LoRA);
  (1b) limit side by side: the same unsharded plain model held by EACH of the 2 ranks, timed
               interleaved with (2)/(3) in the same world (same contention as the ranks);
  (2)  plain:  `generate` of the ZeRO-3 actor on 2 ranks (synced_gpus; LoRA unmerged);
  (3)  hybrid: the project's generation mode (step3_ppo.rollout.hybrid: params gathered once, hooks
               lifted, LoRA merged), and (3u) the same without the LoRA merge.
The actor is built exactly as generation_check does (train_ds_config, load_causal_lm,
build_trained_engine with --lora_dim, non-zero lora_B). Modes (1b), (2), (3), (3u) run round-robin:
one warm-up round, then --repeats timed rounds, each call between barriers; a call's time is the
slowest rank's; figures are medians. Hybrid calls are also split into enter (gather + hooks +
merge) / decode (HF generate) / exit (unmerge + restore + re-partition). With --profile (default:
when 3/1 < 0.9) one extra call of the limit and of the hybrid mode runs under cProfile on rank 0.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import site
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import (  # noqa: E402
    add_model_args,
    add_run_args,
    bench_env,
    bench_model,
    deepspeed_cmd,
    end_report,
    launch,
    machine_line,
    main_or_worker,
    malloc_line,
    start_report,
    title,
)

MODE_LABELS = {
    "limit_1proc": "(1)  limit: unsharded plain generate, 1 process",
    "unsharded": "(1b) limit side by side: unsharded copy on each rank",
    "plain": "(2)  plain generate, ZeRO-3 (synced_gpus)",
    "hybrid": "(3)  hybrid mode, LoRA merged",
    "hybrid_unmerged": "(3u) hybrid mode, LoRA not merged",
    "hybrid_steps": "(3s) = (3) with 1 new token, steps timed one by one",
    "hybrid_proposed": "(3p) = (3s) PROPOSED: no save/unmerge/restore",
}
SHORT_MODES = ("hybrid_steps", "hybrid_proposed")  # 1 new token: the fixed cost of a hybrid call


def add_call_args(p, plain_repeats: int | None) -> None:
    """The flags of the calls, the same for the command line and its launched workers."""
    p.add_argument("--batch_size", type=int, default=8, help="prompts per rank (rows)")
    p.add_argument("--prompt_len", type=int, default=64, help="prompt length, left-padded (tokens)")
    p.add_argument("--new_tokens", type=int, default=64, help="generated tokens per prompt, min = max (tokens)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds of the modes after the warm-up (calls)")
    p.add_argument("--overhead_repeats", type=int, default=7, help="timed calls of (3s) and (3p), short calls (calls)")
    p.add_argument(
        "--plain_repeats",
        type=int,
        default=plain_repeats,
        help="timed calls of (2), the slow plain ZeRO-3 mode, which gets no warm-up call of its own "
        f"(calls; default: {plain_repeats or '--repeats'})",
    )
    p.add_argument("--lora_dim", type=int, default=8, help="LoRA rank of the ZeRO-3 actor (0: no LoRA)")


# ----------------------------------------------------------------------------------------------- worker
def worker_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help="run as one launched process of the benchmark")
    p.add_argument("--model_name_or_path", required=True, help="model directory")
    p.add_argument("--zero_stage", type=int, default=3, help="ZeRO stage of the actor engine (0-3)")
    add_call_args(p, plain_repeats=None)
    p.add_argument(
        "--modes",
        default="unsharded,plain,hybrid,hybrid_unmerged",
        help="modes to time round-robin, comma-separated (keys of MODE_LABELS)",
    )
    p.add_argument("--profile", default="", help="modes to run once more under cProfile on rank 0, comma-separated")
    p.add_argument("--count_calls", action="store_true", help="count the Python calls of one decode per mode")
    p.add_argument("--out", required=True, help="rank 0's result file (JSON path)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher; unused")
    return p.parse_args(argv)


def _sync():
    import torch  # imported here to keep --help fast

    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _max_over_ranks(x: float) -> float:
    from utils.runtime.distributed import all_reduce_max  # torch: imported here to keep --help fast

    return all_reduce_max(x)


def hybrid_steps(engine, generate_fn, proposed: bool):
    """The steps of step3_ppo.rollout.hybrid.generation_mode(hybrid=True, merge_lora=True) one by one, timed.

    proposed=False replays the project's steps exactly (for the breakdown). proposed=True is the
    change suggested in bench/README.md: under ZeRO-3 a gathered, NON-persistent parameter is a
    temporary buffer that GatheredParameters (modifier_rank=None) frees on exit without writing it
    back (has_been_updated=False), so merging LoRA into it needs no saved copy, no unmerge and no
    copy back: only peft's `merged_adapters` bookkeeping is reset. Persistent parameters (kept whole
    on every rank) and ZeRO < 3 keep the save/unmerge/restore path.
    """
    import deepspeed  # imported here to keep --help fast
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from step3_ppo.rollout.hybrid import _hooks_lifted, _zero3_offload, partitioned_params

    marks = [("start", time.perf_counter(), time.process_time())]

    def mark(name):
        marks.append((name, time.perf_counter(), time.process_time()))

    module = engine.module
    was_training = module.training
    engine.eval()
    offload = _zero3_offload(engine)
    gathered = deepspeed.zero.GatheredParameters(partitioned_params(module), enabled=offload is not None)
    gathered.__enter__()
    mark("gather (allgather of all params)")
    lifted = _hooks_lifted(offload) if offload is not None else None
    if lifted is not None:
        lifted.__enter__()
    mark("lift ZeRO-3 hooks")
    layers = [m for m in module.modules() if isinstance(m, LoraLayer)] if isinstance(module, PeftModel) else []
    if proposed and offload is not None:
        keep = [m for m in layers if getattr(m.get_base_layer().weight, "ds_persist", False)]
    else:
        keep = layers
    saved = [m.get_base_layer().weight.detach().clone() for m in keep]
    mark("save base weights (clone)")
    if layers:
        module.merge_adapter()
    mark("merge LoRA")
    try:
        out = generate_fn()
    finally:
        mark("generate (decode)")
        if layers:
            if proposed and offload is not None:
                kept = set(map(id, keep))
                for m in layers:
                    if id(m) not in kept:
                        m.merged_adapters.clear()  # the merged buffer is dropped by GatheredParameters
                for m in keep:
                    m.unmerge()
            else:
                module.unmerge_adapter()
        mark("unmerge LoRA")
        with torch.no_grad():
            for m, w in zip(keep, saved):
                m.get_base_layer().weight.copy_(w)
        mark("copy saved weights back")
        if lifted is not None:
            lifted.__exit__(None, None, None)
        mark("put ZeRO-3 hooks back")
        gathered.__exit__(None, None, None)
        mark("release (re-partition)")
        engine.train(was_training)
        mark("train mode")
    return out, [(name, t - marks[i][1], c - marks[i][2]) for i, (name, t, c) in enumerate(marks[1:])]


def worker(argv):
    """One process of the benchmark (a rank, or the lone process of the limit (1)): its modes timed
    round-robin, checked and optionally profiled; rank 0 writes the result to --out."""
    from utils.runtime.distributed import is_rank0  # torch: imported here to keep --help fast

    w = GenerationWorker(worker_args(argv))
    times, cpu, tokens = w.time_rounds()
    result = w.summary(times, cpu)
    result.update(w.checks(tokens))
    if w.args.count_calls:  # Python calls of the decode alone (cProfile counts them; immune to other load)
        result["decode_python_calls"] = w.decode_calls()
    if w.args.profile:
        result["profiles"] = w.profiles()
    if is_rank0():
        with open(w.args.out, "w") as f:
            json.dump(result, f)


def build_models(args, modes: list[str], tokenizer):
    """The unsharded plain model (mode unsharded) and the actor engine of the other modes, built as
    generation_check builds it (LoRA with non-zero lora_B, lr 0); None where no mode needs one."""
    import torch  # torch, deepspeed and the project: imported here to keep --help fast

    from utils.models.loading import load_causal_lm
    from utils.runtime.distributed import world_size
    from utils.train.ds_config import train_ds_config

    plain_model = None
    if "unsharded" in modes:  # built first, with transformers' ZeRO-3 flag off (load_causal_lm unsets it)
        plain_model = load_causal_lm(args.model_name_or_path, tokenizer, None, dropout=0.0).eval()

    engine = None
    if any(m != "unsharded" for m in modes):
        from utils.train.loop import EngineSpec, build_trained_engine

        config = train_ds_config(args.zero_stage, world_size(), args.batch_size, dtype="fp32")
        model = load_causal_lm(args.model_name_or_path, tokenizer, config, dropout=0.0)
        spec = EngineSpec(learning_rate=0.0, lora_dim=args.lora_dim, lora_learning_rate=0.0)
        engine = build_trained_engine(model, config, spec, total_steps=1)
        if args.lora_dim:  # non-zero LoRA weights (as generation_check), so merging really changes the weights
            import deepspeed

            with torch.no_grad():
                for name, p in engine.module.named_parameters():
                    if "lora_B" in name:
                        with deepspeed.zero.GatheredParameters([p], modifier_rank=0, enabled=args.zero_stage == 3):
                            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return plain_model, engine


class GenerationWorker:
    """One process's models, prompts and greedy settings; `call(mode)` runs one generation call of a mode,
    `split` collects the phases of the hybrid calls."""

    def __init__(self, args):
        from step3_ppo.generation_check import full_weights, make_prompts  # imported here to keep --help fast
        from utils.models.forward import GenerationSettings, generation_kwargs
        from utils.models.loading import load_tokenizer
        from utils.runtime.distributed import init_distributed, set_seed

        self.args, self.modes, self.split = args, [m for m in args.modes.split(",") if m], {}
        init_distributed()
        set_seed(0)
        tokenizer = load_tokenizer(args.model_name_or_path, padding_side="left")
        self.prompts = make_prompts(tokenizer, args.batch_size, args.prompt_len, seed=1)
        greedy = GenerationSettings(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        self.kwargs = generation_kwargs(greedy, tokenizer.eos_token_id, tokenizer.pad_token_id)
        self.plain_model, self.engine = build_models(args, self.modes, tokenizer)
        self.weights_before = full_weights(self.engine) if self.engine is not None else None

    def call(self, mode):
        import torch  # imported here to keep --help fast

        from step3_ppo.rollout.hybrid import generate, generation_mode
        from utils.models.forward import generate as forward_generate

        engine, kwargs = self.engine, self.kwargs
        ids, mask = self.prompts["input_ids"], self.prompts["attention_mask"]
        with torch.no_grad():
            if mode == "unsharded":
                return forward_generate(self.plain_model, ids, mask, synced_gpus=False, **kwargs)
            if mode == "plain":
                return generate(engine, ids, mask, hybrid=False, **kwargs)
            if mode in SHORT_MODES:  # the per-call overhead: 4 prompt tokens, 1 new token
                short = {**kwargs, "max_new_tokens": 1, "min_new_tokens": 1}
                out, steps = hybrid_steps(
                    engine,
                    lambda: forward_generate(engine.module, ids[:, -4:], mask[:, -4:], synced_gpus=False, **short),
                    proposed=mode == "hybrid_proposed",
                )
                self.split.setdefault(mode, []).append(steps)
                return out
            # hybrid: the body of step3_ppo.rollout.hybrid.generate, with the three phases timed
            merge = mode == "hybrid"
            t0 = time.perf_counter()
            ctx = generation_mode(engine, hybrid=True, merge_lora=merge)
            ctx.__enter__()
            t1 = time.perf_counter()
            try:
                out = forward_generate(engine.module, ids, mask, synced_gpus=False, **kwargs)
            finally:
                t2 = time.perf_counter()
                ctx.__exit__(None, None, None)
                t3 = time.perf_counter()
            self.split.setdefault(mode, []).append((t1 - t0, t2 - t1, t3 - t2))
            return out

    def time_rounds(self):
        """A warm-up round, then the timed rounds, the modes round-robin in each, every call between barriers:
        per mode the slowest rank's seconds and rank 0's CPU seconds of each timed call, and its last tokens."""
        from utils.runtime.distributed import is_rank0  # imported here to keep --help fast

        args, modes = self.args, self.modes
        times = {m: [] for m in modes}
        cpu = {m: [] for m in modes}
        tokens = {}
        plain_repeats = args.repeats if args.plain_repeats is None else args.plain_repeats
        rounds = max(args.repeats, args.overhead_repeats if "hybrid_steps" in modes else 0)
        for round_ in range(rounds + 1):  # round 0 is the warm-up
            for mode in modes:
                if mode == "plain" and not 1 <= round_ <= plain_repeats:
                    continue  # the slow reference: no warm-up of its own (the other modes warmed the engine)
                if round_ > (args.overhead_repeats if mode in SHORT_MODES else args.repeats):
                    continue
                _sync()
                start, cpu_start = time.perf_counter(), time.process_time()
                out = self.call(mode)
                cpu_s = time.process_time() - cpu_start
                elapsed = _max_over_ranks(time.perf_counter() - start)
                if is_rank0():
                    print(
                        f"[bench.generation] round {round_} {mode}: {elapsed:.2f} s (cpu {cpu_s:.2f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
                if round_:
                    times[mode].append(elapsed)
                    cpu[mode].append(cpu_s)
                tokens[mode] = out[:, out.shape[1] - (1 if mode in SHORT_MODES else args.new_tokens) :]
        return times, cpu, tokens

    def summary(self, times: dict, cpu: dict) -> dict:
        """The run's settings and, per timed mode, its medians (and the hybrid modes' phases)."""
        import torch  # imported here to keep --help fast

        from utils.runtime.distributed import world_size

        args, split = self.args, self.split
        result = {
            "world_size": world_size(),
            "zero_stage": args.zero_stage,
            "lora_dim": args.lora_dim,
            "batch_size": args.batch_size,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "modes": {},
        }
        for mode in [m for m in self.modes if times[m]]:
            seconds = statistics.median(times[mode])
            new = 1 if mode in SHORT_MODES else args.new_tokens
            entry = {
                "seconds": seconds,
                "all_seconds": times[mode],
                "cpu_seconds_rank0": statistics.median(cpu[mode]),
                "tokens_per_s_per_rank": args.batch_size * new / seconds,
            }
            if mode in SHORT_MODES and mode in split:
                timed = split[mode][1:] or split[mode]
                names = [step[0] for step in timed[0]]
                entry["steps_s"] = {
                    name: statistics.median(call[i][1] for call in timed) for i, name in enumerate(names)
                }
                entry["steps_cpu_s"] = {
                    name: statistics.median(call[i][2] for call in timed) for i, name in enumerate(names)
                }
            elif mode in split:
                timed = split[mode][1:]  # drop the warm-up
                entry["enter_exit_decode_s"] = {
                    "enter": statistics.median(t[0] for t in timed),
                    "decode": statistics.median(t[1] for t in timed),
                    "exit": statistics.median(t[2] for t in timed),
                }
            result["modes"][mode] = entry
        return result

    def checks(self, tokens: dict) -> dict:
        """Weights unchanged by all calls, the same tokens across the ZeRO modes, parameters partitioned again;
        and the tokens of each mode."""
        import torch  # imported here to keep --help fast

        from step3_ppo.generation_check import full_weights, partitioned

        result, modes, engine = {}, self.modes, self.engine
        if engine is not None and self.weights_before is not None:
            result["weights_unchanged"] = all(
                torch.equal(a, b) for a, b in zip(self.weights_before, full_weights(engine))
            )
        zero_modes = [m for m in modes if m in ("plain", "hybrid", "hybrid_unmerged")]
        if zero_modes:
            first = tokens[zero_modes[0]]
            result["tokens_equal_zero3_modes"] = all(torch.equal(first, tokens[m]) for m in zero_modes)
        short_modes = [m for m in modes if m in SHORT_MODES]
        if len(short_modes) == 2:
            result["tokens_equal_overhead_modes"] = torch.equal(tokens[short_modes[0]], tokens[short_modes[1]])
            if self.args.zero_stage == 3:
                result["partitioned_after"] = partitioned(engine)
        result["tokens"] = {m: t.tolist() for m, t in tokens.items()}
        return result

    def decode_calls(self) -> dict:
        """Python calls of one decode (`generate` alone, cProfile) of the unsharded and the hybrid mode."""
        import torch  # imported here to keep --help fast

        from step3_ppo.rollout.hybrid import generation_mode
        from utils.models.forward import generate as forward_generate

        calls = {}
        for mode in [m for m in ("unsharded", "hybrid") if m in self.modes]:
            _sync()
            ids, mask = self.prompts["input_ids"], self.prompts["attention_mask"]
            with (
                torch.no_grad(),
                generation_mode(self.engine, hybrid=True) if mode == "hybrid" else contextlib.nullcontext(),
            ):
                model = self.engine.module if mode == "hybrid" else self.plain_model
                prof = cProfile.Profile()
                prof.enable()
                forward_generate(model, ids, mask, synced_gpus=False, **self.kwargs)
                prof.disable()
            calls[mode] = pstats.Stats(prof).total_calls
        return calls

    def profiles(self) -> dict:
        """One more call of each --profile mode under cProfile (rank 0's): top functions by own and total time."""
        profiles = {}
        for mode in [m for m in self.args.profile.split(",") if m in self.modes]:
            _sync()
            prof = cProfile.Profile()
            prof.enable()
            self.call(mode)
            prof.disable()
            stream = io.StringIO()
            stats = pstats.Stats(prof, stream=stream)
            stream.write(f"--- cProfile, rank 0, one call of mode {mode}: top functions by own time\n")
            stats.sort_stats("tottime").print_stats(14)
            stream.write("--- same call, by cumulative time\n")
            stats.sort_stats("cumulative").print_stats(22)
            if os.environ.get("BENCH_PROFILE_CALLERS"):  # e.g. "disable": who calls the matching functions
                stats.print_callers(os.environ["BENCH_PROFILE_CALLERS"])
            profiles[mode] = _trim_profile(stream.getvalue())
        return profiles


def _trim_profile(text: str) -> str:
    """pstats output without the site-packages prefixes (shorter lines)."""
    for prefix in sorted(set(site.getsitepackages() + [REPO + "/"]), key=len, reverse=True):
        text = text.replace(prefix.rstrip("/") + "/", "")
    return "\n".join(
        line for line in text.splitlines() if line.strip() and "Ordered by" not in line and "List reduced" not in line
    )


# ----------------------------------------------------------------------------------------- orchestrator
def header_lines(args, model_dir: str) -> list[str]:
    import deepspeed  # imported here to keep --help fast (their versions head the report)
    import peft
    import torch
    import transformers

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    return [
        title("generation.py"),
        machine_line(),
        malloc_line(),
        "threads: OMP_NUM_THREADS=1 in every process (1 process for (1), 2 ranks for the rest)",
        f"versions: python {platform.python_version()}, torch {torch.__version__}, deepspeed {deepspeed.__version__}, "
        f"transformers {transformers.__version__}, peft {peft.__version__}",
        f"model: {model_dir} ({cfg.get('model_type')}, hidden {cfg.get('hidden_size')}, layers "
        f"{cfg.get('num_hidden_layers')}, heads {cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')}, "
        f"vocab {cfg.get('vocab_size')}, fp32)",
        f"batch {args.batch_size} prompts per rank, prompt {args.prompt_len} tokens (left-padded, lengths "
        f"{args.prompt_len // 2 + 1}..{args.prompt_len}), "
        f"{'/'.join(map(str, args.sweep)) if args.sweep else args.new_tokens} new tokens (min = max), greedy; "
        f"ZeRO-3 actor with LoRA r={args.lora_dim} (lora_B non-zero), lr 0",
        (
            f"timing: 1 warm-up round + {args.repeats} rounds, modes (1b) and (3) interleaved in each round; "
            if args.sweep
            else f"timing: 1 warm-up round + {args.repeats} rounds, modes (1b)-(3u) interleaved in each round "
            f"((2) only in the first {args.plain_repeats}, no warm-up of its own); "
        )
        + "a call = slowest rank; median; 'cpu s' = CPU seconds of rank 0's process in the call (median): "
        "wall >> cpu means other processes took the cores",
    ]


def decode_calls_line(calls: dict) -> str:
    return (
        f"Python calls of one decode (cProfile, rank 0, generate alone): hybrid {calls['hybrid']}, unsharded "
        f"{calls['unsharded']}: {calls['hybrid'] / calls['unsharded']:.3f}x"
    )


def worker_pair(
    args, env: dict, logs: str, prefix: str, flags: list[str], one: list[str], two: list[str]
) -> tuple[dict, dict]:
    """The two launches of a measurement, each with `flags`: the limit (1) in one process (`one`: its own flags),
    then the 2-rank ZeRO-3 run of the other modes (`two`); their results. Logs: LOGS/PREFIX*.log."""
    with tempfile.TemporaryDirectory(prefix="bench_gen_") as tmp:
        one_out, two_out = os.path.join(tmp, "one.json"), os.path.join(tmp, "two.json")
        launch(
            [
                sys.executable,
                "-m",
                "bench.generation",
                "--worker",
                "--zero_stage",
                "0",
                "--lora_dim",
                "0",
                "--modes",
                "unsharded",
                "--out",
                one_out,
                *flags,
                *one,
            ],
            {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
            args.timeout,
            os.path.join(logs, f"{prefix}limit_1proc.log"),
        )
        launch(
            deepspeed_cmd("bench.generation", args.master_port)
            + ["--worker", "--zero_stage", "3", "--lora_dim", str(args.lora_dim), "--out", two_out, *flags, *two],
            env,
            args.timeout,
            os.path.join(logs, f"{prefix}zero3_2ranks.log"),
        )
        with open(one_out) as f:
            r1 = json.load(f)
        with open(two_out) as f:
            r2 = json.load(f)
    return r1, r2


def sweep(args, model_dir: str, env: dict, logs: str) -> list[str]:
    """Hybrid mode against the limit for several answer lengths (the fixed gather cost amortises).

    Per length: the 1-process limit, then the 2-rank run with the side-by-side limit and the hybrid
    mode interleaved (no plain ZeRO-3, no breakdown); decode Python calls counted in the latter."""
    rows = []
    for new_tokens in args.sweep:
        flags = [
            "--model_name_or_path",
            model_dir,
            "--batch_size",
            str(args.batch_size),
            "--prompt_len",
            str(args.prompt_len),
            "--new_tokens",
            str(new_tokens),
            "--repeats",
            str(args.repeats),
        ]
        r1, r2 = worker_pair(
            args, env, logs, f"sweep{new_tokens}_", flags, [], ["--modes", "unsharded,hybrid", "--count_calls"]
        )
        limit, side, hybrid = r1["modes"]["unsharded"], r2["modes"]["unsharded"], r2["modes"]["hybrid"]
        split = hybrid["enter_exit_decode_s"]
        calls = r2["decode_python_calls"]
        rows.append(
            f"{new_tokens:>10d} {limit['tokens_per_s_per_rank']:9.1f} {side['tokens_per_s_per_rank']:9.1f} "
            f"{hybrid['tokens_per_s_per_rank']:9.1f} "
            f"{hybrid['tokens_per_s_per_rank'] / limit['tokens_per_s_per_rank']:6.2f} "
            f"{hybrid['tokens_per_s_per_rank'] / side['tokens_per_s_per_rank']:7.2f} "
            f"{split['enter'] + split['exit']:11.2f} {split['decode']:8.2f} {side['seconds']:9.2f} "
            f"{calls['hybrid'] / calls['unsharded']:10.3f}"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    head = (
        f"{'new tokens':>10s} {'(1) tok/s':>9s} {'(1b)':>9s} {'(3) tok/s':>9s} {'3/1':>6s} {'3/1b':>7s} "
        f"{'enter+exit':>11s} {'decode':>8s} {'(1b) call':>9s} {'calls 3/1b':>10s}"
    )
    return [
        "",
        f"sweep over answer lengths (modes (1), (1b), (3) only; {args.repeats} timed calls after a warm-up; "
        f"tok/s per rank; seconds per call, rank 0; calls = Python calls of one decode, hybrid / unsharded)",
        head,
        *rows,
        "(goal: 3/1 >= 0.9 at 128 new tokens)",
    ]


def measure(args, model_dir: str, env: dict, logs: str) -> tuple[dict, dict]:
    """The full run: the limit (1) in one process, then (1b)-(3u) (and (3s), (3p)) on 2 ranks."""
    flags = [
        "--model_name_or_path",
        model_dir,
        "--batch_size",
        str(args.batch_size),
        "--prompt_len",
        str(args.prompt_len),
        "--new_tokens",
        str(args.new_tokens),
        "--repeats",
        str(args.repeats),
        "--plain_repeats",
        str(args.plain_repeats),
        "--overhead_repeats",
        str(args.overhead_repeats),
    ]
    want_profile = args.profile != "off"  # one extra call after the timed ones, in the same runs
    modes = "unsharded,plain,hybrid,hybrid_unmerged" + ("" if args.no_breakdown else ",hybrid_steps,hybrid_proposed")
    return worker_pair(
        args,
        env,
        logs,
        "",
        flags,
        ["--profile", "unsharded"] if want_profile else [],
        ["--modes", modes] + (["--profile", "hybrid"] if want_profile else []) + ["--count_calls"],
    )


def modes_report(args, r1: dict, r2: dict) -> list[str]:
    """The full run's report: the modes' table, the hybrid call's overhead, the ratios and checks, the profiles
    (with --profile auto only when the hybrid mode is below 0.9 of the limit)."""
    modes = {"limit_1proc": r1["modes"]["unsharded"], **r2["modes"]}
    ratio_31 = modes["hybrid"]["tokens_per_s_per_rank"] / modes["limit_1proc"]["tokens_per_s_per_rank"]
    ratio_31_cpu = modes["limit_1proc"]["cpu_seconds_rank0"] / modes["hybrid"]["cpu_seconds_rank0"]
    profiles = {**{"limit_1proc": v for v in r1.get("profiles", {}).values()}, **r2.get("profiles", {})}
    if args.profile == "auto" and ratio_31 >= 0.9 and ratio_31_cpu >= 0.9:
        profiles = {}  # on target: the profiles are not printed
    out = mode_table(modes) + overhead_table(args, modes, r2) + ratio_lines(modes, r1, r2, ratio_31)
    for mode, text in profiles.items():
        out += ["", f"=== profile of {MODE_LABELS.get(mode, mode)}", text]
    return out


def mode_table(modes: dict) -> list[str]:
    out = ["", f"{'mode':58s} {'s/call':>8s} {'tok/s/rank':>11s} {'cpu s':>7s}   all calls (s)"]
    for mode, label in MODE_LABELS.items():
        if mode in modes and mode not in SHORT_MODES:
            m = modes[mode]
            out.append(
                f"{label:58s} {m['seconds']:8.3f} {m['tokens_per_s_per_rank']:11.1f} "
                f"{m['cpu_seconds_rank0']:7.3f}   " + " ".join(f"{s:.2f}" for s in m["all_seconds"])
            )
    for mode in ("hybrid", "hybrid_unmerged"):
        if "enter_exit_decode_s" in modes.get(mode, {}):
            s = modes[mode]["enter_exit_decode_s"]
            out.append(
                f"  {mode}: enter (gather + lift hooks{' + merge' if mode == 'hybrid' else ''}) {s['enter']:.3f} s, "
                f"decode (HF generate) {s['decode']:.3f} s, exit {s['exit']:.3f} s (rank 0, median)"
            )
    return out


def overhead_table(args, modes: dict, r2: dict) -> list[str]:
    """(3s) against (3p): the hybrid call's steps one by one, wall and CPU seconds."""
    if "hybrid_steps" not in modes or "hybrid_proposed" not in modes:
        return []
    a, b = modes["hybrid_steps"]["steps_s"], modes["hybrid_proposed"]["steps_s"]
    ca, cb = modes["hybrid_steps"]["steps_cpu_s"], modes["hybrid_proposed"]["steps_cpu_s"]
    out = [
        f"  per-call overhead of the hybrid mode: (3s) replays step3_ppo.rollout.hybrid's steps one by one on a "
        f"4-token prompt with 1 new token, (3p) the proposed variant; rank 0, medians of {args.overhead_repeats} "
        "calls each, "
        f"interleaved; wall s and CPU s",
        f"    {'step':36s} {'(3s) wall':>10s} {'(3p) wall':>10s} {'(3s) cpu':>9s} {'(3p) cpu':>9s}",
    ]
    for name in a:
        out.append(f"    {name:36s} {a[name]:10.3f} {b[name]:10.3f} {ca[name]:9.3f} {cb[name]:9.3f}")
    na, nb, nca, ncb = (sum(v for k, v in d.items() if not k.startswith("generate")) for d in (a, b, ca, cb))
    out.append(f"    {'sum without the generate':36s} {na:10.3f} {nb:10.3f} {nca:9.3f} {ncb:9.3f}")
    out.append(f"    tokens of (3s) == tokens of (3p): {r2.get('tokens_equal_overhead_modes')}")
    return out


def ratio_lines(modes: dict, r1: dict, r2: dict, ratio_31: float) -> list[str]:
    tps = {k: v["tokens_per_s_per_rank"] for k, v in modes.items()}
    cpu_s = {k: v["cpu_seconds_rank0"] for k, v in modes.items()}
    hybrid = modes["hybrid"]
    enter_exit = sum(v for k, v in hybrid.get("enter_exit_decode_s", {}).items() if k != "decode")
    return [
        "",
        f"ratio 3/2  hybrid / plain ZeRO-3           = {tps['hybrid'] / tps['plain']:.2f}x   (target >= 4x)",
        f"ratio 3u/2 hybrid unmerged / plain ZeRO-3  = {tps['hybrid_unmerged'] / tps['plain']:.2f}x",
        f"ratio 3/1  hybrid / limit (1 process)      = {ratio_31:.2f}    (target >= 0.9)",
        f"ratio 3/1b hybrid / limit side by side     = {tps['hybrid'] / tps['unsharded']:.2f}",
        f"ratio 1b/1 side-by-side limit / 1-process  = {tps['unsharded'] / tps['limit_1proc']:.2f}   "
        f"(contention of 2 processes on the shared cores)",
        f"same ratios by CPU seconds per call (rank 0; less sensitive to other processes taking the cores): "
        f"3/2 = {cpu_s['plain'] / cpu_s['hybrid']:.2f}x, 3/1 = {cpu_s['limit_1proc'] / cpu_s['hybrid']:.2f}, "
        f"3/1b = {cpu_s['unsharded'] / cpu_s['hybrid']:.2f}",
        *(
            [
                f"enter + exit of the hybrid mode = {enter_exit:.2f} s "
                f"= {100 * enter_exit / hybrid['seconds']:.0f}% "
                f"of a hybrid call (wall, rank 0)"
            ]
            if "enter_exit_decode_s" in hybrid
            else []
        ),
        *([decode_calls_line(r2["decode_python_calls"])] if "decode_python_calls" in r2 else []),
        f"tokens equal across the ZeRO-3 modes (2),(3),(3u): {r2.get('tokens_equal_zero3_modes')}; "
        f"all weights bit for bit unchanged after all calls: {r2.get('weights_unchanged')}; ZeRO-3 params "
        f"partitioned again after: {r2.get('partitioned_after')}; tokens of (1) == (1b): "
        f"{r1['tokens']['unsharded'] == r2['tokens']['unsharded']}",
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, tiny_help="a tiny random 2-layer llama (utils.models.tiny) instead of SmolLM2 (seconds)")
    add_call_args(p, plain_repeats=1)
    p.add_argument(
        "--no_breakdown",
        action="store_true",
        help="skip modes (3s) and (3p) (the hybrid steps timed one by one, and the proposed variant)",
    )
    p.add_argument(
        "--profile",
        choices=["auto", "on", "off"],
        default="auto",
        help="cProfile one more limit call and hybrid call after the timed ones (auto: printed when 3/1 < 0.9)",
    )
    p.add_argument(
        "--sweep",
        default=None,
        type=lambda v: [int(x) for x in v.split(",") if x],
        help="answer lengths, comma-separated, e.g. 64,128,256 (tokens): only the limit vs hybrid sweep",
    )
    add_run_args(p, 29531, 600)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model_dir = bench_model(args)
    env = bench_env()
    header = start_report(header_lines(args, model_dir))
    wall = time.time()
    logs = os.path.join(REPO, "bench", "runs", "generation")
    os.makedirs(logs, exist_ok=True)
    body = sweep(args, model_dir, env, logs) if args.sweep else modes_report(args, *measure(args, model_dir, env, logs))
    end_report(args.save, header, body, tail=[f"total wall time {time.time() - wall:.0f} s"])


if __name__ == "__main__":
    main_or_worker(main, worker)
