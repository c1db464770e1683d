"""The measurements of bench/gpu.sh, on one GPU (or, without one, its CPU fallback on a tiny model).

    bash bench/gpu.sh                      # what to run; this file is its body
    python bench/gpu_run.py --mode cpu     # the CPU fallback directly (in the repository's venv)

In priority order (later runs are skipped, and the report says so, when --budget_s is spent):
  tiny llama:  step 1 (ZeRO-3), step 2 (ZeRO-3), step 3 (ZeRO-3 + hybrid generation mode), the lr=0
               check (fp32, TF32 off: max |log ratio| <= 1e-4, the lr=0 guarantee)
  SmolLM2-135M-shaped (random weights from its config, GPU only): the same four runs, then
               scripts/step{1_sft,2_reward,3_ppo}/run_single_gpu.sh as they are (LoRA, bf16, gradient
               checkpointing; step 3 with the frozen reference and reward model offloaded),
               scripts/step2_dpo/run_single_gpu.sh (LoRA, the reference = adapters off) and
               scripts/step3_ppo/run_grpo_single_gpu.sh (GRPO on the arithmetic task), then the
               GRPO script again with the vLLM worker as its rollout engine (where vLLM is installed:
               GPU_VLLM_PYTHON), then the generation benchmark (bench/generation.py's worker on one rank:
               unsharded limit, plain ZeRO-3, hybrid; tokens/s), then step 1's training tokens/s and MFU
               (bench/sft_throughput.py's figures: 32 rows x 1024 tokens, bf16, 1 rank), then the GRPO
               script as on-policy distillation alone (the model as its own teacher; reverse_kl_sampled,
               reverse_kl), beside the GRPO row, then the vLLM GRPO row with a LoRA actor (r=16, the base frozen)
               twice: --vllm_lora_sync adapter and merged (MB and seconds per sync, s/iteration)
On CPU the same list runs on the tiny model (the run_single_gpu.sh scripts and the generation
benchmark included), so every part of the script is exercised before GPU minutes are spent.
Every run is the real entry point in its own process; its figures come from its metrics.jsonl:
s/step and samples/s (steps 1-2: time/train_s over the steps, first step included; step 3: the
median iteration after the first), generated tokens/s (step 3: generated tokens / generation time)
and the peak memory of each phase (mem/*: accelerator memory allocated on a GPU, peak RSS on CPU).
The report is printed and written to bench/results/gpu/DATE-gpu[-cpu-fallback].txt (+ .json), and to
$OUT when set (a folder that whoever runs the check on the GPU machine copies back).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import sft_throughput as sft_bench  # noqa: E402
from bench.common import finish_report, save_json  # noqa: E402

CARRY = os.path.join(REPO, "bench", "gpu_carry")
LR0_LIMIT = 1e-4


def data_dir() -> str:
    """The demo data in its raw Human/Assistant form (the tiny model has no chat template): carried (GPU
    machine) or the checkout's data/demo_raw (made here when missing)."""
    carried = os.path.join(CARRY, "data")
    if os.path.isfile(os.path.join(carried, "pairs", "eval.jsonl")):
        return carried
    local = os.path.join(REPO, "data", "demo_raw")
    if not os.path.isfile(os.path.join(local, "pairs", "eval.jsonl")):
        subprocess.run(
            [sys.executable, "-m", "data.make_demo_data", "--out", local, "--format", "raw"], check=True, cwd=REPO
        )
    return local


def make_models(work: str, mode: str) -> dict:
    """{"tiny": dir, "smollm2": dir (GPU only)}: random weights, made here, never downloaded."""
    from utils.models.tiny import make_tiny_model  # torch: imported here to keep --help fast

    models = {"tiny": make_tiny_model("llama", os.path.join(work, "models", "tiny"), seed=0)}
    if mode == "gpu":
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        source = os.path.join(CARRY, "smollm2")
        out = os.path.join(work, "models", "smollm2")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(source), dtype=torch.float32)
        model.save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
        models["smollm2"] = out
    return models


def runs(models: dict, data: str, work: str, mode: str) -> list[dict]:
    """Every run, in priority order: {name, model, kind, cmd, env, out}."""
    py = sys.executable
    out = []
    for name, model in models.items():
        big = name != "tiny"
        d = lambda tag: os.path.join(work, name, tag)  # noqa: E731
        seq = (
            ["--max_prompt_seq_len", "128", "--max_answer_seq_len", "128", "--min_answer_seq_len", "128"]
            if big
            else ["--max_prompt_seq_len", "64", "--max_answer_seq_len", "32", "--min_answer_seq_len", "32"]
        )
        dtype = ["--dtype", "bf16"]
        step3 = [
            "-m",
            "step3_ppo.main",
            "--actor_model_name_or_path",
            d("step1"),
            "--critic_model_name_or_path",
            d("step2"),
            "--data_path",
            os.path.join(data, "pairs"),
            "--data_split",
            "0,0,10",
            "--actor_zero_stage",
            "3",
            "--critic_zero_stage",
            "3",
            "--enable_hybrid_engine",
            "--per_device_generation_batch_size",
            "8",
            "--per_device_training_batch_size",
            "8",
            *seq,
            "--seed",
            "1234",
        ]
        out += [
            dict(
                name=f"{name} step1 zero3 bf16",
                model=name,
                kind="step1",
                out=d("step1"),
                cmd=[
                    py,
                    "-m",
                    "step1_sft.main",
                    "--model_name_or_path",
                    model,
                    "--data_path",
                    os.path.join(data, "sft"),
                    "--data_split",
                    "10,0,0",
                    "--zero_stage",
                    "3",
                    *dtype,
                    "--max_steps",
                    "20" if big else "8",
                    "--per_device_train_batch_size",
                    "8",
                    "--per_device_eval_batch_size",
                    "16",
                    "--max_seq_len",
                    "256",
                    "--learning_rate",
                    "1e-4",
                    "--output_dir",
                    d("step1"),
                ],
            ),
            dict(
                name=f"{name} step2 zero3 bf16",
                model=name,
                kind="step2",
                out=d("step2"),
                cmd=[
                    py,
                    "-m",
                    "step2_reward.main",
                    "--model_name_or_path",
                    d("step1"),
                    "--data_path",
                    os.path.join(data, "pairs"),
                    "--data_split",
                    "0,10,0",
                    "--zero_stage",
                    "3",
                    *dtype,
                    "--max_steps",
                    "20" if big else "8",
                    "--per_device_train_batch_size",
                    "8",
                    "--per_device_eval_batch_size",
                    "16",
                    "--eval_iters",
                    "4",
                    "--max_seq_len",
                    "256",
                    "--learning_rate",
                    "5e-5",
                    "--output_dir",
                    d("step2"),
                ],
            ),
            dict(
                name=f"{name} step3 zero3+hybrid bf16",
                model=name,
                kind="step3",
                out=d("step3"),
                cmd=[py, *step3, *dtype, "--max_steps", "5" if big else "3", "--output_dir", d("step3")],
            ),
            dict(
                name=f"{name} step3 lr=0 fp32 no-TF32",
                model=name,
                kind="lr0",
                out=d("lr0"),
                cmd=[
                    py,
                    *step3,
                    "--dtype",
                    "fp32",
                    "--no_tf32",
                    "--actor_learning_rate",
                    "0",
                    "--critic_learning_rate",
                    "0",
                    "--max_steps",
                    "2",
                    "--output_dir",
                    d("lr0"),
                ],
            ),
        ]
    # the scripts users run on one small GPU, as they are (only the run length and lengths shortened)
    big = "smollm2" if "smollm2" in models else "tiny"
    model, g = models[big], lambda tag: os.path.join(work, big, tag)
    script_env = {"MODEL": model, "DATA": os.path.join(data, "sft"), "RLHF_USE_CURRENT_ENV": "1"}
    out += [
        dict(
            name=f"{big} run_single_gpu.sh step1 (LoRA)",
            model=big,
            kind="step1",
            out=g("gpu1"),
            cmd=["bash", "scripts/step1_sft/run_single_gpu.sh", g("gpu1"), "--max_steps", "10", "--max_seq_len", "256"],
            env=script_env,
        ),
        dict(
            name=f"{big} run_single_gpu.sh step2 (LoRA)",
            model=big,
            kind="step2",
            out=g("gpu2"),
            cmd=[
                "bash",
                "scripts/step2_reward/run_single_gpu.sh",
                g("gpu2"),
                "--max_steps",
                "10",
                "--max_seq_len",
                "256",
                "--eval_iters",
                "4",
            ],
            env={**script_env, "MODEL": g("gpu1"), "DATA": os.path.join(data, "pairs")},
        ),
        dict(
            name=f"{big} run_single_gpu.sh step3 (LoRA, offloaded ref+reward)",
            model=big,
            kind="step3",
            out=g("gpu3"),
            cmd=[
                "bash",
                "scripts/step3_ppo/run_single_gpu.sh",
                g("gpu3"),
                "--max_steps",
                "4",
                "--max_prompt_seq_len",
                "128",
                "--max_answer_seq_len",
                "128",
                "--min_answer_seq_len",
                "128",
            ],
            env={
                "ACTOR": g("gpu1"),
                "CRITIC": g("gpu2"),
                "DATA": os.path.join(data, "pairs"),
                "RLHF_USE_CURRENT_ENV": "1",
            },
        ),
        dict(
            name=f"{big} run_single_gpu.sh DPO (LoRA, adapters-off reference)",
            model=big,
            kind="step2",
            out=g("gpu_dpo"),
            cmd=[
                "bash",
                "scripts/step2_dpo/run_single_gpu.sh",
                g("gpu_dpo"),
                "--max_steps",
                "10",
                "--max_seq_len",
                "256",
                "--eval_iters",
                "4",
            ],
            env={**script_env, "MODEL": g("gpu1"), "DATA": os.path.join(data, "pairs")},
        ),
        grpo_single_gpu(big, model, g, "gpu_grpo", "(GRPO, math_exact, no critic)"),
        # the same rollout with padding-free training forwards and token-budget micro-batches: its s/iteration and
        # tokens/padding_fraction against the row above (same sitting)
        grpo_single_gpu(
            big,
            model,
            g,
            "gpu_grpo_packed",
            "--padding_free --max_tokens_per_micro_batch 4096",
            ["--padding_free", "--max_tokens_per_micro_batch", "4096"],
        ),
        vllm_grpo(big, model, g, mode),
        dict(
            name=f"{big} generation (1 rank: unsharded / plain zero3 / hybrid)",
            model=big,
            kind="generation",
            out=g("generation"),
            cmd=[
                py,
                "-m",
                "bench.generation",
                "--worker",
                "--model_name_or_path",
                model,
                "--zero_stage",
                "3",
                "--lora_dim",
                "8",
                "--modes",
                "unsharded,plain,hybrid",
                "--batch_size",
                "8",
                "--prompt_len",
                "64",
                "--new_tokens",
                "64",
                "--repeats",
                "2",
                "--plain_repeats",
                "1",
                "--out",
                os.path.join(g("generation"), "result.json"),
            ],
        ),
        sft_throughput(big, model, g, data, mode),
        # last (the first to go when the budget is spent): on-policy distillation alone on the GRPO row's rollout
        # shape (bench/distill.py's arms on one GPU, with the GPU preset's bigger batch): the model as its own
        # teacher (a teacher's cost), no reward weight, no reference; s/iteration and peak memory per phase against
        # the GRPO row (same sitting)
        distill_single_gpu(big, model, g, "reverse_kl_sampled"),
        distill_single_gpu(big, model, g, "reverse_kl"),
        # after them: the vLLM worker with a LoRA actor (r=16 on every projection, the base frozen), the adapter alone
        # each sync (the base once) against the merged model each sync: MB and seconds per sync and s/iteration, side
        # by side (same sitting; bench/vllm_sync.py is the CPU benchmark)
        *(vllm_lora_sync(big, model, g, mode, sync) for sync in ("adapter", "merged")),
    ]
    return out


def grpo_single_gpu(big: str, model: str, g, out: str, label: str, extra: tuple = ()) -> dict:
    """run_grpo_single_gpu.sh for 3 iterations (`extra`: more of its flags); the CPU fallback with its template and
    a CPU-sized rollout (2 x 8 rows)."""
    cmd = ["bash", "scripts/step3_ppo/run_grpo_single_gpu.sh", g(out), "--max_steps", "3", "--eval_interval", "0"]
    if big == "tiny":
        cmd += ["--chat_template", "utils/chat_templates/chatml.jinja", "--per_device_generation_batch_size", "2"]
        cmd += ["--per_device_training_batch_size", "16", "--max_answer_seq_len", "16"]
    return dict(
        name=f"{big} run_grpo_single_gpu.sh {label}",
        model=big,
        kind="step3",
        out=g(out),
        cmd=[*cmd, *extra],
        env={"ACTOR": model, "RLHF_USE_CURRENT_ENV": "1"},
    )


def distill_single_gpu(big: str, model: str, g, signal: str) -> dict:
    """run_grpo_single_gpu.sh as on-policy distillation alone with `signal`: the model as its own teacher (a
    teacher's cost, a signal of 0), the rewards' weights 0, no reference (kl_ctl 0)."""
    distill = ["--teacher_model_name_or_path", model, "--distill_signal", signal]
    distill += ["--reward_weights", "0", "0", "--kl_ctl", "0"]
    return grpo_single_gpu(big, model, g, f"gpu_distill_{signal}", f"(distillation alone, {signal})", distill)


def sft_throughput(big: str, model: str, g, data: str, mode: str) -> dict:
    """Step 1's training tokens/s and MFU (bench/sft_throughput.py's figures: 6N per real token against the
    device's peak, perf/training_mfu, the first steps dropped) on rows of exactly --max_seq_len tokens generated
    from the demo's answers: one process, ZeRO-2; on a GPU bf16, 32 rows x 1024 tokens, 10 steps (2 dropped), in
    the CPU fallback fp32, 4 rows x 128 tokens, 4 steps (1 dropped)."""
    gpu = mode == "gpu"
    seq_len, batch, steps = (1024, 32, 10) if gpu else (128, 4, 4)
    rows = sft_bench.write_fixed_rows(g("sft_rows"), 64 * batch, 16, seq_len, source=os.path.join(data, "sft"))
    cmd = [sys.executable, "-m", "step1_sft.main", "--model_name_or_path", model, "--data_path", rows]
    cmd += ["--data_split", "10,0,0", "--zero_stage", "2", "--dtype", "bf16" if gpu else "fp32"]
    cmd += ["--max_steps", str(steps), "--per_device_train_batch_size", str(batch), "--max_seq_len", str(seq_len)]
    cmd += ["--per_device_eval_batch_size", str(batch), "--eval_iters", "1", "--learning_rate", "1e-5"]
    cmd += ["--lr_scheduler_type", "constant", "--num_warmup_steps", "0", "--seed", "1234"]
    name = f"{big} step1 tokens/s + MFU ({batch} x {seq_len} tokens, 1 rank, {'bf16' if gpu else 'fp32'})"
    return dict(
        name=name,
        model=big,
        kind="sft_throughput",
        out=g("sft_throughput"),
        cmd=[*cmd, "--output_dir", g("sft_throughput")],
        warmup=2 if gpu else 1,
        seq_len=seq_len,
        model_dir=model,
    )


def vllm_grpo(
    big: str,
    model: str,
    g,
    mode: str,
    out: str = "gpu_grpo_vllm",
    name: str = "run_grpo_single_gpu.sh --rollout_engine vllm",
    extra: tuple = (),
    steps: int = 3,
) -> dict:
    """run_grpo_single_gpu.sh with the vLLM worker (`--rollout_engine vllm`; `extra`: more of its flags): runs where
    a vLLM is found (GPU_VLLM_PYTHON, else this python: scripts/setup.sh --with-vllm makes .venv-vllm on a GPU
    machine); the CPU fallback's tiny model (head size 16) is one vLLM's CPU attention cannot run (multiples of 32)."""
    from step3_ppo.rollout.vllm_engine import vllm_missing

    python = os.environ.get("GPU_VLLM_PYTHON") or sys.executable
    run = dict(
        name=f"{big} {name}",
        model=big,
        kind="step3",
        out=g(out),
        cmd=[
            "bash",
            "scripts/step3_ppo/run_grpo_single_gpu.sh",
            g(out),
            "--max_steps",
            str(steps),
            "--eval_interval",
            "0",
            "--rollout_engine",
            "vllm",
            "--vllm_python",
            python,
            *extra,
        ],
        env={"ACTOR": model, "RLHF_USE_CURRENT_ENV": "1"},
    )
    reason = "the tiny model's head size 16 (vLLM on CPU: multiples of 32)" if mode == "cpu" else vllm_missing(python)
    if reason:
        run["not_applicable"] = reason
    return run


def vllm_lora_sync(big: str, model: str, g, mode: str, sync: str) -> dict:
    """The vLLM GRPO row with a LoRA actor (r=16 on every projection, the base frozen) and `--vllm_lora_sync sync`:
    4 iterations, so 3 syncs after real optimizer steps follow the first (adapter: the base goes with the first)."""
    lora = ["--actor_lora_dim", "16", "--actor_lora_module_name", "proj", "--only_optimize_lora"]
    name = f"run_grpo_single_gpu.sh vllm LoRA sync {sync}"
    return vllm_grpo(big, model, g, mode, f"vllm_lora_{sync}", name, [*lora, "--vllm_lora_sync", sync], 4)


def read_metrics(out: str) -> list[dict]:
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(run: dict) -> dict:
    """The run's figures from its outputs."""
    rows, kind, s = read_metrics(run["out"]), run["kind"], {}
    for key in ("generation", "experience", "training"):
        values = [r[f"mem/{key}_peak_gb"] for r in rows if f"mem/{key}_peak_gb" in r]
        if values:
            s[f"mem_{key}_gb"] = max(values)
    if kind in ("step1", "step2"):
        steps = [r for r in rows if "train/loss" in r]
        train_s = next((r["time/train_s"] for r in rows if "time/train_s" in r), None)
        if steps and train_s:
            s.update(steps=len(steps), s_per_step=train_s / len(steps))
        if kind == "step1":
            ppl = [r["eval/perplexity"] for r in rows if "eval/perplexity" in r]
            s["perplexity"] = ppl
        else:
            s["eval_accuracy"] = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    elif kind in ("step3", "lr0"):
        its = [r for r in rows if "time/generation_s" in r]
        timed = its[1:] or its
        if timed:
            seconds = [r["time/generation_s"] + r["time/experience_s"] + r.get("time/train_s", 0.0) for r in timed]
            rows_per_it = [r["samples_per_s"] * t for r, t in zip(timed, seconds)]
            tokens = [n * r["gen/response_len_mean"] for n, r in zip(rows_per_it, timed)]
            s.update(
                steps=len(its),
                s_per_step=statistics.median(seconds),
                samples_per_s=statistics.median(r["samples_per_s"] for r in timed),
                gen_tokens_per_s=sum(tokens) / sum(r["time/generation_s"] for r in timed),
                split={
                    k: statistics.median(r[f"time/{k}_s"] for r in timed) for k in ("generation", "experience", "train")
                },
            )
        synced = [r for r in its if "rollout/weight_sync_mb" in r]
        if synced:  # the vLLM worker's syncs: the first (the worker's start excluded), then the median of the later
            later = synced[1:] or synced
            s["weight_sync"] = {
                "first_mb": synced[0]["rollout/weight_sync_mb"],
                "first_s": synced[0]["time/weight_sync_s"],
                "mb": statistics.median(r["rollout/weight_sync_mb"] for r in later),
                "s": statistics.median(r["time/weight_sync_s"] for r in later),
            }
        if kind == "lr0" and its:
            s["log_ratio_max_abs"] = max(r["ppo/log_ratio_max_abs"] for r in its)
            s["lr0_ok"] = s["log_ratio_max_abs"] <= LR0_LIMIT
    elif kind == "sft_throughput" and any("perf/peak_flops" in r for r in rows):
        from transformers import AutoConfig  # lazy: +2.5 s on every --help (transformers)

        c = AutoConfig.from_pretrained(run["model_dir"])
        extra = sft_bench.extra_flops_per_token(
            c.hidden_size, c.vocab_size, c.num_hidden_layers, run["seq_len"], bool(c.tie_word_embeddings)
        )
        t = sft_bench.summarise(rows, run["warmup"], 1, extra)
        s.update(steps=len([r for r in rows if "train/loss" in r]), s_per_step=t["step_s"], sft=t)
    elif kind == "generation":
        path = os.path.join(run["out"], "result.json")
        if os.path.isfile(path):
            with open(path) as f:
                result = json.load(f)
            s["tokens_per_s"] = {m: v["tokens_per_s_per_rank"] for m, v in result["modes"].items()}
            s["tokens_equal_zero3_modes"] = result.get("tokens_equal_zero3_modes")
            s["weights_unchanged"] = result.get("weights_unchanged")
    return s


def launch(run: dict, timeout: float) -> dict:
    os.makedirs(run["out"], exist_ok=True)
    log = os.path.join(run["out"], "run.log")
    env = {**os.environ, **run.get("env", {})}
    start = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                run["cmd"], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - start
    with open(log, errors="replace") as f:
        tail = f.read()[-1500:]
    return {"rc": rc, "wall_s": wall, "log_tail": tail if rc != 0 else ""}


def environment(mode: str) -> list[str]:
    import torch  # imported here to keep --help fast

    from utils.runtime import accelerator

    lines = [
        f"date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"mode: {mode} ({'one GPU' if mode == 'gpu' else 'CPU fallback: tiny model only'})",
        f"python {platform.python_version()}, torch {torch.__version__}",
    ]
    versions = []
    for package in ("deepspeed", "transformers", "peft", "accelerate", "tokenizers"):
        try:
            versions.append(f"{package} {__import__(package).__version__}")
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            versions.append(f"{package} missing ({type(exc).__name__})")
    lines.append(", ".join(versions))
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        lines.append(
            f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, cuda {torch.version.cuda}, "
            f"bf16 {torch.cuda.is_bf16_supported()}"
        )
    else:
        lines.append(f"device: cpu, {os.cpu_count()} cores")
    lines.append(
        f"accelerator (DeepSpeed): {accelerator.name()}, backend {accelerator.communication_backend()}, "
        f"memory figures: {accelerator.memory_kind()}"
    )
    return lines


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def report(results: list[dict], env_lines: list[str], total_s: float) -> list[str]:
    lines = [
        "# bench/gpu.sh",
        *env_lines,
        f"total: {total_s:.0f} s",
        "",
        f"{'run':<58} {'rc':>7} {'wall s':>7} {'steps':>5} {'s/step':>7} {'samp/s':>7} {'gen tok/s':>9} "
        f"{'mem gen':>7} {'mem exp':>7} {'mem train':>9}",
    ]
    for r in results:
        s = r.get("summary", {})
        lines.append(
            f"{r['name'][:58]:<58} {str(r.get('rc', 'skipped')):>7} {fmt(r.get('wall_s'), '.0f'):>7} "
            f"{str(s.get('steps', '-')):>5} {fmt(s.get('s_per_step')):>7} {fmt(s.get('samples_per_s')):>7} "
            f"{fmt(s.get('gen_tokens_per_s'), '.0f'):>9} {fmt(s.get('mem_generation_gb')):>7} "
            f"{fmt(s.get('mem_experience_gb')):>7} {fmt(s.get('mem_training_gb')):>9}"
        )
    lines.append(
        "(mem: peak GB per phase over the run's steps; s/step: steps 1-2 time/train_s per optimizer step, "
        "step 3 median iteration after the first)"
    )
    lines.append("")
    for r in results:
        s = r.get("summary", {})
        if r.get("not_applicable"):
            lines.append(f"{r['name']}: not run: {r['not_applicable']}")
        if "log_ratio_max_abs" in s:
            lines.append(
                f"{r['name']}: max |log ratio| {s['log_ratio_max_abs']:.2e} "
                f"({'PASS' if s['lr0_ok'] else 'FAIL'}, limit {LR0_LIMIT:g})"
            )
        if "split" in s:
            lines.append(
                f"{r['name']}: median seconds generation {s['split']['generation']:.2f}, "
                f"experience {s['split']['experience']:.2f}, train {s['split']['train']:.2f}"
            )
        if "weight_sync" in s:
            w = s["weight_sync"]
            lines.append(
                f"{r['name']}: vLLM weight sync first {w['first_mb']:.1f} MB in {w['first_s']:.2f} s, then median "
                f"{w['mb']:.1f} MB in {w['s']:.2f} s per sync"
            )
        if "perplexity" in s and s["perplexity"]:
            lines.append(f"{r['name']}: eval perplexity {' -> '.join(f'{p:.2f}' for p in s['perplexity'])}")
        if s.get("eval_accuracy"):
            lines.append(f"{r['name']}: eval accuracy {' -> '.join(f'{a:.3f}' for a in s['eval_accuracy'])}")
        if "sft" in s:
            t = s["sft"]
            lines.append(
                f"{r['name']}: training tokens/s {t['real_tokens_per_s']:.0f} real, {t['processed_tokens_per_s']:.0f} "
                f"processed; MFU {100 * t['mfu']:.1f}% (6N per token, the run's perf/training_mfu), "
                f"{100 * t['mfu_with_head_attention']:.1f}% with the LM head and attention; peak "
                f"{t['peak_flops'] / 1e9:.1f} GFLOP/s (perf/peak_flops); {t['steps_timed']} steps timed"
            )
        if "tokens_per_s" in s:
            t = s["tokens_per_s"]
            ratios = ""
            if "hybrid" in t and "plain" in t and "unsharded" in t:
                ratios = (
                    f"; hybrid/plain {t['hybrid'] / t['plain']:.2f}x, "
                    f"hybrid/unsharded {t['hybrid'] / t['unsharded']:.2f}x"
                )
            lines.append(
                f"{r['name']}: tokens/s "
                + ", ".join(f"{m} {v:.0f}" for m, v in t.items())
                + ratios
                + f" (same tokens in the ZeRO-3 modes: {s['tokens_equal_zero3_modes']}, "
                f"weights unchanged: {s['weights_unchanged']})"
            )
        if r.get("rc") not in (0, None, "skipped"):
            lines += [f"--- {r['name']}: rc {r['rc']}, last lines of {r['out']}/run.log:", r["log_tail"], "---"]
    lines += lora_sync_lines(results)
    return lines


def lora_sync_lines(results: list[dict]) -> list[str]:
    """The vLLM LoRA rows side by side: merged / adapter bytes and seconds per later sync, and s/iteration."""
    done = {}
    for r in results:
        s = r.get("summary", {})
        for sync in ("adapter", "merged"):
            if r["name"].endswith(f"vllm LoRA sync {sync}") and "weight_sync" in s and s.get("s_per_step"):
                done[sync] = s
    if len(done) < 2:
        return []
    a, m = done["adapter"], done["merged"]
    return [
        f"vLLM LoRA sync merged / adapter: {m['weight_sync']['mb'] / a['weight_sync']['mb']:.1f}x the bytes, "
        f"{m['weight_sync']['s'] / max(a['weight_sync']['s'], 1e-9):.1f}x the seconds per sync; s/iteration adapter / "
        f"merged {a['s_per_step'] / m['s_per_step']:.2f}x"
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--mode",
        choices=["gpu", "cpu"],
        default=None,
        help="gpu: both models on the GPU; cpu: the tiny-model fallback (default: gpu when CUDA is available)",
    )
    p.add_argument(
        "--work",
        default=os.environ.get("GPU_RUN_WORK", "/tmp/rlhf_gpu_run"),
        help="work folder of the runs, emptied first (path; env GPU_RUN_WORK)",
    )
    p.add_argument(
        "--budget_s",
        type=float,
        default=float(os.environ.get("GPU_RUN_BUDGET_S", 330)),
        help="no run starts after this many seconds; each is cut at what is left (seconds)",
    )
    p.add_argument("--only", default="", help="comma-separated substrings: run only the runs whose name has one")
    p.add_argument(
        "--save",
        default=None,
        help="report file, and its .json beside it (path; default: bench/results/gpu/DATE-gpu[-cpu-fallback].txt)",
    )
    args = p.parse_args(argv)
    import torch  # imported here to keep --help fast

    mode = args.mode or ("gpu" if torch.cuda.is_available() else "cpu")
    start = time.time()
    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    env_lines = environment(mode)
    print("\n".join(env_lines), flush=True)
    models = make_models(args.work, mode)
    planned = runs(models, data_dir(), args.work, mode)
    if args.only:
        planned = [r for r in planned if any(key in r["name"] for key in args.only.split(","))]
    results = []
    for run in planned:
        left = args.budget_s - (time.time() - start)
        if run.get("not_applicable"):  # not a failure: this machine cannot run it
            run["rc"], run["log_tail"] = "n/a", f"not run: {run['not_applicable']}"
            results.append(run)
            print(f"[gpu_run] {run['name']}: {run['log_tail']}", flush=True)
            continue
        needs = [
            o
            for o in planned[: planned.index(run)]
            if o["out"] in " ".join(run["cmd"]) or o["out"] in " ".join(run.get("env", {}).values())
        ]
        failed_input = [o["name"] for o in needs if o.get("rc") != 0]
        if left < 20 or failed_input:
            run["rc"] = "skipped"
            run["log_tail"] = f"skipped: {'needs ' + ', '.join(failed_input) if failed_input else 'budget spent'}"
            results.append(run)
            print(f"[gpu_run] {run['name']}: {run['log_tail']}", flush=True)
            continue
        run.update(launch(run, left))
        run["summary"] = summarise(run)
        results.append(run)
        print(f"[gpu_run] {run['name']}: rc {run['rc']} in {run['wall_s']:.0f} s {run['summary']}", flush=True)
    lines = report(results, env_lines, time.time() - start)
    save = args.save or os.path.join(
        REPO,
        "bench",
        "results",
        "gpu",
        f"{datetime.date.today().isoformat()}-gpu{'' if mode == 'gpu' else '-cpu-fallback'}.txt",
    )
    finish_report(save, [], lines)
    save_json(save, [{k: v for k, v in r.items() if k not in ("env",)} for r in results])
    if os.environ.get("OUT"):
        for path in (save, os.path.splitext(save)[0] + ".json"):
            shutil.copy(path, os.environ["OUT"])
    print(f"[gpu_run] report: {save}", flush=True)
    return 0 if all(r.get("rc") in (0, "n/a") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
