"""Peak memory of one actor training step's log-prob forward + backward with the LM head chunked
(`--logprob_chunk_tokens N`, utils.models.forward.token_logprobs) against the whole [B, T, V] logits (N = 0).

The step is step 3's actor update on a packed batch of rows with `--prompt_len`-token prompts and `--answer_len`-token
answers: `token_logprobs` with the entropy monitor, a policy-gradient-shaped loss over the answer tokens, backward.
The model is a random SmolLM2-135M-shaped llama (49,152-token vocabulary, tied embeddings; its config.json when the
default model is installed, else the same shape built in), trained in fp32 with gradient checkpointing (the setting
long answers need; --no_gradient_checkpointing keeps every activation). Each chunk size runs in a fresh process:
a warm-up step (the parameter gradients are then allocated, as an engine's are), then the measured step; its peak is
what the step adds to the memory in use before it: on CUDA `torch.cuda.max_memory_allocated`, on the CPU the peak
resident set (VmHWM, reset first through /proc/self/clear_refs), with every allocation of 128 KiB or more mmapped
(MALLOC_MMAP_THRESHOLD_) so that a freed tensor leaves the resident set at once. The report gives each chunk
size's peak, its ratio to N = 0 (the goal: <= 0.6 at the default chunk size), the step's seconds and the largest
log-prob difference from N = 0 (the same arithmetic per token: float rounding only).

    .venv/bin/python bench/chunked_logprobs.py [--chunks 0,256,512,1024] [--batch 4] [--answer_len 384] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import BENCH_ENV, REPO, SMOL, BenchError, end_report, machine_line, start_report, title  # noqa: E402

# SmolLM2-135M's shape (its config.json), for a machine without the default model
SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny random 2-layer llama (utils.models.tiny) instead")
    p.add_argument(
        "--model_name_or_path",
        default=None,
        help=f"model directory whose config.json shapes the random model (default: {SMOL}, else SmolLM2-135M's shape)",
    )
    p.add_argument("--chunks", default="0,256,512,1024", help="comma-separated tokens per chunk (0: whole logits)")
    p.add_argument("--batch", type=int, default=4, help="rows of the mini-batch (step 3's default: 4)")
    p.add_argument("--prompt_len", type=int, default=64, help="prompt tokens per row (not through the LM head)")
    p.add_argument("--answer_len", type=int, default=384, help="answer tokens per row (through the LM head)")
    p.add_argument("--temperature", type=float, default=1.0, help="the log-probs' temperature (step 3's sampling one)")
    p.add_argument(
        "--no_gradient_checkpointing",
        action="store_true",
        help="keep every decoder activation (default: recompute them, as long answers need)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (the ranks' OMP_NUM_THREADS: 1)")
    p.add_argument("--save", default=None, help="also write the printed report to this file (path)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_config(args):
    """The random model's config: the tiny llama's, --model_name_or_path's, the default model's, or SmolLM2's shape."""
    from transformers import AutoConfig, LlamaConfig  # lazy: +2.5 s on every --help (transformers)

    if args.tiny:
        from utils.models.tiny import make_tiny_model_cached  # lazy: +1.7 s on every --help (torch)

        return AutoConfig.from_pretrained(make_tiny_model_cached("llama"))
    path = args.model_name_or_path or (SMOL if os.path.exists(os.path.join(SMOL, "config.json")) else None)
    return AutoConfig.from_pretrained(path) if path else LlamaConfig(**SMOLLM2_135M)


def rss_peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def worker(args) -> None:
    """One chunk size in this process: warm-up step, measured step; writes {peak_mib, seconds, logprobs} to --out."""
    import torch  # lazy: +1.7 s on every --help (torch, and below it transformers and the project's forwards)
    from transformers import AutoModelForCausalLM  # lazy: as above

    from utils.math.ops import select  # lazy: as above
    from utils.math.rows import Row, pack  # lazy: as above
    from utils.models.forward import token_logprobs  # lazy: as above

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    config = model_config(args)
    config.use_cache = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device).train()
    if not args.no_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(1)
    rows = [
        Row(
            prompt_ids=torch.randint(0, config.vocab_size, (args.prompt_len,), generator=g),
            response_ids=torch.randint(0, config.vocab_size, (args.answer_len,), generator=g),
            ended_with_eos=True,
        )
        for _ in range(args.batch)
    ]
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in pack(rows, 0).items()}
    mask = batch["action_mask"]

    def step():
        logprobs, entropy = token_logprobs(
            model, batch, args.temperature, return_entropy=True, chunk_tokens=args.worker
        )  # the actor's forward of a PPO mini-batch: log-probs with the entropy monitor
        loss = -select(logprobs, mask).sum() / mask.sum()
        loss.backward()
        return logprobs.detach()

    step()  # warm-up: allocates the parameter gradients (kept, as a DeepSpeed engine keeps its buffers)
    model.zero_grad(set_to_none=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        rss_peak_reset()
        base = status_kib("VmRSS") * 1024
    start = time.perf_counter()
    logprobs = step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = status_kib("VmHWM") * 1024 - base
    seconds = time.perf_counter() - start
    kept = {"logprobs": select(logprobs, mask).cpu(), "base_mib": base / 2**20}
    torch.save({"peak_mib": peak / 2**20, "seconds": seconds, **kept}, args.out)


def main(argv=None):
    args = parse_args(argv)
    import torch  # lazy: +1.7 s on every --help (torch)

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.worker is not None:
        return worker(args)
    chunks = [int(c) for c in args.chunks.split(",")]
    if 0 not in chunks:
        chunks = [0, *chunks]
    config = model_config(args)
    header = start_report(
        [
            title("chunked_logprobs.py"),
            machine_line(),
            f"model: random {config.model_type}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"vocabulary {config.vocab_size}, tied embeddings {config.tie_word_embeddings}; fp32 on {args.device}"
            + (f", {args.threads} torch thread(s)" if args.device == "cpu" else ""),
            f"batch: {args.batch} rows x ({args.prompt_len} prompt + {args.answer_len} answer tokens); temperature "
            f"{args.temperature}; gradient checkpointing {'off' if args.no_gradient_checkpointing else 'on'}",
            "peak: what the measured step adds to the memory in use before it ("
            + ("torch.cuda.max_memory_allocated" if args.device == "cuda" else "peak RSS, VmHWM")
            + "); each chunk size in a fresh process",
        ]
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="chunked_logprobs_") as tmp:
        for n in chunks:
            out = os.path.join(tmp, f"{n}.pt")
            cmd = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
            cmd += ["--worker", str(n), "--out", out, "--device", args.device]
            env = {**os.environ, **BENCH_ENV, "MALLOC_MMAP_THRESHOLD_": "131072"}  # freed tensors leave the RSS
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
                raise BenchError(f"the chunk size {n} run failed (exit status {proc.returncode})")
            results[n] = torch.load(out)
            print(f"[chunked_logprobs] chunk {n}: peak {results[n]['peak_mib']:.0f} MiB", flush=True)
    whole = results[0]
    body = [f"{'chunk tokens':>12s} {'peak MiB':>9s} {'/ whole':>8s} {'step s':>7s} {'max |logprob diff|':>19s}"]
    data = {}
    for n, r in results.items():
        diff = float((r["logprobs"] - whole["logprobs"]).abs().max())
        ratio = r["peak_mib"] / whole["peak_mib"]
        label = "0 (whole)" if n == 0 else str(n)
        body.append(f"{label:>12s} {r['peak_mib']:9.0f} {ratio:8.2f} {r['seconds']:7.2f} {diff:19.1e}")
        data[str(n)] = {"peak_mib": r["peak_mib"], "ratio": ratio, "seconds": r["seconds"], "max_abs_diff": diff}
    from utils.models.forward import LOGPROB_CHUNK_TOKENS  # lazy: torch, +1.7 s on every --help

    default = LOGPROB_CHUNK_TOKENS if LOGPROB_CHUNK_TOKENS in results else max(results)
    body.append(
        f"chunked ({default} tokens{', the default' if default == LOGPROB_CHUNK_TOKENS else ''}) / whole peak: "
        f"{results[default]['peak_mib'] / whole['peak_mib']:.2f} (goal <= 0.6); memory in use before the step: "
        f"{whole['base_mib']:.0f} MiB"
    )
    end_report(args.save, header, body, data=data)


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
