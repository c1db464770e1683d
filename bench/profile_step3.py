"""Where one PPO training phase of step 3 spends its CPU time (torch.profiler, rank 0).

    python bench/profile_step3.py [--tiny] [--stage 3] [--save bench/results/DATE-step3-training-profile.txt]

Runs step 3's own setup() on 2 ranks with the workload of bench/step3.py (hybrid generation
mode), makes two warm-up iterations, then profiles the PPO mini-batch updates (actor and critic
forward, backward, optimizer step) of one more rollout and prints the operators by self CPU time
and by total CPU time. This is how the training share was taken apart on 2026-11-30.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import step3  # noqa: E402
from bench.common import (  # noqa: E402
    RUNS,
    BenchError,
    add_model_args,
    add_run_args,
    bench_env,
    bench_model,
    finish_report,
    machine_line,
    main_or_worker,
    malloc_line,
    run_logged,
    worker_argv,
)


def worker(argv) -> None:
    from torch.profiler import ProfilerActivity, profile  # torch, step 3: imported here to keep --help fast

    from step3_ppo.main import parse_args, setup
    from utils.runtime.distributed import is_rank0

    argv, options = worker_argv(argv, "--worker", "--report")
    run = setup(parse_args(argv))
    trainer, batches = run.trainer, iter(run.loader)
    for step in range(2):
        trainer.step([next(batches)], step)
    rows, _, _ = trainer.make_experience([next(batches)])
    trainer.compute_advantages(rows)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        trainer.train_epochs(rows, 2)
    if is_rank0():
        table = prof.key_averages()
        with open(options["--report"], "w") as f:
            f.write(
                "by self CPU time\n"
                + table.table(sort_by="self_cpu_time_total", row_limit=25)
                + "\nby total CPU time (includes children and waits)\n"
                + table.table(sort_by="cpu_time_total", row_limit=30)
            )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p)
    p.add_argument("--stage", type=int, default=3, choices=[2, 3], help="ZeRO stage of actor and critic (2 or 3)")
    step3.add_ppo_args(p)
    add_run_args(p, 29561, None)
    args = p.parse_args(argv)
    args.steps = 10
    model_dir = bench_model(args)
    prompts = step3.write_prompts(os.path.join(RUNS, "prompts.jsonl"), 256)
    out_dir = os.path.join(RUNS, "profile")
    os.makedirs(out_dir, exist_ok=True)
    report = os.path.join(out_dir, "report.txt")
    cmd = step3.step3_command(
        args, model_dir, prompts, args.stage, True, out_dir, args.master_port, module="bench.profile_step3"
    )
    cmd += ["--worker", "--report", report]
    header = [
        f"# bench/profile_step3.py: PPO training phase of one rollout ({args.batch_size} rows per rank, "
        f"mini-batch {args.train_batch_size}), ZeRO-{args.stage}, model {model_dir}",
        machine_line(),
        malloc_line(),
    ]
    print("\n".join(header), flush=True)
    run = run_logged(cmd, bench_env(), os.path.join(out_dir, "launch.log"), 900)
    if run.returncode != 0 or not os.path.exists(report):
        raise BenchError(f"profile run exited {run.returncode}; see {out_dir}/launch.log")
    with open(report) as f:
        body = f.read()
    finish_report(args.save, header, [body])


if __name__ == "__main__":
    main_or_worker(main, worker)
