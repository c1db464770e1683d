"""bench/'s command lines: every flag says what it does, every script's --help answers at once (no torch
imported for it), and the worker scaffold of bench/common.py hands step 3 its own arguments."""

import ast
import os
import subprocess
import sys
import time

import pytest

from bench.common import worker_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(f for f in os.listdir(os.path.join(ROOT, "bench")) if f.endswith(".py") and f != "common.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_a_help(script):
    with open(os.path.join(ROOT, "bench", script)) as f:
        tree = ast.parse(f.read(), script)
    bare = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "add_argument"
        and not any(k.arg == "help" for k in node.keywords)
    ]
    assert not bare, f"bench/{script}: add_argument without help= at lines {bare}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_answers_without_torch(script):
    probe = (
        "import runpy, sys; sys.argv = [sys.argv[1], '--help']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported for --help'\n"
    )
    start = time.time()
    out = subprocess.run(
        [sys.executable, "-c", probe, os.path.join("bench", script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage:" in out.stdout
    assert time.time() - start < 30


def test_worker_argv_leaves_step3_its_own_arguments():
    argv = ["--actor_model_name_or_path", "m", "--local_rank=1", "--worker", "--memory_out", "out.json", "--steps", "2"]
    rest, values = worker_argv(argv, "--worker", "--memory_out")
    assert rest == ["--actor_model_name_or_path", "m", "--steps", "2"]
    assert values == {"--memory_out": "out.json"}


def test_peer_benchmarks_alternate_the_sides_and_report_the_spread():
    """Run one side after the other, a load change on the host would decide the ratio: the sides alternate
    (AB, BA, ...) and the report gives each round's ratio with the median and spread."""
    from bench.common import alternate, median_result, rounds_lines

    order, speeds = [], iter([2.0, 1.0, 1.0, 3.0, 2.0, 1.0])
    ours, theirs = alternate(
        3,
        lambda: order.append("ours") or {"samples_per_s": next(speeds), "step_s": 1.0},
        lambda: order.append("trl") or {"samples_per_s": next(speeds), "step_s": 1.0},
    )
    assert order == ["ours", "trl", "trl", "ours", "ours", "trl"]
    assert [r["samples_per_s"] for r in ours] == [2.0, 3.0, 2.0] and [r["samples_per_s"] for r in theirs] == [1.0] * 3
    assert median_result(ours)["samples_per_s"] == 2.0
    lines = rounds_lines(ours, theirs, "TRL")
    assert lines[1].startswith("round 2 (TRL first)") and lines[-1].endswith("median 2.00x, spread 2.00x-3.00x")
