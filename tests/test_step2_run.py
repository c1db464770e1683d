"""Step 2 end to end: one real 2-rank ZeRO-3 run through the deepspeed launcher on tiny GPT-2."""

import json
import os
import random

import pytest
import torch

from tests.launch import metrics, run_deepspeed, tail

POSITIVE = ["good", "great", "fine", "nice", "superb", "lovely"]
NEGATIVE = ["bad", "awful", "poor", "dull", "weak", "ugly"]
TOPICS = ["movie", "film", "plot", "actor", "scene", "story", "music", "ending"]


def _pairs(n: int, rng: random.Random, held_out: bool) -> list:
    """Chosen = positive words, rejected = negative words (learnable rule); held-out rows use word
    combinations (3 words) never seen in training (2 words), and other prompts."""
    rows = []
    for i in range(n):
        k = 3 if held_out else 2
        topic = TOPICS[(i * 3 + held_out) % len(TOPICS)]
        prompt = f"Human: What about the {topic}{'?' if held_out else ''}\n\nAssistant:"
        rows.append(
            {
                "prompt": prompt,
                "chosen": " " + " ".join(rng.sample(POSITIVE, k)),
                "rejected": " " + " ".join(rng.sample(NEGATIVE, k)),
            }
        )
    return rows


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("pairs")
    rng = random.Random(0)
    for name, n, held_out in (("train.jsonl", 320, False), ("eval.jsonl", 64, True)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in _pairs(n, rng, held_out)))
    return str(folder)


@pytest.mark.slow
def test_two_rank_zero3_reward_model_learns_and_exports(tiny_gpt2, pair_data, tmp_path):
    out = str(tmp_path / "out")
    args = [
        "--model_name_or_path",
        tiny_gpt2,
        "--data_path",
        pair_data,
        "--data_split",
        "0,10,0",
        "--output_dir",
        out,
        "--zero_stage",
        3,
        "--max_steps",
        20,
        "--per_device_train_batch_size",
        8,
        "--per_device_eval_batch_size",
        16,
        "--max_seq_len",
        32,
        "--learning_rate",
        3e-3,
        "--lr_scheduler_type",
        "constant",
        "--dropout",
        0.0,
        "--seed",
        3,
        "--eval_interval",
        10,
    ]
    proc = run_deepspeed("step2_reward.main", args, num_ranks=2, log_path=str(tmp_path / "log.txt"))
    for name in ("model.safetensors", "config.json", "value_head.safetensors", "reward_model.json"):
        assert os.path.isfile(os.path.join(out, name)), tail(proc)
    rows = metrics(out)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 10, 20], evals
    assert all(r["eval/pairs"] == 64 for r in evals)
    first, last = evals[0], evals[-1]
    assert last["eval/accuracy"] >= 0.75 and last["eval/accuracy"] > first["eval/accuracy"], evals
    assert last["eval/margin"] > first["eval/margin"] and last["eval/margin"] > 0
    assert last["eval/margin"] == pytest.approx(last["eval/chosen_score"] - last["eval/rejected_score"], abs=1e-6)
    train = [r for r in rows if "train/loss" in r]
    assert len(train) == 20 and all("train/accuracy" in r and "train/lr" in r for r in train)
    assert all(r["mem/training_peak_gb"] > 0 for r in train)
    assert sum(r["train/loss"] for r in train[-5:]) < sum(r["train/loss"] for r in train[:5])
    diff = [r["export/score_max_abs_diff"] for r in rows if "export/score_max_abs_diff" in r]
    assert diff and diff[0] <= 1e-5, diff

    # the exported directory is a complete, unpartitioned reward model that ranks held-out pairs
    from utils.data import PairCollator, split_pair_batch, tokenize_pairs
    from utils.math.losses import pair_metrics
    from utils.models.loading import load_tokenizer
    from utils.models.reward_model import RewardModel

    tokenizer = load_tokenizer(out)
    model = RewardModel.from_pretrained(out, tokenizer).eval()
    assert all(p.numel() > 0 for p in model.parameters())  # a naive ZeRO-3 save writes empty tensors
    held_out = [json.loads(line) for line in open(os.path.join(pair_data, "eval.jsonl"))]
    pairs, _ = tokenize_pairs(held_out, tokenizer, 32)
    batch = PairCollator(tokenizer.pad_token_id)(pairs)
    with torch.no_grad():
        chosen, rejected = split_pair_batch(model.score(batch["input_ids"], batch["attention_mask"]))
    reloaded = pair_metrics(chosen, rejected)
    assert reloaded["accuracy"] == pytest.approx(last["eval/accuracy"])
    assert reloaded["margin_mean"] == pytest.approx(last["eval/margin"], abs=1e-4)


@pytest.mark.slow
def test_zero3_bf16_reward_model_trains_with_its_head_in_the_backbones_dtype(tiny_llama, pair_data, tmp_path):
    """ZeRO-3 builds the backbone in bf16 (zero.Init) and deepspeed.initialize casts nothing at stage 3:
    an fp32 value head made DeepSpeed's partition defragmentation fail (mixed dtypes). bench/gpu.sh's
    CPU fallback found it before any GPU run did."""
    from tests.launch import run_module

    out = str(tmp_path / "out")
    proc = run_module(
        "step2_reward.main",
        [
            "--model_name_or_path",
            tiny_llama,
            "--data_path",
            pair_data,
            "--data_split",
            "0,10,0",
            "--output_dir",
            out,
            "--zero_stage",
            3,
            "--dtype",
            "bf16",
            "--max_steps",
            2,
            "--per_device_train_batch_size",
            4,
            "--per_device_eval_batch_size",
            16,
            "--eval_iters",
            1,
            "--max_seq_len",
            32,
        ],
        log_path=str(tmp_path / "log"),
    )
    assert proc.returncode == 0, tail(proc)
    assert os.path.isfile(os.path.join(out, "value_head.safetensors"))
