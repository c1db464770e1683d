"""The distillation demo (scripts/demo.sh --task distill) and its benchmark (bench/distill.py): the comparison table
from two runs' metrics, the quick demo's chain on tiny models, the benchmark's tiny form."""

import json
import os
import subprocess
import sys

import pytest

from scripts.distill_compare import main as compare
from tests.launch import ROOT, subprocess_env
from tests.test_demo import run_demo


def write_run(folder, evals: dict, seconds: float) -> str:
    """A step-3 output directory whose metrics.jsonl has one iteration row of `seconds` per step up to the last
    evaluation, and `evals` ({step: accuracy}) as evaluation rows."""
    os.makedirs(folder)
    half = seconds / 2
    rows = [
        {"step": step, "time/generation_s": half, "time/experience_s": 0.0, "time/train_s": half}
        for step in range(1, max(evals) + 1)
    ]
    rows += [{"step": step, "eval/accuracy": accuracy} for step, accuracy in evals.items()]
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(folder)


def test_the_comparison_table_and_who_reaches_the_goal_first(tmp_path):
    grpo = write_run(tmp_path / "grpo", {0: 0.32, 10: 0.516, 20: 0.539}, 20.0)
    distill = write_run(tmp_path / "distill", {0: 0.32, 2: 0.40, 4: 0.50, 6: 0.52}, 21.0)
    lines = compare(["--distill", distill, "--grpo", grpo])
    assert lines[2:6] == [
        "| teacher: GRPO of the student | 20 | 400 | 0.539 |",
        "| student before | 0 | 0 | 0.320 |",
        "| after distillation | 6 | 126 | 0.520 |",
        "| GRPO at the same training time | 0 | 0 | 0.320 |",  # GRPO's next evaluation is at 200 s
    ]
    goal = "reaches 90% of the teacher's accuracy (0.485)"
    assert lines[6] == f"distillation {goal}: after 4 iterations, 84 s of training"
    assert lines[7] == f"GRPO {goal}: after 10 iterations, 200 s of training"
    assert (tmp_path / "distill" / "comparison.txt").read_text().splitlines() == lines
    assert (tmp_path / "distill" / "accuracy_vs_time.png").stat().st_size > 10_000


def test_a_run_without_accuracy_is_one_error_line(tmp_path):
    folder = write_run(tmp_path / "grpo", {0: 0.3}, 1.0)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "time/generation_s": 1.0, "time/experience_s": 1.0, "time/train_s": 1.0}))
    proc = subprocess.run(
        [sys.executable, "scripts/distill_compare.py", "--distill", folder, "--grpo", folder],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1].startswith("error: "), proc.stderr
    assert "has no eval/accuracy" in proc.stderr


@pytest.mark.slow
def test_quick_distill_demo_makes_the_teacher_then_distils_and_compares(tmp_path):
    """--task distill --quick: the teacher made by the arithmetic GRPO script (none there yet), distillation alone
    from it with an evaluation every iteration, the table and both figures; a second run reuses the teacher."""
    out = tmp_path / "demo"
    proc = run_demo(out, "--task", "distill", fork_server=False)
    assert "[demo] teacher: GRPO of " in proc.stdout
    table = (out / "distill" / "comparison.txt").read_text()
    assert "| after distillation | 2 |" in table and "| teacher: GRPO of the student | 2 |" in table, table
    for name in ("curves.png", "accuracy_vs_time.png", "actor/model.safetensors"):
        assert (out / "distill" / name).exists(), name
    config = (out / "distill" / "config.yaml").read_text()
    assert f"- {out / 'grpo' / 'actor'}\n" in config and "reward_weights:\n- 0.0\n- 0.0\n" in config
    metrics = [json.loads(line) for line in open(out / "distill" / "metrics.jsonl")]
    assert any("distill/reverse_kl_sampled_token_mean" in row for row in metrics)
    assert sorted(row["step"] for row in metrics if "eval/accuracy" in row) == [0, 1, 2]
    assert not (out / "distill" / "critic").exists()


@pytest.mark.slow
def test_distill_bench_tiny_times_the_three_arms():
    proc = subprocess.run(
        [sys.executable, "bench/distill.py", "--tiny", "--rounds", "2"],
        cwd=ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert "host probe: 1-thread sgemm " in proc.stdout
    arms = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith(tuple("0123456789")) and "x " in line]
    assert arms == ["grpo", "reverse_kl_sampled", "reverse_kl"], proc.stdout
