"""DAPO's dynamic sampling: with a reward that is constant for some prompts, the
iteration generates further prompt batches until it holds the groups with signal it asked for (at most
--max_sampling_rounds rounds, then it trains on what it has), every kept group has reward variance, the
generated / kept / dropped groups are logged; the extra batches come from the run's loader and count in
its resume position; two ranks agree on the rounds."""

import json
import os
import shutil

import pytest
import torch

from step3_ppo.main import main, parse_args, setup
from tests.launch import metrics, run_deepspeed, tail
from tests.test_resume import comparable, max_relative_difference
from tests.test_step3_grpo import grpo_args, write_rows
from tests.test_training_loop import Sampler, make_run
from utils.data import PromptCollator
from utils.errors import UsageError

# constant on the prompts of even id (their groups carry no signal); on odd ids a different score for every
# different answer (a hash of its tokens), so those groups vary
REWARDS = """
def half_constant(completion_ids, id, **kwargs):
    return [1.0 if i % 2 == 0 else float(hash(tuple(ids)) % 1000003) for ids, i in zip(completion_ids, id)]
"""


def dynamic_args(model, tmp, *extra):
    return grpo_args(
        model,
        tmp,
        "--reward_funcs",
        f"{tmp / 'dynamic_rewards.py'}:half_constant",
        "--kl_ctl",
        0,
        "--dynamic_sampling",
        *extra,
    )


@pytest.fixture(scope="module")
def dynamic_run(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dynamic")
    write_rows(tmp)
    (tmp / "dynamic_rewards.py").write_text(REWARDS)
    run = setup(parse_args(dynamic_args(tiny_llama, tmp, "--actor_zero_stage", 0, "--actor_learning_rate", 0)))
    return tmp, run


def batches_of(run, parities: list[list[int]]) -> list[dict]:
    """Prompt batches whose prompts have the given id parities (0: constant reward, 1: varying)."""
    pool = {0: [], 1: []}
    for example in run.loader.dataset:
        pool[example["extra"]["id"] % 2].append(example)
    collate = PromptCollator(run.tokenizer.pad_token_id)
    return [collate([pool[p].pop() for p in parity]) for parity in parities]


def group_variance(rows, group) -> float:
    return torch.tensor([r.score for r in rows if r.group == group]).var().item()


@pytest.mark.slow
def test_more_batches_until_the_groups_with_signal_are_there(dynamic_run):
    """2 prompts per batch, one constant: the first round holds 1 group with signal of the 2 asked for; a
    second batch brings the other; the constant groups are dropped."""
    _, run = dynamic_run
    first, *more = batches_of(run, [[0, 1], [1, 0], [1, 1]])
    drawn = []

    def more_prompts():
        drawn.append(more[len(drawn)])
        return drawn[-1]

    torch.manual_seed(0)
    metrics_, rows = run.trainer.step([first], step=0, more_prompts=more_prompts)
    assert len(drawn) == 1 and metrics_["dynamic/rounds"] == 2
    assert (
        metrics_["dynamic/generated_groups"],
        metrics_["dynamic/kept_groups"],
        metrics_["dynamic/dropped_groups"],
        metrics_["dynamic/missing_groups"],
    ) == (4, 2, 2, 0)
    assert len(rows) == 4 and all(r.trained for r in rows)  # the rollout keeps its size: 2 groups x 2 answers
    assert all(group_variance(rows, g) > 0 for g in {r.group for r in rows})
    assert all(r.prompt["extra"]["id"] % 2 == 1 for r in rows)
    assert len({r.group for r in rows}) == 2 and metrics_["ppo/log_ratio_max_abs"] <= 1e-4


@pytest.mark.slow
def test_at_most_max_sampling_rounds_then_what_it_has(dynamic_run):
    """Constant prompts only: 3 rounds (the limit), no group with signal; the rollout is filled with groups
    without signal, all left out of the loss, and the shortfall is logged."""
    _, run = dynamic_run
    first, *more = batches_of(run, [[0, 0], [0, 0], [0, 0], [0, 0]])
    config = run.trainer.config
    config.max_sampling_rounds = 3
    try:
        metrics_, rows = run.trainer.step([first], step=0, more_prompts=lambda: more.pop(0))
    finally:
        config.max_sampling_rounds = 4
    assert len(more) == 1 and metrics_["dynamic/rounds"] == 3
    assert metrics_["dynamic/generated_groups"] == 6 and metrics_["dynamic/kept_groups"] == 0
    assert metrics_["dynamic/missing_groups"] == 2 and metrics_["dynamic/dropped_groups"] == 6
    assert len(rows) == 4 and not any(r.trained for r in rows) and metrics_["train/dropped_rows"] == 4
    # an exhausted loader ends the rounds too
    metrics_, rows = run.trainer.step(batches_of(run, [[0, 0]]), step=1, more_prompts=lambda: None)
    assert metrics_["dynamic/rounds"] == 1 and len(rows) == 4


def test_extra_batches_count_in_the_resume_position(tmp_path):
    """Run.next_batch hands out the epoch's next batch and counts it: the next step's batches and a resumed
    run's skip it; at the end of the epoch it has none."""
    run = make_run(tmp_path / "a", total_steps=3)
    seen = []
    for unit in run.steps(list(range(7)), Sampler(), batches_per_step=2):
        extra = [run.next_batch()] if not seen else []
        seen.append(unit + extra)
        run.after_step({})
    assert seen == [[0, 1, 2], [3, 4], [5, 6]] and run.loop.batches_in_epoch == 7
    assert run.next_batch() is None
    resumed = make_run(tmp_path / "b", total_steps=3)
    resumed.loop.step, resumed.loop.batches_in_epoch = 1, 3  # the checkpoint after the first step
    assert list(resumed.steps(list(range(7)), Sampler(), batches_per_step=2)) == [[3, 4], [5, 6]]


def test_flags(tiny_llama, tmp_path):
    write_rows(tmp_path)
    with pytest.raises(UsageError, match="--dynamic_sampling keeps the prompts whose answers' rewards differ"):
        parse_args(
            dynamic_args(tiny_llama, tmp_path, "--n_samples_per_prompt", 1, "--advantage_estimator", "reinforce_pp")
        )
    with pytest.raises(UsageError, match="--max_sampling_rounds"):
        parse_args(dynamic_args(tiny_llama, tmp_path, "--max_sampling_rounds", 0))


@pytest.mark.slow
def test_a_resumed_run_skips_the_extra_batches_it_drew(tiny_llama, tmp_path):
    """In this process: 3 iterations with dynamic sampling and a checkpoint after each; then the run is put
    back to its checkpoint after iteration 2 and resumed: iteration 3 sees the same prompts (the batches
    iteration 1-2's extra rounds drew are skipped too) and logs the same figures."""
    write_rows(tmp_path, n=48)
    (tmp_path / "dynamic_rewards.py").write_text(REWARDS)
    args = dynamic_args(
        tiny_llama,
        tmp_path,
        "--actor_zero_stage",
        0,
        "--actor_learning_rate",
        1e-3,
        "--max_steps",
        3,
        "--save_interval",
        1,
        "--keep_checkpoints",
        3,
    )
    out = tmp_path / "out"
    main([str(a) for a in args])
    full = metrics(str(out))
    assert sum(r["dynamic/rounds"] - 1 for r in full if r["step"] <= 2) > 0, full  # extra batches before the resume
    with open(out / "checkpoints" / "latest") as f:
        last = f.read().strip()
    assert last.endswith("3"), last
    shutil.rmtree(out / "checkpoints" / last)
    with open(out / "checkpoints" / "latest", "w") as f:
        f.write(last[:-1] + "2")
    main([str(a) for a in args] + ["--resume"])
    resumed = metrics(str(out))
    assert [r["step"] for r in resumed if "dynamic/rounds" in r] == [1, 2, 3]
    difference = max_relative_difference(comparable(full, 2), comparable(resumed, 2))
    print(f"resumed at step 2 with dynamic sampling: max relative difference {difference:.2e}")
    assert difference <= 1e-5


@pytest.mark.slow
def test_two_ranks_agree_on_the_rounds(tiny_gpt2, tmp_path):
    """ZeRO-3 + hybrid generation on 2 ranks (collective): ranks whose prompts differ in signal still run
    the same rounds; the run finishes and logs the groups of both ranks."""
    write_rows(tmp_path, n=64)
    (tmp_path / "dynamic_rewards.py").write_text(REWARDS)
    args = dynamic_args(
        tiny_gpt2,
        tmp_path,
        "--actor_zero_stage",
        3,
        "--enable_hybrid_engine",
        "--actor_learning_rate",
        1e-3,
        "--max_steps",
        3,
    )
    proc = run_deepspeed("step3_ppo.main", args, log_path=str(tmp_path / "log.txt"))
    rows = metrics(str(tmp_path / "out")) if (tmp_path / "out" / "metrics.jsonl").exists() else []
    train = [r for r in rows if "dynamic/rounds" in r]
    assert [r["step"] for r in train] == [1, 2, 3], tail(proc)
    for row in train:  # 2 ranks x 2 prompts asked for
        assert row["dynamic/kept_groups"] + row["dynamic/missing_groups"] == 4, row
        assert row["dynamic/generated_groups"] >= 4 and 1 <= row["dynamic/rounds"] <= 4, row
        assert row["dynamic/dropped_groups"] == row["dynamic/generated_groups"] - row["dynamic/kept_groups"]
    assert os.path.exists(tmp_path / "out" / "actor" / "model.safetensors"), tail(proc)
    print(json.dumps([{k: v for k, v in r.items() if k.startswith("dynamic/")} for r in train]))
