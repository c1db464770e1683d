"""Step 1 end to end: real runs through the deepspeed launcher (2 CPU ranks) and in one process."""

import json
import os

import pytest

from tests.launch import metrics, run_deepspeed, run_module, tail

WORDS = ["good", "great", "fine", "movie", "film", "plot", "actor", "scene", "story", "music"]


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory) -> str:
    """Prompts of varying length; the response is a fixed function of the prompt (learnable)."""
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    rows = []
    for i in range(160):
        prompt_words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(2 + i % 5)]
        rows.append(
            {
                "prompt": f"Human: {' '.join(prompt_words)}\n\nAssistant:",
                "response": " " + " ".join(reversed(prompt_words[:3])),
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def common_args(model, data, out, steps=12):
    return [
        "--model_name_or_path",
        model,
        "--data_path",
        data,
        "--data_split",
        "10,0,0",
        "--output_dir",
        out,
        "--max_steps",
        steps,
        "--per_device_train_batch_size",
        8,
        "--per_device_eval_batch_size",
        8,
        "--max_seq_len",
        48,
        "--learning_rate",
        3e-3,
        "--lr_scheduler_type",
        "constant",
        "--dropout",
        0.0,
        "--seed",
        7,
    ]


def check_run(out: str, proc) -> list[dict]:
    assert os.path.exists(os.path.join(out, "model.safetensors")), tail(proc)
    rows = metrics(out)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    ppl = [r["eval/perplexity"] for r in rows if "eval/perplexity" in r]
    assert len(ppl) == 2 and ppl[1] < ppl[0], ppl
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    diff = [r["export/logits_max_abs_diff"] for r in rows if "export/logits_max_abs_diff" in r]
    assert diff and diff[0] <= 1e-5, diff
    train = [r for r in rows if "train/loss" in r]  # peak memory of every step, the largest over ranks
    assert all(r["mem/training_peak_gb"] > 0 and r["train/overflow_steps"] == 0 for r in train), train[-1]
    # the training forwards' tokens over ranks, padding included in processed, and their rate
    assert all(0 < r["tokens/real"] <= r["tokens/processed"] and 0 <= r["tokens/padding_fraction"] < 1 for r in train)
    assert all(r["perf/training_tokens_per_s"] > 0 and r["perf/training_mfu"] > 0 for r in train), train[-1]
    return rows


# step 1's 2-rank ZeRO-3 full fine-tune (learns, exports what it trained, no empty ZeRO-3 tensors) is checked on
# the resumed run of tests/test_resume_coverage.py's SIGKILL test: one 2-rank launch less, to keep the suite short


@pytest.mark.slow
def test_two_rank_zero3_lora_exports_merged_weights(tiny_llama, sft_data, tmp_path):
    out = str(tmp_path / "out")
    args = common_args(tiny_llama, sft_data, out) + [
        "--zero_stage",
        3,
        "--lora_dim",
        8,
        "--only_optimize_lora",
        "--lora_learning_rate",
        1e-2,
    ]
    proc = run_deepspeed("step1_sft.main", args, log_path=str(tmp_path / "log.txt"))
    check_run(out, proc)
    from safetensors.torch import load_file

    keys = load_file(os.path.join(out, "model.safetensors")).keys()
    assert not any("lora" in k for k in keys)


@pytest.mark.slow
def test_zero0_single_process(tiny_opt, sft_data, tmp_path):
    out = str(tmp_path / "out")
    # --eval_iters 2: perplexity on the first 2 batches of 8 held-out rows (of 16)
    proc = run_module(
        "step1_sft.main", common_args(tiny_opt, sft_data, out, steps=8) + ["--zero_stage", 0, "--eval_iters", 2]
    )
    assert proc.returncode == 0, tail(proc)
    check_run(out, proc)
    assert "perplexity on at most 2 batches of 8 held-out rows per rank" in proc.stdout, tail(proc)


def test_rank_batches_caps_every_rank_at_the_same_count(monkeypatch):
    """--eval_iters (steps 1 and 2): each rank's share cut to max_batches, fillers (weight 0) kept where a
    rank has fewer rows, so ZeRO-3's collective forwards stay matched."""
    import utils.runtime.distributed as dist

    rows = list(range(21))  # rank 0: 0, 2, ..., 20 (11 rows); rank 1: 1, 3, ..., 19 (10 rows)
    monkeypatch.setattr(dist, "world_size", lambda: 2)
    for r, expected in (
        (0, [([0, 2, 4, 6], 1.0), ([8, 10, 12, 14], 1.0), ([16, 18, 20], 1.0)]),
        (1, [([1, 3, 5, 7], 1.0), ([9, 11, 13, 15], 1.0), ([17, 19], 1.0)]),
    ):
        monkeypatch.setattr(dist, "rank", lambda r=r: r)
        assert dist.rank_batches(rows, 4) == expected
        assert dist.rank_batches(rows, 4, max_batches=2) == expected[:2]
        assert dist.rank_batches(rows, 4, max_batches=9) == expected
    monkeypatch.setattr(dist, "rank", lambda: 1)
    assert dist.rank_batches(list(range(3)), 1) == [([1], 1.0), ([0], 0.0)]  # the filler: a real batch, weight 0


@pytest.mark.slow
def test_bad_flags_fail_before_loading(tiny_gpt2, sft_data, tmp_path):
    proc = run_module("step1_sft.main", common_args(tiny_gpt2, sft_data, str(tmp_path)) + ["--only_optimize_lora"])
    assert proc.returncode != 0 and "--only_optimize_lora needs --lora_dim" in proc.stderr
    proc = run_module("step1_sft.main", common_args(tiny_gpt2, sft_data, str(tmp_path)) + ["--eval_iters", -1])
    assert proc.returncode != 0 and "--eval_iters must be >= 0, got -1" in proc.stderr
    proc = run_module("step1_sft.main", common_args(str(tmp_path / "missing"), sft_data, str(tmp_path)))
    assert proc.returncode != 0 and "missing" in proc.stderr and "does not exist" in proc.stderr
