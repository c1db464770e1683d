"""Step 2's alternative, DPO: preference pairs tokenised with the prompt apart, sequence log-probs
that ignore padding, the three forms of the reference giving the same losses, ln 2 at step 0, and
one 2-rank ZeRO-3 run that learns a rule, exports a policy and resumes exactly after SIGKILL."""

import json
import math
import os

import pytest
import torch

from tests.launch import metrics, tail
from tests.test_resume import comparable, kill_after_row_and_resume, max_relative_difference
from tests.test_step2_run import pair_data  # noqa: F401  (fixture)
from utils.errors import UsageError

LN2 = math.log(2.0)
ROWS = [
    {"prompt": "Human: What about the plot?\n\nAssistant:", "chosen": " good fine", "rejected": " bad"},
    {
        "prompt": "Human: And the music, the actors and the long ending?\n\nAssistant:",
        "chosen": " lovely",
        "rejected": " awful and dull, really",
    },
]


def _tokenizer(path):
    from utils.models.loading import load_tokenizer

    return load_tokenizer(path)


def test_preference_pairs_hold_the_reward_models_sequences_with_the_prompt_apart(tiny_gpt2):
    from utils.data import tokenize_pairs, tokenize_preference_pairs

    tok = _tokenizer(tiny_gpt2)
    rows = ROWS + [{"prompt": "Human: Same?\n\nAssistant:", "chosen": " x", "rejected": " x"}]
    scored, scored_stats = tokenize_pairs(rows, tok, 24)
    split, split_stats = tokenize_preference_pairs(rows, tok, 24)
    assert split_stats == scored_stats and split_stats["skipped_bad_pairs"] == 1
    for whole, apart in zip(scored, split):
        for side in ("chosen", "rejected"):
            assert apart["prompt_input_ids"] + apart[f"{side}_response_ids"] == whole[f"{side}_input_ids"]
        assert apart["chosen_response_ids"][-1] == tok.eos_token_id


def test_preference_collator_marks_exactly_the_response_tokens_on_either_side():
    from utils.data import PreferenceCollator

    pairs = [
        {
            "prompt_input_ids": [5, 6],
            "chosen_response_ids": [7, 8],
            "rejected_response_ids": [9],
            "ref_chosen_logp": -1.0,
            "ref_rejected_logp": -2.0,
        },
        {
            "prompt_input_ids": [5],
            "chosen_response_ids": [7, 8, 9, 4],
            "rejected_response_ids": [3],
            "ref_chosen_logp": -3.0,
            "ref_rejected_logp": -4.0,
        },
    ]
    right = PreferenceCollator(0)(pairs)
    assert right["input_ids"].tolist() == [[5, 6, 7, 8, 0], [5, 7, 8, 9, 4], [5, 6, 9, 0, 0], [5, 3, 0, 0, 0]]
    # position i predicts token i+1: the responses' tokens, nothing of the prompt or the padding
    assert right["action_mask"].tolist() == [[0, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0], [1, 0, 0, 0]]
    assert right["ref_logps"].tolist() == [-1.0, -3.0, -2.0, -4.0]
    left = PreferenceCollator(0, padding_side="left")(pairs)
    assert left["input_ids"].tolist() == [[0, 5, 6, 7, 8], [5, 7, 8, 9, 4], [0, 0, 5, 6, 9], [0, 0, 0, 5, 3]]
    assert left["action_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 0, 0, 1]]
    assert "ref_logps" not in PreferenceCollator(0)([{k: v for k, v in p.items() if "ref" not in k} for p in pairs])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])  # gpt2: absolute position embeddings
def test_sequence_logprobs_do_not_depend_on_padding_side_or_amount(arch, tiny_gpt2, tiny_llama):
    from utils.data import PreferenceCollator, tokenize_preference_pairs
    from utils.models.forward import sequence_logprobs
    from utils.models.loading import load_causal_lm

    path = {"gpt2": tiny_gpt2, "llama": tiny_llama}[arch]
    tok = _tokenizer(path)
    pairs, _ = tokenize_preference_pairs(ROWS, tok, 48)
    model = load_causal_lm(path).eval()
    with torch.no_grad():
        alone = sequence_logprobs(model, PreferenceCollator(tok.pad_token_id)(pairs[:1]))[0]
        for side in ("right", "left"):  # the long second pair pads the first one by several tokens
            logps, counts = sequence_logprobs(model, PreferenceCollator(tok.pad_token_id, side)(pairs))
            torch.testing.assert_close(logps[[0, 2]], alone, rtol=0, atol=2e-5)
            expected = [len(pairs[i][f"{s}_response_ids"]) for s in ("chosen", "rejected") for i in (0, 1)]
            assert counts.tolist() == expected


def _dpo_args(model, data, out, steps=6, extra=()):
    return [
        "--model_name_or_path",
        model,
        "--data_path",
        data,
        "--data_split",
        "0,10,0",
        "--output_dir",
        out,
        "--max_steps",
        steps,
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
        "--seed",
        3,
        "--eval_interval",
        3,
        *extra,
    ]


def _losses(out):
    rows = metrics(out)
    return ([r["train/loss"] for r in rows if "train/loss" in r], [r for r in rows if "eval/loss" in r])


@pytest.mark.slow
def test_the_reference_forms_give_the_same_losses_and_ln2_at_step_0(tiny_gpt2, pair_data, tmp_path):
    """A frozen reference engine (here ZeRO-3), the policy's own log-probs precomputed before its first
    update, and (with LoRA on a frozen base) the policy with its adapters disabled: one reference, so
    the same losses (fp32), starting at ln 2 for every pair (the policy IS the reference)."""
    from step2_dpo.main import main

    lora = ["--lora_dim", 4, "--only_optimize_lora", "--lora_learning_rate", 3e-2]
    runs = {
        "engine": ["--zero_stage", 3],
        "precomputed": ["--zero_stage", 3, "--precompute_ref_log_probs"],
        "adapters": lora,
        "adapters_precomputed": lora + ["--precompute_ref_log_probs"],
    }
    results = {}
    for name, extra in runs.items():
        out = str(tmp_path / name)
        main([str(a) for a in _dpo_args(tiny_gpt2, pair_data, out, extra=extra)])
        results[name] = _losses(out)
    for name, (train, evals) in results.items():
        assert train[0] == pytest.approx(LN2, abs=1e-6), name  # the first update's pairs, in training mode
        first = evals[0]
        assert first["step"] == 0 and first["eval/loss"] == pytest.approx(LN2, abs=1e-6), name
        # every pair ties: the accuracy before training is undefined, not 0
        assert abs(first["eval/margin"]) < 1e-6 and "eval/accuracy" not in first, first
        assert train[-1] < train[0] and evals[-1]["eval/margin"] > 0.05, (name, train, evals)
    for a, b in (("engine", "precomputed"), ("adapters", "adapters_precomputed")):
        (train_a, evals_a), (train_b, evals_b) = results[a], results[b]
        assert train_a == pytest.approx(train_b, abs=1e-6), (a, b)
        for key in ("eval/loss", "eval/margin", "eval/chosen_reward", "eval/accuracy"):
            assert [r.get(key) for r in evals_a] == pytest.approx([r.get(key) for r in evals_b], abs=1e-6), key
    assert results["engine"][0] != pytest.approx(results["adapters"][0], abs=1e-3)  # LoRA trains otherwise


@pytest.mark.slow
def test_ipo_smoothing_and_nll_term_reach_the_run(tiny_gpt2, pair_data, tmp_path):
    from step2_dpo.main import main

    out = str(tmp_path / "ipo")
    main(
        [
            str(a)
            for a in _dpo_args(
                tiny_gpt2,
                pair_data,
                out,
                steps=1,
                extra=["--loss_type", "ipo", "--beta", 0.5, "--nll_loss_coef", 0.5, "--precompute_ref_log_probs"],
            )
        ]
    )
    rows = metrics(out)
    step1 = next(r for r in rows if "train/loss" in r)
    assert step1["train/nll"] > 0
    # policy = reference: h = 0, IPO loss (0 - 1 / (2 beta))^2 = 1, plus 0.5 x the chosen NLL
    assert step1["train/loss"] == pytest.approx(1.0 + 0.5 * step1["train/nll"], abs=1e-5)
    assert next(r for r in rows if "eval/loss" in r)["eval/loss"] == pytest.approx(1.0, abs=1e-6)  # DPO part only


def test_bf16_zero3_dpo_trains_in_fp32_math_and_exports(tiny_gpt2, pair_data, tmp_path):
    """bf16 weights under ZeRO-3 with the frozen reference engine: the log-prob and loss math stays fp32
    (ln 2 at the first update), the losses stay finite and the export is a full fp32 model."""
    from safetensors.torch import load_file

    from step2_dpo.main import main

    out = str(tmp_path / "bf16")
    main([str(a) for a in _dpo_args(tiny_gpt2, pair_data, out, steps=3, extra=["--dtype", "bf16", "--zero_stage", 3])])
    train, evals = _losses(out)
    assert train[0] == pytest.approx(LN2, abs=1e-6) and all(math.isfinite(x) for x in train)
    assert all(math.isfinite(r["eval/margin"]) for r in evals)
    weights = load_file(os.path.join(out, "model.safetensors"))
    assert weights and all(t.dtype == torch.float32 and t.numel() > 0 for t in weights.values())


def test_a_registered_reference_free_loss_runs_with_lengths_and_its_own_flag(
    tiny_gpt2, pair_data, tmp_path, monkeypatch, capsys
):
    """The DPO step asks the PAIR_LOSSES entry, not the loss's name: a toy SimPO-like entry (no reference,
    length-normalised, its own --toy_gamma) registered here runs with no reference model or log-probs, gets
    the responses' token counts, and its flag reaches it; the held-out figures before training come from a
    real pass of the policy."""
    import torch.nn.functional as F

    from step2_dpo.main import main
    from utils.math import losses

    seen = []

    def toy(p, beta, toy_gamma):
        assert p.ref_chosen is None and p.ref_rejected is None and p.chosen_tokens is not None
        seen.append(toy_gamma)
        chosen, rejected = p.chosen.float() / p.chosen_tokens, p.rejected.float() / p.rejected_tokens
        return -F.logsigmoid(beta * (chosen - rejected) - toy_gamma), beta * chosen, beta * rejected

    entry = losses.PairLoss(
        toy,
        "a toy SimPO",
        needs_reference=False,
        needs_lengths=True,
        options={"toy_gamma": losses.PairOption(0.5, "the toy's target margin")},
    )
    monkeypatch.setitem(losses.PAIR_LOSSES, "toy", entry)
    out = str(tmp_path / "toy")
    main(
        [
            str(a)
            for a in _dpo_args(
                tiny_gpt2, pair_data, out, steps=2, extra=["--loss_type", "toy", "--beta", 2.0, "--toy_gamma", 0.25]
            )
        ]
    )
    assert set(seen) == {0.25}
    printed = capsys.readouterr().out
    assert "reference: none (the loss is reference-free)" in printed and "reference log-probs of" not in printed
    rows = metrics(out)
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 2] and evals[0]["eval/loss"] != pytest.approx(LN2, abs=1e-3)
    assert all(math.isfinite(r["train/loss"]) for r in rows if "train/loss" in r)
    assert os.path.exists(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--label_smoothing", 0.1, "--loss_type", "ipo"], "does not take it"),
        (["--beta", 0], "--beta must be > 0"),
        (["--label_smoothing", 0.5], "--label_smoothing must be in [0, 0.5), got 0.5"),
        (["--precompute_ref_log_probs", "--offload_reference_model"], "no reference model to offload"),
    ],
)
def test_contradictory_dpo_settings_stop_before_any_model_loads(flags, message, tmp_path):
    from step2_dpo.main import parse_args

    with pytest.raises(UsageError, match=message.replace("[", r"\[").replace(")", r"\)")):
        parse_args(
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


@pytest.mark.slow
def test_two_rank_zero3_dpo_learns_exports_and_resumes_exactly_after_sigkill(tiny_gpt2, pair_data, tmp_path):
    """Precomputed reference log-probs gathered over 2 ranks and kept in the checkpoints: a run killed
    after a checkpoint and resumed writes the same metrics as the uninterrupted run (dropout on: only
    if every rank's RNG state came back too; the loop and checkpoints are steps 1-2's), which learns
    the rule (held-out implicit-reward accuracy > 0.8) and exports a policy that reloads as it trained."""

    def args(out):
        return _dpo_args(
            tiny_gpt2,
            pair_data,
            out,
            steps=12,
            extra=[
                "--zero_stage",
                3,
                "--precompute_ref_log_probs",
                "--save_interval",
                4,
                "--eval_interval",
                6,
                "--dropout",
                0.1,
                "--num_warmup_steps",
                2,
                "--lr_scheduler_type",
                "cosine",
            ],
        )

    out = str(tmp_path / "out")  # killed once it has logged step 7: steps 5-7 are the uninterrupted reference
    resumed_at, uninterrupted, proc = kill_after_row_and_resume("step2_dpo.main", args(out), out, tmp_path, kill_at=7)
    assert resumed_at == 4, resumed_at
    assert os.path.isfile(os.path.join(out, "model.safetensors")), tail(proc)
    rows = metrics(out)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 13))
    last = max(r["step"] for r in uninterrupted)
    expected = comparable(uninterrupted, resumed_at)
    assert {step for step, _ in expected} >= {5, 6, 7} and (6, "eval/loss") in expected, sorted(expected)
    difference = max_relative_difference(expected, comparable([r for r in rows if r["step"] <= last], resumed_at))
    print(f"DPO resumed at step {resumed_at}: max relative difference {difference:.2e}")
    assert difference <= 1e-5

    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 6, 12] and all(r["eval/pairs"] == 64 for r in evals), evals
    first, last = evals[0], evals[-1]
    assert first["eval/loss"] == pytest.approx(LN2, abs=1e-6)
    assert last["eval/accuracy"] > 0.8 and last["eval/margin"] > first["eval/margin"] + 0.5, evals
    assert last["eval/margin"] == pytest.approx(last["eval/chosen_reward"] - last["eval/rejected_reward"], abs=1e-5)
    assert [r["export/logp_max_abs_diff"] for r in rows if "export/logp_max_abs_diff" in r][0] <= 1e-4
    from utils.models.reward_model import check_policy_dir

    check_policy_dir(out)  # a plain causal LM directory (step 3's actor, the evaluation, chat.py), no value head
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "gpt2"
