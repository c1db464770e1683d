"""bench/'s one runner (`python -m bench`): its command lines answer, every benchmark entry point is in its
registry, and the generated views (bench/results/INDEX.md, bench/README.md's table) match the registry and results."""

import os
import subprocess
import sys

from bench.runner import results
from bench.runner.registry import BENCHMARKS, REGISTRY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_BENCHMARKS = {"common.py", "__main__.py"}  # the shared scaffold and the runner


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_help_list_and_a_benchmarks_help_answer():
    out = bench("--help")
    assert out.returncode == 0 and "usage: python -m bench" in out.stdout
    out = bench("list")
    assert out.returncode == 0
    assert [line.split()[0] for line in out.stdout.splitlines()] == [b.name for b in BENCHMARKS]
    out = bench("run", "optimizer_step", "--help")
    assert out.returncode == 0, out.stderr
    assert "--tiny" in out.stdout and "--params" in out.stdout  # the runner's flags, then the benchmark's own


def test_an_impossible_run_ends_in_one_error_line():
    out = bench("run", "preference_losses", "--tiny")
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "error: preference_losses has no tiny form (minutes: 50); run it without --tiny"
    ]


def test_every_entry_point_under_bench_is_registered():
    """A new bench/*.py or bench/*.sh needs its registry entry (or to be a registered benchmark's file)."""
    claimed = {b.entry_point() for b in BENCHMARKS} | {f"bench/{f}" for b in BENCHMARKS for f in b.files}
    scripts = {
        f"bench/{f}"
        for f in os.listdir(os.path.join(ROOT, "bench"))
        if f.endswith((".py", ".sh")) and f not in NOT_BENCHMARKS
    }
    assert not scripts - claimed, f"not in bench/runner/registry.py: {sorted(scripts - claimed)}"
    assert all(os.path.exists(os.path.join(ROOT, path)) for path in claimed)


def test_index_and_readme_table_are_up_to_date():
    with open(results.INDEX) as f:
        assert f.read() == results.index_text(), "bench/results/INDEX.md is stale: python -m bench index"
    with open(results.README) as f:
        assert f.read() == results.readme_text(), "bench/README.md's table is stale: python -m bench index"


def test_results_live_in_a_registered_benchmarks_folder():
    folders = {d for d in os.listdir(results.RESULTS) if os.path.isdir(os.path.join(results.RESULTS, d))}
    assert folders - {"archive"} <= set(REGISTRY), sorted(folders - {"archive"} - set(REGISTRY))
    loose = [f for f in os.listdir(results.RESULTS) if os.path.isfile(os.path.join(results.RESULTS, f))]
    assert loose == ["INDEX.md"], loose


def test_host_slug_is_short_and_file_safe():
    assert results.host_slug("AMD EPYC 7B13 64-Core Processor") == "amd-epyc-7b13-64-core"
    assert results.host_slug("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz") == "intel-xeon-platinum-8481c"
    assert results.host_slug("") == "unknown-cpu"
