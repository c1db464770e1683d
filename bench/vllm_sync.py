"""Step 3's vLLM weight sync with LoRA (the adapter alone vs the merged model) and --max_staleness, per iteration.

The real step 3, one CPU process with its vLLM worker beside it: MB and seconds per sync of each mode, and what
generating ahead (--max_staleness k) saves per iteration.

    python bench/vllm_sync.py                   # SmolLM2-135M-Instruct, LoRA r=16 on every projection, fp32
    python bench/vllm_sync.py --tiny            # a tiny random llama (head size 32: vLLM's CPU minimum)
    python bench/vllm_sync.py --save bench/results/vllm_sync/DATE-cpu.txt

Each configuration is one run of `python -m step3_ppo.main` (one rank, ZeRO-0, `--rollout_engine vllm --vllm_mode
eager`): GRPO on the arithmetic prompts (data/arithmetic) with a reward the sampled answers differ in (the first
answer token's id even: every iteration updates the adapter), no KL term (kl_ctl 0), the actor's LoRA adapter alone
trained (`--only_optimize_lora`), answers of a fixed length (min = max new tokens, sampled), one
optimizer step per iteration (the training batch is the whole rollout, one PPO epoch), so --max_staleness k
generates k iterations ahead. The configurations: `--vllm_lora_sync merged` and `adapter` at k = 0, then `adapter`
at each k of --staleness; --rounds times, the order reversed every other round (a change of the machine's load
shows as spread, not as a ratio). Only one run at a time (a SmolLM2 trainer and its worker: ~5 GiB).

Figures from each run's metrics.jsonl, per iteration: the weight sync (time/weight_sync_s, rollout/weight_sync_mb:
the last sync before the iteration's metrics), the phases (time/generation_s + time/experience_s + time/train_s =
the iteration; with k > 0 the sync and the hand-over of later prompts fall in time/train_s), and with k > 0
rollout/staleness_mean and rollout/stale_rows_regenerated. The first iteration is left out of the times (it waits
for the worker to start) but gives the first sync (adapter: the frozen base too).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import (  # noqa: E402
    RUNS,
    BenchError,
    add_model_args,
    bench_env,
    bench_model,
    end_report,
    fresh_dir,
    launch_failed,
    machine_line,
    malloc_line,
    read_jsonl,
    run_logged,
    sgemm_gflops,
    start_report,
    title,
)
from utils.errors import run_main  # noqa: E402

ARITHMETIC = os.path.join(REPO, "data", "arithmetic")
# the reward: whether the answer's first token id is even, which a group's sampled answers often differ in, so GRPO has
# a gradient every iteration and each sync follows a real change of the adapter (math_exact on answers of a fixed
# length scores 0 everywhere: no update at all)
REWARD = """
def even_first_token(completions, completion_ids, **kwargs):
    return [float(len(ids) > 0 and ids[0] % 2 == 0) for ids in completion_ids]
"""
CHATML = os.path.join("utils", "chat_templates", "chatml.jinja")
# lines step 3 prints when it runs otherwise than asked: the adapter sync refused, or k below one iteration's steps
NOTICES = ("[step3] vLLM weight sync:", "[step3] --max_staleness")


def tiny_model() -> str:
    """A tiny random llama with ChatML, head size 32 (bench_model's tiny one has 16, which vLLM's CPU attention
    refuses), made once under bench/runs."""
    from utils.models.tiny import make_tiny_model  # lazy: torch, kept off --help

    out = os.path.join(RUNS, "vllm_sync", "tiny_llama_32")
    if not os.path.isfile(os.path.join(out, "config.json")):
        make_tiny_model("llama", out, num_heads=2, chat=True)
    return out


def configurations(staleness: list[int]) -> list[tuple[str, int]]:
    """(--vllm_lora_sync, --max_staleness) of each run of a round: merged and adapter synchronous, then adapter at
    every other k."""
    return [("merged", 0), ("adapter", 0)] + [("adapter", k) for k in staleness if k]


def reward_file() -> str:
    path = os.path.join(RUNS, "vllm_sync", "reward.py")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(REWARD)
    return f"{path}:even_first_token"


def step3_command(args, model: str, sync: str, k: int, out_dir: str) -> list[str]:
    rows = args.batch_size * args.samples
    return [
        sys.executable,
        "-m",
        "step3_ppo.main",
        *(["--chat_template", CHATML] if args.tiny else []),
        *("--actor_model_name_or_path", model, "--data_path", ARITHMETIC, "--data_split", "0,0,1"),
        *("--output_dir", out_dir, "--dtype", "fp32", "--actor_zero_stage", "0"),
        *("--actor_lora_dim", str(args.lora_dim), "--actor_lora_module_name", "proj", "--only_optimize_lora"),
        *("--advantage_estimator", "grpo", "--n_samples_per_prompt", str(args.samples)),
        *("--reward_funcs", reward_file(), "--kl_ctl", "0"),
        *("--max_prompt_seq_len", str(args.prompt_len)),
        *("--max_answer_seq_len", str(args.answer_len), "--min_answer_seq_len", str(args.answer_len)),
        *("--per_device_generation_batch_size", str(args.batch_size), "--generation_batches", "1"),
        *("--per_device_training_batch_size", str(rows), "--gradient_accumulation_steps", "1", "--ppo_epochs", "1"),
        *("--actor_lora_learning_rate", "1e-4", "--lr_scheduler_type", "constant", "--num_warmup_steps", "0"),
        *("--max_steps", str(args.steps), "--eval_interval", "0", "--seed", "1234"),
        *("--rollout_engine", "vllm", "--vllm_mode", "eager", "--vllm_lora_sync", sync),
        *("--max_staleness", str(k)),
        *(["--vllm_threads", str(args.vllm_threads)] if args.vllm_threads else []),
    ]


def one_run(args, model: str, sync: str, k: int, round_: int) -> dict:
    """One configuration's run: its iterations' figures and the notices it printed."""
    out_dir = fresh_dir(os.path.join(RUNS, "vllm_sync", f"{sync}-k{k}"))
    log = os.path.join(out_dir, "launch.log")
    print(f"[bench.vllm_sync] round {round_ + 1}: --vllm_lora_sync {sync} --max_staleness {k}", file=sys.stderr)
    run = run_logged(step3_command(args, model, sync, k, out_dir), bench_env(), log, args.timeout)
    path = os.path.join(out_dir, "metrics.jsonl")
    its = [r for r in read_jsonl(path) if "time/generation_s" in r] if os.path.exists(path) else []
    if run.returncode != 0 or len(its) < args.steps:
        raise launch_failed(
            f"--vllm_lora_sync {sync} --max_staleness {k}: {len(its)} of {args.steps} iterations, exit "
            f"{run.returncode} (log {log})",
            run.tail(),
        )
    with open(log, errors="replace") as f:
        notices = sorted({line.strip() for line in f if line.strip().startswith(NOTICES)})
    shutil.rmtree(os.path.join(out_dir, "actor"), ignore_errors=True)  # the exported model: not read, 0.5 GB
    return {
        "sync": sync,
        "k": k,
        "round": round_,
        "wall_s": run.wall_s,
        "load_after": os.getloadavg()[0],  # the machine's 1-minute load as the run ended (2 cores: > ~3 is shared)
        "notices": notices,
        "iterations": [
            {
                "iteration_s": r["time/generation_s"] + r["time/experience_s"] + r["time/train_s"],
                "generation_s": r["time/generation_s"],
                "experience_s": r["time/experience_s"],
                "train_s": r["time/train_s"],
                "sync_s": r["time/weight_sync_s"],
                "sync_mb": r["rollout/weight_sync_mb"],
                "sync_norm": r["rollout/weight_sync_norm"],
                "regenerated": r["rollout/stale_rows_regenerated"],
                "staleness_mean": r.get("rollout/staleness_mean"),
                "staleness_max": r.get("rollout/staleness_max"),
            }
            for r in its
        ],
    }


def med(values) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def summarize(runs: list[dict]) -> dict:
    """Per configuration: the first sync (median over the rounds), the later syncs and the iterations after the
    first (pooled over the rounds: medians), the staleness and the rows generated again."""
    out = {}
    for key in sorted({(r["sync"], r["k"]) for r in runs}, key=lambda x: (x[1], x[0] != "merged")):
        mine = [r for r in runs if (r["sync"], r["k"]) == key]
        # timed: the iterations after the first, less the last k (at the run's end nothing is left to generate ahead)
        later = [it for r in mine for it in r["iterations"][1 : len(r["iterations"]) - key[1]]]
        first = [r["iterations"][0] for r in mine]
        out[f"{key[0]}-k{key[1]}"] = {
            "sync": key[0],
            "k": key[1],
            "runs": len(mine),
            "first_sync_s": med(it["sync_s"] for it in first),
            "first_sync_mb": med(it["sync_mb"] for it in first),
            "sync_s": med(it["sync_s"] for it in later),
            "sync_mb": med(it["sync_mb"] for it in later),
            "iteration_s": med(it["iteration_s"] for it in later),
            "generation_s": med(it["generation_s"] for it in later),
            "train_s": med(it["train_s"] for it in later),
            "per_round_iteration_s": [
                round(med(it["iteration_s"] for it in r["iterations"][1 : len(r["iterations"]) - key[1]]), 2)
                for r in mine
            ],
            "staleness_mean": med(it["staleness_mean"] for it in later),
            "staleness_max": max((it["staleness_max"] or 0 for it in later), default=0),
            "regenerated": sum(it["regenerated"] for r in mine for it in r["iterations"]),
            "notices": sorted({n for r in mine for n in r["notices"]}),
            # the norm of what the syncs sent, first and last iteration of the first round: moves with the adapter
            "norm_first_last": [mine[0]["iterations"][0]["sync_norm"], mine[0]["iterations"][-1]["sync_norm"]],
        }
    return out


def report(args, s: dict, runs: list[dict]) -> list[str]:
    merged, adapter = s["merged-k0"], s["adapter-k0"]
    bytes_ratio = merged["sync_mb"] / adapter["sync_mb"]
    lines = [
        "",
        f"1. Weight sync per mode (--max_staleness 0; first: the first iteration's, median over {args.rounds} "
        f"round(s); later: median over iterations 2-{args.steps} of every round, each after a real optimizer step)",
        "| sync | first MB | first s | later MB | later s |",
        "|---|---|---|---|---|",
    ]
    for name, x in (("merged", merged), ("adapter", adapter)):
        lines.append(
            f"| {name} | {x['first_sync_mb']:.1f} | {x['first_sync_s']:.2f} | {x['sync_mb']:.2f} | {x['sync_s']:.3f} |"
        )
    lines.append(
        f"| merged / adapter | {merged['first_sync_mb'] / adapter['first_sync_mb']:.2f}x | "
        f"{merged['first_sync_s'] / adapter['first_sync_s']:.2f}x | {bytes_ratio:.1f}x | "
        f"{merged['sync_s'] / adapter['sync_s']:.1f}x |"
    )
    lines.append(
        "norm of what the syncs sent (rollout/weight_sync_norm), first -> last iteration: "
        + ", ".join(
            f"{n} {x['norm_first_last'][0]:.6g} -> {x['norm_first_last'][1]:.6g}"
            for n, x in (("merged", merged), ("adapter", adapter))
        )
    )
    lines += [
        f"bytes per sync merged / adapter: {bytes_ratio:.1f}x ({'meets' if bytes_ratio >= 10 else 'MISSES'} the "
        f"goal of >= 10x)",
        "",
        f"2. Step-3 iteration time (median over iterations 2 to {args.steps} - k of every round: the last k have "
        "nothing left to generate ahead; iteration = generation + experience + training; with k > 0 the sync and the "
        "hand-over of later prompts are in training)",
        "| sync | k | iteration s | generation s | training s | vs k=0 | staleness mean (max) | rows regenerated "
        "| per round s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = adapter["iteration_s"]
    for x in s.values():
        stale = "-" if x["k"] == 0 else f"{x['staleness_mean']:.2f} ({x['staleness_max']:.0f})"
        lines.append(
            f"| {x['sync']} | {x['k']} | {x['iteration_s']:.2f} | {x['generation_s']:.2f} | {x['train_s']:.2f} | "
            f"{x['iteration_s'] / base:.2f}x | {stale} | {x['regenerated']:.0f} | "
            + ", ".join(f"{v:.2f}" for v in x["per_round_iteration_s"])
            + " |"
        )
    lines.append(
        f"adapter / merged iteration at k=0: {adapter['iteration_s'] / merged['iteration_s']:.2f}x "
        f"(goal: adapter no slower, <= 1.00x); vs k=0: the adapter runs' k=0 row"
    )
    loads = [f"{r['sync']} k={r['k']} {r['load_after']:.1f}" for r in runs]
    lines.append(
        f"1-minute load average as each run ended, in run order (its own processes: up to ~3): {', '.join(loads)}"
    )
    notices = sorted({n for x in s.values() for n in x["notices"]})
    lines += ["", "step 3 ran otherwise than asked:" if notices else "step 3 printed no notice of a changed mode"]
    lines += [f"  {n}" for n in notices]
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(
        p, "a tiny random llama with head size 32 (vLLM's CPU attention minimum), 4 iterations a run, 1 round"
    )
    p.add_argument("--steps", type=int, default=None, help="iterations of each run (default: tiny 4, else 7)")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds of every configuration, the order alternating (default: tiny 1, else 2)",
    )
    p.add_argument(
        "--staleness",
        default="0,1,2",
        help="--max_staleness values of the adapter runs, 0 always among them (comma-separated)",
    )
    p.add_argument("--lora_dim", type=int, default=16, help="the LoRA adapter's rank on every projection")
    p.add_argument("--batch_size", type=int, default=4, help="rollout prompts per iteration (prompts)")
    p.add_argument("--samples", type=int, default=2, help="answers per prompt (GRPO's group size)")
    p.add_argument("--prompt_len", type=int, default=64, help="longest prompt (tokens)")
    p.add_argument("--answer_len", type=int, default=32, help="answer length, fixed: min = max new tokens (tokens)")
    p.add_argument(
        "--vllm_threads",
        type=int,
        default=None,
        help="the worker's threads (default: step 3's, every core; with k > 0 it generates while the rank trains)",
    )
    p.add_argument("--timeout", type=int, default=900, help="limit of each run (seconds)")
    p.add_argument(
        "--save", default=None, help="also write the printed report to this file, the figures as JSON beside it"
    )
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.tiny else 7)
    args.rounds = args.rounds or (1 if args.tiny else 2)
    if args.steps < 2 + max(int(k) for k in args.staleness.split(",")):
        raise BenchError(
            "--steps must be >= 2 + the largest --staleness (the first iteration waits for the worker to "
            "start, the last k have nothing to generate ahead)"
        )
    return args


def main(argv=None):
    args = parse_args(argv)
    model = tiny_model() if args.tiny else bench_model(args)
    staleness = sorted({int(k) for k in args.staleness.split(",")})
    probe = sgemm_gflops()
    header = start_report(
        [
            title("vllm_sync.py"),
            machine_line(),
            f"host probe: 1-thread sgemm {probe} GFLOP/s",
            malloc_line(),
            f"model {model}; fp32, 1 CPU rank (ZeRO-0, 1 thread) + its vLLM worker (eager, "
            f"{args.vllm_threads or os.cpu_count()} threads); LoRA r={args.lora_dim} on every "
            f"projection, the adapter alone trained (lr 1e-4)",
            f"GRPO on arithmetic prompts (reward: the first answer token's id even): {args.batch_size} prompts x "
            f"{args.samples} answers of exactly {args.answer_len} tokens per iteration, one optimizer step each; "
            f"{args.steps} iterations per run, "
            f"{args.rounds} round(s) of {len(configurations(staleness))} runs (order reversed every other round)",
        ]
    )
    runs = []
    for r in range(args.rounds):
        order = configurations(staleness)
        for sync, k in order if r % 2 == 0 else order[::-1]:
            runs.append(one_run(args, model, sync, k, r))
    s = summarize(runs)
    tail = [f"host probe after: 1-thread sgemm {sgemm_gflops()} GFLOP/s"]
    end_report(args.save, header, report(args, s, runs), tail, data={"probe": probe, "summary": s, "runs": runs})


if __name__ == "__main__":
    run_main(main)
