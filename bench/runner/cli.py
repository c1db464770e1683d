"""`python -m bench list | run NAME [--tiny] [--save] [-- ARGS] | index`: the one entry point of bench/."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import REPO, BenchError, cpu_name, sgemm_gflops
from bench.runner import results
from bench.runner.registry import BENCHMARKS, REGISTRY, Benchmark


def parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line, and its `run` subcommand's parser (whose help `run NAME --help` prints)."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0].split(": ", 1)[1])
    sub = p.add_subparsers(dest="command", required=True, metavar="{list,run,index}")
    sub.add_parser("list", help="one line per benchmark: name, minutes tiny / full, what it measures")
    run = sub.add_parser(
        "run",
        add_help=False,
        help="run one benchmark (run NAME --help: its own flags too)",
        usage="python -m bench run NAME [--tiny] [--save] [-- ARGS passed to the benchmark]",
    )
    run.add_argument(
        "name", nargs="?", choices=sorted(REGISTRY), metavar="NAME", help="a name of `python -m bench list`"
    )
    run.add_argument(
        "--tiny", action="store_true", help="the benchmark's tiny form (its arguments: bench/README.md's table)"
    )
    run.add_argument(
        "--save",
        action="store_true",
        help="write the report to bench/results/NAME/DATE-HOST.txt and the run's record (host, sgemm "
        "GFLOP/s, command, wall, headline, the benchmark's figures) to .json; then update INDEX.md",
    )
    run.add_argument("-h", "--help", action="store_true", help="this help, then the benchmark's own")
    sub.add_parser("index", help="regenerate bench/results/INDEX.md and bench/README.md's table")
    return p, run


def minutes(value) -> str:
    return "-" if value is None else f"{value:g}"


def list_lines() -> list[str]:
    width = max(len(b.name) for b in BENCHMARKS)
    return [
        f"{b.name:{width}s}  {minutes(b.minutes[0]):>4s} / {minutes(b.minutes[1]):<4s} min  {b.what}"
        for b in BENCHMARKS
    ]


def host_record() -> dict:
    """The machine of a saved run: CPU model, its tag in file names, cores, and how fast one core multiplies now."""
    cpu = cpu_name()
    return {"cpu": cpu, "slug": results.host_slug(cpu), "cores": os.cpu_count(), "sgemm_gflops": sgemm_gflops()}


def command(bench: Benchmark, tiny: bool, extra: list[str]) -> list[str]:
    if tiny and bench.tiny is None:
        raise BenchError(f"{bench.name} has no tiny form (minutes: {minutes(bench.minutes[1])}); run it without --tiny")
    return bench.command(sys.executable) + list(bench.tiny if tiny else ()) + extra


def execute(cmd: list[str], log_path: str | None) -> int:
    """Run `cmd` from the repository root; with `log_path`, its output also goes there (the report of a benchmark
    that does not write its own)."""
    if log_path is None:
        return subprocess.run(cmd, cwd=REPO).returncode
    with (
        open(log_path, "w") as log,
        subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        ) as proc,
    ):
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
    return proc.returncode


def save_record(bench: Benchmark, base: str, record: dict) -> None:
    """The run's json: `record` (with the report's headline) and, as "result", what the benchmark saved there."""
    json_path, report = base + ".json", base + ".txt"
    if os.path.exists(report):
        with open(report, errors="replace") as f:
            record["headline"] = results.headline(bench, f.read())
    data = {"run": record}
    if os.path.exists(json_path):
        with open(json_path) as f:
            data["result"] = json.load(f)
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1, default=str)


def run(bench: Benchmark, tiny: bool, save: bool, extra: list[str]) -> None:
    cmd = command(bench, tiny, extra)
    host = host_record() if save else None
    base = results.new_base(bench.name, host["slug"]) if save else None
    if save and bench.takes_save:
        cmd += ["--save", base + ".txt"]
    print(f"[bench] {' '.join(cmd)}", flush=True)
    start = time.time()
    rc = execute(cmd, base + ".txt" if save and not bench.takes_save else None)
    wall = time.time() - start
    if save:
        host["sgemm_gflops_after"] = sgemm_gflops()
        shown = [os.path.relpath(part, REPO) if part.startswith(REPO) else part for part in cmd]
        save_record(
            bench,
            base,
            {
                "benchmark": bench.name,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "command": shown,
                "tiny": tiny,
                "host": host,
                "wall_s": round(wall, 1),
                "exit": rc,
            },
        )
        print(
            f"[bench] saved {os.path.relpath(base, REPO)}.{{txt,json}}; updated: "
            f"{', '.join(results.write_views()) or 'nothing'}",
            flush=True,
        )
    if rc != 0:  # the benchmark printed its own `error:` line (or traceback): one more would repeat it
        print(f"[bench] {bench.name} exited with {rc} after {wall:.0f} s", file=sys.stderr, flush=True)
        raise SystemExit(rc)


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    p, run_parser = parsers()
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.command == "list":
        print("\n".join(list_lines()))
    elif args.command == "index":
        print(f"updated: {', '.join(results.write_views()) or 'nothing (up to date)'}")
    elif args.help or args.name is None:
        if not args.help:
            run_parser.error("NAME is required (python -m bench list)")
        run_parser.print_help()
        if args.name:
            print(f"\n{args.name}'s own flags (after --):", flush=True)
            execute(REGISTRY[args.name].command(sys.executable) + ["--help"], None)
    else:
        run(REGISTRY[args.name], args.tiny, args.save, extra)
