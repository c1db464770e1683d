"""lr = 0 keeps the log-ratio at 0 (<= 1e-4) for every `--policy_loss` x {clip-higher, dual-clip, entropy
bonus} at 4 samples per prompt, with the unbiased KL loss and GDPO's normalize-then-sum on two
reward functions: in this process (ZeRO-0, one rank, llama) for each combination, and one 2-rank
ZeRO-3 + hybrid run through the launcher for gspo. The settings go through the flags, as a user gives them.
"""

import pytest
import torch

from step3_ppo.main import parse_args, setup
from step3_ppo.trainer import PPOConfig, PPOTrainer
from tests.launch import metrics, run_deepspeed, tail
from tests.test_step3_lr0 import prompt_batches, write_prompts
from utils.errors import UsageError

# two rewards on different scales that vary between the samples of a prompt (non-zero advantages)
REWARDS = """
def first_token(completion_ids, **kwargs):
    return [float(ids[0] % 7) for ids in completion_ids]


def token_sum(completion_ids, **kwargs):
    return [float(sum(ids) % 101) for ids in completion_ids]
"""

# every --policy_loss x {clip-higher, dual-clip, entropy}; cispo has no clipped surrogate to dual-clip (refused)
COMBINATIONS = {
    ("ppo", "clip_higher"): ["--cliprange_high", "0.28"],
    ("ppo", "dual_clip"): ["--dual_clip", "3"],
    ("ppo", "entropy"): ["--entropy_coef", "0.01"],
    ("gspo", "clip_higher"): ["--cliprange_high", "1e-3"],
    ("gspo", "dual_clip"): ["--dual_clip", "3"],
    ("gspo", "entropy"): ["--entropy_coef", "0.01"],
    ("cispo", "clip_higher"): ["--cliprange_high", "0.28"],
    ("cispo", "entropy"): ["--entropy_coef", "0.01"],
}


def rl_args(model, tmp, *extra):
    """GRPO on 4 samples per prompt, two reward functions normalised apart, KL to the reference in the loss."""
    return [
        "--actor_model_name_or_path",
        model,
        "--data_path",
        str(tmp / "prompts.jsonl"),
        "--data_split",
        "0,0,10",
        "--output_dir",
        str(tmp / "out"),
        "--advantage_estimator",
        "grpo",
        "--n_samples_per_prompt",
        "4",
        "--reward_funcs",
        f"{tmp / 'rewards.py'}:first_token",
        f"{tmp / 'rewards.py'}:token_sum",
        "--reward_norm",
        "normalize_then_sum",
        "--kl_in_loss",
        "--max_prompt_seq_len",
        "32",
        "--max_answer_seq_len",
        "8",
        "--per_device_generation_batch_size",
        "2",
        "--per_device_training_batch_size",
        "4",
        "--ppo_epochs",
        "2",
        "--seed",
        "3",
        *map(str, extra),
    ]


@pytest.fixture(scope="module")
def lr0_run(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("policy_losses_lr0")
    write_prompts(tmp / "prompts.jsonl")
    (tmp / "rewards.py").write_text(REWARDS)
    run = setup(parse_args(rl_args(tiny_llama, tmp, "--actor_zero_stage", 0, "--actor_learning_rate", 0)))
    return tiny_llama, tmp, run


def trainer_for(run, args) -> PPOTrainer:
    """A trainer on the run's engines and rewards with the RL settings of `args` (as main builds it)."""
    base = run.trainer.config
    config = PPOConfig.from_args(
        args, stop_token_ids=base.stop_token_ids, pad_token_id=base.pad_token_id, reward_weights=base.reward_weights
    )
    return PPOTrainer(run.engines, config, run.trainer.kl_ctl, run.trainer.rewards)


@pytest.mark.slow
def test_log_ratio_is_zero_at_lr0_for_every_policy_loss_and_option(lr0_run):
    model, tmp, run = lr0_run
    assert run.engines.ref is not None and len(run.trainer.rewards) == 2
    maxima = {}
    for (loss, option), flags in COMBINATIONS.items():
        args = parse_args(
            rl_args(model, tmp, "--actor_zero_stage", 0, "--actor_learning_rate", 0, "--policy_loss", loss, *flags)
        )
        trainer = trainer_for(run, args)
        assert trainer.loss_agg == {"ppo": "seq_mean", "gspo": "seq_mean", "cispo": "token_mean"}[loss]
        torch.manual_seed(len(maxima))
        metrics, rows = trainer.step(prompt_batches(run, 2, n_rows=2, offset=2 * len(maxima)), step=0)
        assert len(rows) == 8 and len({r.group for r in rows}) == 2
        # advantages that are not all 0 (at lr 0 the ratio is 1, so a group-normalised loss is 0 up to rounding)
        assert metrics["reward/zero_variance_group_fraction"] < 1, metrics
        assert metrics["ppo/entropy"] > 0 and metrics["loss/kl"] == pytest.approx(0.0, abs=1e-6), (loss, option)
        assert all(torch.isfinite(torch.tensor(metrics[k])) for k in ("loss/actor", "ppo/clipfrac")), metrics
        maxima[loss, option] = metrics["ppo/log_ratio_max_abs"]
    print(f"lr=0 max |log_ratio| per (policy loss, option): {maxima}")
    assert max(maxima.values()) <= 1e-4, maxima
    with pytest.raises(UsageError, match="--dual_clip does nothing with --policy_loss cispo"):
        parse_args(rl_args(model, tmp, "--policy_loss", "cispo", "--dual_clip", "3"))


@pytest.mark.slow
def test_two_rank_zero3_hybrid_gspo_lr0(tiny_gpt2, tmp_path):
    """gspo with a clip-higher range, dual-clip and the entropy bonus under ZeRO-3 + hybrid on 2 ranks: the
    log-ratio stays ~0 over 2 iterations of 2 PPO epochs, the entropy is logged, the KL loss is 0 (actor ==
    reference at lr 0)."""
    write_prompts(tmp_path / "prompts.jsonl", 40)
    (tmp_path / "rewards.py").write_text(REWARDS)
    out = str(tmp_path / "out")
    args = rl_args(
        tiny_gpt2,
        tmp_path,
        "--actor_zero_stage",
        3,
        "--enable_hybrid_engine",
        "--actor_learning_rate",
        0,
        "--policy_loss",
        "gspo",
        "--cliprange_high",
        "1e-3",
        "--dual_clip",
        3,
        "--entropy_coef",
        0.01,
        "--max_steps",
        2,
    )
    proc = run_deepspeed("step3_ppo.main", args, log_path=str(tmp_path / "log.txt"))
    rows = metrics(out) if (tmp_path / "out" / "metrics.jsonl").exists() else []
    assert [r["step"] for r in rows] == [1, 2], tail(proc)
    for row in rows:
        assert row["ppo/log_ratio_max_abs"] <= 1e-4, row
        assert row["reward/zero_variance_group_fraction"] < 1 and row["loss/actor"] != 0, row
        assert row["ppo/entropy"] > 0 and row["loss/kl"] == pytest.approx(0.0, abs=1e-6), row
    print(f"2-rank ZeRO-3 + hybrid gspo lr=0 max |log_ratio|: {max(r['ppo/log_ratio_max_abs'] for r in rows)}")
