"""DeepSpeed's JIT-built CPU communication op: a per-checkout build folder set by the
scripts and the test launcher, and a stale torch build `lock` (its builder killed) removed with one line
instead of a silent wait forever."""

import fcntl
import os
import shutil
import subprocess
import threading
import time

import pytest

from tests.launch import ROOT, subprocess_env
from utils.runtime.extensions import CHECKOUT_DIR, OUR_LOCK, TORCH_LOCK, build_lock


def test_a_stale_torch_lock_is_removed_with_one_line(tmp_path):
    (tmp_path / TORCH_LOCK).write_text("")  # left by a build that was killed
    said, built = [], []
    with build_lock(str(tmp_path), said.append):
        built.append(os.path.exists(tmp_path / TORCH_LOCK))
    assert built == [False]
    assert len(said) == 1 and f"removed the stale build lock {tmp_path / TORCH_LOCK}" in said[0]


def test_a_live_builder_is_waited_for_and_named(tmp_path):
    """While another loader holds our lock, its torch `lock` is live: untouched, and the wait says who."""
    (tmp_path / TORCH_LOCK).write_text("")
    holder = os.open(tmp_path / OUR_LOCK, os.O_RDWR | os.O_CREAT)
    fcntl.flock(holder, fcntl.LOCK_EX)
    os.write(holder, b"4242@builder\n")
    said, inside = [], []

    def load():
        with build_lock(str(tmp_path), said.append, say_after_s=0.2):
            inside.append(time.time())

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(1.0)
    assert not inside and (tmp_path / TORCH_LOCK).exists()
    assert len(said) == 1 and "waiting for 4242@builder" in said[0]
    os.remove(tmp_path / TORCH_LOCK)  # the live builder finishes: releases torch's lock, then ours
    os.close(holder)
    thread.join(10)
    assert inside and len(said) == 1  # nothing stale to remove


def test_the_comm_op_loads_past_a_stale_lock(tmp_path, monkeypatch):
    """The real loader (the checkout's op built here if missing) finds the op's build folder under
    TORCH_EXTENSIONS_DIR, a copy with a planted `lock`, and clears the lock before torch would wait on it."""
    from utils.runtime.extensions import load_comm_op

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    built = load_comm_op(lambda line: None)
    if built is None:
        pytest.skip("no JIT-built communication op on this accelerator")
    copy = tmp_path / "ext"
    shutil.copytree(built, copy / os.path.basename(built))
    (copy / os.path.basename(built) / TORCH_LOCK).write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(copy))
    said = []
    assert load_comm_op(said.append) == str(copy / os.path.basename(built))
    assert not (copy / os.path.basename(built) / TORCH_LOCK).exists()
    assert [line for line in said if "stale build lock" in line]


def test_the_scripts_and_the_test_launcher_set_a_per_checkout_dir(tmp_path):
    assert CHECKOUT_DIR == os.path.join(ROOT, ".cache", "torch_extensions")
    env = subprocess_env()
    assert env["TORCH_EXTENSIONS_DIR"] == os.environ.get("TORCH_EXTENSIONS_DIR", CHECKOUT_DIR)
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env.update({"RLHF_USE_CURRENT_ENV": "1", "PATH": os.path.join(ROOT, ".venv", "bin") + os.pathsep + env["PATH"]})
    show = 'source scripts/common.sh >/dev/null && echo "$TORCH_EXTENSIONS_DIR"'
    proc = subprocess.run(["bash", "-c", show], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == CHECKOUT_DIR, proc.stderr
    proc = subprocess.run(
        ["bash", "-c", show],
        cwd=ROOT,
        env={**env, "TORCH_EXTENSIONS_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == str(tmp_path), proc.stderr  # the user's choice is kept
    for script in ("scripts/setup.sh", "scripts/test.sh"):
        with open(os.path.join(ROOT, script)) as f:
            assert 'TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.cache/torch_extensions}"' in f.read()


def test_the_interpreters_own_tools_come_first_on_path(monkeypatch):
    """Builds use this interpreter's `ninja` whether or not the venv is activated: the venv's and the
    system's log builds differently, and the scripts (activated) and the tests (not) rebuilt the op for
    each other (20-25 s a time)."""
    import sys

    from utils.runtime.extensions import use_interpreter_tools

    tools = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    use_interpreter_tools()
    assert os.environ["PATH"] == f"{tools}:/usr/bin:/bin"
    use_interpreter_tools()  # once only
    assert os.environ["PATH"].count(tools) == 1
