"""The tests' fork server (tests/zygote.py) gives a forked run what a fresh `python -m` would get: its
arguments, environment, stdio and exit status; a failing rank ends the others; a timed-out run leaves no rank."""

import os
import subprocess
import time

import pytest

from tests.launch import ROOT, process_running, rank_command, run_deepspeed, subprocess_env, zygote_socket

pytestmark = pytest.mark.slow  # they start the fork server (~5 s), which the fast tier otherwise never needs


@pytest.fixture(autouse=True)
def fork_server():
    if zygote_socket() is None:
        pytest.skip("the fork server is off (RLHF_TESTS_ZYGOTE=0)")


def test_a_forked_module_gets_its_arguments_environment_stdio_and_exit_code():
    proc = subprocess.run(
        rank_command("tests.zygote_probe", ["a b", "show"], 0, zygote=True),
        cwd=ROOT,
        input="hello\n",
        env=subprocess_env(PROBE="x1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == f"argv=['a b', 'show'] rank=- world=- probe=x1 cwd={ROOT} stdin=hello"
    assert proc.stderr.strip().endswith("to stderr")


def test_a_forked_script_runs_as_python_script_args():
    """A path ending in .py runs as `python SCRIPT ARGS` (how tests.launch.vllm_python's shim runs the vLLM worker)."""
    script = os.path.join(ROOT, "tests", "zygote_probe.py")
    proc = subprocess.run(
        rank_command(script, ["show"], 0, zygote=True),
        cwd=ROOT,
        input="hi\n",
        env=subprocess_env(PROBE="s"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == f"argv=['show'] rank=- world=- probe=s cwd={ROOT} stdin=hi"


def test_ranks_get_the_launcher_variables_and_a_failing_rank_ends_the_others():
    start = time.monotonic()
    proc = run_deepspeed("tests.zygote_probe", ["fail_rank_1"], timeout=60)
    assert proc.returncode == 1 and "ValueError: rank 1 fails" in proc.stderr
    assert time.monotonic() - start < 20  # rank 0 sleeps 60 s: stopped, not waited for


def test_a_run_past_its_timeout_leaves_no_rank(tmp_path):
    probe = str(tmp_path / "pid")
    with pytest.raises(subprocess.TimeoutExpired):
        run_deepspeed("tests.zygote_probe", ["sleep"], timeout=3, env=subprocess_env(PROBE=probe))
    pids = [int(open(f"{probe}.{rank}").read()) for rank in (0, 1)]
    deadline = time.monotonic() + 10
    while any(process_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_running(pid) for pid in pids)
