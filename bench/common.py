"""What the three benchmarks share: paths, and the lines that describe the machine a run got."""
from __future__ import annotations

import os
import platform

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(REPO, "bench", "runs")
SMOL = os.path.join(REPO, ".cache", "models", "SmolLM2-135M-Instruct")


def bench_model(args) -> str:
    """The model directory a benchmark runs: `--tiny`'s cached 2-layer random llama, else
    --model_name_or_path, else the embedded SmolLM2-135M-Instruct."""
    if getattr(args, "tiny", False):
        from utils.tiny_model import make_tiny_model_cached

        return make_tiny_model_cached("llama")
    return args.model_name_or_path or SMOL


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor() or ""


def cpu_busy_fraction(seconds: float = 2.0) -> float:
    """Fraction of all cores busy over `seconds` (from /proc/stat), measured before a run starts."""
    import time

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
    """Which allocator settings the launched processes get (utils.distributed.tune_malloc)."""
    from utils.distributed import malloc_tuning_wanted

    env = os.environ if env is None else env
    set_vars = " ".join(f"{k}={v}" for k, v in env.items() if k.startswith("MALLOC_"))
    if malloc_tuning_wanted(env):
        return ("malloc: the project's tune_malloc (mallopt at init: no mmap, no trim, 1 GB top pad)"
                + (f"; also in the environment: {set_vars}" if set_vars else ""))
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
    return [f"load average {label}: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (1/5/15 min); "
            f"memory available {mem.get('MemAvailable', '?')} MiB of {mem.get('MemTotal', '?')} MiB"]


def finish_report(path: str | None, header: list[str], body: list[str]) -> None:
    """Print the body (the header was printed when the run started) and save header + body to `path`."""
    print("\n".join(body), flush=True)
    lines = header + body
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
