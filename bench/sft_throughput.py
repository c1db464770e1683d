"""SFT throughput of the real step 1 (step1_sft/main.py through DeepSpeed): tokens/s and MFU per configuration.

    python bench/sft_throughput.py --tiny                    # the tiny random llama, well under a minute
    python bench/sft_throughput.py [--configs 2r,1r] [--steps 4] [--seq_len 512] [--batch 4] [--save FILE]

Each configuration runs the unmodified step 1 for --steps optimizer steps in its own launch: 1 rank as one
process (no launcher), 2 ranks through the `deepspeed` launcher, each rank with the configuration's torch threads
(OMP_NUM_THREADS). The workload is --batch rows per rank of exactly --seq_len tokens (generated from the words of
the demo's SFT answers: a short prompt, the answer right-truncated to fill the row, so no padding), except the
`demo` configuration: configs/step1_sft/cpu.yaml as the demo runs it (its SFT rows, 80 tokens, 8 rows per rank).

The figures come from the run's metrics.jsonl, the first --warmup steps dropped: real and processed (padded)
tokens per second of the training phase (the micro-batches' forward, backward and optimizer step, the slowest
rank), the run's own MFU (`perf/training_mfu`: 6 FLOPs per non-embedding parameter per real token, over all
ranks' peak, `perf/peak_flops`: a 1024^3 fp32 matmul probe on each rank's threads), and the MFU counting the
work the 6N rule leaves out: the LM head of a tied-embedding model (6 V d per token) and causal attention's
matmuls (6 L d T / 2 per token at T tokens per row). Beside them: the bench's own 1-thread sgemm figure
(bench.common.sgemm_gflops) and where a rank's time goes, timed by the worker around DeepSpeed's calls
(decoder forward, LM head + loss, backward, optimizer step), and with --profile a torch.profiler table of the 1r
run's last step (left out of its figures) by operator, grouped into matmuls, attention, the LM head's softmax /
loss, the optimizer and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import (  # noqa: E402
    RUNS,
    BenchError,
    add_model_args,
    add_run_args,
    bench_env,
    bench_model,
    deepspeed_cmd,
    end_report,
    fresh_dir,
    launch_failed,
    machine_line,
    main_or_worker,
    malloc_line,
    read_jsonl,
    run_logged,
    sgemm_gflops,
    start_report,
    title,
    worker_argv,
)

DEMO_SFT = os.path.join(REPO, "data", "demo", "sft")
CHATML = os.path.join(REPO, "utils", "chat_templates", "chatml.jinja")  # the tiny model has no chat template
DEMO_BATCH = 8  # configs/step1_sft/cpu.yaml's per_device_train_batch_size
PROMPT_WORDS = 24  # the generated rows' prompt (not trained); the answer fills the rest of the row


@dataclass(frozen=True)
class Config:
    """One launch: `ranks` processes of `threads` torch threads each, on the fixed-length rows (or the demo's
    preset, `demo`), with `flags` added to step 1's command line."""

    ranks: int
    threads: int
    what: str
    flags: tuple[str, ...] = ()
    demo: bool = False


CONFIGS = {
    "demo": Config(2, 1, "the demo's step 1 (configs/step1_sft/cpu.yaml: its SFT rows, 80 tokens, 8 rows)", demo=True),
    "2r": Config(2, 1, "2 ranks x 1 thread (the CPU scripts' layout)"),
    "1r": Config(1, 1, "1 rank x 1 thread, no launcher"),
    "1r2t": Config(1, 2, "1 rank x 2 threads, no launcher"),
    "2r_chunk0": Config(2, 1, "2 ranks, the whole logits (--logprob_chunk_tokens 0)", ("--logprob_chunk_tokens", "0")),
    "2r_ckpt": Config(2, 1, "2 ranks, --gradient_checkpointing", ("--gradient_checkpointing",)),
}
DEFAULT_CONFIGS = "demo,1r,1r2t,2r,2r_chunk0"
TINY_CONFIGS = "2r,1r"
PROFILED = "1r"  # the configuration whose last step --profile records


# ------------------------------------------------------------------------------------------ the arithmetic
def extra_flops_per_token(hidden: int, vocab: int, layers: int, seq_len: float, tied: bool) -> float:
    """Training FLOPs per token that 6N (non-embedding parameters) leaves out: a tied LM head's matmul (6 V d:
    its weight is the input embedding, not counted in N; an untied head is in N already) and causal attention's
    two matmuls (QK^T and AV: 2 x 2 d FLOPs per earlier position per layer forward, T/2 positions on average at T
    tokens per row, x3 with the backward)."""
    head = 6 * vocab * hidden if tied else 0
    attention = 3 * 2 * 2 * hidden * (seq_len / 2) * layers
    return head + attention


def summarise(rows: list[dict], warmup: int, ranks: int, extra_per_token: float = 0.0, drop_last: int = 0) -> dict:
    """The figures of one run from its metrics.jsonl rows, the first `warmup` optimizer steps dropped (and the
    last `drop_last`: a profiled step): the
    training phase's seconds (each step's real tokens / its tokens/s: the slowest rank's), real and processed
    tokens/s, the run's MFU over those seconds (perf/training_mfu weighted by each step's seconds), the probe's
    peak per rank and all ranks', the model FLOPs per real token the run counted (6N, derived back from its MFU),
    the achieved FLOP/s, and the MFU with `extra_per_token` FLOPs more per real token (extra_flops_per_token)."""
    steps = [r for r in rows if "perf/training_tokens_per_s" in r and "train/loss" in r]
    peak = next((r["perf/peak_flops"] for r in rows if "perf/peak_flops" in r), 0.0)
    timed = steps[warmup : len(steps) - drop_last]
    if not timed or not peak:
        raise BenchError(f"no timed steps in the run's metrics ({len(steps)} step(s), --warmup {warmup})")
    seconds = [r["tokens/real"] / r["perf/training_tokens_per_s"] for r in timed]
    total_s = sum(seconds)
    real = sum(r["tokens/real"] for r in timed)
    processed = sum(r["tokens/processed"] for r in timed)
    peak_all = peak * ranks
    mfu = sum(r["perf/training_mfu"] * s for r, s in zip(timed, seconds)) / total_s
    achieved = mfu * peak_all
    return {
        "steps_timed": len(timed),
        "step_s": statistics.median(seconds),
        "step_s_total": total_s,
        "tokens_per_step": real / len(timed),
        "real_tokens_per_s": real / total_s,
        "processed_tokens_per_s": processed / total_s,
        "padding_fraction": 1 - real / processed,
        "mfu": mfu,
        "peak_flops_per_rank": peak,
        "peak_flops": peak_all,
        "achieved_flops": achieved,
        "model_flops_per_token": achieved * total_s / real,
        "mfu_with_head_attention": (achieved + extra_per_token * real / total_s) / peak_all,
    }


def cpu_mfu(model_flops: float, cpu_seconds: float, core_flops: float) -> float:
    """The model FLOPs over the CPU seconds the ranks were given (all their threads), against one core's peak: the
    MFU of the time actually scheduled, which a machine shared with other work does not move as it moves the wall
    clock's (a core taken away half the time halves the wall-clock MFU, not this one)."""
    return model_flops / (cpu_seconds * core_flops) if cpu_seconds > 0 and core_flops > 0 else 0.0


# ----------------------------------------------------------------------------------------------- the data
def answer_words(source: str = DEMO_SFT) -> list[str]:
    """The words of the SFT answers of `source` (a folder with train.jsonl: chat rows, whose assistant turns
    count, or raw {"prompt", "response"} rows), in file order: the generated rows' text."""
    path = os.path.join(source, "train.jsonl")
    if not os.path.exists(path):
        raise BenchError(f"{path} is missing (python -m data.make_demo_data --out data/demo)")
    words = []
    for row in read_jsonl(path):
        if "messages" in row:
            words += " ".join(m["content"] for m in row["messages"] if m["role"] == "assistant").split()
        else:
            words += (row.get("response") or row.get("chosen") or "").split()
    return words


def write_fixed_rows(folder: str, n_train: int, n_eval: int, seq_len: int, source: str = DEMO_SFT) -> str:
    """train.jsonl and eval.jsonl of {"prompt", "chosen"} string rows longer than `seq_len` tokens (the answer
    right-truncated by step 1's tokenizer: every row exactly `seq_len` tokens), from `source`'s answers."""
    words = answer_words(source)
    answer = 2 * seq_len  # words: more tokens than the row holds
    os.makedirs(folder, exist_ok=True)
    for name, count, offset in (("train", n_train, 0), ("eval", n_eval, n_train)):
        with open(os.path.join(folder, f"{name}.jsonl"), "w") as f:
            for i in range(offset, offset + count):
                start = (i * 97) % max(len(words) - answer - PROMPT_WORDS, 1)
                prompt = " ".join(words[start : start + PROMPT_WORDS])
                chosen = " ".join(words[start + PROMPT_WORDS : start + PROMPT_WORDS + answer])
                f.write(json.dumps({"prompt": prompt, "chosen": chosen}) + "\n")
    return folder


# --------------------------------------------------------------------------------------------- the worker
def worker(argv) -> None:
    """One rank: records its torch threads, times DeepSpeed's forward / backward / step and the loss (and with
    --profile, on rank 0, a torch.profiler table of one step), then runs step 1's main on the rest of argv."""
    import torch  # lazy: torch, deepspeed and step 1 (+3 s on every --help)
    from deepspeed.runtime.engine import DeepSpeedEngine  # lazy: as above

    import step1_sft.main as step1  # lazy: as above
    from utils.train.run import Run  # lazy: as above

    argv, options = worker_argv(argv, "--worker", "--timings", "--profile")
    rank = int(os.environ.get("RANK", "0"))
    timings = {"threads": torch.get_num_threads(), "rank": rank, "steps": []}
    current = {"forward": 0.0, "loss": 0.0, "backward": 0.0, "step": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                with torch.profiler.record_function(f"sft:{name}"):
                    return fn(*a, **k)
            finally:
                current[name] += time.perf_counter() - start

        return wrapper

    DeepSpeedEngine.forward = timed("forward", DeepSpeedEngine.forward)
    DeepSpeedEngine.backward = timed("backward", DeepSpeedEngine.backward)
    DeepSpeedEngine.step = timed("step", DeepSpeedEngine.step)
    step1.sft_loss_terms = timed("loss", step1.sft_loss_terms)  # main's micro-step calls it by its module name
    profiler = None
    after_step = Run.after_step

    def after_step_timed(self, *a, **k):
        wall, cpu = time.perf_counter(), time.process_time()  # the process's CPU seconds: all its threads
        timings["steps"].append({**current, "wall": wall - clock["wall"], "cpu": cpu - clock["cpu"]})
        clock.update(wall=wall, cpu=cpu)
        current.update(dict.fromkeys(current, 0.0))
        if profiler is not None:
            profiler.step()
        return after_step(self, *a, **k)

    Run.after_step = after_step_timed
    clock = {"wall": time.perf_counter(), "cpu": time.process_time()}
    profile_at = int(options["--profile"])
    try:
        if profile_at >= 0 and rank == 0:
            from torch.profiler import ProfilerActivity, profile, schedule  # lazy: as above

            with profile(
                activities=[ProfilerActivity.CPU],
                schedule=schedule(wait=profile_at, warmup=1, active=1, repeat=1),
                on_trace_ready=lambda p: timings.update(profile=operator_rows(p.key_averages())),
            ) as profiler:
                step1.main(argv)
        else:
            step1.main(argv)
    finally:
        with open(f"{options['--timings']}.rank{rank}.json", "w") as f:
            json.dump(timings, f)


def operator_rows(averages) -> list[dict]:
    """A profiler's key averages as {name, calls, self_s, total_s}, by self CPU time."""
    rows = [
        {"name": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6, "total_s": e.cpu_time_total / 1e6}
        for e in averages
    ]
    return sorted(rows, key=lambda r: -r["self_s"])


# operator groups of the profile, first match wins (self CPU time)
GROUPS = (
    ("matmul (linear layers, LM head)", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")),
    ("attention (SDPA)", ("attention",)),
    (
        "softmax / loss / masking (LM head)",
        ("softmax", "nll", "logsumexp", "cross_entropy", "gather", "where", "fill_"),
    ),
    ("optimizer (Adam)", ("adam", "_foreach", "addcdiv", "lerp", "sqrt")),
    ("communication", ("all_reduce", "allreduce", "reduce_scatter", "all_gather", "broadcast", "gloo", "shm")),
)


OTHER = "other (elementwise, norms, copies, ...)"


def group_profile(rows: list[dict]) -> dict:
    """{group: self seconds} over the operator rows (the record_function scopes sft:* left out)."""
    out = {name: 0.0 for name, _ in GROUPS}
    out[OTHER] = 0.0
    for r in rows:
        name = r["name"].lower()
        if name.startswith("sft:") or name.startswith("profilerstep"):
            continue
        group = next(
            (g for g, keys in GROUPS if any(k in name for k in keys)), "other (elementwise, norms, copies, ...)"
        )
        out[group] += r["self_s"]
    return out


# ----------------------------------------------------------------------------------------------- the runs
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_run_args(p, port=29671, timeout=900)
    p.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated of: {', '.join(CONFIGS)} (default: all; --tiny: {TINY_CONFIGS})",
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per run (3: 1 warm-up, 2 timed)")
    p.add_argument("--warmup", type=int, default=1, help="first optimizer steps dropped from the figures")
    p.add_argument("--seq_len", type=int, default=None, help="tokens per generated row (default 512; --tiny 128)")
    p.add_argument("--batch", type=int, default=None, help="generated rows per rank per step (default 2; --tiny 4)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="training dtype (CPU: fp32)")
    p.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="profile the last step of the 1r run (torch.profiler, by operator; left out of its figures)",
    )
    args = p.parse_args(argv)
    args.steps = args.steps or 3
    args.seq_len = args.seq_len or (128 if args.tiny else 512)
    args.batch = args.batch or (4 if args.tiny else 2)
    names = (args.configs or (TINY_CONFIGS if args.tiny else DEFAULT_CONFIGS)).split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    profiled = args.profile and PROFILED in names
    if args.steps <= args.warmup + (1 if profiled else 0):
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup} (by 2 with {PROFILED} profiled)")
    args.configs = names
    return args


def step1_flags(args, config: Config, model: str, data: str, out: str) -> list[str]:
    """Step 1's command line (after the module) of one configuration."""
    common = ["--model_name_or_path", model, "--data_split", "10,0,0", "--zero_stage", "2", "--dtype", args.dtype]
    common += ["--max_steps", str(args.steps), "--eval_iters", "1", "--seed", "1234", "--output_dir", out]
    common += ["--lr_scheduler_type", "constant", "--num_warmup_steps", "0"]
    if args.tiny:
        common += ["--chat_template", CHATML]
    if config.demo:
        return ["--config", "configs/step1_sft/cpu.yaml", "--data_path", DEMO_SFT, *common, *config.flags]
    rows = ["--max_seq_len", str(args.seq_len), "--per_device_train_batch_size", str(args.batch)]
    rows += ["--per_device_eval_batch_size", str(args.batch), "--learning_rate", "1e-5", "--weight_decay", "0.0"]
    return ["--data_path", data, *common, *rows, *config.flags]


def run_config(args, name: str, model: str, data: str, shape: dict, index: int, profile: bool = False) -> dict:
    """One configuration's launch and its figures (summarise), its ranks' CPU seconds in the timed steps, rank 0's
    split and, with `profile`, its profile of the last optimizer step (left out of the figures)."""
    config = CONFIGS[name]
    out = fresh_dir(os.path.join(RUNS, "sft_throughput", name))
    profile_at = args.steps - 2 if profile else -1  # steps waited; then 1 profiler warm-up step, 1 recorded
    timings = os.path.join(out, "timings")
    flags = step1_flags(args, config, model, data, out)
    worker_flags = ["--worker", "--timings", timings, "--profile", str(profile_at)]
    if config.ranks == 1:
        cmd = [sys.executable, "-m", "bench.sft_throughput", *flags, *worker_flags]
    else:
        cmd = deepspeed_cmd("bench.sft_throughput", args.master_port + index)
        cmd[cmd.index("--num_gpus") + 1] = str(config.ranks)
        cmd += [*flags, *worker_flags]
    env = bench_env(OMP_NUM_THREADS=str(config.threads))
    launch = run_logged(cmd, env, os.path.join(out, "bench.log"), args.timeout)
    if launch.returncode != 0:
        raise launch_failed(f"the {name} run exited with {launch.returncode} (log {launch.log})", launch.tail())
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    steps = [r for r in rows if "tokens/real" in r]
    rows_per_step = config.ranks * (DEMO_BATCH if config.demo else args.batch)
    mean_len = sum(r["tokens/real"] for r in steps) / max(len(steps) * rows_per_step, 1)
    extra = extra_flops_per_token(shape["hidden"], shape["vocab"], shape["layers"], mean_len, shape["tied"])
    result = summarise(rows, args.warmup, config.ranks, extra, drop_last=1 if profile else 0)
    result.update(config=name, ranks=config.ranks, threads=config.threads, wall_s=launch.wall_s, cpu_s=launch.cpu_s)
    result.update(mean_row_tokens=mean_len, extra_flops_per_token=extra)
    per_rank = []
    for rank in range(config.ranks):
        path = f"{timings}.rank{rank}.json"
        if os.path.exists(path):
            with open(path) as f:
                per_rank.append(json.load(f))
    result["torch_threads"] = [t["threads"] for t in per_rank]
    timed = slice(args.warmup, args.steps - (1 if profile else 0))
    steps = per_rank[0]["steps"][timed] if per_rank else []
    if steps:
        result["split_s"] = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    if len(per_rank) == config.ranks and all(len(t["steps"]) == args.steps for t in per_rank):
        result["cpu_s"] = sum(s["cpu"] for t in per_rank for s in t["steps"][timed])  # all ranks, timed steps
        result["model_flops"] = result["achieved_flops"] * result["step_s_total"]
    if per_rank and "profile" in per_rank[0]:
        result["profile"], result["profile_step"] = per_rank[0]["profile"], args.steps
    return result


def model_shape(model: str) -> dict:
    from transformers import AutoConfig  # lazy: +2.5 s on every --help (transformers)

    c = AutoConfig.from_pretrained(model)
    return {
        "hidden": c.hidden_size,
        "vocab": c.vocab_size,
        "layers": c.num_hidden_layers,
        "tied": bool(getattr(c, "tie_word_embeddings", False)),
    }


def config_lines(results: list[dict]) -> list[str]:
    head = (
        f"{'config':<10} {'ranks x thr':>11} {'s/step':>7} {'tok/step':>8} {'real tok/s':>10} {'proc tok/s':>10} "
        f"{'peak GF/s':>9} {'achv GF/s':>9} {'MFU':>6} {'MFU+head+attn':>13} {'fwd':>5} {'loss':>5} {'bwd':>5} "
        f"{'step':>5}"
    )
    lines = [head]
    for r in results:
        split = r.get("split_s", {})
        cells = " ".join(f"{split.get(k, float('nan')):5.2f}" for k in ("forward", "loss", "backward", "step"))
        lines.append(
            f"{r['config']:<10} {r['ranks']:>5} x {r['threads']:<3} {r['step_s']:7.2f} {r['tokens_per_step']:8.0f} "
            f"{r['real_tokens_per_s']:10.0f} {r['processed_tokens_per_s']:10.0f} {r['peak_flops'] / 1e9:9.1f} "
            f"{r['achieved_flops'] / 1e9:9.1f} {100 * r['mfu']:5.1f}% {100 * r['mfu_with_head_attention']:12.1f}% "
            f"{cells}"
        )
    return lines


def cpu_lines(results: list[dict], core_flops: float) -> list[str]:
    """Per configuration: the ranks' CPU seconds per timed step and the MFU over them (cpu_mfu)."""
    lines = [
        f"per CPU second the ranks were given (against one core's {core_flops / 1e9:.1f} GFLOP/s, the best "
        "probe seen; the machine's other work left out): "
        + "; ".join(
            f"{r['config']} {r['cpu_s'] / r['steps_timed']:.1f} CPU s/step, MFU {100 * r['cpu_mfu']:.1f}% "
            f"({100 * r['cpu_mfu_with_head_attention']:.1f}% with head + attention)"
            for r in results
            if "cpu_mfu" in r
        )
    ]
    return lines


def profile_lines(result: dict) -> list[str]:
    rows = result["profile"]
    groups = group_profile(rows)
    total = sum(groups.values()) or 1.0
    lines = [
        "",
        f"profile of one step of {result['config']} (rank 0, step {result['profile_step']}; torch.profiler, self CPU "
        f"time {total:.2f} s; the profiler's own overhead included):",
    ]
    lines += [f"  {name:<42} {s:7.2f} s {100 * s / total:5.1f}%" for name, s in groups.items()]
    lines.append(f"  {'operator':<52} {'calls':>6} {'self s':>7} {'total s':>8}")
    lines += [f"  {r['name'][:52]:<52} {r['calls']:6d} {r['self_s']:7.3f} {r['total_s']:8.3f}" for r in rows[:18]]
    scopes = [r for r in rows if r["name"].startswith("sft:")]
    if scopes:
        lines.append("  scopes (total CPU time): " + ", ".join(f"{r['name']} {r['total_s']:.2f} s" for r in scopes))
    return lines


def main(argv=None):
    args = parse_args(argv)
    model = bench_model(args)
    probe = sgemm_gflops()
    data = write_fixed_rows(os.path.join(RUNS, "sft_throughput", f"rows_{args.seq_len}"), 256, 16, args.seq_len)
    header = start_report(
        [
            title("sft_throughput.py"),
            machine_line(),
            malloc_line(bench_env()),
            f"1-thread sgemm (1024^3 fp32, bench.common.sgemm_gflops) before: {probe} GFLOP/s",
            f"model {model}; step 1 (step1_sft.main) through DeepSpeed, ZeRO-2, {args.dtype}, {args.steps} optimizer "
            f"steps per run, the first {args.warmup} dropped",
            f"rows: {args.batch} per rank x {args.seq_len} tokens (generated from the demo's answers, no padding), "
            f"except demo: configs/step1_sft/cpu.yaml",
            "configs: " + "; ".join(f"{n}: {CONFIGS[n].what}" for n in args.configs),
        ]
    )
    shape = model_shape(model)
    results, failed = [], []
    for index, name in enumerate(args.configs):
        print(f"[sft_throughput] {name} ...", file=sys.stderr, flush=True)
        try:
            r = run_config(args, name, model, data, shape, index, args.profile and name == PROFILED)
        except BenchError as exc:  # one configuration's failure (a rank killed for memory): the others still run
            failed.append(f"{name}: {exc}")
            continue
        results.append(r)
        print(f"[sft_throughput] {name}: MFU {100 * r['mfu']:.1f}%, {r['real_tokens_per_s']:.0f} tok/s", flush=True)
    if not results:
        raise BenchError("every configuration failed: " + "; ".join(failed))
    after = sgemm_gflops()
    # one core's peak for cpu_mfu: the best probe seen (this bench's sgemm before and after, each run's own probe per
    # thread), the least shared moment: a probe that shared its core reads low and would inflate the MFU
    core_flops = max([probe * 1e9, after * 1e9] + [r["peak_flops_per_rank"] / r["threads"] for r in results])
    for r in results:
        if "cpu_s" in r:
            r["cpu_mfu"] = cpu_mfu(r["model_flops"], r["cpu_s"], core_flops)
            r["cpu_mfu_with_head_attention"] = r["cpu_mfu"] * (
                1 + r["extra_flops_per_token"] / r["model_flops_per_token"]
            )
    body = ["", *config_lines(results)]
    body.append(
        "(s/step: the training phase of a step, the slowest rank; tok/step: real tokens of all ranks; peak: the "
        "run's probe x ranks; MFU: 6N per real token (N: non-embedding parameters, the run's perf/training_mfu); "
        "MFU+head+attn: with the tied LM head and causal attention; fwd / loss / bwd / step: rank 0's median "
        "seconds in DeepSpeed's forward, the whole loss (forward + LM head + NLL), backward and step)"
    )
    threads = [f"{r['config']}: {r['torch_threads']}" for r in results]
    body.append("torch.get_num_threads() per rank: " + "; ".join(threads))
    body += [f"FAILED {line}" for line in failed]
    body += cpu_lines(results, core_flops)
    for r in results:
        if "profile" in r:
            body += profile_lines(r)
    body.append(f"1-thread sgemm after: {after} GFLOP/s")
    best = max(results, key=lambda r: r["mfu"])
    best_cpu = max(results, key=lambda r: r.get("cpu_mfu", 0.0))
    body.append(
        f"best MFU: {100 * best['mfu']:.1f}% ({best['config']}, {best['real_tokens_per_s']:.0f} real tokens/s; "
        f"{100 * best['mfu_with_head_attention']:.1f}% with the LM head and attention); per CPU second given: "
        f"{100 * best_cpu.get('cpu_mfu', 0.0):.1f}% ({best_cpu['config']})"
    )
    data_out = {"sgemm_gflops": [probe, after], "model": model, "shape": shape, "runs": results, "failed": failed}
    data_out["args"] = vars(args)
    end_report(args.save, header, body, data=data_out)


if __name__ == "__main__":
    main_or_worker(main, worker)
