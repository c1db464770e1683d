"""Peak memory per rank of the DPO step with a reference (sigmoid DPO) against a reference-free loss (SimPO),
on the demo's DPO settings (scripts/step2_dpo/run_cpu.sh: 2 ranks, ZeRO-2, fp32, LoRA rank 16 with the base
frozen, 4 pairs x 2 accumulation per rank, the demo pairs; SimPO at beta 2.0, both with the NLL term), the losses
alternating (AB BA ...).

    .venv/bin/python bench/memory_dpo.py [--steps 6] [--rounds 2] [--losses sigmoid,simpo] [--tiny]

Reads each run's metrics.jsonl: `mem/training_peak_gb` (the largest over ranks and steps of the rank's peak
RSS, VmHWM, during the training phase: weights, LoRA optimizer state, activations, and for sigmoid the
reference forward) and `time/train_s` per step. On the demo's settings the reference is the policy with its
adapters disabled (no second copy), so the difference is the reference forwards' share, not a model copy;
a full fine-tune's reference would be a frozen engine (a whole fp32 model per rank under ZeRO-2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    RUNS,
    add_model_args,
    add_run_args,
    alternate,
    bench_env,
    bench_model,
    end_report,
    fresh_dir,
    read_jsonl,
    run_logged,
    start_report,
    title,
)

LOSSES = ("sigmoid", "ipo", "simpo", "orpo", "kto")  # run_cpu.sh's LOSS_TYPE: it gives each loss its flags


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    add_run_args(p, port=29641, timeout=1800)
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--rounds", type=int, default=2, help="runs of each loss, alternating which goes first")
    p.add_argument("--losses", default="sigmoid,simpo", help="two of: " + ", ".join(LOSSES))
    args = p.parse_args(argv)
    args.losses = args.losses.split(",")
    if len(args.losses) != 2 or any(name not in LOSSES for name in args.losses):
        p.error(f"--losses: two of {', '.join(LOSSES)}, got {','.join(args.losses)}")
    return args


def run_once(args, loss: str, model: str, index: int) -> dict:
    out = fresh_dir(os.path.join(RUNS, "memory_dpo", f"{loss}_{index}"))
    env = bench_env(MODEL=model, MAX_STEPS=str(args.steps), MASTER_PORT=str(args.master_port + index), LOSS_TYPE=loss)
    extra = ["--chat_template", "utils/chat_templates/chatml.jinja"] if args.tiny else []
    launch = run_logged(
        ["bash", "scripts/step2_dpo/run_cpu.sh", out, "--eval_iters", "1", *extra],
        env,
        os.path.join(out, "bench.log"),
        args.timeout,
    )
    if launch.returncode != 0:
        sys.exit(f"the {loss} run failed (exit {launch.returncode}); its log's tail:\n{launch.tail()}")
    rows = read_jsonl(os.path.join(out, "metrics.jsonl"))
    peaks = [r["mem/training_peak_gb"] for r in rows if "mem/training_peak_gb" in r]
    train_s = next(r["time/train_s"] for r in reversed(rows) if "time/train_s" in r)
    return {"loss": loss, "peak_gib": max(peaks), "step_s": train_s / args.steps, "wall_s": launch.wall_s}


def main(argv=None):
    args = parse_args(argv)
    model = bench_model(args)
    header = start_report(
        [
            title("memory_dpo.py"),
            f"model {model}; the demo's DPO settings "
            f"(scripts/step2_dpo/run_cpu.sh), {args.steps} steps, {args.rounds} round(s) per loss",
        ]
    )
    counter = iter(range(1000))
    first, second = args.losses
    a, b = alternate(
        args.rounds,
        lambda: run_once(args, first, model, next(counter)),
        lambda: run_once(args, second, model, next(counter)),
    )
    body = ["", "| loss | peak RSS per rank, GiB (median; rounds) | s/step (median; rounds) |", "|---|---|---|"]
    for results in (a, b):
        peaks, steps = [r["peak_gib"] for r in results], [r["step_s"] for r in results]
        body.append(
            f"| {results[0]['loss']} | {statistics.median(peaks):.3f} ({', '.join(f'{p:.3f}' for p in peaks)}) "
            f"| {statistics.median(steps):.2f} ({', '.join(f'{s:.2f}' for s in steps)}) |"
        )
    ratio = statistics.median(r["peak_gib"] for r in b) / statistics.median(r["peak_gib"] for r in a)
    body.append(f"peak {second} / {first}: {ratio:.3f}")
    end_report(args.save, header, body, data={"runs": a + b})


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
