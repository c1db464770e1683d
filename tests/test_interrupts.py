"""Ctrl-C ends a run with one line from rank 0, `interrupted; --resume continues from <checkpoint>` (or that
there is nothing to resume yet), and exit status 130, no KeyboardInterrupt traceback on any rank. In process
through run_main's choices; then a real 2-rank step-1 run whose process group gets SIGINT after its first
checkpoint, as a terminal's Ctrl-C sends it to every process of the job."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launch import ROOT, free_port, rank_command, subprocess_env
from tests.ranks import rank_env
from tests.test_step1_run import common_args, sft_data  # noqa: F401  (sft_data: a fixture)
from utils import errors


class Exited(Exception):
    """What os._exit would have done: the test sees the exit code instead of losing its process."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


@pytest.fixture
def rank_of_two(monkeypatch):
    """`as_rank(r)`: this process as rank r of 2 (its store unused by an interrupt); os._exit raises Exited."""

    def exit_now(code):
        raise Exited(code)

    monkeypatch.setattr(errors.os, "_exit", exit_now)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(errors, "_store", None)
    return lambda rank: monkeypatch.setenv("RANK", str(rank))


def interrupted(argv):
    raise KeyboardInterrupt


@pytest.fixture(autouse=True)
def no_exit_hooks(monkeypatch):
    """An interrupted rank of several runs the exit hooks before it leaves: not this test process's."""
    monkeypatch.setattr(errors.atexit, "_run_exitfuncs", lambda: None)


@pytest.fixture
def resume_point(monkeypatch):
    """`resume_point(path)`: what the run says a --resume continues from (None: no checkpoint yet)."""

    def use(path):
        monkeypatch.setattr(errors, "_resume_point", lambda: path)

    return use


def test_one_process_prints_one_line_and_exits_130(monkeypatch, capsys, resume_point):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    resume_point("out/checkpoints/step-00000004")
    with pytest.raises(SystemExit) as exc:
        errors.run_main(interrupted)
    assert exc.value.code == 130
    assert capsys.readouterr().err == "interrupted; --resume continues from out/checkpoints/step-00000004\n"
    resume_point(None)
    with pytest.raises(SystemExit):
        errors.run_main(interrupted)
    assert capsys.readouterr().err == "interrupted before the first checkpoint; nothing to resume\n"


def test_rank_0_prints_the_line_the_others_stay_silent(rank_of_two, capsys, resume_point):
    resume_point("out/checkpoints/step-00000002")
    rank_of_two(1)
    with pytest.raises(Exited) as exited:
        errors.run_main(interrupted)
    assert exited.value.code == 130 and capsys.readouterr().err == ""
    rank_of_two(0)
    with pytest.raises(Exited) as exited:
        errors.run_main(interrupted)
    assert exited.value.code == 130
    assert capsys.readouterr().err == "interrupted; --resume continues from out/checkpoints/step-00000002\n"


def test_an_error_after_the_interrupt_is_the_interrupt(rank_of_two, capsys, resume_point):
    """A rank whose collective fails because a peer already left on the same Ctrl-C shows no traceback."""
    resume_point(None)
    rank_of_two(0)

    def peer_left(argv):
        errors._interrupted.set()  # what the SIGINT handler does first
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    with pytest.raises(Exited) as exited:
        errors.run_main(peer_left)
    assert exited.value.code == 130
    assert capsys.readouterr().err == "interrupted before the first checkpoint; nothing to resume\n"


def test_the_line_names_the_runs_checkpoint(tmp_path, monkeypatch):
    """utils.train.run registers where a --resume continues from: before the Run is built, the checkpoint the
    output directory's `latest` names."""
    import utils.train.run as run_module
    from utils.runtime import distributed

    monkeypatch.setattr(run_module, "_current", None)
    monkeypatch.setattr(distributed, "_output_dir", str(tmp_path))
    assert errors.interrupted_line() == "interrupted before the first checkpoint; nothing to resume"
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step-00000006")
    expected = os.path.join(str(tmp_path), "checkpoints", "step-00000006")
    assert errors.interrupted_line() == f"interrupted; --resume continues from {expected}"


@pytest.mark.slow
def test_ctrl_c_on_a_two_rank_run(tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """SIGINT to every rank once the first checkpoint is written: each rank exits 130, rank 0 prints
    the one line naming the latest checkpoint, no traceback."""
    out = tmp_path / "out"
    args = [str(a) for a in common_args(tiny_gpt2, sft_data, str(out), steps=100000)] + [
        "--save_interval",
        "2",
        "--num_train_epochs",
        "1000",
    ]
    env, port = subprocess_env(), free_port()
    log = tmp_path / "log.txt"
    ranks = []
    with open(log, "w") as f:
        for r in range(2):
            command = [sys.executable, "-u", "-m", "step1_sft.main", f"--local_rank={r}", *args]
            env_r = rank_env(r, 2, port, env)
            ranks.append(
                subprocess.Popen(
                    command, cwd=ROOT, env=env_r, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 240
        while not latest.exists() and time.monotonic() < deadline and all(p.poll() is None for p in ranks):
            time.sleep(0.2)
        assert latest.exists(), log.read_text()[-3000:]
        for p in ranks:  # what a terminal's Ctrl-C does: SIGINT to every process of the job
            os.killpg(p.pid, signal.SIGINT)
        codes = [p.wait(60) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    text = log.read_text()
    assert codes == [130, 130], (codes, text[-3000:])
    # (after the progress bar's last redraw, which ends in no newline)
    lines = [
        line[line.index("interrupted") :] for line in text.replace("\r", "\n").splitlines() if "interrupted" in line
    ]
    assert len(lines) == 1 and lines[0].startswith("interrupted; --resume continues from "), text[-3000:]
    assert os.path.exists(os.path.join(lines[0].rsplit(" ", 1)[1], "COMPLETE")), lines
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]


# run_main over a main thread inside one long C call (a float64 matmul of a minute on one thread)
IN_A_LONG_C_CALL = """
import sys
import torch
from utils.errors import run_main

def main(argv):
    torch.set_num_threads(1)
    a = torch.ones(5000, 5000, dtype=torch.float64)
    print("in", flush=True)
    torch.mm(a, a)

run_main(main)
"""


def test_sigterm_ends_a_rank_at_once_even_inside_a_c_call():
    """Not interrupted, SIGTERM (the launcher ending the ranks after one failed) ends the rank at once, as its
    default did, though the main thread is inside a C call for a minute: no line, status 143."""
    proc = subprocess.Popen(
        [sys.executable, "-c", IN_A_LONG_C_CALL],
        cwd=ROOT,
        env=subprocess_env(RANK=1, WORLD_SIZE=2),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "in\n"
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
        seconds = time.monotonic() - sent
    finally:
        proc.kill()
    assert code == 143 and seconds < 5, (code, seconds)
    assert proc.stderr.read() == ""


@pytest.mark.slow
def test_ctrl_c_under_the_deepspeed_launcher(tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    """SIGINT to the `deepspeed` launcher's whole process group, as a terminal's Ctrl-C: the launcher's SIGTERM to
    the ranks right after does not cut rank 0's line; the only traceback is the `deepspeed` command's own (its
    runner process, DeepSpeed's code)."""
    out = tmp_path / "out"
    args = common_args(tiny_gpt2, sft_data, str(out), steps=100000) + ["--save_interval", 2, "--num_train_epochs", 1000]
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            rank_command("step1_sft.main", args, 2, launcher=True),
            cwd=ROOT,
            env=subprocess_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + 240
        while not latest.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert latest.exists(), log.read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    lines = [
        line[line.index("interrupted") :] for line in text.replace("\r", "\n").splitlines() if "interrupted" in line
    ]
    assert len(lines) == 1 and lines[0].startswith("interrupted; --resume continues from "), text[-3000:]
    frames = [line for line in text.splitlines() if line.strip().startswith('File "')]
    assert all("deepspeed/launcher/runner.py" in f or "subprocess.py" in f or "bin/deepspeed" in f for f in frames), (
        frames
    )
