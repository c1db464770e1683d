"""Benchmark of the real step 3 (python -m step3_ppo.main, deepspeed launcher, 2 CPU ranks).

    python bench/step3.py --tiny                                  # tiny random llama
    python bench/step3.py                                         # SmolLM2-135M-shaped model
    python bench/step3.py --save bench/results/2026-11-30-step3-smol.txt
    python bench/step3.py --ab [--tiny]     # hybrid on/off A/B in ONE process (side by side)

For each configuration (default: ZeRO-3 and ZeRO-2 for actor AND critic, each with and without
--enable_hybrid_engine) it runs --steps PPO iterations of the unmodified step 3 on the same model
(actor = reference = the model; critic = reward model = its backbone + a fresh seeded value head,
saved once as a reward-model directory under bench/runs/reward_models), then reads OUTPUT_DIR/metrics.jsonl: the
first iteration is a warm-up and is dropped; the rest give the median seconds per iteration
(time/generation_s + time/experience_s + time/train_s, rank 0), the median samples/s (the
trainer's own samples_per_s: rows of both ranks / iteration time) and the share of generation,
experience making (the four no-grad forwards: actor, reference, critic, reward) and training
(PPO epochs: actor + critic forward/backward/step) in the summed iteration time.

Prompts: the first --num_prompts prompts of data/demo_raw/pairs/train.jsonl written as a JSONL of
{"prompt"} rows (bench/runs/prompts.jsonl; the TRL peer reads the same file), all given to step 3
(--data_split 0,0,1). Answers have a FIXED length (--min_answer_seq_len = --max_answer_seq_len),
sampled at temperature 1 (top_k 0, top_p 1), so every configuration does the same work.
Configurations run one after the other (not interleaved): their ratios carry the drift of the
shared machine between runs; 'cpu/wall' (CPU seconds of both ranks / wall seconds of the launch,
2.0 = both cores ours) shows how much of the machine each run got.
"""

from __future__ import annotations

import argparse
import json
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
    start_report,
    title,
    worker_argv,
)

DEMO_PAIRS = os.path.join(REPO, "data", "demo_raw", "pairs", "train.jsonl")  # raw rows: the figures in bench/results
CONFIGS = {  # name: (actor/critic ZeRO stage, --enable_hybrid_engine)
    "z3+hybrid": (3, True),
    "z3": (3, False),
    "z2+hybrid": (2, True),
    "z2": (2, False),
}


def write_prompts(path: str, n: int) -> str:
    """The first n prompts of the demo pairs as {"prompt"} rows (shared with bench/peer_trl.py)."""
    if not os.path.exists(DEMO_PAIRS):
        raise BenchError(
            f"{DEMO_PAIRS} is missing (python -m data.make_demo_data --out data/demo_raw --seed 0 --format raw)"
        )
    rows = []
    with open(DEMO_PAIRS) as f:
        for line in f:
            if line.strip():
                rows.append({"prompt": json.loads(line)["prompt"]})
            if len(rows) == n:
                break
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def reward_model_dir(model_dir: str) -> str:
    """The critic / reward model of the benchmark: the model's backbone + a fresh seeded value head, made
    once under bench/runs (step 3 refuses a plain causal LM as --critic_model_name_or_path)."""
    from utils.models.reward_model import VALUE_HEAD_FILE, make_reward_model_dir  # torch: here to keep --help fast

    out = os.path.join(RUNS, "reward_models", os.path.basename(model_dir.rstrip("/")))
    if not os.path.isfile(os.path.join(out, VALUE_HEAD_FILE)):
        make_reward_model_dir(model_dir, out)
    return out


def step3_command(
    args,
    model_dir: str,
    prompts: str,
    stage: int,
    hybrid: bool,
    out_dir: str,
    port: int,
    module: str = "step3_ppo.main",
) -> list[str]:
    """The launch of step 3 on the benchmark's workload; `module` runs it (step3_ppo.main, or a bench worker
    that calls it: bench.step3 --ab_worker, bench.memory_step3 --worker, bench.profile_step3 --worker)."""
    cmd = deepspeed_cmd(module, port) + [
        "--actor_model_name_or_path",
        model_dir,
        "--critic_model_name_or_path",
        reward_model_dir(model_dir),
        "--data_path",
        prompts,
        "--data_split",
        "0,0,1",
        "--actor_zero_stage",
        str(stage),
        "--critic_zero_stage",
        str(stage),
        "--dtype",
        "fp32",
        "--max_prompt_seq_len",
        str(args.prompt_len),
        "--max_answer_seq_len",
        str(args.answer_len),
        "--min_answer_seq_len",
        str(args.answer_len),
        "--temperature",
        "1.0",
        "--top_k",
        "0",
        "--top_p",
        "1.0",
        "--per_device_generation_batch_size",
        str(args.batch_size),
        "--generation_batches",
        "1",
        "--per_device_training_batch_size",
        str(args.train_batch_size),
        "--ppo_epochs",
        str(args.ppo_epochs),
        "--actor_learning_rate",
        "1e-6",
        "--critic_learning_rate",
        "1e-6",
        "--lr_scheduler_type",
        "constant",
        "--max_steps",
        str(args.steps),
        "--seed",
        "1234",
        "--output_dir",
        out_dir,
    ]
    if hybrid:
        cmd.append("--enable_hybrid_engine")
    return cmd


def summarize(rows: list[dict], warmup: int) -> dict:
    timed = rows[warmup:] or rows
    parts = {"gen": "time/generation_s", "exp": "time/experience_s", "train": "time/train_s"}
    step_s = [sum(r[k] for k in parts.values()) for r in timed]
    total = sum(step_s)
    peaks = {
        phase: max(r[f"mem/{phase}_peak_gb"] for r in rows if f"mem/{phase}_peak_gb" in r)
        for phase in ("generation", "experience", "training")
        if any(f"mem/{phase}_peak_gb" in r for r in rows)
    }
    return {
        "steps_timed": len(timed),
        "step_s": statistics.median(step_s),
        "all_step_s": step_s,
        "peak_rss_gib": peaks,  # per phase, the largest rank's, over all iterations (warm-up included)
        "samples_per_s": statistics.median(r["samples_per_s"] for r in timed),
        **{f"{name}_s": statistics.median(r[k] for r in timed) for name, k in parts.items()},
        **{f"{name}_share": sum(r[k] for r in timed) / total for name, k in parts.items()},
    }


PHASE_HEAD = (
    f"{'s/iter':>7s} {'samples/s':>9s} {'gen s':>6s} {'exp s':>6s} {'train s':>7s} "
    f"{'gen %':>6s} {'exp %':>6s} {'train %':>7s}"
)


def phase_cells(r: dict) -> str:
    """One summarize() result under PHASE_HEAD: medians (s), samples/s, shares (%)."""
    return (
        f"{r['step_s']:7.2f} {r['samples_per_s']:9.2f} {r['gen_s']:6.2f} {r['exp_s']:6.2f} {r['train_s']:7.2f} "
        f"{100 * r['gen_share']:5.1f}% {100 * r['exp_share']:5.1f}% {100 * r['train_share']:6.1f}%"
    )


def biggest_share(r: dict) -> tuple[str, float]:
    """The phase with the largest share of a summarize() result, and that share."""
    shares = {"generation": r["gen_share"], "experience (4 forwards)": r["exp_share"], "training": r["train_share"]}
    big = max(shares, key=shares.get)
    return big, shares[big]


def logits_to_keep_logprobs(
    model, batch: dict, temperature: float, return_entropy: bool = False, entropy_grad: bool = False
):
    """PROPOSED policy forward, passed through PPOTrainer's `logprobs_fn` seam for the A/B only: the
    LM head (and log-softmax) only for the positions that predict response tokens (transformers'
    `logits_to_keep`), not for the prompt. Same contract as utils.models.forward.token_logprobs."""
    import torch  # imported here to keep --help fast

    from utils.math.ops import entropy_from_logits, logprobs_from_logits, position_ids_from_attention_mask
    from utils.models.forward import model_device

    device = model_device(model)
    input_ids, attention_mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    p, length = batch["prompt_len"], input_ids.shape[1]
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_attention_mask(attention_mask),
        use_cache=False,
        logits_to_keep=length - p + 1,
    )
    logits = out.logits[:, :-1]  # positions p-1 .. L-2: they predict the response tokens p .. L-1
    if temperature != 1.0:
        logits = logits / temperature
    pad = torch.zeros((input_ids.shape[0], p - 1), device=device)
    logprobs = torch.cat([pad, logprobs_from_logits(logits, input_ids[:, p:])], dim=1)
    if return_entropy:
        return logprobs, torch.cat([pad, entropy_from_logits(logits if entropy_grad else logits.detach())], dim=1)
    return logprobs


SHORTEST_ANSWER = 8  # --ab_variant padding_free: answers cut to lengths drawn from [this, --answer_len]


def vary_answer_lengths(trainer) -> None:
    """Every rollout answer cut to a length drawn uniformly from [SHORTEST_ANSWER, its generated length] (seeded
    by the row's group and place), its last token made the EOS: the rows of a rollout whose answers end anywhere
    between 8 and --answer_len tokens, as a reasoning model's do, which a fixed-length benchmark never has. The
    cut is the same in both arms of the A/B run (it depends on the iteration's rows only)."""
    import torch  # lazy: the worker only (keeps --help fast)

    generate_rows = trainer.generate_rows
    eos = trainer.config.stop_token_ids[0]

    def cut(*args, **kwargs):
        rows = generate_rows(*args, **kwargs)
        for i, row in enumerate(rows):
            longest = row.response_ids.numel()
            g = torch.Generator().manual_seed(1_000_003 * row.group + i)
            n = int(torch.randint(min(SHORTEST_ANSWER, longest), longest + 1, (1,), generator=g))
            row.response_ids = torch.cat([row.response_ids[: n - 1], torch.tensor([eos])])
            row.ended_with_eos = True
            row.per_action = {name: values[:n] for name, values in row.per_action.items()}
        return rows

    trainer.generate_rows = cut


def ab_worker(argv) -> None:
    """One rank of the A/B run: step 3's own setup() and PPOTrainer.step(), alternating per
    iteration between arm A and arm B (A, B, A, ...): both arms share the process, the engines and
    the moment, so their ratio is side by side. Rank 0 appends one JSON row per iteration.
    --ab_variant hybrid: A = plain generation, B = hybrid generation mode.
    --ab_variant logits_to_keep: both hybrid; B with the proposed policy forward (logits_to_keep_logprobs),
    given to the trainer through its logprobs_fn seam."""
    from step3_ppo.main import parse_args as parse_step3_args  # torch: imported here to keep --help fast
    from step3_ppo.main import setup
    from utils.models.forward import token_logprobs
    from utils.runtime.distributed import is_rank0

    argv, options = worker_argv(argv, "--ab_worker", "--ab_out", "--ab_variant", "--ab_budget")
    out, variant = options["--ab_out"], options["--ab_variant"]
    run = setup(parse_step3_args(argv))
    batches = iter(run.loader)
    if variant == "padding_free":
        vary_answer_lengths(run.trainer)
    for step in range(run.total_steps):
        arm_b = step % 2 == 1
        extra = {}
        if variant == "hybrid":
            run.trainer.config.enable_hybrid_engine = arm_b
        elif variant == "padding_free":
            run.trainer.config.enable_hybrid_engine = True
            run.trainer.config.padding_free = arm_b
            run.trainer.config.max_tokens_per_micro_batch = int(options["--ab_budget"]) if arm_b else 0
        else:
            run.trainer.config.enable_hybrid_engine = True
            run.trainer.logprobs_fn = logits_to_keep_logprobs if arm_b else token_logprobs
            if step == 0:  # the proposed log-probs against the project's on one packed batch
                extra["logprobs_max_abs_diff"] = logprobs_max_abs_diff(run)
        metrics, _ = run.trainer.step([next(batches)], step)
        if is_rank0():
            with open(out, "a") as f:
                f.write(json.dumps({"step": step, "hybrid": arm_b, **extra, **metrics}) + "\n")
            print(
                f"[bench.step3 ab] iteration {step} arm {'B' if arm_b else 'A'}: "
                f"{sum(metrics[k] for k in ('time/generation_s', 'time/experience_s', 'time/train_s')):.2f} s",
                file=sys.stderr,
                flush=True,
            )


def logprobs_max_abs_diff(run) -> float:
    """The proposed logits_to_keep_logprobs against the project's token_logprobs on one packed rollout batch of
    step 3's `run` (largest absolute difference over the action positions)."""
    import torch  # imported here to keep --help fast

    from utils.math.rows import pack
    from utils.models.forward import token_logprobs

    rows = run.trainer.generate_rows(next(iter(run.loader)))
    batch = pack(rows, run.trainer.config.pad_token_id)
    with torch.no_grad():
        a = token_logprobs(run.trainer.actor, batch, 1.0)
        b = logits_to_keep_logprobs(run.trainer.actor, batch, 1.0)
    mask = batch["action_mask"]
    return float(((a - b) * mask).abs().max())


def run_ab(args, model_dir, prompts) -> list[str]:
    stage = args.ab_stage
    out_dir = fresh_dir(
        os.path.join(RUNS, "step3", f"{os.path.basename(model_dir.rstrip('/'))}-ab-{args.ab_variant}-z{stage}")
    )
    ab_out = os.path.join(out_dir, "ab.jsonl")
    cmd = step3_command(args, model_dir, prompts, stage, False, out_dir, args.master_port, module="bench.step3")
    cmd += ["--ab_worker", "--ab_out", ab_out, "--ab_variant", args.ab_variant, "--ab_budget", str(args.ab_budget)]
    run = run_logged(cmd, bench_env(), os.path.join(out_dir, "launch.log"), args.timeout)
    rows = read_jsonl(ab_out) if os.path.exists(ab_out) else []
    if len(rows) < 4:
        raise launch_failed(f"A/B run: {len(rows)} iterations (exit {run.returncode}; log tail above)", run.tail())
    return ab_report(args, rows, run)


def ab_report(args, rows: list[dict], run) -> list[str]:
    """The A/B table: one row per arm (the first pair of iterations dropped), their ratios, the biggest share."""
    timed = rows[2:]  # the first plain/hybrid pair is the warm-up
    names = {
        "hybrid": ("plain", "hybrid"),
        "logits_to_keep": ("project", "proposed"),
        "padding_free": ("padded", "packed"),
    }[args.ab_variant]
    what = {
        "hybrid": "plain / hybrid generation",
        "padding_free": f"padded / --padding_free --max_tokens_per_micro_batch {args.ab_budget} (0: off), hybrid on in "
        f"both, answers cut to {SHORTEST_ANSWER}-{args.answer_len} tokens",
        "logits_to_keep": "the project's token_logprobs / the PROPOSED one with logits_to_keep (hybrid on in both)",
    }
    lines = [
        "",
        f"A/B in ONE process (ZeRO-{args.ab_stage} actor and critic; iterations alternate "
        f"{what[args.ab_variant]}; first pair dropped; {len(timed)} timed; launch {run.wall_s:.0f} s, "
        f"exit {run.returncode})",
        f"{'arm':8s} {PHASE_HEAD}   all iterations (s)",
    ]
    arms = {}
    for hybrid in (False, True):
        arm = summarize([r for r in timed if r["hybrid"] == hybrid], 0)
        arms[hybrid] = arm
        lines.append(f"{names[hybrid]:8s} {phase_cells(arm)}   " + " ".join(f"{x:.2f}" for x in arm["all_step_s"]))
    p, h = arms[False], arms[True]
    if "logprobs_max_abs_diff" in rows[0]:
        lines.append(
            f"log-probs of the proposed logits_to_keep_logprobs vs the project's on one rollout batch: max abs diff "
            f"{rows[0]['logprobs_max_abs_diff']:.2e} (action positions)"
        )
    lines.append(
        f"{names[1]} over {names[0]} (side by side): {p['step_s'] / h['step_s']:.2f}x per iteration, generation "
        f"{p['gen_s'] / h['gen_s']:.2f}x, experience {p['exp_s'] / h['exp_s']:.2f}x, training "
        f"{p['train_s'] / h['train_s']:.2f}x"
    )
    big, share = biggest_share(h)
    lines.append(f"biggest share with {names[1]}: {big} ({100 * share:.0f}%)")
    return lines


def by_name(results):
    return {r["name"]: r for r in results}


def run_config(args, model_dir, prompts, name, port, command=None) -> dict:
    """One launch of step 3 (`command(out_dir, port)`, default: CONFIGS[name]'s step3_command) and its figures."""
    stage, hybrid = CONFIGS.get(name, (None, None))
    out_dir = fresh_dir(
        os.path.join(RUNS, "step3", f"{os.path.basename(model_dir.rstrip('/'))}-{name.replace('+', '_')}")
    )
    cmd = (
        command(out_dir, port)
        if command is not None
        else step3_command(args, model_dir, prompts, stage, hybrid, out_dir, port)
    )
    run = run_logged(cmd, bench_env(), os.path.join(out_dir, "launch.log"), args.timeout)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(metrics_path) or os.path.getsize(metrics_path) == 0:
        tail = run.tail()
        oom = " (a rank was KILLED, signal 9: out of memory?)" if "return code = -9" in tail else ""
        raise launch_failed(f"{name}: no metrics (exit {run.returncode}){oom}; log tail above", tail)
    rows = read_jsonl(metrics_path)
    for sub in ("actor", "critic"):  # the exported models are not needed here (hundreds of MB each)
        shutil.rmtree(os.path.join(out_dir, sub), ignore_errors=True)
    result = {
        "name": name,
        "zero_stage": stage,
        "hybrid": hybrid,
        "exit": run.returncode,
        "wall_s": run.wall_s,
        "out_dir": out_dir,
        "rows": rows,
        "max_rss_mib": run.max_rss_mib,
        "cpu_s": run.cpu_s,
        "iterations": len(rows),
        **summarize(rows, args.warmup),
    }
    print(
        f"  [{run.wall_s:.0f} s] {name}: exit {run.returncode}, {len(rows)} iterations, "
        f"median {result['step_s']:.2f} s/iteration, largest process so far {result['max_rss_mib']:.0f} MiB",
        file=sys.stderr,
        flush=True,
    )
    return result


def add_ppo_args(p) -> None:
    """The rollout and PPO-update flags that step3_command reads (bench/profile_step3.py has these alone)."""
    p.add_argument("--prompt_len", type=int, default=32, help="longest prompt, step 3's --max_prompt_seq_len (tokens)")
    p.add_argument("--answer_len", type=int, default=24, help="answer length, fixed: min = max (tokens)")
    p.add_argument(
        "--batch_size", type=int, default=8, help="rollout prompts per rank, --per_device_generation_batch_size (rows)"
    )
    p.add_argument(
        "--train_batch_size",
        type=int,
        default=4,
        help="PPO mini-batch per rank, --per_device_training_batch_size (rows)",
    )
    p.add_argument("--ppo_epochs", type=int, default=1, help="passes of PPO updates over each rollout (epochs)")


def add_workload_args(p, steps_help: str) -> None:
    """The model and the PPO workload flags that step3_command reads (bench/peer_trl.py and
    bench/memory_step3.py launch the same workload)."""
    add_model_args(p)
    p.add_argument("--steps", type=int, default=None, help=steps_help)
    p.add_argument("--warmup", type=int, default=1, help="first iterations left out of the medians (iterations)")
    add_ppo_args(p)
    p.add_argument(
        "--num_prompts",
        type=int,
        default=256,
        help="prompts of the demo pairs written to bench/runs/prompts.jsonl (rows)",
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_workload_args(p, "PPO iterations per run (iterations; default: tiny 6, else 3; --ab: tiny 10, else 8)")
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"configurations to run one after the other, comma-separated, from {list(CONFIGS)}",
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="instead of the four launches: ONE launch whose iterations alternate plain/hybrid generation",
    )
    p.add_argument("--ab_stage", type=int, default=3, choices=[2, 3], help="ZeRO stage of the A/B run (2 or 3)")
    p.add_argument(
        "--ab_variant",
        choices=["hybrid", "logits_to_keep", "padding_free"],
        default="hybrid",
        help="hybrid: plain vs hybrid generation; logits_to_keep: the proposed logits_to_keep_logprobs vs the "
        "project's; padding_free: padded vs --padding_free (+ --ab_budget) on answers of 8 to --answer_len tokens",
    )
    p.add_argument(
        "--ab_budget",
        type=int,
        default=0,
        help="--ab_variant padding_free: the packed arm's --max_tokens_per_micro_batch (tokens; 0: off)",
    )
    add_run_args(
        p, 29541, 600, save_help="also write the printed report to this file, and the figures as JSON beside it (path)"
    )
    args = p.parse_args(argv)
    args.steps = args.steps or ((10 if args.tiny else 8) if args.ab else (6 if args.tiny else 3))
    args.names = [n for n in args.configs.split(",") if n]
    for n in args.names:
        if n not in CONFIGS:
            raise BenchError(f"unknown configuration {n!r}; choose from {list(CONFIGS)}")
    return args


def header_lines(args, model_dir: str, prompts: str) -> list[str]:
    import deepspeed  # imported here to keep --help fast (their versions head the report)
    import torch
    import transformers

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    runs = (
        f"{args.steps} iterations in one run"
        if args.ab
        else f"{args.steps} iterations per run (first {args.warmup} dropped)"
    )
    return [
        title("step3.py"),
        machine_line(),
        malloc_line(),
        f"launch: deepspeed --num_gpus 2 --module step3_ppo.main (2 CPU ranks, gloo), OMP_NUM_THREADS=1; "
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}",
        f"model: {model_dir} ({cfg.get('model_type')}, hidden {cfg.get('hidden_size')}, layers "
        f"{cfg.get('num_hidden_layers')}, vocab {cfg.get('vocab_size')}), fp32, full fine-tuning (no LoRA), "
        f"actor = reference, critic = reward = backbone + fresh value head",
        f"PPO: {runs}, rollout {args.batch_size} prompts per "
        f"rank (x2 ranks), prompt <= {args.prompt_len} tokens, answer exactly {args.answer_len} tokens "
        f"(sampled, T=1), PPO mini-batch {args.train_batch_size}, {args.ppo_epochs} PPO epoch(s)",
        f"prompts: {prompts} ({args.num_prompts} rows from data/demo_raw/pairs/train.jsonl), --data_split 0,0,1",
    ]


def configs_report(results: list[dict]) -> list[str]:
    """The table of the configurations, their peak memory, biggest shares and speed-ups."""
    out = ["", f"{'config':11s} {PHASE_HEAD} {'wall s':>7s} {'cpu/wall':>8s}   all iterations (s)"]
    for r in results:
        out.append(
            f"{r['name']:11s} {phase_cells(r)} {r['wall_s']:7.0f} {r['cpu_s'] / r['wall_s']:8.2f}   "
            + " ".join(f"{s:.2f}" for s in r["all_step_s"])
        )
    out.append(
        "(s/iter, gen/exp/train s: medians of rank 0's iteration times; %: share of the summed timed "
        "iterations; wall s: whole launch incl. start-up, model loading and the final export)"
    )
    out.append(
        "peak RSS of the largest rank process after its last phase (MiB; Linux resets ru_maxrss with the "
        "VmHWM that each phase resets, so this covers the last training phase and the export): "
        + ", ".join(f"{r['name']} {r['max_rss_mib']:.0f}" for r in results)
    )
    out.append(
        "peak RSS per phase (GiB, largest rank, max over iterations; utils.runtime.accelerator.PhaseMemory): "
        + "; ".join(f"{r['name']} " + " / ".join(f"{k} {v:.2f}" for k, v in r["peak_rss_gib"].items()) for r in results)
    )
    by = by_name(results)
    if "z2+hybrid" in by and "z2" in by:
        out.append(
            "note: without LoRA, z2 and z2+hybrid run the SAME code (no ZeRO-3 gather, nothing to merge): "
            "their difference is the run-to-run noise of this machine"
        )
    for r in results:
        big, share = biggest_share(r)
        out.append(f"biggest share in {r['name']}: {big} ({100 * share:.0f}%)")
    for a, b in (("z3+hybrid", "z3"), ("z2+hybrid", "z2"), ("z2+hybrid", "z3+hybrid"), ("z2", "z3")):
        if a in by and b in by:
            out.append(
                f"speed-up {a} over {b}: {by[b]['step_s'] / by[a]['step_s']:.2f}x per iteration "
                f"(generation {by[b]['gen_s'] / by[a]['gen_s']:.2f}x)"
            )
    return out


def main(argv=None):
    args = parse_args(argv)
    model_dir = bench_model(args)
    prompts = write_prompts(os.path.join(RUNS, "prompts.jsonl"), args.num_prompts)
    header = start_report(header_lines(args, model_dir, prompts))
    if args.ab:
        end_report(args.save, header, run_ab(args, model_dir, prompts))
        return
    results = [run_config(args, model_dir, prompts, name, args.master_port + i) for i, name in enumerate(args.names)]
    end_report(args.save, header, configs_report(results), data=results)


if __name__ == "__main__":
    main_or_worker(main, ab_worker, flag="--ab_worker")
