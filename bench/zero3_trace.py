"""What a no-grad forward of a ZeRO-3 engine costs the training steps after it, side by side.

    python bench/zero3_trace.py [--tiny] [--rounds 4] [--save FILE]

One ZeRO-3 actor on 2 ranks (launched through `deepspeed`), learning rate 0. Each round runs one
no-grad forward of the rollout batch (8 rows) in one of three ways, then two PPO-sized training
steps (4 rows each: forward, backward, optimizer step); the ways rotate round-robin:

- hooked:        the forward through DeepSpeed's module hooks (fetch and release per layer);
- gathered:      `step3_ppo.rollout.hybrid.gathered` (the project's: partitioned parameters gathered once,
                 hooks taken out and the same hooks put back);
- re-registered: what hybrid mode did before 2026-11-30 (kept here as the baseline): every
                 parameter gathered, hooks removed, then re-registered with
                 `setup_zero_stage3_hooks`, which makes DeepSpeed drop its recorded parameter trace.

Prints per way the medians of the forward and of each training step, and the all-gather calls
each made (DeepSpeed's comm backend is counted). A training step that follows a dropped trace
runs without prefetching and gathers some parameters more than once.
"""

from __future__ import annotations

import argparse
import contextlib
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
    main_or_worker,
    malloc_line,
    start_report,
    title,
)

WAYS = ("hooked", "gathered", "re-registered")
COUNTED = ("all_gather_into_tensor", "all_gather_coalesced", "reduce_scatter_tensor", "all_reduce")


def count_collectives() -> dict:
    """Counts DeepSpeed's collective calls by name (the TorchBackend methods ZeRO-3 goes through)."""
    from deepspeed.comm.torch import TorchBackend  # imported here to keep --help fast

    counts = {name: 0 for name in COUNTED}
    for name in COUNTED:
        original = getattr(TorchBackend, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        setattr(TorchBackend, name, counted)
    return counts


@contextlib.contextmanager
def re_registered(engine):
    """The pre-2026-11-30 hybrid gather: all parameters, hooks removed and registered anew on exit."""
    import deepspeed  # imported here to keep --help fast
    from deepspeed.runtime.zero import parameter_offload as zero_offload

    offload = engine.optimizer.parameter_offload
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        offload._remove_module_hooks()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            offload.setup_zero_stage3_hooks()
            stack = zero_offload.FWD_MODULE_STACK
            if len(stack) > 1 and stack[-1] is engine.module:
                stack.pop()


def worker(argv) -> None:
    """One rank: the three ways round-robin, each followed by two training steps; rank 0 writes --out."""
    import torch  # torch, deepspeed and the project: imported here to keep --help fast
    import torch.distributed as dist

    from step3_ppo.rollout.hybrid import gathered
    from utils.models.forward import causal_lm_logits, eval_mode
    from utils.models.loading import load_causal_lm
    from utils.runtime.distributed import init_distributed, is_rank0
    from utils.train.ds_config import train_ds_config
    from utils.train.loop import build_optimizer, initialize_engine

    args = parse_args(argv)
    init_distributed()
    counts = count_collectives()
    config = train_ds_config(3, dist.get_world_size(), 4)
    model = load_causal_lm(args.model_name_or_path, None, config, dropout=0.0)
    optimizer = build_optimizer([{"params": list(model.parameters()), "weight_decay": 0.0}], 0.0, False)
    engine = initialize_engine(model, config, optimizer)
    engine.train()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (8, args.seq_len), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def timed(fn):
        for name in counts:
            counts[name] = 0
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start, counts["all_gather_into_tensor"] + counts["all_gather_coalesced"]

    def no_grad_forward(way):
        def run():
            context = {"hooked": contextlib.nullcontext, "gathered": gathered, "re-registered": re_registered}[way]
            with torch.no_grad(), eval_mode(engine), context() if way == "hooked" else context(engine):
                causal_lm_logits(engine, ids, mask)

        return run

    def train_step(k):
        def run():
            logits = causal_lm_logits(engine, ids[4 * k : 4 * k + 4], mask[4 * k : 4 * k + 4])
            engine.backward(logits.float().logsumexp(-1).mean())
            engine.step()

        return run

    results = {way: {"forward": [], "train1": [], "train2": []} for way in WAYS}
    for round_ in range(args.rounds + 1):  # round 0 is a warm-up
        for way in WAYS:
            row = [timed(no_grad_forward(way)), timed(train_step(0)), timed(train_step(1))]
            if round_ > 0:
                for key, value in zip(("forward", "train1", "train2"), row):
                    results[way][key].append(value)
    if is_rank0():
        with open(args.out, "w") as f:
            json.dump(results, f)


def report(results: dict) -> list[str]:
    lines = [
        "",
        f"{'no-grad forward':16s} {'forward s':>10s} {'gathers':>8s} {'train 1 s':>10s} {'gathers':>8s} "
        f"{'train 2 s':>10s} {'gathers':>8s}   (medians; gathers = all-gather calls per rank)",
    ]
    med = {
        way: {k: (statistics.median(t for t, _ in v), statistics.median(n for _, n in v)) for k, v in r.items()}
        for way, r in results.items()
    }
    for way in WAYS:
        m = med[way]
        lines.append(
            f"{way:16s} {m['forward'][0]:10.3f} {m['forward'][1]:8.0f} {m['train1'][0]:10.3f} "
            f"{m['train1'][1]:8.0f} {m['train2'][0]:10.3f} {m['train2'][1]:8.0f}"
        )
    g, r, h = med["gathered"], med["re-registered"], med["hooked"]
    lines.append(
        f"first training step after the forward: re-registered / gathered = "
        f"{r['train1'][0] / g['train1'][0]:.2f}x; forward + both steps: "
        f"{sum(r[k][0] for k in r) / sum(g[k][0] for k in g):.2f}x (re-registered), "
        f"{sum(h[k][0] for k in h) / sum(g[k][0] for k in g):.2f}x (hooked) the time of gathered"
    )
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help="(internal) run as one launched rank")
    p.add_argument("--out", default=None, help="(internal, with --worker) rank 0's result file (JSON path)")
    add_model_args(p)
    p.add_argument("--seq_len", type=int, default=56, help="row length (tokens; SmolLM2 bench: prompt 32 + answer 24)")
    p.add_argument("--rounds", type=int, default=4, help="timed rounds per way after one warm-up round (rounds)")
    add_run_args(p, 29551, 900)
    p.add_argument("--local_rank", type=int, default=-1, help="(internal) set by the deepspeed launcher; unused")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    model_dir = bench_model(args)
    header = start_report(
        [
            title("zero3_trace.py"),
            f"model: {model_dir}; ZeRO-3 fp32 actor (utils.train.ds_config), 2 ranks, OMP_NUM_THREADS=1, lr 0; "
            f"no-grad forward of 8 x {args.seq_len} tokens, then 2 training steps of 4 x {args.seq_len}; "
            f"{args.rounds} rounds per way (round-robin) after a warm-up round",
            malloc_line(),
        ]
    )
    logs = os.path.join(REPO, "bench", "runs")
    os.makedirs(logs, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench_z3trace_") as tmp:
        out = os.path.join(tmp, "result.json")
        launch(
            deepspeed_cmd("bench.zero3_trace", args.master_port)
            + [
                "--worker",
                "--out",
                out,
                "--model_name_or_path",
                model_dir,
                "--seq_len",
                str(args.seq_len),
                "--rounds",
                str(args.rounds),
            ],
            bench_env(),
            args.timeout,
            os.path.join(logs, "zero3_trace.log"),
        )
        with open(out) as f:
            results = json.load(f)
    end_report(args.save, header, report(results))


if __name__ == "__main__":
    main_or_worker(main, worker)
