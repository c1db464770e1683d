"""Side-by-side: our step 3 with --advantage_estimator grpo against TRL 1.16.0's GRPOTrainer on 2 CPU ranks.

    python3 -m venv bench/.venv-trl-grpo && bench/.venv-trl-grpo/bin/pip install -r bench/requirements-grpo.txt  # once
    python bench/peer_trl_grpo.py --tiny                 # (project venv) tiny random llama, ~3 min
    python bench/peer_trl_grpo.py                        # SmolLM2-135M-Instruct (alone on the machine)
    python bench/peer_trl_grpo.py --save bench/results/2026-12-01-peer-trl-grpo-smollm2.txt
    python bench/peer_trl_grpo.py --tiny --as_shipped    # ours with tune_malloc vs TRL on glibc's defaults

The workload, identical on both sides: the verifiable arithmetic prompts (--data, default
data/arithmetic/train.jsonl; python -m data.make_arithmetic_data --out data/arithmetic), read and
tokenized by the project's own code (utils.train.loop.step_examples + utils.data.tokenize_prompts with
--data_split 0,0,1, as step 3's setup() does; chat template: the model's, or with --tiny
utils/chat_templates/chatml.jinja, on both sides); TRL renders the same template itself, and its
_tokenize_prompts is wrapped to hand generation the project's ids (the report counts any prompt whose
ids TRL's own rendering got differently). Two models per side: policy + frozen reference (the same
model), no critic, no reward model. Reward: the project's math_exact (step3_ppo.rewards.functions),
called by TRL through a thin reward function (PYTHONPATH=REPO). --prompts_per_rank prompts per rank
x --group completions each (ours --n_samples_per_prompt, TRL num_generations); answers exactly
--answer_len tokens (ours --min_answer_seq_len = --max_answer_seq_len; TRL max_completion_length and
generation_kwargs min_new_tokens, so the EOS never comes earlier); sampled at --temperature, --top_k,
--top_p on both. KL: TRL beta (k3, in the loss) = ours --kl_ctl BETA --kl_in_loss --kl_loss_estimator k3.
Loss: per-sequence mean of the token losses on both (ours grpo's seq_mean = TRL loss_type="grpo"),
group-normalised advantages, clip 0.2. Updates per rollout: ours rollout R = prompts_per_rank x group
rows per rank, --per_device_training_batch_size T, --ppo_epochs E: R/T x E optimizer steps; TRL
per_device_train_batch_size T, gradient_accumulation_steps 1, steps_per_generation R/T,
num_iterations E: the same count (both printed). fp32 (TRL bf16=False, ACCELERATE_MIXED_PRECISION=no),
no gradient checkpointing, dropout off, ZeRO-3 on both (ours --actor_zero_stage 3 --enable_hybrid_engine;
TRL accelerate's DeepSpeed environment with our ZeRO section, bench.peer_trl.ds_config_file,
ds3_gather_for_generation=True; its reference is a ZeRO-3 engine too), fused torch AdamW with betas
(0.9, 0.95) and gradient clipping 1.0 on both, lr 1e-6 constant, no eval, no saving, no vLLM, no
completion logging. Allocator: by default tune_malloc's settings as MALLOC_* variables for BOTH sides
(bench.peer_trl.malloc_env; our tune_malloc then steps aside); --as_shipped: ours applies tune_malloc
itself, TRL runs on glibc's defaults.

Timing (the first --warmup iterations dropped, medians over the rest). Ours: step 3's own metrics.jsonl
(rank 0): generation = the hybrid generation mode (gather + generate + release), scoring = experience
(old and reference log-probs, the reward function, advantages), training = the updates; the final export
happens after the last row and is not timed. TRL (rank 0): an iteration = from the previous rollout's
last optimizer step (on_step_end) to this one's; generation = TRL's unwrap_model_for_generation context
(ZeRO-3 gather, generate, release); scoring = the rest of _generate_and_score_completions (prompt
rendering, old and reference log-probs, math_exact, advantages, TRL's gathers and metric bookkeeping);
training = from there to the rollout's last on_step_end (its training_steps and optimizer steps);
other = the rest (its log() call after the previous step, the data loader). samples/s = completions of
both ranks / iteration seconds. Peak RSS per phase: VmHWM reset at each phase's start and read at its
end (/proc/self/clear_refs), max over all iterations; ours: step 3's mem/<phase>_peak_gb (the same
measure, max over ranks), TRL: per rank. The two sides run one after the
other, --rounds times, alternating which goes first (bench.common.alternate), each alone on the machine;
the report gives each round's ratio and their median and spread.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import step3  # noqa: E402
from bench.common import (  # noqa: E402
    RUNS,
    BenchError,
    add_model_args,
    add_run_args,
    alternate,
    bench_model,
    deepspeed_cmd,
    end_report,
    main_or_worker,
    malloc_line,
    median_result,
    rounds_lines,
    run_logged,
    start_report,
    torchrun_cmd,
)
from bench.peer_trl import ds_config_file, first_error_line, malloc_env, peer_header, trl_env  # noqa: E402

TRL_VENV = os.path.join(REPO, "bench", ".venv-trl-grpo")
ARITHMETIC = os.path.join(REPO, "data", "arithmetic", "train.jsonl")
CHATML = os.path.join(REPO, "utils", "chat_templates", "chatml.jinja")  # --tiny: its tokenizer has no template
OURS = "grpo-z3+hybrid"  # our configuration's name (bench.step3.run_config's out dir: <model>-grpo-z3_hybrid)
PHASES = ("gen", "score", "train")
GIB = 2**30


# --------------------------------------------------------------------------------------- TRL worker
WORKER_FLAGS = {  # the TRL worker's flags (all required but --chat_template): type, help
    "model_name_or_path": (str, "model directory TRL loads (resized to the tokenizer, see trl_model_dir)"),
    "tokenizer_path": (str, "tokenizer directory (the project's model)"),
    "data": (str, "prompt rows with an 'answer' field (JSONL path)"),
    "output_dir": (str, "TRL's output directory (path)"),
    "out": (str, "result files' prefix: OUT.rank<r>.json (path)"),
    "prompt_len": (int, "longest prompt (tokens)"),
    "answer_len": (int, "exact completion length (tokens)"),
    "prompts_per_rank": (int, "prompts per rank per rollout (rows)"),
    "group": (int, "completions per prompt, TRL's num_generations (G)"),
    "train_batch_size": (int, "rows per update per rank (rows)"),
    "ppo_epochs": (int, "passes over the rollout, TRL's num_iterations (epochs)"),
    "steps": (int, "GRPO iterations (rollouts)"),
    "top_k": (int, "sampling top-k (tokens; 0: off)"),
    "beta": (float, "KL coefficient, k3 in the loss"),
    "temperature": (float, "sampling temperature"),
    "top_p": (float, "sampling top-p (probability mass)"),
}


def worker_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help="run as one rank of TRL's GRPO (in TRL's venv)")
    p.add_argument("--chat_template", default=None, help="chat template file of the tokenizer (path)")
    for name, (kind, text) in WORKER_FLAGS.items():
        p.add_argument(f"--{name}", type=kind, required=True, help=text)
    return p.parse_args(argv)


def worker(argv) -> None:
    """One rank of TRL's GRPO (run by torchrun in bench/.venv-trl-grpo); writes OUT.rank<r>.json."""
    args = worker_args(argv)
    from accelerate import PartialState  # TRL's venv: imported here, also to keep --help fast

    state = PartialState(backend="gloo")  # before the config and the models: gloo, or 1 process on CPU
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if state.num_processes != launched:
        raise BenchError(f"accelerate counts {state.num_processes} process(es) of the {launched} launched")
    from trl.trainer import grpo_trainer as trl_grpo

    from step3_ppo.rewards.functions import math_exact
    from utils.models.loading import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer_path, padding_side="left", chat_template=args.chat_template)
    examples, stats, project_ids, dataset = grpo_dataset(args, tokenizer)
    rollout = args.prompts_per_rank * args.group  # completions per rank per rollout
    steps_per_generation = rollout // args.train_batch_size
    updates = steps_per_generation * args.ppo_epochs  # optimizer steps per rollout
    config = grpo_config(args, steps_per_generation, updates)

    rec = {"gen": [], "gs": [], "ends": [], "peaks": [], "completion_len": [], "prompt_mismatch": 0, "prompts_seen": 0}
    peaks = {}
    time_generation(trl_grpo, rec, peaks)
    # the policy; TRL builds the reference itself, from the same directory (get_config_model_id(model.config))
    trainer = timed_trainer(rec, peaks, project_ids)(
        model=policy_model(args, tokenizer),
        reward_funcs=[math_exact_reward(math_exact)],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[iteration_ends(rec, peaks, updates)],
    )
    trainer.train()
    result = grpo_result(rec, trainer, config, state, rollout, updates, len(examples), stats)
    with open(f"{args.out}.rank{state.process_index}.json", "w") as f:
        json.dump(result, f, default=str)


def grpo_dataset(args, tokenizer) -> tuple:
    """Step 3's own prompt examples of --data (its data flags and defaults), their ids by prompt, and the
    dataset TRL is given (prompt, answer)."""
    from datasets import Dataset  # TRL's venv: imported here, also to keep --help fast

    from utils.data import tokenize_prompts
    from utils.train.flags import add_data_args
    from utils.train.loop import step_examples

    data_parser = argparse.ArgumentParser()
    add_data_args(data_parser)  # step 3's own data flags and defaults (eval_fraction, keys, ...)
    data_args = data_parser.parse_args(
        ["--data_path", args.data, "--data_split", "0,0,1"]
        + (["--chat_template", args.chat_template] if args.chat_template else [])
    )
    data_args.seed = 1234
    examples, stats, _, _ = step_examples(
        data_args,
        tokenizer,
        3,
        lambda rows: tokenize_prompts(rows, tokenizer, args.prompt_len),
        {"max_prompt_seq_len": args.prompt_len},
        with_eval=False,
    )
    project_ids = {json.dumps(ex["prompt"], sort_keys=True): ex["input_ids"] for ex in examples}
    dataset = Dataset.from_dict(
        {"prompt": [ex["prompt"] for ex in examples], "answer": [ex.get("extra", {}).get("answer") for ex in examples]}
    )
    return examples, stats, project_ids, dataset


def grpo_config(args, steps_per_generation: int, updates: int):
    """TRL's GRPOConfig for our workload (the module docstring maps every setting)."""
    from trl import GRPOConfig  # TRL's venv: imported here, also to keep --help fast

    return GRPOConfig(
        output_dir=args.output_dir,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=updates,
        disable_tqdm=True,
        log_completions=False,
        use_vllm=False,
        per_device_train_batch_size=args.train_batch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=steps_per_generation,
        num_iterations=args.ppo_epochs,
        num_generations=args.group,
        max_completion_length=args.answer_len,
        generation_kwargs={"min_new_tokens": args.answer_len},
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        beta=args.beta,
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        max_steps=args.steps * updates,
        learning_rate=1e-6,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        optim="adamw_torch_fused",
        adam_beta1=0.9,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        disable_dropout=True,
        seed=1234,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        ds3_gather_for_generation=True,
    )


def phase_boundary(peaks: dict, ended: str, reset: bool = True) -> None:
    """Read the phase that just ended (VmHWM since its start), then start a new peak."""
    from utils.runtime.accelerator import (  # torch: imported here to keep --help fast
        peak_memory_bytes,
        reset_peak_memory,
    )

    peaks[ended] = max(peaks.get(ended, 0), peak_memory_bytes())
    if reset:
        reset_peak_memory()


def time_generation(trl_grpo, rec: dict, peaks: dict) -> None:
    """Times TRL's whole generation context (ZeRO-3 gather + generate + release), a phase of its own."""
    original_unwrap = trl_grpo.unwrap_model_for_generation

    @contextlib.contextmanager
    def timed_unwrap(*a, **k):
        phase_boundary(peaks, "other")
        start = time.time()
        with original_unwrap(*a, **k) as model:
            yield model
        rec["gen"].append((start, time.time()))
        phase_boundary(peaks, "gen")

    trl_grpo.unwrap_model_for_generation = timed_unwrap


def timed_trainer(rec: dict, peaks: dict, project_ids: dict):
    """GRPOTrainer handing generation the project's prompt ids (counting those TRL's rendering got otherwise),
    recording completion lengths and timing _generate_and_score_completions (the end of the scoring phase)."""
    from trl import GRPOTrainer  # TRL's venv: imported here, also to keep --help fast

    class TimedGRPOTrainer(GRPOTrainer):
        def _tokenize_prompts(self, prompts: list):
            ids, images, fields = super()._tokenize_prompts(prompts)
            ours = [project_ids[json.dumps(prompt, sort_keys=True)] for prompt in prompts]
            rec["prompt_mismatch"] += sum(list(a) != list(b) for a, b in zip(ids, ours))
            rec["prompts_seen"] += len(prompts)
            return ours, images, fields

        def _generate(self, prompts: list):
            out = super()._generate(prompts)
            completion_ids = out[1]
            rec["completion_len"].append(sum(len(c) for c in completion_ids) / max(len(completion_ids), 1))
            return out

        def _generate_and_score_completions(self, inputs):
            start = time.time()
            out = super()._generate_and_score_completions(inputs)
            rec["gs"].append((start, time.time()))
            phase_boundary(peaks, "score")
            return out

    return TimedGRPOTrainer


def iteration_ends(rec: dict, peaks: dict, updates: int):
    """A TrainerCallback marking the start of training and the end of every rollout's updates (an iteration),
    which also ends the training phase's peak."""
    from transformers import TrainerCallback  # TRL's venv: imported here, also to keep --help fast

    from utils.runtime.accelerator import peak_memory_bytes, reset_peak_memory

    class IterationEnds(TrainerCallback):
        def on_train_begin(self, *a, **k):
            rec["begin"] = time.time()
            rec["load_peak_bytes"] = peak_memory_bytes()  # model loading + engine set-up (before any reset)
            reset_peak_memory()

        def on_step_end(self, args_, state_, control, **k):
            if state_.global_step % updates == 0:
                rec["ends"].append(time.time())
                # no reset after the last one: ru_maxrss at exit then covers the last training phase and after,
                # as our ranks' does (Linux resets ru_maxrss with VmHWM)
                phase_boundary(peaks, "train", reset=state_.global_step < state_.max_steps)
                rec["peaks"].append(dict(peaks))
                peaks.clear()

    return IterationEnds()


def policy_model(args, tokenizer):
    import torch  # TRL's venv: imported here, also to keep --help fast
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=torch.float32)
    rows = model.get_input_embeddings().num_embeddings  # (the weight is a ZeRO-3 partition here)
    if rows < len(tokenizer):
        raise BenchError(
            f"{args.model_name_or_path}: {rows} embedding rows "
            f"< {len(tokenizer)} tokens (the orchestrator passes a resized copy)"
        )
    return model


def grpo_result(
    rec: dict, trainer, config, state, rollout: int, updates: int, train_prompts: int, data_stats: dict
) -> dict:
    """One rank's result: per iteration its phases in step 3's metrics.jsonl keys (bench.step3.summarize reads
    them), the per-phase peaks, and what TRL ran (engines, steps, config)."""
    import torch  # TRL's venv: imported here, also to keep --help fast
    import trl

    rows = []
    starts = [rec["begin"]] + rec["ends"][:-1]
    for i, (begin, end) in enumerate(zip(starts, rec["ends"])):
        (g0, g1), (c0, c1) = rec["gen"][i], rec["gs"][i]
        rows.append(
            {
                "time/generation_s": g1 - g0,
                "time/experience_s": (c1 - c0) - (g1 - g0),
                "time/train_s": end - c1,
                "other_s": c0 - begin,
                "iteration_s": end - begin,
                "samples_per_s": rollout * state.num_processes / (end - begin),
            }
        )
    engine = trainer.model_wrapped
    zero = getattr(engine, "zero_optimization_stage", None)
    return {
        "rank": state.process_index,
        "rows": rows,
        "peaks": rec["peaks"],
        "load_peak_bytes": rec["load_peak_bytes"],
        "completion_len": rec["completion_len"],
        "prompt_mismatch": rec["prompt_mismatch"],
        "prompts_seen": rec["prompts_seen"],
        "rollouts": len(rec["gs"]),
        "generations": len(rec["gen"]),
        "global_steps": trainer.state.global_step,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "trl": trl.__version__,
        "torch": torch.__version__,
        "deepspeed_enabled": trainer.is_deepspeed_enabled,
        "zero_stage": zero() if callable(zero) else None,
        "engine": type(engine).__name__,
        "ref_engine": type(trainer.ref_model).__name__,
        "world_size": state.num_processes,
        "torch_threads": torch.get_num_threads(),
        "train_prompts": train_prompts,
        "data_stats": data_stats,
        "updates_per_rollout": updates,
        "config": {
            k: getattr(config, k)
            for k in (
                "per_device_train_batch_size",
                "gradient_accumulation_steps",
                "steps_per_generation",
                "generation_batch_size",
                "num_iterations",
                "num_generations",
                "max_completion_length",
                "generation_kwargs",
                "temperature",
                "top_k",
                "top_p",
                "beta",
                "loss_type",
                "bf16",
                "gradient_checkpointing",
                "optim",
                "max_steps",
            )
        },
    }


def math_exact_reward(math_exact):
    """TRL's reward function: the project's math_exact on the completions' text (TRL hands a conversational
    prompt's completion over as [{"role": "assistant", "content": text}])."""

    def reward(completions, answer, **kwargs):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return math_exact(texts, answer=answer)

    reward.__name__ = "math_exact"
    return reward


# ------------------------------------------------------------------------------------- orchestrator
def grpo_command(args, model_dir: str, out_dir: str, port: int) -> list[str]:
    """Our step 3 launch with the GRPO workload (no critic, no reward model: math_exact)."""
    cmd = deepspeed_cmd("step3_ppo.main", port) + [
        "--actor_model_name_or_path",
        model_dir,
        "--data_path",
        args.data,
        "--data_split",
        "0,0,1",
        "--advantage_estimator",
        "grpo",
        "--n_samples_per_prompt",
        str(args.group),
        "--reward_funcs",
        "math_exact",
        "--actor_zero_stage",
        "3",
        "--enable_hybrid_engine",
        "--dtype",
        "fp32",
        "--max_prompt_seq_len",
        str(args.prompt_len),
        "--max_answer_seq_len",
        str(args.answer_len),
        "--min_answer_seq_len",
        str(args.answer_len),
        "--temperature",
        str(args.temperature),
        "--top_k",
        str(args.top_k),
        "--top_p",
        str(args.top_p),
        "--per_device_generation_batch_size",
        str(args.prompts_per_rank),
        "--generation_batches",
        "1",
        "--per_device_training_batch_size",
        str(args.train_batch_size),
        "--ppo_epochs",
        str(args.ppo_epochs),
        "--kl_ctl",
        str(args.beta),
        "--kl_in_loss",
        "--kl_loss_estimator",
        "k3",
        "--kl_estimator",
        "k3",
        "--actor_learning_rate",
        "1e-6",
        "--lr_scheduler_type",
        "constant",
        "--max_steps",
        str(args.steps),
        "--seed",
        "1234",
        "--output_dir",
        out_dir,
        "--old_logprobs",
        args.old_logprobs,
    ]
    if args.chat_template:
        cmd += ["--chat_template", args.chat_template]
    if args.padding_free:
        cmd.append("--padding_free")
    return cmd


def run_ours(args, model_dir: str) -> dict:
    result = step3.run_config(
        args,
        model_dir,
        None,
        OURS,
        args.master_port,
        command=lambda out_dir, port: grpo_command(args, model_dir, out_dir, port),
    )
    rows = result.pop("rows")
    result["peaks_gib"] = {
        phase: result["peak_rss_gib"][name]
        for phase, name in (("gen", "generation"), ("score", "experience"), ("train", "training"))
        if name in result["peak_rss_gib"]
    }
    result["response_len"] = statistics.mean(r.get("gen/response_len_mean", float("nan")) for r in rows)
    result["score_s"] = result["exp_s"]  # experience = the scoring forwards + reward
    return result


def trl_model_dir(model_dir: str, tokenizer_len: int) -> str:
    """The model directory TRL loads: itself, or (when the project's tokenizer added a pad token the embedding
    lacks, e.g. SmolLM2) a copy resized as utils.models.loading resizes ours (mean_resizing), made once under
    bench/runs: TRL builds its reference from the policy's directory, so an in-memory resize would leave the reference
    short of the pad row. Called after our run (the child's ru_maxrss would count in ours)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    if vocab >= tokenizer_len:
        return model_dir
    out = os.path.join(RUNS, "trl_grpo", "models", f"{os.path.basename(model_dir.rstrip('/'))}-vocab{tokenizer_len}")
    if not os.path.exists(os.path.join(out, "config.json")):  # in a child: its memory is given back at once
        resize = (
            "import sys, torch; from transformers import AutoModelForCausalLM as M; "
            "m = M.from_pretrained(sys.argv[1], dtype=torch.float32); "
            "m.resize_token_embeddings(int(sys.argv[2]), mean_resizing=True); m.save_pretrained(sys.argv[3])"
        )
        subprocess.run(
            [sys.executable, "-c", resize, model_dir, str(tokenizer_len), out],
            check=True,
            cwd=REPO,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            capture_output=True,
            timeout=600,
        )
    return out


def run_trl(args, model_dir: str, tokenizer_len: int) -> dict:
    python = os.path.join(TRL_VENV, "bin", "python")
    if not os.path.exists(python):
        return {"error": f"{python} does not exist (see this file's docstring: bench/requirements-grpo.txt)"}
    out_dir = os.path.join(RUNS, "trl_grpo", os.path.basename(model_dir.rstrip("/")))
    os.makedirs(out_dir, exist_ok=True)
    result_base = os.path.join(out_dir, "result")
    for old in glob.glob(result_base + ".rank*.json"):
        os.remove(old)
    env = trl_env(
        TRL_VENV,
        ds_config_file(os.path.join(out_dir, "ds_zero3.json"), 3),
        drop=("VIRTUAL_ENV", "ACCELERATE_", "MALLOC_"),
    )
    if not args.as_shipped:
        env.update(malloc_env())
    cmd = torchrun_cmd(python, args.master_port + 7, os.path.abspath(__file__)) + [
        "--worker",
        "--model_name_or_path",
        trl_model_dir(model_dir, tokenizer_len),
        "--tokenizer_path",
        model_dir,
        "--data",
        args.data,
        "--output_dir",
        out_dir,
        "--out",
        result_base,
    ]
    if args.chat_template:
        cmd += ["--chat_template", args.chat_template]
    for name in (
        "prompt_len",
        "answer_len",
        "prompts_per_rank",
        "group",
        "train_batch_size",
        "ppo_epochs",
        "steps",
        "top_k",
        "beta",
        "temperature",
        "top_p",
    ):
        cmd += [f"--{name}", str(getattr(args, name))]
    run = run_logged(cmd, env, os.path.join(out_dir, "trl.log"), args.timeout)
    ranks = []
    for path in sorted(glob.glob(result_base + ".rank*.json")):
        with open(path) as f:
            ranks.append(json.load(f))
    if run.returncode != 0 or len(ranks) != 2:
        with open(run.log) as f:
            return {
                "error": first_error_line(f.read()),
                "exit": run.returncode,
                "log": run.log,
                "rank_files": len(ranks),
            }
    r = trl_summary(args, ranks)
    r.update(wall_s=run.wall_s, cpu_s=run.cpu_s)
    print(
        f"  [{run.wall_s:.0f} s] TRL: exit 0, {len(r['rows'])} iterations, median {r['step_s']:.2f} s/iteration",
        file=sys.stderr,
        flush=True,
    )
    return r


def trl_summary(args, ranks: list[dict]) -> dict:
    """Rank 0's result with the medians of its iterations (as step 3's, plus TRL's whole iteration and 'other')
    and, over both ranks, the peaks, completion lengths and prompt-id checks."""
    r = ranks[0]
    timed = r["rows"][args.warmup :] or r["rows"]
    r.update(step3.summarize(r["rows"], args.warmup))  # gen / exp / train medians; its step_s is their sum's median
    r.update(
        window_s=r["step_s"],
        score_s=r["exp_s"],
        step_s=statistics.median(x["iteration_s"] for x in timed),
        all_step_s=[x["iteration_s"] for x in timed],
        other_s=statistics.median(x["other_s"] for x in timed),
        rank_peaks_gib=[{k: max(p.get(k, 0) for p in x["peaks"]) / GIB for k in (*PHASES, "other")} for x in ranks],
        lifetime_peak_gib=max(max([x["load_peak_bytes"]] + [v for p in x["peaks"] for v in p.values()]) for x in ranks)
        / GIB,
        max_ru_maxrss_mib=max(x["ru_maxrss_mib"] for x in ranks),
        completion_len_mean=statistics.mean(c for x in ranks for c in x["completion_len"]),
        prompt_mismatch=sum(x["prompt_mismatch"] for x in ranks),
        prompts_seen=sum(x["prompts_seen"] for x in ranks),
    )
    return r


def table_line(label: str, r: dict) -> str:
    other = f"{r['other_s']:7.2f}" if "other_s" in r else f"{'-':>7s}"
    return (
        f"{label:30s} {r['step_s']:7.2f} {r['samples_per_s']:9.2f} {r['gen_s']:6.2f} {r['score_s']:7.2f} "
        f"{r['train_s']:7.2f} {other} {r['wall_s']:7.0f} {r['cpu_s'] / r['wall_s']:8.2f}   "
        + " ".join(f"{s:.2f}" for s in r["all_step_s"])
    )


def peak_cells(peaks: dict) -> str:
    return " ".join(f"{peaks[k]:8.2f}" if k in peaks else f"{'-':>8s}" for k in PHASES)


def report(args, ours: dict | None, theirs: dict) -> list[str]:
    out = [
        "",
        f"{'side':30s} {'s/iter':>7s} {'samples/s':>9s} {'gen s':>6s} {'score s':>7s} {'train s':>7s} "
        f"{'other s':>7s} {'wall s':>7s} {'cpu/wall':>8s}   all iterations (s)",
    ]
    if ours:
        out.append(table_line("ours (step3_ppo grpo, z3+hybrid)", ours))
    if "error" in theirs:
        out.append(f"TRL could not run: {theirs['error']}")
        if "log" in theirs:
            out.append(
                f"  (exit {theirs.get('exit')}, {theirs.get('rank_files')} rank result file(s); full log: "
                f"{theirs['log']})"
            )
        return out
    out.append(table_line(f"TRL {theirs['trl']} GRPOTrainer", theirs))
    out.append(
        "(medians of rank 0's iterations; ours: generation / experience (= scoring) / train of step 3's "
        "metrics.jsonl, whose iteration has no 'other'; wall s: whole launch incl. start-up and loading)"
    )
    out.append(
        f"TRL checks: deepspeed enabled {theirs['deepspeed_enabled']}, ZeRO stage {theirs['zero_stage']} "
        f"(policy {theirs['engine']}, reference {theirs['ref_engine']}), world {theirs['world_size']}, "
        f"threads/rank {theirs['torch_threads']}; mean completion length {theirs['completion_len_mean']:.2f} "
        f"tokens (ours {ours['response_len'] if ours else float('nan'):.2f}; wanted {args.answer_len}); "
        f"{theirs['rollouts']} rollouts, {theirs['global_steps']} optimizer steps "
        f"({theirs['updates_per_rollout']} per rollout); prompt ids differing from the project's tokenization: "
        f"{theirs['prompt_mismatch']} of {theirs['prompts_seen']}"
    )
    out.append(f"TRL config: {json.dumps(theirs['config'])}")
    if ours:
        out.append(
            f"ratio ours/TRL samples/s = {ours['samples_per_s'] / theirs['samples_per_s']:.2f}x  "
            f"(goal >= 1.5x; TRL's whole iteration)"
        )
        out.append(
            f"the same ratio over the window our trainer times (TRL's gen + score + train, no 'other'): "
            f"{theirs['window_s'] / ours['step_s']:.2f}x"
        )
        out.append(
            "per phase, TRL s / our s (medians; > 1: ours faster): "
            + ", ".join(
                f"{name} {theirs[k + '_s'] / ours[k + '_s']:.2f}x"
                for name, k in (("generation", "gen"), ("scoring", "score"), ("training", "train"))
            )
        )
    out.append("")
    out.append("peak RSS per phase (GiB; VmHWM reset at the phase's start, read at its end; max over iterations)")
    out.append(f"{'side':30s} {'gen':>8s} {'score':>8s} {'train':>8s}")
    if ours:
        out.append(
            f"{'ours (max over ranks)':30s} {peak_cells(ours['peaks_gib'])}"
            + ("" if ours["peaks_gib"] else "   (no per-phase keys in metrics.jsonl)")
        )
    for rank, peaks in enumerate(theirs["rank_peaks_gib"]):
        out.append(f"{f'TRL rank {rank}':30s} {peak_cells(peaks)}   (between iterations: {peaks['other']:.2f})")
    out.append(
        f"largest process ru_maxrss (MiB; on Linux counted since the process's last VmHWM reset: the last "
        f"training phase and after): ours {ours['max_rss_mib'] if ours else float('nan'):.0f} (the launch's "
        f"RUSAGE_CHILDREN), TRL {theirs['max_ru_maxrss_mib']:.0f} (its ranks' own at exit); TRL's largest "
        f"rank over its whole run, loading included: {theirs['lifetime_peak_gib'] * 1024:.0f}"
    )
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, tiny_help="a tiny random 2-layer llama (utils.models.tiny) with the chatml template instead")
    p.add_argument("--data", default=ARITHMETIC, help="prompt rows with an 'answer' field (JSONL path)")
    p.add_argument(
        "--steps", type=int, default=None, help="GRPO iterations per side (iterations; default: tiny 6, else 4)"
    )
    p.add_argument("--warmup", type=int, default=1, help="first iterations left out of the medians (iterations)")
    p.add_argument("--prompt_len", type=int, default=64, help="longest prompt (tokens)")
    p.add_argument("--answer_len", type=int, default=16, help="exact answer length (tokens)")
    p.add_argument("--prompts_per_rank", type=int, default=4, help="prompts per rank per rollout (rows)")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (G)")
    p.add_argument("--train_batch_size", type=int, default=8, help="rows per update per rank (T, rows)")
    p.add_argument("--ppo_epochs", type=int, default=1, help="passes over the rollout (E; TRL num_iterations)")
    p.add_argument("--beta", type=float, default=0.04, help="KL coefficient (k3, in the loss)")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature of both sides")
    p.add_argument("--top_k", type=int, default=0, help="sampling top-k of both sides (tokens; 0: off)")
    p.add_argument("--top_p", type=float, default=1.0, help="sampling top-p of both sides (probability mass)")
    p.add_argument(
        "--old_logprobs",
        choices=("forward", "rollout"),
        default="forward",
        help="ours: the old policy's log-probs from a forward after generation (as TRL when a rollout "
        "feeds more than one optimizer step) or the generator's own (step 3's --old_logprobs)",
    )
    p.add_argument(
        "--padding_free",
        action="store_true",
        help="ours with --padding_free (the rows' real tokens packed, no left padding of the prompts computed)",
    )
    p.add_argument(
        "--as_shipped",
        action="store_true",
        help="ours with its own tune_malloc, TRL on glibc's defaults (default: MALLOC_* for both)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each side, alternating which goes first (ours, TRL, TRL, ours, ...), so a load "
        "change shows as spread between rounds; the tables show each side's median round",
    )
    p.add_argument("--skip_ours", action="store_true", help="TRL only (debugging)")
    p.add_argument("--skip_trl", action="store_true", help="ours only (debugging)")
    add_run_args(
        p,
        29581,
        1200,
        save_help="also write the printed report to this file, and both sides' figures as JSON beside it (path)",
    )
    args = p.parse_args(argv)
    rollout = args.prompts_per_rank * args.group
    if rollout % args.train_batch_size:
        raise BenchError(f"--train_batch_size {args.train_batch_size} must divide the rollout of {rollout} rows")
    if not os.path.exists(args.data):
        raise BenchError(f"{args.data} is missing (python -m data.make_arithmetic_data --out data/arithmetic)")
    return args


def header_lines(args, model_dir: str) -> list[str]:
    rollout = args.prompts_per_rank * args.group
    updates = rollout // args.train_batch_size * args.ppo_epochs
    return peer_header("peer_trl_grpo.py", TRL_VENV) + [
        f"model: {model_dir}{' (chat template ' + args.chat_template + ')' if args.chat_template else ''}; "
        f"policy + frozen reference on each side, no critic, no reward model; fp32; ZeRO-3 both (ours "
        f"--enable_hybrid_engine, TRL ds3_gather_for_generation=True); 2 ranks, OMP_NUM_THREADS=1",
        "allocator: ours "
        + malloc_line()
        + "; TRL "
        + ("glibc defaults (--as_shipped)" if args.as_shipped else "the same MALLOC_* environment"),
        f"GRPO: {args.steps} iterations per side (first {args.warmup} dropped); prompts {args.data} "
        f"(prompt <= {args.prompt_len} tokens); {args.prompts_per_rank} prompts/rank x G={args.group} = {rollout} "
        f"completions/rank/rollout (x2 ranks), exactly {args.answer_len} tokens, sampled T={args.temperature} "
        f"top_k {args.top_k} top_p {args.top_p}; reward math_exact; KL k3 in the loss, beta {args.beta}; "
        f"per-update batch {args.train_batch_size}/rank, {args.ppo_epochs} epoch(s): {updates} optimizer steps "
        f"per rollout on each side (ours {rollout}/{args.train_batch_size} x {args.ppo_epochs}; TRL "
        f"steps_per_generation {rollout // args.train_batch_size} x num_iterations {args.ppo_epochs}); "
        f"lr 1e-6 constant; ours --old_logprobs {args.old_logprobs}" + (" --padding_free" if args.padding_free else ""),
    ]


def main(argv=None):
    args = parse_args(argv)
    from utils.models.loading import load_tokenizer  # transformers: imported here to keep --help fast

    model_dir, args.chat_template = bench_model(args), CHATML if args.tiny else None
    args.steps = args.steps or (6 if args.tiny else 4)
    if not args.as_shipped:
        os.environ.update(malloc_env())  # inherited by our step 3 launch (tune_malloc then steps aside)
    tokenizer_len = len(load_tokenizer(model_dir, chat_template=args.chat_template))
    header = start_report(header_lines(args, model_dir))
    all_ours, all_theirs = alternate(
        args.rounds,
        lambda: None if args.skip_ours else run_ours(args, model_dir),
        lambda: {"error": "skipped (--skip_trl)"} if args.skip_trl else run_trl(args, model_dir, tokenizer_len),
    )
    ours = median_result(all_ours)
    theirs = median_result(all_theirs) or all_theirs[-1]  # an error's dict when TRL could not run
    lines = report(args, ours, theirs) + ["", "(the tables: each side's median round)"]
    end_report(
        args.save, header, lines + rounds_lines(all_ours, all_theirs, "TRL"), data={"ours": all_ours, "trl": all_theirs}
    )


if __name__ == "__main__":
    main_or_worker(main, worker)
