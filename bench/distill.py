"""One on-policy distillation iteration's cost against one GRPO iteration on the same rollout (the real step 3, 2 CPU
ranks under the deepspeed launcher, one process).

    python bench/distill.py --tiny                                 # tiny random llama, student = teacher
    python bench/distill.py [--teacher out/grpo/actor]             # SmolLM2-135M-Instruct as the student
    python bench/distill.py --save bench/results/distill/DATE-smol.txt

One launch of step 3 with a teacher (`--teacher`, default the student itself: the cost is the same) and the
reference model loads every engine once; its iterations then rotate through the arms, the order rotating from one
round to the next (A B C, B C A, C A B, ...), so a change of the machine's load shows as spread, not as a ratio:

- grpo: the `math_exact` reward, GRPO's group baseline, the KL to the reference in the loss (the arithmetic GRPO
  demo's recipe): the reference's forward in the experience;
- reverse_kl_sampled: distillation alone (reward weight 0, no reference forward: kl_ctl 0 as in the distillation
  demo): the teacher's forward in the experience, minus the sampled tokens' reverse KL as the advantage;
- a full-vocabulary signal (`--full_signal`, default reverse_kl): the same experience, plus the divergence over the
  vocabulary through both LM heads in training (the teacher's decoder again, the student's a second time).

Same rollout: the first arm of a round generates, the others reuse its rows (a copy: the same prompts and the same
answers), so generation is timed once per round and the arms differ in experience and training only. Answers have
a fixed length (min = max answer tokens, sampled at temperature 1) on the arithmetic prompts (data/arithmetic).
Figures per arm: medians over the rounds (the first round dropped: warm-up) of each phase's seconds, and the
largest peak per phase (utils.runtime.accelerator.PhaseMemory: RSS on CPU, allocated memory on a GPU).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys

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

ARITHMETIC = os.path.join(REPO, "data", "arithmetic")
PHASES = {"gen": "time/generation_s", "exp": "time/experience_s", "train": "time/train_s"}
MEMORY = ("generation", "experience", "training")


def arms(full_signal: str) -> list[str]:
    return ["grpo", "reverse_kl_sampled", full_signal]


def set_arm(trainer, arm: str, saved: dict) -> None:
    """The trainer made ready for one arm: GRPO (reward, reference, no teacher) or distillation alone with `arm`
    as the signal (no reward weight, no reference forward, the teacher)."""
    from step3_ppo.algo.distill import DISTILL_SIGNALS  # lazy: the worker only (torch)

    c = trainer.config
    if arm == "grpo":
        trainer.teachers, trainer.distill, trainer.ref = {}, None, saved["ref"]
        c.reward_weights = (1.0,)
    else:
        trainer.teachers, trainer.ref = saved["teachers"], None
        c.distill_signal = arm
        trainer.distill = DISTILL_SIGNALS[arm]
        c.reward_weights = (0.0,)


def replay_generation(trainer) -> dict:
    """trainer.generate_rows wrapped: with `cache["rows"]` set, a copy of those rows instead of generating (the
    same rollout for every arm of a round); otherwise generate and keep a copy there."""
    generate_rows = trainer.generate_rows
    cache = {"rows": None}

    def generate(*args, **kwargs):
        if cache["rows"] is not None:
            return copy.deepcopy(cache["rows"])
        rows = generate_rows(*args, **kwargs)
        cache["rows"] = copy.deepcopy(rows)
        return rows

    trainer.generate_rows = generate
    return cache


def worker(argv) -> None:
    """One rank: step 3's own setup() once, then rounds of PPOTrainer.step() on one prompt batch, each round every
    arm once (the order rotating), the first arm generating and the others replaying its rows. Rank 0 appends one
    JSON row per arm and round."""
    from step3_ppo.main import parse_args as parse_step3_args  # lazy: torch, the worker only
    from step3_ppo.main import setup
    from utils.runtime.distributed import all_reduce_max_list, is_rank0

    argv, options = worker_argv(argv, "--worker", "--bench_out", "--rounds", "--full_signal")
    out, rounds, names = options["--bench_out"], int(options["--rounds"]), arms(options["--full_signal"])
    run = setup(parse_step3_args(argv))
    trainer = run.trainer
    saved = {"ref": trainer.ref, "teachers": dict(trainer.teachers)}
    if saved["ref"] is None or not saved["teachers"]:
        raise BenchError("the worker needs the reference and the teacher loaded (kl_ctl > 0 and a teacher)")
    cache = replay_generation(trainer)
    batches = iter(run.loader)
    step = 0
    for r in range(rounds):
        batch = next(batches)
        cache["rows"] = None
        for arm in names[r % len(names) :] + names[: r % len(names)]:
            set_arm(trainer, arm, saved)
            generated = cache["rows"] is None
            metrics, _ = trainer.step([batch], step)
            step += 1
            peaks = trainer.memory.metrics()  # this arm's peak per phase, the largest rank's (collective)
            phases = sorted(peaks)
            metrics.update(zip(phases, all_reduce_max_list([peaks[n] for n in phases])))
            if is_rank0():
                with open(out, "a") as f:
                    f.write(json.dumps({"round": r, "arm": arm, "generated": generated, **metrics}) + "\n")
                seconds = sum(metrics[k] for k in PHASES.values())
                print(f"[bench.distill] round {r} {arm}: {seconds:.2f} s", file=sys.stderr, flush=True)


def step3_command(args, model_dir: str, teacher: str, out_dir: str) -> list[str]:
    n = args.answer_len
    # the tiny model has no chat template: ChatML, whose markers are plain text to its tokenizer (longer prompts)
    tiny = ["--chat_template", "utils/chat_templates/chatml.jinja"] if args.tiny else []
    return (
        deepspeed_cmd("bench.distill", args.master_port)
        + tiny
        + [
            *("--actor_model_name_or_path", model_dir, "--teacher_model_name_or_path", teacher),
            *("--data_path", ARITHMETIC, "--data_split", "0,0,1", "--output_dir", out_dir),
            *("--advantage_estimator", "grpo", "--n_samples_per_prompt", "4", "--reward_funcs", "math_exact"),
            *("--kl_ctl", "0.05", "--kl_in_loss", "--old_logprobs", "rollout"),
            *("--actor_zero_stage", "3", "--enable_hybrid_engine", "--dtype", args.dtype),
            *("--max_prompt_seq_len", "96" if args.tiny else "64"),
            *("--max_answer_seq_len", str(n), "--min_answer_seq_len", str(n)),
            *("--temperature", "1.0", "--top_k", "0", "--top_p", "1.0"),
            *("--per_device_generation_batch_size", str(args.batch_size), "--generation_batches", "1"),
            *("--per_device_training_batch_size", str(4 * args.batch_size), "--ppo_epochs", "1"),
            *("--actor_learning_rate", "1e-6", "--lr_scheduler_type", "constant"),
            *("--max_steps", str(args.rounds * 3), "--seed", "1234"),
            *("--worker", "--bench_out", os.path.join(out_dir, "arms.jsonl")),
            *("--rounds", str(args.rounds), "--full_signal", args.full_signal),
        ]
    )


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Generation's median seconds and peak (the arms that generated), then per arm: the medians of the experience
    and training seconds over the rounds after the first, and the largest peak of each over all rounds."""
    timed = [r for r in rows if r["round"] > 0] or rows
    generated = [r[PHASES["gen"]] for r in timed if r["generated"]]
    out = {
        "generation_s": statistics.median(generated) if generated else float("nan"),
        "generation_peak_gib": peak([r for r in rows if r["generated"]], "generation"),
    }
    for arm in names:
        mine = [r for r in timed if r["arm"] == arm]
        out[arm] = {
            "rounds": len(mine),
            "exp_s": statistics.median(r[PHASES["exp"]] for r in mine),
            "train_s": statistics.median(r[PHASES["train"]] for r in mine),
            "all_exp_train_s": [round(r[PHASES["exp"]] + r[PHASES["train"]], 2) for r in mine],
            "peak_gib": {phase: peak([r for r in rows if r["arm"] == arm], phase) for phase in MEMORY[1:]},
        }
    return out


def peak(rows, phase: str) -> float:
    return max((r[f"mem/{phase}_peak_gb"] for r in rows if f"mem/{phase}_peak_gb" in r), default=float("nan"))


def report(args, s: dict, names: list[str], wall_s: float, exit_code: int) -> list[str]:
    gen = s["generation_s"]
    lines = [
        "",
        f"{args.rounds} rounds in one launch ({wall_s:.0f} s, exit {exit_code}); first round dropped; generation "
        f"median {gen:.2f} s, peak {s['generation_peak_gib']:.2f} GiB (in the arm that generated; the others reuse "
        "its rows)",
        f"{'arm':20s} {'s/iter':>7s} {'exp s':>6s} {'train s':>7s} {'vs grpo':>8s}   peak GiB exp / train"
        f"   exp+train per round (s)",
    ]
    base = gen + s["grpo"]["exp_s"] + s["grpo"]["train_s"]
    for arm in names:
        a = s[arm]
        total = gen + a["exp_s"] + a["train_s"]
        peaks = " / ".join(f"{a['peak_gib'][p]:.2f}" for p in MEMORY[1:])
        lines.append(
            f"{arm:20s} {total:7.2f} {a['exp_s']:6.2f} {a['train_s']:7.2f} {total / base:7.2f}x   {peaks:>17s}   "
            + " ".join(f"{x:.2f}" for x in a["all_exp_train_s"])
        )
    lines.append(
        "(s/iter = generation + experience + training; medians; experience: grpo = the reference's forward and the "
        "reward, distillation = the teacher's forward (no reference); peak: the largest rank's, over the rounds)"
    )
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, "a tiny random 2-layer llama as student and teacher, 3 rounds (the runner's tiny mode)")
    p.add_argument("--teacher", default=None, help="the teacher's model directory (default: the student itself)")
    p.add_argument("--rounds", type=int, default=None, help="rounds of every arm (default: tiny 3, else 5)")
    p.add_argument("--batch_size", type=int, default=4, help="rollout prompts per rank, 4 answers each (prompts)")
    p.add_argument("--answer_len", type=int, default=16, help="answer length, fixed: min = max (tokens)")
    p.add_argument(
        "--full_signal",
        choices=["reverse_kl", "forward_kl", "jsd"],
        default="reverse_kl",
        help="the full-vocabulary distillation signal timed beside reverse_kl_sampled",
    )
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="the models' dtype (fp32 on CPU)")
    add_run_args(p, 29571, 1200, save_help="also write the printed report to this file, the figures as JSON beside it")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (3 if args.tiny else 5)
    if args.rounds < 2:
        raise BenchError("--rounds must be >= 2 (the first round is a warm-up)")
    return args


def main(argv=None):
    args = parse_args(argv)
    model_dir = bench_model(args)
    teacher = args.teacher or model_dir
    probe = sgemm_gflops()
    names = arms(args.full_signal)
    header = start_report(
        [
            title("distill.py"),
            machine_line(),
            f"host probe: 1-thread sgemm {probe} GFLOP/s",
            malloc_line(),
            f"student: {model_dir}; teacher: {teacher}; {args.dtype}; 2 CPU ranks (gloo), ZeRO-3 + hybrid generation",
            f"rollout: {args.batch_size} arithmetic prompts x 4 answers per rank, answers exactly {args.answer_len} "
            f"tokens (T=1), one optimizer step per rollout; arms {', '.join(names)}",
        ]
    )
    out_dir = fresh_dir(os.path.join(RUNS, "distill", os.path.basename(model_dir.rstrip("/"))))
    cmd = step3_command(args, model_dir, teacher, out_dir)
    run = run_logged(cmd, bench_env(), os.path.join(out_dir, "launch.log"), args.timeout)
    path = os.path.join(out_dir, "arms.jsonl")
    rows = read_jsonl(path) if os.path.exists(path) else []
    if len(rows) < 2 * len(names):
        raise launch_failed(f"{len(rows)} arm iterations (exit {run.returncode}; log tail above)", run.tail())
    s = summarize(rows, names)
    end_report(args.save, header, report(args, s, names, run.wall_s, run.returncode), data={"probe": probe, **s})


if __name__ == "__main__":
    main_or_worker(main, worker, flag="--worker")
