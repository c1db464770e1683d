"""The demo script end to end in its quick mode (tiny models): steps 1-3, evaluation table, curves."""
import os
import subprocess

from tests.launch import ROOT, subprocess_env


def test_quick_demo_writes_table_and_curves(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "demo.sh"), "--quick", "--output_root", str(out)],
                          cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    table = (out / "eval.txt").read_text()
    for column in ("reward (RM)", "judge (VADER)", "KL to SFT", "response len"):
        assert column in table, table
    png = out / "step3" / "curves.png"
    assert png.exists() and png.stat().st_size > 10_000
    assert (out / "step3" / "actor" / "model.safetensors").exists()
