"""What the benchmarks share: paths, the flags every one of them has, the launch of a benchmark's worker
(the script re-launched under the `deepspeed` launcher or torchrun with --worker, see main_or_worker), and
the report: its header (the machine a run got, start_report) and its tail (the load after the run, the
file under bench/results, end_report).

Heavy modules (torch, deepspeed, transformers and the project's modules that import them) are imported
inside the functions that need them, so that every benchmark's --help stays fast."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from utils.errors import ProjectError, run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, "bench", "runs")
SMOL = os.path.join(REPO, ".cache", "models", "SmolLM2-135M-Instruct")
# the environment of every launched run: one thread per process (2 ranks on 2 cores), offline, quiet
BENCH_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONWARNINGS": "ignore",
}


class BenchError(ProjectError):
    """A benchmark that cannot run as asked or whose launch failed: shown as one `error:` line by
    utils.errors.run_main (every benchmark's main goes through it), exit status 1."""


def launch_failed(message: str, log_tail: str) -> BenchError:
    """The error of a failed launch: its log's tail goes to stderr first (the lines that say why), then the
    one-line `message`."""
    sys.stderr.write(log_tail.rstrip("\n") + "\n")
    return BenchError(message)


def bench_model(args) -> str:
    """The model directory a benchmark runs: `--tiny`'s cached 2-layer random llama, else
    --model_name_or_path, else the embedded SmolLM2-135M-Instruct."""
    if getattr(args, "tiny", False):
        from utils.models.tiny import make_tiny_model_cached  # torch: imported here to keep --help fast

        return make_tiny_model_cached("llama")
    return args.model_name_or_path or SMOL


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor() or ""


def sgemm_gflops(n: int = 1024, repeats: int = 5) -> float:
    """How fast one core multiplies right now (fp32 n x n matmul, 1 thread, best of `repeats`, GFLOP/s): a saved
    result's host figure, since the same CPU model reads 80-160 on a shared VM from one hour to the next."""
    import torch  # imported here to keep --help fast

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return round(2 * n**3 / best / 1e9, 1)


def cpu_busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over `seconds` (from /proc/stat), measured before a run starts."""

    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except OSError:
        return float("nan")
    return (busy1 - busy0) / max(total1 - total0, 1)


def machine_line() -> str:
    """Cores, and how busy other work kept them just before the run (> ~10%: timings are noisy)."""
    busy = cpu_busy_fraction()
    verdict = "otherwise idle" if busy < 0.10 else "SHARED with other work: timings are noisy"
    return f"machine: {os.cpu_count()} CPU cores ({cpu_name()}); {100 * busy:.0f}% busy just before the run, {verdict}"


def malloc_line(env: dict | None = None) -> str:
    """Which allocator settings the launched processes get (utils.runtime.distributed.tune_malloc)."""
    from utils.runtime.distributed import malloc_tuning_wanted  # torch: imported here to keep --help fast

    env = os.environ if env is None else env
    set_vars = " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("MALLOC_"))
    if malloc_tuning_wanted(env):
        return "malloc: the project's tune_malloc (mallopt at init: no mmap, no trim, 1 GB top pad)" + (
            f"; also in the environment: {set_vars}" if set_vars else ""
        )
    return f"malloc: {set_vars or 'glibc defaults'} (tune_malloc off: the environment chose)"


def machine_lines(label: str) -> list[str]:
    load = os.getloadavg()
    mem = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                k, v = line.split(":")
                mem[k] = int(v.split()[0]) // 1024
    except OSError:
        pass
    return [
        f"load average {label}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min); "
        f"memory available {mem.get('MemAvailable', '?')} MiB of {mem.get('MemTotal', '?')} MiB"
    ]


def finish_report(path: str | None, header: list[str], body: list[str]) -> None:
    """Print the body (the header was printed when the run started) and save header + body to `path`."""
    print("\n".join(body), flush=True)
    lines = header + body
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")


def save_json(report_path: str | None, data) -> None:
    """`data` as JSON beside a saved report (same name, .json); nothing without --save."""
    if report_path:
        with open(os.path.splitext(report_path)[0] + ".json", "w") as f:
            json.dump(data, f, indent=1, default=str)


def title(script: str) -> str:
    """A report's first line: `# bench/SCRIPT  DATE TIME`."""
    return f"# bench/{script}  {time.strftime('%Y-%m-%d %H:%M:%S')}"


def start_report(lines: list[str]) -> list[str]:
    """A report's header: `lines` (title, machine, configuration) and the load before the run; printed now,
    returned for end_report."""
    header = lines + machine_lines("before")
    print("\n".join(header), flush=True)
    return header


def end_report(save: str | None, header: list[str], body: list[str], tail: list[str] = (), data=None) -> None:
    """A report's tail: print `body`, the load after the run and `tail`; with --save write the header and all of
    it to `save`, and `data` (when given) as JSON beside it."""
    finish_report(save, header, body + machine_lines("after") + list(tail))
    if data is not None:
        save_json(save, data)


# ----------------------------------------------------------------------------------------------- flags
def add_model_args(
    p: argparse.ArgumentParser,
    tiny_help: str = "a tiny random 2-layer llama (utils.models.tiny) instead of the default model",
) -> None:
    """--tiny and --model_name_or_path (bench_model reads them)."""
    p.add_argument("--tiny", action="store_true", help=tiny_help)
    p.add_argument("--model_name_or_path", default=None, help=f"model directory to run (default: {SMOL})")


def add_run_args(
    p: argparse.ArgumentParser,
    port: int,
    timeout: int | None,
    save_help: str = "also write the printed report to this file (path)",
) -> None:
    """--master_port, --timeout (when the script has one) and --save."""
    p.add_argument(
        "--master_port",
        type=int,
        default=port,
        help="TCP port the launched ranks meet on (port number; further launches of the run add to it)",
    )
    if timeout is not None:
        p.add_argument("--timeout", type=int, default=timeout, help="limit of each launch (seconds)")
    p.add_argument("--save", default=None, help=save_help)


# ---------------------------------------------------------------------------------------------- launch
def main_or_worker(main, worker, flag: str = "--worker") -> None:
    """The entry point of a benchmark that re-launches itself (under `deepspeed` or torchrun) with `flag`:
    the launched copies run worker(argv), the command line a person types runs main() (one `error:` line and exit
    status 1 on a BenchError or another ProjectError, utils.errors.run_main)."""
    argv = sys.argv[1:]
    if flag in argv:
        worker(argv)
    else:
        run_main(main)


def worker_argv(argv: list[str], flag: str, *options: str) -> tuple[list[str], dict[str, str]]:
    """A re-launched worker's command line split in two: the rest without `flag`, the bench's own `options`
    (each with its value) and the launcher's --local_rank (step 3's own command line, for its parse_args); and
    those options' values."""
    values = {option: argv[argv.index(option) + 1] for option in options}
    rest = [
        a
        for i, a in enumerate(argv)
        if a != flag and a not in options and not (i and argv[i - 1] in options) and not a.startswith("--local_rank")
    ]
    return rest, values


def deepspeed_cmd(module: str, port: int) -> list[str]:
    """`deepspeed` launching `python -m module` on 2 ranks (the script's own arguments follow): the launcher
    of this interpreter's venv, so `.venv/bin/python bench/...` works without an activated venv."""
    own = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [
        own if os.path.exists(own) else "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        "--module",
        module,
    ]


def alternate(rounds: int, first, second) -> tuple[list, list]:
    """Both sides of a side-by-side benchmark `rounds` times, the order alternating (AB, BA, AB, ...), so a
    change of the machine's load shows as spread between rounds instead of deciding the ratio. `first` /
    `second`: callables returning a side's result (None when skipped). Returns each side's results."""
    a, b = [], []
    for r in range(rounds):
        order = ((a, first), (b, second)) if r % 2 == 0 else ((b, second), (a, first))
        for results, run in order:
            results.append(run())
    return a, b


def median_result(results: list) -> dict | None:
    """The result of the round with the median samples/s (the lower middle one for an even count)."""
    done = sorted((r for r in results if r and "samples_per_s" in r), key=lambda r: r["samples_per_s"])
    return done[(len(done) - 1) // 2] if done else None


def rounds_lines(ours: list, theirs: list, peer: str) -> list[str]:
    """Each round's s/iteration of both sides and its ratio, then the ratios' median and spread."""
    out, ratios = [], []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a and b and "samples_per_s" in a and "samples_per_s" in b:
            ratios.append(a["samples_per_s"] / b["samples_per_s"])
            out.append(
                f"round {i + 1} ({'ours first' if i % 2 == 0 else peer + ' first'}): ours "
                f"{a['step_s']:.2f} s/iteration, {peer} {b['step_s']:.2f}: ratio {ratios[-1]:.2f}x"
            )
    if ratios:
        out.append(
            f"ratio ours/{peer} samples/s over {len(ratios)} alternating round(s): median "
            f"{statistics.median(ratios):.2f}x, spread {min(ratios):.2f}x-{max(ratios):.2f}x"
        )
    return out


def torchrun_cmd(python: str, port: int, script: str) -> list[str]:
    """torchrun (of another venv's `python`) launching `script` on 2 ranks (its arguments follow)."""
    return [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port), script]


def bench_env(drop: tuple[str, ...] = (), **extra: str) -> dict:
    """The environment of a launched run: ours without the variables that start with one of `drop`, with
    BENCH_ENV and `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(drop)}, **BENCH_ENV, **extra}


def fresh_dir(path: str) -> str:
    """`path` emptied (a run's work folder under bench/runs: the previous run's outputs go)."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass
class Launch:
    """One finished launch: exit status, wall seconds, CPU seconds of its processes, the largest child
    process's peak RSS so far (MiB, RUSAGE_CHILDREN's ru_maxrss) and its log file."""

    returncode: int
    wall_s: float
    cpu_s: float
    max_rss_mib: float
    log: str

    def tail(self, chars: int = 3000) -> str:
        with open(self.log) as f:
            return f.read()[-chars:]


def run_logged(cmd: list[str], env: dict, log_path: str, timeout: int) -> Launch:
    """Run `cmd` from the repository root, its output to log_path; timed, with its CPU time."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.time() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return Launch(proc.returncode, wall, cpu, after.ru_maxrss / 1024, log_path)


def launch(cmd: list[str], env: dict, timeout: int, log_path: str) -> None:
    """Run a command in its own process group (killed whole on timeout), output to log_path; exit on failure."""
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            time.sleep(5)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            rc = "timeout"
    print(f"  [{time.time() - start:.0f} s] {' '.join(cmd[:8])} ... (log {log_path})", file=sys.stderr, flush=True)
    if rc != 0:
        with open(log_path) as f:
            raise launch_failed(f"{' '.join(cmd[:6])} ... exited with {rc} (log {log_path})", f.read()[-6000:])
