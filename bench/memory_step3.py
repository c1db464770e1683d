"""Where a step-3 rank's memory goes: by model (weights, gradients, optimizer), by phase, and the allocator.

    python bench/memory_step3.py                       # SmolLM2-135M, 4-model PPO with GAE, ZeRO-3 + hybrid
    python bench/memory_step3.py --tiny                # tiny random llama (seconds)
    python bench/memory_step3.py --variants tuned,glibc --save bench/results/DATE-memory-step3.txt

Runs the unmodified step 3 (`deepspeed --num_gpus 2 --module bench.memory_step3 --worker`, which
calls `step3_ppo.main.main`) on bench/step3.py's workload (same prompts, fixed answer length, rollout,
mini-batch, fp32, full fine-tuning; actor = reference, critic = reward = backbone + fresh value head)
and records on every rank:
- the process RSS (VmRSS) before and after each model is loaded and made an engine, so each model's
  resident cost is the difference;
- the bytes of the tensors each engine holds, from DeepSpeed's objects: the rank's parameter shards,
  the optimizer's flat fp32 partitions, gradient partitions and Adam moments (found by walking the
  optimizer's attributes, unique storages only);
- per PPO phase (generation, experience, training; `utils.runtime.accelerator.PhaseMemory` already resets the
  peak at each phase's start): the RSS at its start, its peak (VmHWM) and glibc's heap at its end
  (`mallinfo2`: bytes in use and bytes free but kept by the allocator, the slack), the heap IN USE at its start
  and at its most, and its minor page faults (memory touched for the first time, or again after a trim);
- the heap in use at its most (and the RSS) inside each part of the run (`HeapSampler`: a thread reads
  mallinfo2's uordblks + hblkhd every BENCH_HEAP_SAMPLE_MS, default 5 ms): model loading, each gathered
  model, the rollout's sampling, each scoring forward, each mini-batch and each engine's backward and step,
  the export; and which part the run's heap-in-use and RSS peaks fell in. A gain counts where the heap in
  use falls; the RSS above it is the allocator's slack (free blocks it keeps resident) and the libraries;
- glibc's arenas at the end (malloc_info): their sizes and free bytes.
Variants (`--variants`, run one after the other): `tuned` = the project's default (`tune_malloc`),
`glibc` = RLHF_MALLOC_TUNING=0 (glibc's defaults), `env:NAME=VALUE,...` = extra environment, `flags:--a --b` =
extra step-3 flags; parts joined by `+` combine (`env:A=1+flags:--release_inference_cache`).
Experiments (bench only, as `env:` variants): BENCH_TRIM_AT_PHASE_END=1 calls glibc's malloc_trim(0)
after every phase; BENCH_ZERO='{"stage3_max_reuse_distance": 0}' sets DeepSpeed zero_optimization keys
(BENCH_REDUCE_BUCKET_SIZE=N: its reduce_bucket_size).
Seconds per iteration come from metrics.jsonl as in bench/step3.py (first iteration dropped).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import json
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench import step3  # noqa: E402
from bench.common import (  # noqa: E402
    RUNS,
    BenchError,
    add_run_args,
    bench_env,
    bench_model,
    end_report,
    fresh_dir,
    launch_failed,
    machine_line,
    main_or_worker,
    malloc_line,
    read_jsonl,
    run_logged,
    start_report,
    title,
    worker_argv,
)

GIB = 2**30


# ----------------------------------------------------------------------------------------------- worker
class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc, loaded once (None elsewhere: musl, macOS)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return None
    return libc


def heap() -> dict:
    """glibc's view of the heap (GiB): in use, free but kept (slack), mmapped blocks; {} off glibc."""
    if _libc() is None:
        return {}
    m = _libc().mallinfo2()
    return {
        "in_use": (m.uordblks + m.hblkhd) / GIB,
        "free_kept": m.fordblks / GIB,
        "mmapped": m.hblkhd / GIB,
        "heap": m.arena / GIB,
    }


def arenas() -> list[dict]:
    """glibc's arenas (malloc_info): each one's size and free bytes (GiB); [] off glibc. Threads other than the
    main one allocate from arenas of their own, whose free blocks the main thread's allocations cannot use."""
    if _libc() is None:
        return []
    fd, path = tempfile.mkstemp(suffix=".xml")
    os.close(fd)
    try:
        fopen, fclose = _libc().fopen, _libc().fclose
        fopen.restype, fopen.argtypes, fclose.argtypes = (
            ctypes.c_void_p,
            [ctypes.c_char_p, ctypes.c_char_p],
            [ctypes.c_void_p],
        )
        _libc().malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
        stream = fopen(path.encode(), b"w")
        _libc().malloc_info(0, stream)
        fclose(stream)
        with open(path) as f:
            xml = f.read()
    finally:
        os.remove(path)
    out = []
    for nr, body in re.findall(r'<heap nr="(\d+)">(.*?)</heap>', xml, re.S):
        free = sum(int(n) for n in re.findall(r'<total type="(?:fast|rest)" count="\d+" size="(\d+)"/>', body))
        size = re.search(r'<system type="current" size="(\d+)"/>', body)
        out.append({"arena": int(nr), "size": int(size.group(1)) / GIB if size else 0.0, "free": free / GIB})
    return out


def rss() -> float:
    with open("/proc/self/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+)", f.read(), re.MULTILINE).group(1)) / 2**20


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _in_use_and_rss() -> tuple[float, float]:
    """(heap in use, RSS) in GiB, cheaply: glibc's uordblks + hblkhd (NaN off glibc) and /proc/self/statm."""
    with open("/proc/self/statm") as f:
        resident = int(f.read().split()[1]) * _PAGE / GIB
    if _libc() is None:
        return float("nan"), resident
    m = _libc().mallinfo2()
    return (m.uordblks + m.hblkhd) / GIB, resident


class HeapSampler:
    """The heap in use (and the RSS) sampled every `interval_s` by a daemon thread, so that a phase or a
    span reports the most the heap held inside it, not only what it holds at its end.

    Spans nest: every open span's maximum is raised by each sample (and by a reading at its start and
    end), and the whole run's maximum remembers the innermost span open when it happened. A sample is
    one mallinfo2 call (it walks the free lists under the arena locks: tens of microseconds) and one
    read of /proc/self/statm; peaks shorter than the interval can be missed.
    """

    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.open: list[dict] = []  # the open spans, outermost first
        self.stats: dict[str, dict] = {}  # span name -> count, in use at start / peak / end, RSS peak (max)
        self.top = {"in_use": 0.0, "rss": 0.0, "in_use_at": "", "rss_at": ""}
        self.samples = 0
        self._lock = threading.Lock()
        if interval_s > 0:
            threading.Thread(target=self._run, name="heap-sampler", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            self.sample()

    def sample(self) -> tuple[float, float]:
        in_use, resident = _in_use_and_rss()
        with self._lock:
            self.samples += 1
            for span in self.open:
                span["in_use"], span["rss"] = max(span["in_use"], in_use), max(span["rss"], resident)
            where = self.open[-1]["name"] if self.open else "(outside the spans)"
            if in_use > self.top["in_use"]:
                self.top.update(in_use=in_use, in_use_at=where)
            if resident > self.top["rss"]:
                self.top.update(rss=resident, rss_at=where)
        return in_use, resident

    @contextlib.contextmanager
    def span(self, name: str):
        in_use, resident = _in_use_and_rss()
        span = {"name": name, "start": in_use, "in_use": in_use, "rss": resident, "t0": time.perf_counter()}
        with self._lock:
            self.open.append(span)
        try:
            yield span
        finally:
            end, _ = self.sample()
            with self._lock:
                self.open.remove(span)
                q = self.stats.setdefault(
                    name, {"count": 0, "start": 0.0, "in_use": 0.0, "end": 0.0, "rise": 0.0, "rss": 0.0, "s": 0.0}
                )
                q["count"] += 1
                q["s"] += time.perf_counter() - span["t0"]
                q["start"], q["end"] = max(q["start"], span["start"]), max(q["end"], end)
                q["in_use"], q["rss"] = max(q["in_use"], span["in_use"]), max(q["rss"], span["rss"])
                q["rise"] = max(q["rise"], span["in_use"] - span["start"])


SAMPLER: HeapSampler | None = None


def tensor_bytes(obj, seen: set, depth: int = 0) -> int:
    """Bytes of the distinct tensor storages reachable from obj through lists, tuples, dicts and DeepSpeed's
    own objects (depth <= 4)."""
    import torch  # imported here to keep --help fast

    if isinstance(obj, torch.Tensor):
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return 0
        key = storage.data_ptr()
        if key == 0 or key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if depth >= 4:
        return 0
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen, depth + 1) for v in obj)
    if type(obj).__module__.startswith("deepspeed") and hasattr(obj, "__dict__"):  # e.g. its gradient buckets
        return sum(tensor_bytes(v, seen, depth + 1) for v in vars(obj).values())
    return 0


def engine_tensors(engine) -> dict:
    """GiB the engine's rank holds: parameter shards (ZeRO-3 ds_tensor, else the data), and the
    optimizer's tensors by attribute (flat fp32 partitions, gradient partitions, Adam moments)."""
    import torch  # imported here to keep --help fast

    seen: set = set()
    params = 0
    for p in engine.module.parameters():
        shard = getattr(p, "ds_tensor", None)
        params += tensor_bytes(shard if shard is not None else p.data, seen)
    out = {"parameters (this rank's shards)": params / GIB}
    optimizer = getattr(engine, "optimizer", None)
    if optimizer is not None:
        by_attr = {}
        inner = getattr(optimizer, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            by_attr["Adam moments (optimizer.state)"] = tensor_bytes(dict(inner.state), seen)
        for name, value in sorted(vars(optimizer).items()):
            n = tensor_bytes(value, seen)
            if n >= 1 << 20:
                by_attr[name] = n
        out.update({k: v / GIB for k, v in by_attr.items()})
    return out


def worker(argv) -> None:
    """One rank: step 3's own main() with its model loading and its phases instrumented; writes OUT.rank<r>."""
    import torch  # torch and step 3: imported here to keep --help fast

    from step3_ppo import main as step3_main

    global SAMPLER
    argv, options = worker_argv(argv, "--worker", "--memory_out")
    SAMPLER = HeapSampler(float(os.environ.get("BENCH_HEAP_SAMPLE_MS", "5")) / 1000)
    record = {"milestones": [("start", rss(), heap())], "engines": {}, "phases": []}
    built = instrument_loading(record, step3_main)
    instrument_phases(record)
    instrument_spans(built, step3_main)
    bucket_experiment()
    try:
        with SAMPLER.span("run"):
            step3_main.main(argv)
    finally:
        milestone(record, "end (after export)")
        record["spans"], record["top"], record["samples"] = SAMPLER.stats, SAMPLER.top, SAMPLER.samples
        record["arenas"] = arenas()
        for engines in built:  # after training: the optimizer creates the Adam moments at its first step
            named = {name: getattr(engines, name) for name in ("actor", "ref", "critic")}
            named.update({f"reward{i}": reward for i, reward in enumerate(engines.rewards.values())})
            record["engines"] = {name: engine_tensors(e) for name, e in named.items() if e is not None}
        record["rank"] = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(f"{options['--memory_out']}.rank{record['rank']}", "w") as f:
            json.dump(record, f)


def milestone(record: dict, name: str) -> None:
    record["milestones"].append((name, rss(), heap()))


def instrument_loading(record: dict, step3_main) -> list:
    """A milestone before and after every model load and engine build of step 3 (step3_ppo.deepspeed_models's functions
    wrapped, and step3_ppo.main's build_engines); returns the list the built engines are collected in."""
    from step3_ppo import deepspeed_models as engine_module  # imported here to keep --help fast

    def wrap(fn, label):
        def wrapped(*a, **k):
            milestone(record, f"before {label}")
            with SAMPLER.span(label):
                result = fn(*a, **k)
            milestone(record, f"after {label}")
            return result

        return wrapped

    engine_module.load_causal_lm = wrap(engine_module.load_causal_lm, "load causal LM")
    engine_module.build_trained_engine = wrap(engine_module.build_trained_engine, "trained engine")
    engine_module.build_frozen_engine = wrap(engine_module.build_frozen_engine, "frozen engine")
    original_from_pretrained = engine_module.RewardModel.from_pretrained.__func__
    engine_module.RewardModel.from_pretrained = classmethod(wrap(original_from_pretrained, "load value model"))
    original_build = engine_module.build_engines

    built = []

    def build_engines(*a, **k):
        built.append(original_build(*a, **k))
        milestone(record, "engines built")
        return built[-1]

    engine_module.build_engines = build_engines
    step3_main.build_engines = build_engines  # main imported the name
    return built


def instrument_phases(record: dict) -> None:
    """Per PPO phase: the RSS at its start and end, its peak, glibc's heap at its end and the heap in use at
    its start and at its most (HeapSampler); with
    BENCH_TRIM_AT_PHASE_END=1 (experiment) malloc_trim(0) after every phase."""
    from utils.runtime import accelerator  # imported here to keep --help fast

    original_phase = accelerator.PhaseMemory.phase

    @contextlib.contextmanager
    def phase(self, phase_name):
        start, faults = rss(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with original_phase(self, phase_name), SAMPLER.span(f"phase {phase_name}") as span:
            yield
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        record["phases"].append(
            {
                "phase": phase_name,
                "start_rss": start,
                "end_rss": rss(),
                "peak": accelerator.peak_memory_bytes() / GIB,
                "heap_end": heap(),
                "in_use_start": span["start"],
                "in_use_peak": span["in_use"],
                "minor_faults": faults,
            }
        )

    accelerator.PhaseMemory.phase = phase
    if os.environ.get("BENCH_TRIM_AT_PHASE_END") == "1" and _libc() is not None:  # experiment: free pages back
        inner_phase = accelerator.PhaseMemory.phase

        @contextlib.contextmanager
        def trimmed_phase(self, phase_name):
            with inner_phase(self, phase_name):
                yield
            _libc().malloc_trim(0)

        accelerator.PhaseMemory.phase = trimmed_phase


def instrument_spans(built: list, step3_main) -> None:
    """HeapSampler spans around the parts of an iteration and of the run's end: the rollout's sampling, each
    no-grad scoring forward, each gathered model, each mini-batch's forward and each engine's backward and
    step, the export; the report's span table says which of them the heap's peak is in."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # imported here to keep --help fast

    from step3_ppo import trainer as trainer_module  # step 3 and utils: imported here to keep --help fast
    from step3_ppo.rollout import hybrid  # imported here to keep --help fast
    from utils.runtime import accelerator  # imported here to keep --help fast

    def engine_name(engine) -> str:
        for engines in built:
            for name in ("actor", "ref", "critic"):
                if getattr(engines, name) is engine:
                    return name
            if engine in engines.rewards.values():
                return "reward"
        return "engine"

    def wrap(owner, attr, label):
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with SAMPLER.span(label(*a, **k)):
                return fn(*a, **k)

        setattr(owner, attr, wrapped)

    trainer_class = trainer_module.PPOTrainer
    wrap(trainer_class, "generate_rows", lambda *a, **k: "generate_rows (sampling)")
    wrap(trainer_class, "store_logprobs", lambda self, rows, engine, name, *a, **k: f"store_logprobs {name}")
    wrap(trainer_class, "store_values", lambda *a, **k: "store_values (critic)")
    wrap(trainer_class, "score_rewards", lambda *a, **k: "score_rewards")
    wrap(trainer_class, "train_minibatch", lambda *a, **k: "train_minibatch")
    wrap(trainer_class, "compute_advantages", lambda *a, **k: "compute_advantages")
    wrap(DeepSpeedEngine, "backward", lambda self, *a, **k: f"{engine_name(self)}.backward")
    wrap(DeepSpeedEngine, "step", lambda self, *a, **k: f"{engine_name(self)}.step")
    wrap(step3_main, "export", lambda *a, **k: "export")
    wrap(accelerator, "empty_cache", lambda *a, **k: "accelerator.empty_cache")

    original_gathered = hybrid.gathered

    @contextlib.contextmanager
    def gathered(engine):
        with SAMPLER.span(f"gathered {engine_name(engine)}"), original_gathered(engine):
            yield

    hybrid.gathered = trainer_module.gathered = gathered  # the trainer imported the name


def bucket_experiment() -> None:
    """BENCH_ZERO='{"key": value, ...}' (experiment): these DeepSpeed zero_optimization keys in every ZeRO section
    (e.g. reduce_bucket_size, stage3_max_reuse_distance); BENCH_REDUCE_BUCKET_SIZE=N is {"reduce_bucket_size": N}."""
    extra = json.loads(os.environ.get("BENCH_ZERO") or "{}")
    if os.environ.get("BENCH_REDUCE_BUCKET_SIZE"):  # experiment: a smaller ZeRO gradient bucket
        extra["reduce_bucket_size"] = int(float(os.environ["BENCH_REDUCE_BUCKET_SIZE"]))
    if extra:
        from utils.train import ds_config  # imported here to keep --help fast

        original_section = ds_config._zero_section

        def zero_section(*a, **k):
            return {**original_section(*a, **k), **extra}

        ds_config._zero_section = zero_section


# ----------------------------------------------------------------------------------------- orchestrator
def run_variant(args, model_dir, prompts, variant: str, port: int) -> dict:
    out_dir = fresh_dir(
        os.path.join(
            RUNS, "memory", f"{os.path.basename(model_dir.rstrip('/'))}-{re.sub(r'[^A-Za-z0-9]+', '_', variant)}"
        )
    )
    env, flags = bench_env(), []
    for part in variant.split("+"):
        if part == "glibc":
            env["RLHF_MALLOC_TUNING"] = "0"
        elif part.startswith("env:"):
            env.update(dict(kv.split("=", 1) for kv in part[4:].split(",") if kv))
        elif part.startswith("flags:"):
            flags += part[6:].split()
        elif part != "tuned":
            raise BenchError(f"unknown variant {variant!r} (tuned, glibc, env:K=V,..., flags:--a --b; join with +)")
    cmd = step3.step3_command(args, model_dir, prompts, 3, True, out_dir, port, module="bench.memory_step3")
    record_path = os.path.join(out_dir, "memory.json")
    cmd += flags + ["--worker", "--memory_out", record_path]
    run = run_logged(cmd, env, os.path.join(out_dir, "launch.log"), args.timeout)
    records = []
    for r in range(2):
        path = f"{record_path}.rank{r}"
        if os.path.exists(path):
            with open(path) as f:
                records.append(json.load(f))
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    if run.returncode != 0 or not records or not os.path.exists(metrics_path):
        raise launch_failed(f"variant {variant}: exit {run.returncode}; log tail above", run.tail())
    rows = read_jsonl(metrics_path)
    for sub in ("actor", "critic"):
        shutil.rmtree(os.path.join(out_dir, sub), ignore_errors=True)
    print(f"  [{run.wall_s:.0f} s] {variant}: exit {run.returncode}", file=sys.stderr, flush=True)
    return {"variant": variant, "records": records, "wall_s": run.wall_s, **step3.summarize(rows, args.warmup)}


def report(result: dict) -> list[str]:
    out = [
        "",
        f"=== variant {result['variant']}: {result['step_s']:.2f} s/iteration (median; generation "
        f"{result['gen_s']:.2f}, experience {result['exp_s']:.2f}, training {result['train_s']:.2f}); "
        f"launch {result['wall_s']:.0f} s",
    ]
    for rec in result["records"]:
        out.append(f"rank {rec['rank']}: RSS (GiB) at each milestone, and the change from the one before")
        prev = None
        for name, value, h in rec["milestones"]:
            delta = "" if prev is None else f"{value - prev:+7.2f}"
            extra = f"   heap in use {h['in_use']:.2f}, free kept {h['free_kept']:.2f}" if h else ""
            out.append(f"  {name:32s} {value:6.2f} {delta:>7s}{extra}")
            prev = value
        if rec["rank"] == 0:
            out.append("  tensors each engine holds on this rank at the end of the run (GiB):")
            for engine, parts in rec["engines"].items():
                total = sum(parts.values())
                out.append(f"    {engine:7s} {total:5.2f} = " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
            out.append(f"    all engines {sum(sum(p.values()) for p in rec['engines'].values()):.2f}")
        phases = {}
        for p in rec["phases"]:
            q = phases.setdefault(
                p["phase"], {k: [] for k in ("start", "peak", "end", "in_use", "free", "u0", "u", "faults")}
            )
            q["faults"].append(p.get("minor_faults", 0))
            q["start"].append(p["start_rss"])
            q["peak"].append(p["peak"])
            q["end"].append(p["end_rss"])
            q["in_use"].append(p["heap_end"].get("in_use", float("nan")))
            q["free"].append(p["heap_end"].get("free_kept", float("nan")))
            q["u0"].append(p.get("in_use_start", float("nan")))
            q["u"].append(p.get("in_use_peak", float("nan")))
        out.append(
            f"  {'phase':12s} {'entries':>7s} {'RSS at start':>12s} {'peak':>6s} {'peak - start':>12s} "
            f"{'RSS at end':>10s} {'heap in use':>11s} {'free kept':>9s} {'in use: start':>13s} {'peak':>6s} "
            f"{'rise':>6s} {'faults/entry':>12s}   (GiB; max over entries; heap at end; in use sampled; minor page "
            f"faults: thousands, median over entries)"
        )
        for name, q in phases.items():
            out.append(
                f"  {name:12s} {len(q['peak']):7d} {max(q['start']):12.2f} {max(q['peak']):6.2f} "
                f"{max(p - s for p, s in zip(q['peak'], q['start'])):12.2f} {max(q['end']):10.2f} "
                f"{max(q['in_use']):11.2f} {max(q['free']):9.2f} {max(q['u0']):13.2f} {max(q['u']):6.2f} "
                f"{max(u - u0 for u, u0 in zip(q['u'], q['u0'])):6.2f} {statistics.median(q['faults']) / 1000:12.1f}"
            )
        out += span_table(rec)
    return out


def span_table(rec: dict) -> list[str]:
    """The HeapSampler's spans of one rank, and where the run's heap-in-use and RSS peaks fell."""
    if not rec.get("spans"):
        return []
    top = rec["top"]
    heaps = rec.get("arenas", [])
    others = [a for a in heaps if a["arena"] != 0]
    out = [
        f"  glibc arenas at the end: {len(heaps)}; "
        + ", ".join(f"arena {a['arena']} {a['size']:.2f} GiB ({a['free']:.2f} free)" for a in heaps if a["arena"] == 0)
        + f"; the {len(others)} others {sum(a['size'] for a in others):.2f} GiB "
        f"({sum(a['free'] for a in others):.2f} free)",
        f"  peak of the run ({rec['samples']} samples): heap in use {top['in_use']:.2f} GiB in "
        f"'{top['in_use_at']}', RSS {top['rss']:.2f} GiB in '{top['rss_at']}'",
        f"  {'span':32s} {'count':>5s} {'in use: start':>13s} {'peak':>6s} {'rise':>6s} {'end':>6s} "
        f"{'RSS peak':>8s} {'seconds':>8s}   (GiB: max over entries; seconds: summed)",
    ]
    for name, q in rec["spans"].items():
        out.append(
            f"  {name:32s} {q['count']:5d} {q['start']:13.2f} {q['in_use']:6.2f} {q['rise']:6.2f} {q['end']:6.2f} "
            f"{q['rss']:8.2f} {q.get('s', float('nan')):8.2f}"
        )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    step3.add_workload_args(p, "PPO iterations per variant (iterations; default: tiny 4, else 3)")
    p.add_argument(
        "--variants",
        default="tuned",
        help="variants run one after the other, separated by ';': tuned;glibc;env:K=V,K2=V2;flags:--a --b "
        "(parts joined by '+' combine)",
    )
    add_run_args(p, 29591, 900)
    args = p.parse_args(argv)
    model_dir = bench_model(args)
    args.steps = args.steps or (4 if args.tiny else 3)
    prompts = step3.write_prompts(os.path.join(RUNS, "prompts.jsonl"), args.num_prompts)
    header = start_report(
        [
            title("memory_step3.py"),
            machine_line(),
            malloc_line(),
            f"model: {model_dir}; step 3 PPO with GAE, 4 models (actor, reference, critic, reward), ZeRO-3 + hybrid, "
            f"fp32, full fine-tuning, 2 ranks; {args.steps} iterations, rollout {args.batch_size} prompts/rank, "
            f"prompt <= {args.prompt_len}, answer {args.answer_len}, mini-batch {args.train_batch_size}",
        ]
    )
    out = []
    for i, variant in enumerate(v for v in args.variants.split(";") if v):
        out += report(run_variant(args, model_dir, prompts, variant, args.master_port + i))
    end_report(args.save, header, out)


if __name__ == "__main__":
    main_or_worker(main, worker)
