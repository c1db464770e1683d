"""KTO: the loss and its reference point against hand-computed values, unpaired feedback rows
through the data layer (TRL's {prompt, completion, label}, conversational too; pairs give one of each),
the mismatched rows of its collator, its flags and refusals, and a short run that learns."""

import json
import math
import os
import random

import pytest
import torch

from tests.launch import metrics
from tests.test_step2_dpo import _dpo_args
from tests.test_step2_run import _pairs
from utils.data import DataError, RowFormat, normalize_row
from utils.errors import UsageError
from utils.math.losses import (
    PAIR_LOSSES,
    PairLogps,
    UnpairedLogps,
    kto_loss,
    kto_reference_point,
    pair_loss,
    unpaired_loss,
)

UNPAIRED = RowFormat(unpaired=True)


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_kto_by_hand():
    # a desirable example (logp -2, ref -3: r = 1) and an undesirable one (logp -4, ref -3: r = -1), z0 0.5, beta 0.1
    examples = UnpairedLogps(
        torch.tensor([-2.0, -4.0]), torch.tensor([-3.0, -3.0]), torch.tensor([True, False]), torch.tensor(0.5)
    )
    losses, rewards = kto_loss(examples, beta=0.1)
    # 1 - sigmoid(0.1 * (1 - 0.5)) and 1 - sigmoid(0.1 * (0.5 - -1))
    assert losses.tolist() == pytest.approx([0.48750260351578967, 0.4625701546562504], rel=1e-6)
    assert rewards.tolist() == pytest.approx([0.1, -0.1])
    weighted, _ = kto_loss(examples, 0.1, kto_desirable_weight=2.0, kto_undesirable_weight=0.5)
    assert weighted.tolist() == pytest.approx([2 * 0.48750260351578967, 0.5 * 0.4625701546562504], rel=1e-6)
    loss, stats = unpaired_loss(examples, 0.1, "kto", kto_desirable_weight=2.0, kto_undesirable_weight=0.5)
    assert loss.item() == pytest.approx(0.6031451421798523, rel=1e-6)
    assert stats["desirable_reward_sum"].item() == pytest.approx(0.1) and stats["desirable_count"].item() == 1
    assert stats["undesirable_reward_sum"].item() == pytest.approx(-0.1) and stats["z0"].item() == 0.5
    assert "accuracy" not in stats  # no pairs, nothing to rank


def test_the_reference_point_is_a_clamped_detached_mean_over_ranks():
    kl = torch.tensor([-1.0, -2.5], requires_grad=True)
    ref = torch.tensor([-1.5, -2.0])
    assert kto_reference_point(kl, ref).item() == 0.0  # mean -0.0: clamped at 0
    assert kto_reference_point(kl + 1.0, ref).item() == pytest.approx(1.0)  # (1.5 + 0.5) / 2
    seen = []

    def reduce(totals):  # another rank holds 2 rows whose log-ratios sum to 4
        seen.append(totals)
        return [totals[0] + 4.0, totals[1] + 2.0]

    z0 = kto_reference_point(kl + 1.0, ref, reduce)
    assert seen == [[pytest.approx(2.0), 2.0]] and z0.item() == pytest.approx(1.5) and not z0.requires_grad


def test_kto_gradient_raises_desirable_and_lowers_undesirable_logps_only():
    logps = torch.tensor([-2.0, -4.0], requires_grad=True)
    examples = UnpairedLogps(logps, torch.tensor([-3.0, -3.0]), torch.tensor([True, False]), torch.tensor(0.5))
    unpaired_loss(examples, 0.1)[0].backward()
    assert logps.grad[0] < 0 < logps.grad[1]
    # d/dr of 1 - sigmoid(beta (r - z0)) = -beta s (1 - s), over 2 examples
    s = _sigmoid(0.05)
    assert logps.grad[0].item() == pytest.approx(-0.1 * s * (1 - s) / 2, rel=1e-5)


def test_the_registry_entry_reads_unpaired_examples_only():
    entry = PAIR_LOSSES["kto"]
    assert (
        entry.unpaired
        and entry.needs_reference
        and set(entry.options) == {"kto_desirable_weight", "kto_undesirable_weight"}
    )
    pair = PairLogps(torch.tensor([-1.0]), torch.tensor([-2.0]), torch.tensor([-1.0]), torch.tensor([-2.0]))
    with pytest.raises(ValueError, match="reads unpaired examples: use unpaired_loss"):
        pair_loss(pair, 0.1, "kto")
    with pytest.raises(ValueError, match="reads pairs: use pair_loss"):
        unpaired_loss(
            UnpairedLogps(*[torch.zeros(1)] * 2, torch.ones(1, dtype=torch.bool), torch.tensor(0.0)), 0.1, "sigmoid"
        )


def test_unpaired_rows_in_trls_forms():
    row = normalize_row({"prompt": "Q?", "completion": " yes", "label": True, "id": 7}, "f.jsonl:1", 2, UNPAIRED)
    assert (row["prompt"], row["chosen"], row["rejected"], row["label"], row["extra"]) == (
        "Q?",
        " yes",
        None,
        True,
        {"id": 7},
    )
    chat = normalize_row(
        {
            "prompt": [{"role": "user", "content": "Q?"}],
            "completion": [{"role": "assistant", "content": "no"}],
            "label": False,
        },
        "f.jsonl:2",
        2,
        UNPAIRED,
    )
    assert chat["chosen"] == [{"role": "assistant", "content": "no"}] and chat["label"] is False
    pair = normalize_row({"prompt": "Q?", "chosen": " a", "rejected": " b"}, "f.jsonl:3", 2, UNPAIRED)
    assert pair["rejected"] == " b" and "label" not in pair
    with pytest.raises(
        DataError,
        match=r"f.jsonl:4: field 'label' must be true \(desirable\) or false "
        r"\(undesirable\), got 1",
    ):
        normalize_row({"prompt": "Q?", "completion": " yes", "label": 1}, "f.jsonl:4", 2, UNPAIRED)
    with pytest.raises(DataError, match=r"f.jsonl:5: field 'thumbs' must be true"):
        normalize_row(
            {"prompt": "Q?", "completion": " yes", "thumbs": "up"},
            "f.jsonl:5",
            2,
            RowFormat(unpaired=True, label_key="thumbs"),
        )
    # CSV has only strings: there (only there) the text true / false is a label
    assert (
        normalize_row({"prompt": "Q?", "completion": " no", "label": "False"}, "d/f.csv:7", 2, UNPAIRED)["label"]
        is False
    )
    with pytest.raises(DataError, match="f.jsonl:8: field 'label' must be true"):
        normalize_row({"prompt": "Q?", "completion": " yes", "label": "true"}, "f.jsonl:8", 2, UNPAIRED)
    with pytest.raises(DataError, match="f.csv:9: field 'label' must be true"):
        normalize_row({"prompt": "Q?", "completion": " yes", "label": "yes"}, "f.csv:9", 2, UNPAIRED)
    # the pair losses name the loss that reads such rows
    with pytest.raises(DataError, match="missing field 'rejected' .*--loss_type kto"):
        normalize_row({"prompt": "Q?", "completion": " yes", "label": True}, "f.jsonl:6", 2)


def test_tokenized_examples_and_the_mismatched_rows(tiny_gpt2):
    from utils.data import UnpairedCollator, tokenize_preference_pairs, tokenize_unpaired
    from utils.models.loading import load_tokenizer

    tok = load_tokenizer(tiny_gpt2)
    rows = [
        {"prompt": "Human: plot?\n\nAssistant:", "chosen": " good", "rejected": " bad awful"},
        {"prompt": "Human: music?\n\nAssistant:", "chosen": " dull", "rejected": None, "label": False},
    ]
    examples, stats = tokenize_unpaired(rows, tok, 24)
    (pair,), _ = tokenize_preference_pairs(rows[:1], tok, 24)
    assert [ex["desirable"] for ex in examples] == [True, False, False]
    assert examples[0]["completion_response_ids"] == pair["chosen_response_ids"]
    assert examples[1]["completion_response_ids"] == pair["rejected_response_ids"]
    assert examples[1]["prompt_input_ids"] == pair["prompt_input_ids"] and stats["desirable"] == 1
    assert examples[2]["completion_response_ids"][-1] == tok.eos_token_id and stats["undesirable"] == 2

    batch = [
        {"prompt_input_ids": [5, 6], "completion_response_ids": [7, 8], "desirable": True},
        {"prompt_input_ids": [5, 5, 5, 5], "completion_response_ids": [9], "desirable": False},
        {"prompt_input_ids": [4], "completion_response_ids": [3, 2, 1, 1, 1], "desirable": True},
    ]
    out = UnpairedCollator(0, max_seq_len=6)(batch)
    # the examples, then each prompt with the previous example's completion (the first's cut to fit 6 tokens)
    assert out["input_ids"].tolist() == [
        [5, 6, 7, 8, 0, 0],
        [5, 5, 5, 5, 9, 0],
        [4, 3, 2, 1, 1, 1],
        [5, 6, 3, 2, 1, 1],
        [5, 5, 5, 5, 7, 8],
        [4, 9, 0, 0, 0, 0],
    ]
    assert out["action_mask"].tolist() == [
        [0, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [1, 1, 1, 1, 1],
        [0, 1, 1, 1, 1],
        [0, 0, 0, 1, 1],
        [1, 0, 0, 0, 0],
    ]
    assert out["desirable"].tolist() == [True, False, True]


def _parse(tmp_path, *flags):
    from step2_dpo.main import parse_args

    return parse_args(
        [
            str(a)
            for a in [
                "--model_name_or_path",
                str(tmp_path),
                "--data_path",
                str(tmp_path),
                "--output_dir",
                str(tmp_path / "out"),
                *flags,
            ]
        ]
    )


def test_flags(tmp_path):
    args = _parse(tmp_path, "--loss_type", "kto", "--kto_undesirable_weight", 1.33)
    assert args.unpaired and args.beta == 0.1 and args.kto_undesirable_weight == 1.33
    assert RowFormat.from_args(args).unpaired and not RowFormat.from_args(_parse(tmp_path)).unpaired
    for flags, message in [
        (["--loss_type", "kto", "--nll_loss_coef", 0.5], "no chosen side"),
        (["--loss_type", "kto", "--precompute_ref_log_probs"], "keeps a reference model"),
        (["--loss_type", "kto", "--per_device_train_batch_size", 1], "must be >= 2"),
        (["--loss_type", "kto", "--kto_desirable_weight", 0], "must be > 0"),
        (["--kto_desirable_weight", 2.0], "does not take it"),
    ]:
        with pytest.raises(UsageError, match=message):
            _parse(tmp_path, *flags)


@pytest.fixture(scope="module")
def feedback_data(tmp_path_factory) -> str:
    """Unpaired thumbs-up / thumbs-down rows from the pair rule of tests/test_step2_run.py: each pair gives ONE
    row, its chosen (label true) or its rejected (false) in turn; the held-out rows stay pairs."""
    folder = tmp_path_factory.mktemp("feedback")
    rng = random.Random(0)
    train = [
        {"prompt": p["prompt"], "completion": p["chosen"] if i % 2 else p["rejected"], "label": bool(i % 2)}
        for i, p in enumerate(_pairs(320, rng, False))
    ]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    (folder / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _pairs(32, rng, True)))
    return str(folder)


def test_a_kto_run_on_unpaired_feedback_learns(tiny_gpt2, feedback_data, tmp_path, capsys):
    from step2_dpo.main import main

    out = str(tmp_path / "kto")
    main([str(a) for a in _dpo_args(tiny_gpt2, feedback_data, out, steps=6, extra=["--loss_type", "kto"])])
    printed = capsys.readouterr().out
    assert "reference: a frozen copy of the starting model" in printed
    rows = metrics(out)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6] and len(train) == 6
    first, last = evals[0], evals[-1]
    # before training the policy is the reference: every implicit reward and z0 are 0, each loss 1 - sigmoid(0)
    assert first["eval/loss"] == pytest.approx(0.5, abs=1e-6) and first["eval/z0"] == pytest.approx(0.0, abs=1e-6)
    assert first["eval/examples"] == 64 and "eval/accuracy" not in first
    assert train[0]["train/loss"] == pytest.approx(0.5, abs=1e-6)
    assert last["eval/margin"] > first["eval/margin"] + 0.05 and last["eval/loss"] < first["eval/loss"], evals
    assert last["eval/desirable_reward"] > 0 > last["eval/undesirable_reward"]
    assert all(r["train/z0"] >= 0 for r in train) and os.path.exists(os.path.join(out, "model.safetensors"))


def test_kto_with_one_kind_of_label_stops_before_loading_a_model(tiny_gpt2, tmp_path):
    from step2_dpo.main import main

    data = tmp_path / "thumbs_up"
    data.mkdir()
    rows = [{"prompt": f"Human: {i}?\n\nAssistant:", "completion": " good", "label": True} for i in range(40)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        UsageError,
        match=r"every usable training row of .*thumbs_up has 'label' true \(.* examples\); "
        r"it needs rows labelled false too",
    ):
        main(
            [
                str(a)
                for a in _dpo_args(
                    tiny_gpt2, str(data), str(tmp_path / "out"), extra=["--loss_type", "kto", "--eval_fraction", 0.2]
                )
            ]
        )


@pytest.mark.slow
def test_two_rank_zero3_kto_with_the_adapters_reference_learns_and_exports(tiny_gpt2, feedback_data, tmp_path):
    """2 ranks: every micro-step's z0 is one all-reduce (collective, the same on both ranks), the held-out
    figures are summed over ranks exactly; the reference is the LoRA policy with its adapters disabled."""
    from tests.launch import run_deepspeed, tail

    out = str(tmp_path / "out")
    args = _dpo_args(
        tiny_gpt2,
        feedback_data,
        out,
        steps=6,
        extra=[
            "--loss_type",
            "kto",
            "--zero_stage",
            3,
            "--per_device_train_batch_size",
            4,
            "--lora_dim",
            8,
            "--only_optimize_lora",
            "--lora_learning_rate",
            1e-2,
        ],
    )
    proc = run_deepspeed("step2_dpo.main", [str(a) for a in args], num_ranks=2, log_path=str(tmp_path / "log.txt"))
    assert os.path.isfile(os.path.join(out, "model.safetensors")), tail(proc)
    rows = metrics(out)
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6] and all(r["eval/examples"] == 64 for r in evals), evals
    assert evals[0]["eval/loss"] == pytest.approx(0.5, abs=1e-6) and evals[-1]["eval/margin"] > evals[0]["eval/margin"]
    assert [r["export/logp_max_abs_diff"] for r in rows if "export/logp_max_abs_diff" in r][0] <= 1e-4
    assert "reference: the policy with its LoRA adapters disabled" in open(tmp_path / "log.txt").read()


def test_the_before_training_figures_known_without_a_pass_are_a_passs(tiny_gpt2, tmp_path):
    """Before the first update the policy is the reference: unpaired_reference_metrics (no forward) gives what
    evaluate_unpaired measures with both forwards, with unequal weights and batches that split the kinds."""
    from step2_dpo.main import Reference, UnpairedLoss, evaluate_unpaired, unpaired_reference_metrics
    from utils.data import UnpairedCollator, tokenize_unpaired
    from utils.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_gpt2)
    rows = [
        {"prompt": f"Human: {topic}?\n\nAssistant:", "chosen": " good fine", "rejected": " bad"}
        for topic in ("plot", "music", "actors")
    ]
    rows.append({"prompt": "Human: ending?\n\nAssistant:", "chosen": " dull", "rejected": None, "label": False})
    examples, _ = tokenize_unpaired(rows, tok, 24)
    model = load_causal_lm(tiny_gpt2)
    loss_of = UnpairedLoss(
        _parse(tmp_path, "--loss_type", "kto", "--kto_desirable_weight", 2.0, "--kto_undesirable_weight", 0.5)
    )
    measured = evaluate_unpaired(
        model, examples, UnpairedCollator(tok.pad_token_id, 24), 3, loss_of, Reference("engine", model, model)
    )
    known = unpaired_reference_metrics(examples, loss_of)
    assert known["eval/loss"] == pytest.approx((3 * 2.0 + 4 * 0.5) * 0.5 / 7)
    for key, value in known.items():
        assert measured[key] == pytest.approx(value, abs=1e-6), key
