"""What one call of the python tool costs before the code runs: its bubblewrap sandbox's start-up.

    .venv/bin/python -m bench.sandbox_startup [--calls N]

Times N calls of `print(1)` through the python tool (step3_ppo/agents/tools.py: run_python, a sandbox per call)
and N plain `python -I -S -c 'print(1)'` subprocesses with no sandbox (the same interpreter: the baseline),
alternating in one process so both see the same load; prints the median and p90 of each in ms and the
1-thread sgemm probe.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import machine_line, sgemm_gflops  # noqa: E402
from step3_ppo.agents import python_sandbox  # noqa: E402
from step3_ppo.agents.tools import run_python, sandbox_missing  # noqa: E402
from utils.errors import ProjectError  # noqa: E402


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="calls of each kind (alternating)")
    args = parser.parse_args(argv)
    if args.calls < 1:
        raise ProjectError(f"--calls must be >= 1, got {args.calls}")
    missing = sandbox_missing()
    if missing:
        raise ProjectError(f"the python tool cannot run here: {missing}")
    python = python_sandbox.interpreter()
    print(machine_line())
    print(f"sgemm probe: {sgemm_gflops():.1f} GFLOP/s (1 thread)")
    sandboxed, plain = [], []
    for _ in range(args.calls):
        start = time.perf_counter()
        run = run_python("print(1)", timeout=30)
        sandboxed.append(time.perf_counter() - start)
        if run.output != "1\n" or run.status != 0:
            raise ProjectError(f"the sandboxed print(1) gave {run.output!r} (status {run.status})")
        start = time.perf_counter()
        subprocess.run([python, "-I", "-S", "-c", "print(1)"], capture_output=True, env={}, check=True)
        plain.append(time.perf_counter() - start)
    for name, times in (("python tool (bubblewrap)", sandboxed), ("plain python -I -S -c", plain)):
        print(
            f"{name}: median {statistics.median(times) * 1e3:.1f} ms, p90 {_p90(times) * 1e3:.1f} ms "
            f"of {len(times)} calls of print(1)"
        )
    extra = statistics.median(sandboxed) - statistics.median(plain)
    print(f"sandbox start-up: +{extra * 1e3:.1f} ms per call over the plain interpreter (medians)")


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
