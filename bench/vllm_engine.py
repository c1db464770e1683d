"""Benchmark of step 3's two rollout engines on the same ZeRO-3 actor: the hybrid engine (`--rollout_engine hf
--enable_hybrid_engine`) against the vLLM worker (`--rollout_engine vllm`), 2 ranks, greedy, fp32.

    python bench/vllm_engine.py                         # SmolLM2-135M, 8 prompts/rank of 64 tokens, 64/128/256 new
    python bench/vllm_engine.py --model_name_or_path DIR  # another model (vLLM on CPU: head size a multiple of 32)
    python bench/vllm_engine.py --compiled              # the worker with vLLM's compilation (minutes to start)
    python bench/vllm_engine.py --save bench/results/2026-12-03-vllm-engine.txt

One launch of 2 ranks; both engines are built on the same actor engine (ZeRO-3, no LoRA). For each answer
length (min = max new tokens, so both generate the same number of tokens) one warm-up call per engine, then
--repeats rounds alternating the order (AB, BA, ...); a call's time is the slowest rank's, between barriers;
figures are medians, with the spread. Also: the worker's start-up (process start to ready, eager unless
--compiled), the weight sync (gather from ZeRO-3 + shared memory + vLLM's reload) over --syncs forced syncs,
peak RSS of a rank and of the worker, and whether the two engines' greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
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


def add_call_args(p) -> None:
    p.add_argument("--batch_size", type=int, default=8, help="prompts per rank (rows)")
    p.add_argument("--prompt_len", type=int, default=64, help="prompt length, left-padded (tokens)")
    p.add_argument("--new_tokens", default="64,128,256", help="answer lengths, comma-separated (tokens)")
    p.add_argument("--repeats", type=int, default=4, help="timed rounds per answer length (calls per engine)")
    p.add_argument("--syncs", type=int, default=3, help="forced weight syncs timed (calls)")
    p.add_argument("--compiled", action="store_true", help="vLLM with its compilation (default: enforce_eager)")


def worker_args(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true", help="run as one launched process of the benchmark")
    p.add_argument("--model_name_or_path", required=True, help="model directory")
    p.add_argument("--out", required=True, help="rank 0's result file (JSON path)")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher; unused")
    add_call_args(p)
    return p.parse_args(argv)


def _timed(call) -> float:
    import torch

    torch.distributed.barrier()
    t0 = time.perf_counter()
    out = call()
    torch.distributed.barrier()
    elapsed = torch.tensor([time.perf_counter() - t0])
    torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
    return float(elapsed), out


def _peak_rss_gib(pid: int | None = None) -> float:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def worker(argv):
    """One rank: the actor engine, both rollout engines, the timed rounds; rank 0 writes the result."""
    from types import SimpleNamespace

    import torch

    from bench.generation import build_models
    from step3_ppo.generation_check import make_prompts
    from step3_ppo.rollout.engines import ActorGenerate
    from step3_ppo.rollout.vllm_engine import VLLMRollout, VLLMSettings
    from utils.models.forward import GenerationSettings
    from utils.models.loading import load_tokenizer
    from utils.runtime.distributed import init_distributed, is_rank0, set_seed

    args = worker_args(argv)
    init_distributed()
    set_seed(0)
    tokenizer = load_tokenizer(args.model_name_or_path, padding_side="left")
    prompts = make_prompts(tokenizer, args.batch_size, args.prompt_len, seed=1)
    build = SimpleNamespace(
        model_name_or_path=args.model_name_or_path, zero_stage=3, batch_size=args.batch_size, lora_dim=0
    )
    _, actor = build_models(build, ["hybrid"], tokenizer)
    lengths = [int(n) for n in args.new_tokens.split(",")]
    config = SimpleNamespace(
        stop_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id,
        seed=0,
        enable_hybrid_engine=True,
        merge_lora_for_generation=True,
        generation=GenerationSettings(max(lengths)),
    )
    engines = {
        "hybrid": ActorGenerate(actor, config),
        "vllm": VLLMRollout(
            actor,
            config,
            VLLMSettings(mode="compiled" if args.compiled else "eager", max_model_len=args.prompt_len + max(lengths)),
        ),
    }
    vllm = engines["vllm"]
    start_s, _ = _timed(vllm.sync_weights)  # process start -> ready, then the first sync
    result = {"start_s": vllm.start_s, "first_sync_s": start_s - vllm.start_s, "hello": vllm.hello, "lengths": {}}
    syncs = []
    for _ in range(args.syncs):
        actor.global_steps += 1
        syncs.append(_timed(vllm.sync_weights)[0])
    result.update(sync_s=syncs, sync_mb=vllm.sync_bytes / 2**20)
    ids, mask = prompts["input_ids"], prompts["attention_mask"]
    for n in lengths:
        settings = GenerationSettings(max_new_tokens=n, min_new_tokens=n, do_sample=False)
        calls = {name: (lambda e=e: e.generate(ids, mask, settings)) for name, e in engines.items()}
        out = {name: _timed(call)[1] for name, call in calls.items()}  # warm-up
        same = float((out["hybrid"] == out["vllm"]).all(dim=1).float().mean())
        times = {name: [] for name in engines}
        for r in range(args.repeats):
            for name in ("hybrid", "vllm") if r % 2 == 0 else ("vllm", "hybrid"):
                times[name].append(_timed(calls[name])[0])
        tokens = args.batch_size * n * torch.distributed.get_world_size()
        result["lengths"][n] = {"times": times, "tokens": tokens, "same_rows": same}
    peak = torch.tensor([_peak_rss_gib()])
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    result["rank_peak_gib"] = float(peak)
    if is_rank0():
        result["worker_peak_gib"] = _peak_rss_gib(vllm.proc.pid)
    vllm.close()
    if is_rank0():
        with open(args.out, "w") as f:
            json.dump(result, f)


def report(r: dict) -> list[str]:
    med = statistics.median
    hello = r["hello"]
    lines = [
        f"vLLM {hello['vllm']}: worker start-up {r['start_s']:.1f} s (vLLM's own {hello['start_s']:.1f} s; "
        f"{hello['threads']} threads), first sync {r['first_sync_s']:.2f} s",
        f"weight sync ({r['sync_mb']:.0f} MB: ZeRO-3 gather + shared memory + reload): median "
        f"{med(r['sync_s']):.2f} s (" + ", ".join(f"{s:.2f}" for s in r["sync_s"]) + ")",
        f"peak RSS: a rank {r['rank_peak_gib']:.2f} GiB, the worker {r['worker_peak_gib']:.2f} GiB",
        "",
        "| new tokens | hybrid tokens/s | vLLM tokens/s | vLLM / hybrid (median; spread over rounds) "
        "| greedy rows equal |",
        "|---|---|---|---|---|",
    ]
    for n, x in r["lengths"].items():
        h, v = x["times"]["hybrid"], x["times"]["vllm"]
        ratios = sorted(a / b for a, b in zip(h, v))
        lines.append(
            f"| {n} | {x['tokens'] / med(h):.0f} | {x['tokens'] / med(v):.0f} | {med(h) / med(v):.2f}x "
            f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {x['same_rows']:.2f} |"
        )
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    add_run_args(p, port=29731, timeout=1800)
    add_call_args(p)
    args = p.parse_args(argv)
    model = bench_model(args)
    header = start_report(
        [
            title("vllm_engine.py"),
            machine_line(),
            malloc_line(),
            f"model {model}; 2 ranks, ZeRO-3, fp32, greedy; {args.batch_size} prompts/rank of "
            f"{args.prompt_len} tokens; vLLM {'compiled' if args.compiled else 'eager'}",
        ]
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = (
            deepspeed_cmd("bench.vllm_engine", args.master_port)
            + [
                "--worker",
                "--model_name_or_path",
                model,
                "--out",
                out,
                "--batch_size",
                str(args.batch_size),
                "--prompt_len",
                str(args.prompt_len),
                "--new_tokens",
                args.new_tokens,
                "--repeats",
                str(args.repeats),
                "--syncs",
                str(args.syncs),
            ]
            + (["--compiled"] if args.compiled else [])
        )
        launch(
            cmd,
            bench_env(),
            args.timeout,
            os.path.join(tmp, "log.txt") if not args.save else os.path.splitext(args.save)[0] + ".log",
        )
        with open(out) as f:
            result = json.load(f)
    end_report(args.save, header, report(result), data=result)


if __name__ == "__main__":
    main_or_worker(main, worker)
