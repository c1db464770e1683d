"""One AdamW step over a ZeRO partition of a SmolLM2-135M-sized model: default vs fused.

    OMP_NUM_THREADS=1 python bench/optimizer_step.py [--params 67e6] [--repeats 5]

Step 3 takes four optimizer steps per PPO mini-batch pair (actor and critic) and step 1 one per
step; utils/training.build_optimizer uses the fused kernel. Prints seconds per step (median after
a warm-up step) and the ratio, side by side in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import machine_line  # noqa: E402


def time_steps(params, repeats: int, **kwargs) -> float:
    import torch  # imported here to keep --help fast

    opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), **kwargs)
    opt.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=float, default=67e6, help="parameters in the partition (count, e.g. 67e6)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per variant after a warm-up step (steps)")
    args = p.parse_args(argv)
    import torch  # imported here to keep --help fast

    print(machine_line())
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, fp32, {args.params / 1e6:.0f}M parameters "
        f"in tensors of 576x1536"
    )
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(576 * 1536, generator=gen)) for _ in range(int(args.params // (576 * 1536)))
    ]
    for param in params:
        param.grad = torch.randn(param.shape, generator=gen)
    results = {
        name: time_steps(params, args.repeats, **kw)
        for name, kw in (("for-loop", {"foreach": False}), ("foreach", {"foreach": True}), ("fused", {"fused": True}))
    }
    for name, seconds in results.items():
        print(f"{name:9s} {seconds:.4f} s/step")
    print(f"fused over foreach (torch's default): {results['foreach'] / results['fused']:.1f}x")


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
