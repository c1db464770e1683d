"""The reference-free preference losses of the DPO step: SimPO and ORPO as PAIR_LOSSES entries,
checked against hand-computed values, their gradients, their flags, and a short run of each."""

import math
import os

import pytest
import torch

from tests.launch import metrics
from tests.test_step2_dpo import _dpo_args
from tests.test_step2_run import pair_data  # noqa: F401  (fixture)
from utils.errors import UsageError
from utils.math.losses import PAIR_LOSSES, PairLogps, orpo_pair_loss, pair_loss, simpo_pair_loss

# one pair: the chosen response 4 tokens with log-prob -2 (-0.5 per token), the rejected 2 tokens with -3 (-1.5)
PAIR = dict(
    chosen=torch.tensor([-2.0], dtype=torch.float64),
    rejected=torch.tensor([-3.0], dtype=torch.float64),
    chosen_tokens=torch.tensor([4]),
    rejected_tokens=torch.tensor([2]),
)


def test_simpo_by_hand():
    # -log sigmoid(2 * (-0.5 - -1.5) - 0.5) = log(1 + e^-1.5)
    losses, chosen, rejected = simpo_pair_loss(PairLogps(**PAIR), beta=2.0, simpo_gamma=0.5)
    assert losses.item() == pytest.approx(0.2014132779827524, rel=1e-6)
    assert chosen.item() == pytest.approx(-1.0) and rejected.item() == pytest.approx(-3.0)
    # gamma 0 and equal per-token log-probs: ln 2, whatever the lengths
    even = PairLogps(
        torch.tensor([-2.0]), torch.tensor([-1.0]), chosen_tokens=torch.tensor([4]), rejected_tokens=torch.tensor([2])
    )
    assert simpo_pair_loss(even, 2.0, 0.0)[0].item() == pytest.approx(math.log(2), rel=1e-6)


def test_orpo_by_hand():
    # log odds = avg - log(1 - e^avg): 0.43275 (chosen, avg -0.5), -1.24752 (rejected, avg -1.5)
    losses, chosen, rejected = orpo_pair_loss(PairLogps(**PAIR), beta=0.1, orpo_lambda=0.1)
    assert losses.item() == pytest.approx(0.017085921714647852, rel=1e-6)
    assert chosen.item() == pytest.approx(-0.5) and rejected.item() == pytest.approx(-1.5)
    assert orpo_pair_loss(PairLogps(**PAIR), beta=5.0, orpo_lambda=0.2)[0].item() == pytest.approx(
        2 * 0.017085921714647852, rel=1e-6
    )  # lambda scales it, beta is not read


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_gradients_match_finite_differences(loss_type):
    fn = {"simpo": lambda p: simpo_pair_loss(p, 2.0, 0.5), "orpo": lambda p: orpo_pair_loss(p, 0.1, 0.1)}[loss_type]
    logps = torch.tensor([-2.0, -3.0], dtype=torch.float64, requires_grad=True)

    def loss(x):
        return fn(
            PairLogps(x[:1], x[1:], chosen_tokens=PAIR["chosen_tokens"], rejected_tokens=PAIR["rejected_tokens"])
        )[0].sum()

    loss(logps).backward()
    eps = 1e-2  # the losses compute in fp32: a central difference this wide is good to ~1e-4 relative
    for i in range(2):
        step = torch.zeros(2, dtype=torch.float64)
        step[i] = eps
        numeric = (loss(logps.detach() + step) - loss(logps.detach() - step)).item() / (2 * eps)
        assert logps.grad[i].item() == pytest.approx(numeric, rel=2e-3)
    assert logps.grad[0] < 0 < logps.grad[1]  # raise the chosen, lower the rejected


def test_the_entries_need_no_reference_and_take_lengths():
    for name in ("simpo", "orpo"):
        entry = PAIR_LOSSES[name]
        assert not entry.needs_reference and entry.needs_lengths
    assert PAIR_LOSSES["orpo"].nll_coef == 1.0 and PAIR_LOSSES["simpo"].default_beta == 2.0
    loss, stats = pair_loss(PairLogps(**PAIR), 2.0, "simpo", simpo_gamma=0.5)
    assert stats["accuracy"].item() == 1.0 and stats["margin"].item() == pytest.approx(2.0)


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


def test_flags_beta_defaults_and_refusals(tmp_path):
    assert _parse(tmp_path).beta == 0.1
    assert _parse(tmp_path, "--loss_type", "simpo").beta == 2.0
    assert _parse(tmp_path, "--loss_type", "simpo", "--beta", 2.5).beta == 2.5
    for flags, message in [
        (["--loss_type", "orpo", "--nll_loss_coef", 0.5], "has its own NLL term"),
        (["--loss_type", "orpo", "--beta", 0.5], "does not read it"),
        (["--simpo_gamma", 1.0], "does not take it"),
        (["--loss_type", "orpo", "--orpo_lambda", 0], "--orpo_lambda must be > 0"),
        (["--loss_type", "simpo", "--simpo_gamma", -1], "--simpo_gamma must be >= 0"),
        (["--loss_type", "simpo", "--precompute_ref_log_probs"], "reference-free"),
    ]:
        with pytest.raises(UsageError, match=message):
            _parse(tmp_path, *flags)


def test_orpo_adds_the_chosen_nll_per_token_with_weight_one(tmp_path):
    from step2_dpo.main import PreferenceLoss

    loss_of = PreferenceLoss(_parse(tmp_path, "--loss_type", "orpo"))
    logps = torch.tensor([-2.0, -3.0])  # [chosen, rejected] of one pair
    counts = torch.tensor([4, 2])
    terms, stats = loss_of.terms(logps, counts, None)
    assert terms["pairs"].item() == pytest.approx(0.017085921714647852, rel=1e-5)
    assert terms["chosen_tokens"].item() == pytest.approx(0.5)  # 2 / 4 tokens
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "action_mask": torch.tensor([[1] * 4 + [0] * 2] * 2)}
    assert loss_of.units(batch) == {"pairs": 1, "chosen_tokens": 4}


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_a_reference_free_run_builds_no_reference_and_learns(loss_type, tiny_gpt2, pair_data, tmp_path, capsys):
    from step2_dpo.main import main

    out = str(tmp_path / loss_type)
    main([str(a) for a in _dpo_args(tiny_gpt2, pair_data, out, steps=3, extra=["--loss_type", loss_type])])
    printed = capsys.readouterr().out
    assert "reference: none (the loss is reference-free)" in printed and "reference log-probs of" not in printed
    rows = metrics(out)
    train = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 3] and len(train) == 3
    assert all(math.isfinite(r["train/loss"]) for r in train)
    assert ("train/nll" in train[0]) == (loss_type == "orpo")
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert os.path.exists(os.path.join(out, "model.safetensors"))


@pytest.mark.slow
def test_a_preference_output_is_step3s_actor_and_prompt_eval_and_chat_take_it(
    tiny_gpt2, pair_data, tmp_path, monkeypatch, capsys
):
    """A DPO-step output (here SimPO's) is a plain from_pretrained policy: a 2-iteration step 3 starts from it as
    its actor, and prompt_eval and chat.py (one turn from standard input) load it as it is."""
    import io
    import sys

    import chat
    from step1_sft.prompt_eval import main as prompt_eval
    from step2_dpo.main import main as dpo
    from step3_ppo.main import main as rl
    from tests.test_step3_grpo import grpo_args, write_rows

    policy = str(tmp_path / "policy")
    dpo([str(a) for a in _dpo_args(tiny_gpt2, pair_data, policy, steps=2, extra=["--loss_type", "simpo"])])
    write_rows(tmp_path)
    rl([str(a) for a in grpo_args(policy, tmp_path, "--actor_zero_stage", 0, "--max_steps", 2)])
    iterations = [r for r in metrics(str(tmp_path / "out")) if "time/train_s" in r]
    assert [r["step"] for r in iterations] == [1, 2] and all(math.isfinite(r["reward/score_mean"]) for r in iterations)
    assert os.path.exists(os.path.join(tmp_path, "out", "actor", "model.safetensors"))

    result = prompt_eval(
        [
            "--model_name_or_path_baseline",
            tiny_gpt2,
            "--model_name_or_path_finetune",
            policy,
            "--prompts",
            "Human: hello\n\nAssistant:",
            "--max_new_tokens",
            "3",
            "--num_beams",
            "2",
            "--device",
            "cpu",
        ]
    )
    assert len(result["answers"]["Finetune/Greedy"]) == 1
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    assert chat.main(["--model_name_or_path", policy, "--max_new_tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.count("Assistant:") == 1
