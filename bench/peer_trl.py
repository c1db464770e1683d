"""Side-by-side: our step 3 against TRL 1.12.0's PPO trainer (trl.experimental.ppo) on 2 CPU ranks.

    python3 -m venv bench/.venv-trl && bench/.venv-trl/bin/pip install -r bench/requirements.txt   # once
    python bench/peer_trl.py --tiny                      # (project venv) tiny random llama
    python bench/peer_trl.py                             # SmolLM2-135M-shaped model
    python bench/peer_trl.py --save bench/results/2026-11-30-peer-trl.txt

Same model, prompts (bench/runs/prompts.jsonl, tokenized by the project's utils.data.tokenize_prompts
on both sides), rollout (--batch_size prompts per rank x 2 ranks), answer length (fixed: ours
min = max; TRL has no stop token, so it always generates response_length tokens), sampling at
temperature 1 (top_k 0, top_p 1), PPO mini-batch (--train_batch_size), PPO epochs, fp32 (TRL:
bf16=False and ACCELERATE_MIXED_PRECISION=no), no gradient checkpointing (TRL's default is on:
turned off), the same ZeRO stage on both sides (--zero_stage, default 3; ours: --actor/critic_zero_stage
and --enable_hybrid_engine; TRL: through accelerate's environment (ACCELERATE_USE_DEEPSPEED
and its DEEPSPEED_* variables) with the same ZeRO section as ours, ds3_gather_for_generation=True), torch AdamW on
both sides, no eval generations (num_sample_generations=0), no saving.

TRL batch mapping: per_device_train_batch_size = rollout per rank, gradient_accumulation_steps 1,
num_mini_batches = rollout / mini-batch, so each PPO epoch does rollout/mini-batch optimizer steps
on mini-batches of --train_batch_size rows, as ours does (TRL steps policy and value together).

Timing: the first --warmup iterations are dropped; median over the rest. Ours: the trainer's own
per-iteration time (rank 0, metrics.jsonl). TRL: the wall time between consecutive on_step_end
callbacks on rank 0 (includes TRL's per-step logging and its two gc.collect() calls), with
generation = TRL's generation context (unwrap_model_for_generation: ZeRO-3 gather, generate,
release; ours: the hybrid generation mode's enter + generate + exit), experience = from there to
the first grad-enabled forward, training = from there to the end of the iteration's updates
and logging; 'other' = the rest of TRL's iteration (its two gc.collect() calls, data loading). samples/s = rollout rows
of both ranks / iteration seconds. The two runs go one after the other (ours first), each alone on the shared machine.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import glob
import importlib.metadata as md
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import step3  # noqa: E402
from bench.common import (  # noqa: E402
    RUNS,
    BenchError,
    add_run_args,
    alternate,
    bench_env,
    bench_model,
    end_report,
    machine_line,
    main_or_worker,
    malloc_line,
    median_result,
    rounds_lines,
    run_logged,
    start_report,
    title,
    torchrun_cmd,
)

TRL_VENV = os.path.join(REPO, "bench", ".venv-trl")
MALLOC_ENV: dict[str, str] = {}  # tune_malloc's settings as MALLOC_* variables, for TRL's processes too


def malloc_env() -> dict[str, str]:
    """MALLOC_ENV, filled on first use (--malloc_trim_threshold changes it for the whole run)."""
    if not MALLOC_ENV:
        from utils.runtime.distributed import malloc_tuning_env  # torch: imported here to keep --help fast

        MALLOC_ENV.update(malloc_tuning_env())
    return MALLOC_ENV


# --------------------------------------------------------------------------------------- TRL worker
WORKER_FLAGS = {  # the TRL worker's flags (all required): type, help
    "model_name_or_path": (str, "model directory"),
    "prompts": (str, 'prompt rows, {"prompt"} per line (JSONL path)'),
    "prompt_len": (int, "longest prompt (tokens)"),
    "answer_len": (int, "answer length, TRL's response_length (tokens)"),
    "batch_size": (int, "rollout prompts per rank (rows)"),
    "train_batch_size": (int, "PPO mini-batch per rank (rows)"),
    "ppo_epochs": (int, "passes of PPO updates over each rollout (epochs)"),
    "steps": (int, "PPO iterations (iterations)"),
    "output_dir": (str, "TRL's output directory (path)"),
    "out": (str, "rank 0's result file (JSON path)"),
}


def worker(argv) -> None:
    """One rank of TRL's PPO (run by torchrun in bench/.venv-trl)."""
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help="run as one rank of TRL's PPO (in TRL's venv)")
    for name, (kind, text) in WORKER_FLAGS.items():
        p.add_argument(f"--{name}", type=kind, required=True, help=text)
    args = p.parse_args(argv)

    from accelerate import PartialState  # TRL's venv: imported here, also to keep --help fast

    # before the config and the models; without backend="gloo" it reports 1 process on CPU
    state = PartialState(backend="gloo")
    if state.num_processes != int(os.environ.get("WORLD_SIZE", "1")):
        raise BenchError(
            f"accelerate sees {state.num_processes} process(es), WORLD_SIZE is {os.environ.get('WORLD_SIZE')}"
        )
    from datasets import Dataset
    from transformers import DataCollatorWithPadding
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    from utils.data import tokenize_prompts
    from utils.models.loading import load_tokenizer

    tokenizer = load_tokenizer(args.model_name_or_path, padding_side="left")  # same pad handling as ours
    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts, _ = tokenize_prompts(rows, tokenizer, args.prompt_len)
    dataset = Dataset.from_dict({"input_ids": [r["input_ids"] for r in prompts]})
    rollout_total = args.batch_size * state.num_processes
    config = ppo_config(args, state.num_processes, rollout_total)
    policy, ref, value, reward = ppo_models(args, tokenizer)
    marks = instrument(trl_ppo)
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        eval_dataset=dataset.select(range(8)),
        data_collator=DataCollatorWithPadding(tokenizer),
        callbacks=[step_times(marks)],
    )
    trainer.train()
    steps = iteration_times(marks, rollout_total)
    if state.is_main_process:
        write_result(args.out, trainer, config, state, steps, marks)


def ppo_config(args, world_size: int, rollout_total: int):
    """TRL's PPOConfig for our workload (its batch mapping: the module docstring)."""
    from trl.experimental.ppo import PPOConfig  # TRL's venv: imported here, also to keep --help fast

    return PPOConfig(
        output_dir=args.output_dir,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        num_mini_batches=args.batch_size // args.train_batch_size,
        num_ppo_epochs=args.ppo_epochs,
        local_rollout_forward_batch_size=args.batch_size,
        response_length=args.answer_len,
        stop_token=None,
        temperature=1.0,
        total_episodes=args.steps * rollout_total,
        num_sample_generations=0,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        kl_coef=0.05,
        seed=1234,
        ddp_backend="gloo",
        world_size=world_size,
        dataloader_num_workers=0,
        ds3_gather_for_generation=True,
    )


def ppo_models(args, tokenizer) -> tuple:
    """Policy, reference, value model and reward model (the last two: the model with a scalar head), fp32, the
    embedding resized to the tokenizer as ours is."""
    import torch  # TRL's venv: imported here, also to keep --help fast
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    def causal_lm():
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
        if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        model.config.pad_token_id = model.generation_config.pad_token_id = tokenizer.pad_token_id
        return model

    def scalar_head():
        model = AutoModelForSequenceClassification.from_pretrained(
            args.model_name_or_path, num_labels=1, dtype=torch.float32
        )
        if model.get_input_embeddings().weight.shape[0] < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        model.config.pad_token_id = tokenizer.pad_token_id
        return model

    return causal_lm(), causal_lm(), scalar_head(), scalar_head()


def instrument(trl_ppo) -> dict:
    """Times TRL's generation context, marks each iteration's first grad-enabled forward (training starts) and
    times its gc.collect() calls, by patching TRL's PPO module; returns where the marks collect."""
    import torch  # TRL's venv: imported here, also to keep --help fast

    marks = {"step_end": [], "gen": [], "train_start": []}
    original_unwrap, original_forward = trl_ppo.unwrap_model_for_generation, trl_ppo.forward

    @contextlib.contextmanager
    def timed_unwrap(*a, **k):  # generation = TRL's whole generation context (ZeRO-3 gather + generate + release)
        start = time.time()
        with original_unwrap(*a, **k) as model:
            yield model
        marks["gen"].append((start, time.time()))

    def marked_forward(*a, **k):
        if torch.is_grad_enabled() and len(marks["train_start"]) < len(marks["gen"]):
            marks["train_start"].append(time.time())
        return original_forward(*a, **k)

    trl_ppo.unwrap_model_for_generation, trl_ppo.forward = timed_unwrap, marked_forward

    marks["gc"] = []

    class TimedGC:  # TRL calls gc.collect() twice per iteration: how long do they take?
        def collect(self, *a):
            start = time.time()
            n = gc.collect(*a)
            marks["gc"].append(time.time() - start)
            return n

    trl_ppo.gc = TimedGC()
    return marks


def step_times(marks: dict):
    """A TrainerCallback marking the start of training and the end of every iteration."""
    from transformers import TrainerCallback  # TRL's venv: imported here, also to keep --help fast

    class StepTimes(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks["begin"] = time.time()

        def on_step_end(self, *a, **k):
            marks["step_end"].append(time.time())

    return StepTimes()


def iteration_times(marks: dict, rollout_total: int) -> list[dict]:
    """Per iteration: its seconds, split into generation / experience / training / other, and samples/s."""
    ends = marks["step_end"]
    starts = [marks["begin"]] + ends[:-1]
    steps = []
    for i, (s, e) in enumerate(zip(starts, ends)):
        g0, g1 = marks["gen"][i]
        t0 = marks["train_start"][i] if i < len(marks["train_start"]) else e
        steps.append(
            {
                "step_s": e - s,
                "gen_s": g1 - g0,
                "exp_s": t0 - g1,
                "train_s": e - t0,
                "other_s": (g0 - s),
                "samples_per_s": rollout_total / (e - s),
            }
        )
    return steps


def write_result(path: str, trainer, config, state, steps: list[dict], marks: dict) -> None:
    import torch  # TRL's venv: imported here, also to keep --help fast
    import trl

    engine = trainer.model
    with open(path, "w") as f:
        json.dump(
            {
                "steps": steps,
                "gc_s_per_iteration": sum(marks["gc"]) / max(len(steps), 1),
                "trl": trl.__version__,
                "torch": torch.__version__,
                "deepspeed_enabled": trainer.is_deepspeed_enabled,
                "zero_stage": getattr(getattr(engine, "zero_optimization_stage", None), "__call__", lambda: None)(),
                "world_size": state.num_processes,
                "torch_threads": torch.get_num_threads(),
                "config": {
                    k: getattr(config, k)
                    for k in (
                        "per_device_train_batch_size",
                        "num_mini_batches",
                        "local_mini_batch_size",
                        "batch_size",
                        "num_ppo_epochs",
                        "response_length",
                        "temperature",
                        "bf16",
                        "gradient_checkpointing",
                        "num_total_batches",
                    )
                },
            },
            f,
        )


# ------------------------------------------------------------------------------------- orchestrator
def ds_config_file(path: str, stage: int) -> str:
    """Our ZeRO section (utils.train.ds_config) for TRL through accelerate, batch sizes left to accelerate."""
    from utils.train.ds_config import _zero_section  # torch: imported here to keep --help fast

    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": 1.0,
        "zero_optimization": _zero_section(stage, False, False),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
    }
    with open(path, "w") as f:
        json.dump(config, f, indent=1)
    return path


def first_error_line(text: str) -> str:
    """The line naming the exception of the first traceback (else the last non-empty line)."""
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            for later in lines[i + 1 :]:
                if not later.startswith((" ", "\t", "Traceback")) and (
                    "Error" in later or "Exception" in later or ":" in later
                ):
                    return later.strip()
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()
    return lines[-1] if lines else "(no output)"


def venv_versions(venv: str) -> str:
    """The TRL venv's package versions from its metadata (no process: it would count in our ru_maxrss)."""
    sites = glob.glob(os.path.join(venv, "lib", "python*", "site-packages"))
    found = {d.metadata["Name"].lower(): d.version for d in md.distributions(path=sites)} if sites else {}
    return " ".join(f"{n} {found.get(n, '?')}" for n in ("trl", "torch", "deepspeed", "transformers", "accelerate"))


def peer_header(script: str, venv: str) -> list[str]:
    """The first lines of a peer benchmark's report: title, machine, the TRL venv's versions."""
    return [title(script), machine_line(), f"TRL venv {venv}: {venv_versions(venv)}"]


def trl_env(venv: str, ds_config: str, drop: tuple[str, ...] = ("VIRTUAL_ENV", "ACCELERATE_")) -> dict:
    """The environment of TRL's launch: ours without the variables starting with `drop`, the bench's, TRL's
    venv first on PATH, the repository on PYTHONPATH (the worker uses utils), accelerate's DeepSpeed on with
    the ZeRO section in `ds_config`, fp32."""
    env = bench_env(drop=drop)
    env.update(
        {
            "PATH": os.path.join(venv, "bin") + os.pathsep + env.get("PATH", ""),
            "PYTHONPATH": REPO,
            "ACCELERATE_USE_DEEPSPEED": "true",
            "ACCELERATE_MIXED_PRECISION": "no",
            "ACCELERATE_DEEPSPEED_CONFIG_FILE": ds_config,
        }
    )
    return env


def run_trl(args, model_dir: str, prompts: str, out_dir: str) -> dict:
    python = os.path.join(TRL_VENV, "bin", "python")
    if not os.path.exists(python):
        return {"error": f"{python} does not exist (create bench/.venv-trl, see bench/README.md)"}
    os.makedirs(out_dir, exist_ok=True)
    result_path = os.path.join(out_dir, "trl_result.json")
    if os.path.exists(result_path):
        os.remove(result_path)
    env = trl_env(TRL_VENV, ds_config_file(os.path.join(out_dir, f"ds_zero{args.zero_stage}.json"), args.zero_stage))
    if args.malloc_tuning:
        env.update(malloc_env())
    cmd = torchrun_cmd(python, args.master_port + 7, os.path.join(REPO, "bench", "peer_trl.py")) + [
        "--worker",
        "--model_name_or_path",
        model_dir,
        "--prompts",
        prompts,
        "--prompt_len",
        str(args.prompt_len),
        "--answer_len",
        str(args.answer_len),
        "--batch_size",
        str(args.batch_size),
        "--train_batch_size",
        str(args.train_batch_size),
        "--ppo_epochs",
        str(args.ppo_epochs),
        "--steps",
        str(args.steps),
        "--output_dir",
        out_dir,
        "--out",
        result_path,
    ]
    run = run_logged(cmd, env, os.path.join(out_dir, "trl.log"), args.timeout)
    if run.returncode != 0 or not os.path.exists(result_path):
        with open(run.log) as f:
            return {"error": first_error_line(f.read()), "exit": run.returncode, "log": run.log}
    with open(result_path) as f:
        r = json.load(f)
    timed = r["steps"][args.warmup :] or r["steps"]
    total = sum(s["step_s"] for s in timed)
    r.update(
        wall_s=run.wall_s,
        cpu_s=run.cpu_s,
        step_s=statistics.median(s["step_s"] for s in timed),
        all_step_s=[s["step_s"] for s in timed],
        samples_per_s=statistics.median(s["samples_per_s"] for s in timed),
        **{f"{k}_s": statistics.median(s[f"{k}_s"] for s in timed) for k in ("gen", "exp", "train", "other")},
        **{f"{k}_share": sum(s[f"{k}_s"] for s in timed) / total for k in ("gen", "exp", "train", "other")},
    )
    print(
        f"  [{run.wall_s:.0f} s] TRL: {len(r['steps'])} iterations, median {r['step_s']:.2f} s",
        file=sys.stderr,
        flush=True,
    )
    return r


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step3.add_workload_args(p, "PPO iterations per side (iterations; default: tiny 6, else 3)")
    p.add_argument("--zero_stage", type=int, default=3, choices=[2, 3], help="ZeRO stage of BOTH sides (2 or 3)")
    p.add_argument(
        "--malloc_tuning",
        action="store_true",
        help="set tune_malloc's settings (utils.runtime.distributed.MALLOC_TUNING) as MALLOC_* variables "
        "for BOTH sides (the report prints them)",
    )
    p.add_argument(
        "--malloc_trim_threshold",
        type=int,
        default=None,
        help="with --malloc_tuning: MALLOC_TRIM_THRESHOLD_ for both sides instead of tune_malloc's "
        "2^31-1 (bytes; mallopt takes an int, the variable does not: 16 GiB is 17179869184)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each side, alternating which goes first (ours, TRL, TRL, ours, ...), so a load "
        "change shows as spread between rounds; the tables show each side's median round",
    )
    p.add_argument("--skip_ours", action="store_true", help="TRL only (for debugging)")
    add_run_args(p, 29561, 600)
    args = p.parse_args(argv)
    if args.batch_size % args.train_batch_size:
        raise BenchError("--train_batch_size must divide --batch_size")
    return args


def report(args, ours: dict | None, theirs: dict) -> list[str]:
    """The table of both sides and their ratios (or why TRL could not run)."""
    out = [
        "",
        f"{'side':28s} {'s/iter':>7s} {'samples/s':>9s} {'gen s':>6s} {'exp s':>6s} {'train s':>7s} "
        f"{'other s':>7s} {'wall s':>7s} {'cpu/wall':>8s}   all iterations (s)",
    ]
    if ours:
        out.append(
            f"{'ours (step3_ppo, ' + ours['name'] + ')':28s} {ours['step_s']:7.2f} {ours['samples_per_s']:9.2f} "
            f"{ours['gen_s']:6.2f} {ours['exp_s']:6.2f} {ours['train_s']:7.2f} {'-':>7s} {ours['wall_s']:7.0f} "
            f"{ours['cpu_s'] / ours['wall_s']:8.2f}   " + " ".join(f"{s:.2f}" for s in ours["all_step_s"])
        )
    if "error" in theirs:
        out.append(f"TRL could not run: {theirs['error']}")
        if "log" in theirs:
            out.append(f"  (exit {theirs.get('exit')}; full log: {theirs['log']})")
        return out
    out.append(
        f"{'TRL 1.12.0 PPOTrainer':28s} {theirs['step_s']:7.2f} {theirs['samples_per_s']:9.2f} "
        f"{theirs['gen_s']:6.2f} {theirs['exp_s']:6.2f} {theirs['train_s']:7.2f} {theirs['other_s']:7.2f} "
        f"{theirs['wall_s']:7.0f} "
        f"{theirs['cpu_s'] / theirs['wall_s']:8.2f}   " + " ".join(f"{s:.2f}" for s in theirs["all_step_s"])
    )
    out.append(
        f"  TRL: deepspeed enabled {theirs['deepspeed_enabled']}, ZeRO stage {theirs['zero_stage']}, "
        f"world {theirs['world_size']}, threads/rank {theirs['torch_threads']}; its gc.collect() calls "
        f"take {theirs['gc_s_per_iteration']:.2f} s per iteration (mean); config {json.dumps(theirs['config'])}"
    )
    if ours:
        same_window = theirs["step_s"] - theirs["other_s"]
        out.append(
            f"ratio ours/TRL samples/s = {ours['samples_per_s'] / theirs['samples_per_s']:.2f}x  "
            f"(target >= 1.5x; TRL's full iteration)"
        )
        out.append(
            f"ratio ours/TRL, TRL without its between-iteration 'other' (the window our trainer times) = "
            f"{same_window / ours['step_s']:.2f}x"
        )
        out.append(
            f"per phase, TRL s / our s (medians): generation {theirs['gen_s'] / ours['gen_s']:.2f}x, "
            f"experience {theirs['exp_s'] / ours['exp_s']:.2f}x, training "
            f"{theirs['train_s'] / ours['train_s']:.2f}x  (> 1: ours faster)"
        )
    return out


def main(argv=None):
    args = parse_args(argv)
    model_dir = bench_model(args)
    args.steps = args.steps or (6 if args.tiny else 3)
    prompts = step3.write_prompts(os.path.join(RUNS, "prompts.jsonl"), args.num_prompts)
    if args.malloc_trim_threshold is not None:
        if not args.malloc_tuning:
            raise BenchError("--malloc_trim_threshold needs --malloc_tuning")
        malloc_env()["MALLOC_TRIM_THRESHOLD_"] = str(args.malloc_trim_threshold)
    if args.malloc_tuning:
        os.environ.update(malloc_env())  # inherited by our step 3 launch too

    header = start_report(
        peer_header("peer_trl.py", TRL_VENV)
        + [
            f"model: {model_dir}; fp32; ZeRO-{args.zero_stage} both sides (ours: --enable_hybrid_engine; TRL: "
            f"ds3_gather_for_generation=True); 2 ranks, OMP_NUM_THREADS=1",
            "ours: "
            + malloc_line()
            + "; TRL: "
            + ("the same MALLOC_* environment" if args.malloc_tuning else "glibc defaults"),
            f"PPO: {args.steps} iterations per side (first {args.warmup} dropped), rollout {args.batch_size}/rank x 2, "
            f"prompt <= {args.prompt_len}, answer exactly {args.answer_len} tokens, sampled T=1, mini-batch "
            f"{args.train_batch_size}, {args.ppo_epochs} PPO epoch(s); prompts {prompts}",
        ]
    )

    trl_dir = os.path.join(RUNS, "trl", f"{os.path.basename(model_dir.rstrip('/'))}-z{args.zero_stage}")
    all_ours, all_theirs = alternate(
        args.rounds,
        lambda: (
            None
            if args.skip_ours
            else step3.run_config(args, model_dir, prompts, f"z{args.zero_stage}+hybrid", args.master_port)
        ),
        lambda: run_trl(args, model_dir, prompts, trl_dir),
    )
    lines = report(args, median_result(all_ours), median_result(all_theirs) or all_theirs[-1])
    end_report(
        args.save,
        header,
        lines + ["", "(the tables: each side's median round)"] + rounds_lines(all_ours, all_theirs, "TRL"),
    )


if __name__ == "__main__":
    main_or_worker(main, worker)
