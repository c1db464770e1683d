"""Step 3 under bad numbers and bad input: a NaN reward skips the update and is counted; too many in
a row stop the run; a killed run resumes with the same metrics; input errors name what is wrong."""

import os

import pytest
import torch

from step3_ppo.main import parse_args, setup
from tests.launch import metrics, tail
from tests.test_resume import comparable, kill_after_row_and_resume, max_relative_difference
from tests.test_step3_lr0 import prompt_batches, write_prompts
from utils.errors import UsageError
from utils.train.checkpoint import BadStepGuard, LoopState, NonFiniteUpdates


def ppo_args(model, prompts, out, *extra, critic=None):
    """`critic` (default: `model`, enough for tests that stop in parse_args before the model-kind checks) must
    be a reward-model directory otherwise."""
    return [
        "--actor_model_name_or_path",
        model,
        "--critic_model_name_or_path",
        critic or model,
        "--data_path",
        str(prompts),
        "--data_split",
        "0,0,10",
        "--output_dir",
        str(out),
        "--max_prompt_seq_len",
        "32",
        "--max_answer_seq_len",
        "4",
        "--per_device_generation_batch_size",
        "4",
        "--per_device_training_batch_size",
        "2",
        "--seed",
        "11",
        *map(str, extra),
    ]


@pytest.fixture(scope="module")
def nan_run(tiny_gpt2, tiny_gpt2_reward, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nan")
    write_prompts(tmp / "prompts.jsonl")
    args = parse_args(
        ppo_args(
            tiny_gpt2,
            tmp / "prompts.jsonl",
            tmp / "out",
            "--actor_zero_stage",
            0,
            "--critic_zero_stage",
            0,
            "--actor_learning_rate",
            1e-2,
            "--max_bad_steps",
            2,
            critic=tiny_gpt2_reward,
        )
    )
    return setup(args)


class NanReward:
    """A reward behind step 3's reward interface that turns every score into nan."""

    def __init__(self, reward):
        self.name, self.engine, self.reward = "nan", reward.engine, reward

    def __call__(self, rows):
        return self.reward(rows) * float("nan")


def poison_reward(monkeypatch, run):
    monkeypatch.setattr(run.trainer, "rewards", [NanReward(run.trainer.rewards[0])])


def test_nan_reward_skips_the_update_and_is_counted(nan_run, monkeypatch):
    run = nan_run
    loop = LoopState()
    run.trainer.guard = BadStepGuard(loop, max_in_a_row=2)
    before = [p.detach().clone() for p in run.trainer.actor.module.parameters()]
    with monkeypatch.context() as m:
        poison_reward(m, run)
        metrics_bad, _ = run.trainer.step(prompt_batches(run, 4), step=0)
    assert metrics_bad["ppo/skipped_non_finite"] == 1.0 and loop.bad_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, run.trainer.actor.module.parameters()))
    metrics_ok, _ = run.trainer.step(prompt_batches(run, 4), step=1)  # a good step resets the streak
    assert metrics_ok["ppo/skipped_non_finite"] == 0.0 and loop.bad_in_a_row == 0 and loop.bad_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, run.trainer.actor.module.parameters()))


def test_consecutive_nan_rewards_stop_the_run(nan_run, monkeypatch):
    run = nan_run
    run.trainer.guard = BadStepGuard(LoopState(), max_in_a_row=2)
    poison_reward(monkeypatch, run)
    run.trainer.step(prompt_batches(run, 4), step=0)
    with pytest.raises(NonFiniteUpdates, match="2 consecutive updates had a non-finite loss or reward"):
        run.trainer.step(prompt_batches(run, 4), step=1)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--per_device_training_batch_size", "3"], "does not divide the rollout of 4 rows"),
        (["--min_answer_seq_len", "9"], "--min_answer_seq_len (9) <= --max_answer_seq_len (4)"),
        (["--temperature", "0"], "--temperature must be > 0"),
        (["--only_optimize_lora"], "--only_optimize_lora needs"),
    ],
)
def test_incompatible_flags_fail_before_any_model_is_loaded(tiny_gpt2, tiny_gpt2_reward, tmp_path, flags, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(ppo_args(tiny_gpt2, tmp_path / "p.jsonl", tmp_path / "out", *flags, critic=tiny_gpt2_reward))


def test_missing_model_directory_is_named(tmp_path):
    with pytest.raises(Exception, match="does-not-exist"):
        parse_args(ppo_args(str(tmp_path / "does-not-exist"), tmp_path / "p.jsonl", tmp_path / "out"))


@pytest.mark.slow
def test_step3_kill_and_resume_matches_uninterrupted(tiny_gpt2, tiny_gpt2_reward, tmp_path):
    """Sampling, PPO epochs, the adaptive KL controller and EMA: all must come back exactly. The run is
    SIGKILLed once it has logged iteration 5 (its one checkpoint: 3); its iterations 4-5 are the
    uninterrupted reference (tests.test_resume.kill_after_row_and_resume)."""
    write_prompts(tmp_path / "prompts.jsonl", 64)
    out = str(tmp_path / "out")
    args = ppo_args(
        tiny_gpt2,
        tmp_path / "prompts.jsonl",
        out,
        "--actor_zero_stage",
        3,
        "--critic_zero_stage",
        3,
        "--enable_hybrid_engine",
        "--actor_learning_rate",
        1e-3,
        "--critic_learning_rate",
        1e-3,
        "--adaptive_kl",
        "--kl_target",
        0.5,
        "--kl_horizon",
        100,
        "--enable_ema",
        "--ppo_epochs",
        2,
        "--max_steps",
        7,
        "--save_interval",
        3,
        critic=tiny_gpt2_reward,
    )
    resumed_at, uninterrupted, proc = kill_after_row_and_resume("step3_ppo.main", args, out, tmp_path, kill_at=5)
    assert resumed_at == 3, resumed_at
    assert os.path.exists(os.path.join(out, "actor", "model.safetensors")), tail(proc)
    assert os.path.exists(os.path.join(out, "actor_ema", "model.safetensors")), tail(proc)
    rows = metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 8))
    last = max(r["step"] for r in uninterrupted)
    expected = comparable(uninterrupted, resumed_at)
    assert {step for step, _ in expected} >= {4, 5}, sorted(expected)
    difference = max_relative_difference(expected, comparable([r for r in rows if r["step"] <= last], resumed_at))
    print(f"step 3 resumed at step {resumed_at}: max relative difference {difference:.2e}")
    assert difference <= 1e-5
