"""Step 3 without a critic or a reward model: GRPO-family estimators on several samples per prompt, scored
by reward functions that receive the prompt rows' other fields. In this process (ZeRO-0, one rank) for
the trainer's behaviour, and through the launcher (2 ranks, ZeRO-3 + hybrid) for alignment across ranks,
checkpoints, resume and the outputs."""

import json
import os

import pytest
import torch

from step3_ppo.main import parse_args, setup
from step3_ppo.rewards.components import FunctionReward
from step3_ppo.rewards.functions import RewardFunctionError, load_reward_function
from tests.launch import metrics, run_deepspeed, tail
from tests.test_step3_lr0 import PROMPT_WORDS, prompt_batches
from utils.errors import UsageError

# Each prompt row carries `answer` (its last word) and `id`; the function checks that every completion
# arrives with its own row's fields (it raises otherwise) and scores the completion's length, which varies.
REWARDS = """
def aligned_length(prompts, completions, completion_ids, answer, id, **kwargs):
    for prompt, a, i in zip(prompts, answer, id):
        if prompt.split()[-3] != a or f"#{i}" not in prompt:
            raise ValueError(f"row {i} got the fields of another row: {prompt!r} {a!r}")
    return [float(len(ids)) for ids in completion_ids]


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def fails_on_first_id(completions, id, **kwargs):
    return [float("nan") if i == min(id) else 0.5 for i in id]


def raises(completions, **kwargs):
    raise KeyError("no such column")
"""


def write_rows(tmp, n=24):
    """Prompt rows of 1 to 12 words (different padding) with the extra fields `answer` and `id`."""
    path = tmp / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            words = [PROMPT_WORDS[(i + j) % len(PROMPT_WORDS)] for j in range(1 + (i * 5) % 12)]
            f.write(
                json.dumps({"prompt": f"Human: #{i} {' '.join(words)} ?\n\nAssistant:", "answer": words[-1], "id": i})
                + "\n"
            )
    (tmp / "rewards.py").write_text(REWARDS)
    return path


def grpo_args(model, tmp, *extra):
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
        "2",
        "--reward_funcs",
        f"{tmp / 'rewards.py'}:aligned_length",
        "--max_prompt_seq_len",
        "32",
        "--max_answer_seq_len",
        "6",
        "--per_device_generation_batch_size",
        "2",
        "--per_device_training_batch_size",
        "2",
        "--seed",
        "3",
        *map(str, extra),
    ]


@pytest.fixture(scope="module")
def grpo_run(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    write_rows(tmp)
    return tmp, setup(
        parse_args(grpo_args(tiny_llama, tmp, "--actor_zero_stage", 0, "--actor_learning_rate", 0, "--kl_ctl", 0.1))
    )


def use_reward(run, tmp, name, skip_bad=False):
    func = load_reward_function(f"{tmp / 'rewards.py'}:{name}")
    run.trainer.rewards = [FunctionReward(func, run.tokenizer, timeout=None, skip_bad=skip_bad)]
    run.trainer.config.skip_bad_rewards = skip_bad


def test_no_critic_no_reward_model_and_the_fields_reach_the_function(grpo_run):
    tmp, run = grpo_run
    assert run.engines.critic is None and run.trainer.critic is None and run.engines.rewards == {}
    assert run.engines.ref is not None  # --kl_ctl > 0
    use_reward(run, tmp, "aligned_length")
    metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=6, offset=3), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    assert [r.score for r in rows] == [float(r.response_ids.numel()) for r in rows]
    assert metrics["reward/aligned_length_mean"] == pytest.approx(sum(r.score for r in rows) / len(rows))
    assert "loss/critic" not in metrics and all("old_values" not in r.per_action for r in rows)
    # GRPO: the group-normalised score on every action (no KL in the advantage: it is the return-to-go of
    # the score at the last action plus the per-token KL penalty; at lr 0 the KL is 0)
    for g in {r.group for r in rows}:
        pair = [r for r in rows if r.group == g]
        scores = torch.tensor([r.score for r in pair])
        expected = (scores - scores.mean()) / (scores.std() + 1e-6)
        for r, a in zip(pair, expected):
            assert torch.allclose(r.per_action["advantages"], a.expand_as(r.per_action["advantages"]), atol=1e-4)


def test_groups_without_signal_and_truncated_answers_are_dropped_and_counted(grpo_run):
    tmp, run = grpo_run
    use_reward(run, tmp, "constant")
    config = run.trainer.config
    config.filter_zero_variance_groups = True
    try:
        metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=4, offset=9), step=0)
    finally:
        config.filter_zero_variance_groups = False
    assert metrics["train/dropped_rows"] == len(rows) == 8 and not any(r.trained for r in rows)
    assert metrics["reward/zero_variance_group_fraction"] == 1.0 and metrics["train/trained_tokens"] == 0
    assert all(r.per_action["advantages"].abs().max() == 0 for r in rows)
    config.mask_truncated_completions = True
    try:
        metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=4, offset=13), step=0)
    finally:
        config.mask_truncated_completions = False
    assert [r.trained for r in rows] == [r.ended_with_eos for r in rows]
    assert metrics["train/dropped_rows"] == sum(not r.ended_with_eos for r in rows) > 0  # 6 tokens: most are cut


def test_a_bad_reward_names_the_function_and_row_or_is_skipped(grpo_run):
    tmp, run = grpo_run
    batches = prompt_batches(run, 2, n_rows=4, offset=0)
    firsts = [min(row["extra"]["id"] for row in batch["rows"]) for batch in batches]  # one per function call
    first = firsts[0]
    use_reward(run, tmp, "fails_on_first_id")
    with pytest.raises(RewardFunctionError) as raised:
        run.trainer.step(batches, step=0)
    message = str(raised.value)
    assert "fails_on_first_id" in message and f"prompts.jsonl:{first + 1}" in message and "\n" not in message
    use_reward(run, tmp, "raises")
    with pytest.raises(RewardFunctionError, match="raises.*KeyError.*no such column"):
        run.trainer.step(batches, step=0)
    use_reward(run, tmp, "fails_on_first_id", skip_bad=True)
    try:
        metrics, rows = run.trainer.step(batches, step=0)
    finally:
        run.trainer.config.skip_bad_rewards = False
    bad = [r for r in rows if r.prompt["extra"]["id"] in firsts]
    assert len(bad) == 4 and metrics["reward/skipped_rows"] == 4
    assert all(not r.trained for r in bad) and sum(r.trained for r in rows) == len(rows) - 4  # their groups
    assert metrics["ppo/skipped_non_finite"] == 0 and metrics["reward/score_mean"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--advantage_estimator", "rloo", "--n_samples_per_prompt", "1"], "needs --n_samples_per_prompt >= 2"),
        (["--advantage_estimator", "gae"], "trains a critic: give --critic_model_name_or_path"),
        (["--reward_weights", "1", "2"], "--reward_weights has 2 values for 1 rewards"),
        (["--reward_funcs", "no_such_builtin"], "no_such_builtin"),
        (["--per_device_training_batch_size", "3"], "--n_samples_per_prompt x"),
    ],
)
def test_rl_flag_errors_are_one_line(tiny_llama, tmp_path, flags, message):
    write_rows(tmp_path)
    with pytest.raises(UsageError) as raised:
        setup(parse_args(grpo_args(tiny_llama, tmp_path, *flags)))
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_gae_critic_from_a_causal_lm_only_when_asked(tiny_llama, tmp_path):
    """With a function reward, gae's critic may start from a plain causal LM (a fresh value head) only with
    --critic_fresh_value_head; without it such a directory is refused as it is as a reward model."""
    write_rows(tmp_path)
    flags = [
        "--advantage_estimator",
        "gae",
        "--n_samples_per_prompt",
        "1",
        "--critic_model_name_or_path",
        tiny_llama,
        "--actor_zero_stage",
        0,
        "--critic_zero_stage",
        0,
    ]
    with pytest.raises(Exception, match="value_head.safetensors"):
        parse_args(grpo_args(tiny_llama, tmp_path, *flags))
    run = setup(parse_args(grpo_args(tiny_llama, tmp_path, *flags, "--critic_fresh_value_head")))
    assert run.engines.critic is not None and run.engines.rewards == {}
    metrics, _ = run.trainer.step(prompt_batches(run, 4), step=0)
    assert "loss/critic" in metrics and metrics["reward/aligned_length_mean"] > 0


def test_a_reward_model_and_a_function_combined_and_no_reference_without_kl(tiny_llama, tiny_llama_reward, tmp_path):
    """--reward_funcs mixes a reward-model directory with a function (weighted, each logged); with --kl_ctl 0
    no reference model is built (the KL is 0, not measured against a copy)."""
    write_rows(tmp_path)
    run = setup(
        parse_args(
            grpo_args(
                tiny_llama,
                tmp_path,
                "--reward_funcs",
                tiny_llama_reward,
                f"{tmp_path / 'rewards.py'}:aligned_length",
                "--reward_weights",
                0.5,
                2,
                "--kl_ctl",
                0,
                "--actor_zero_stage",
                0,
                "--critic_zero_stage",
                0,
            )
        )
    )
    assert run.engines.ref is None and list(run.engines.rewards) == [tiny_llama_reward]
    metrics, rows = run.trainer.step(prompt_batches(run, 2), step=0)
    for r in rows:
        assert r.score == pytest.approx(0.5 * r.score_parts["reward_model"] + 2 * r.score_parts["aligned_length"])
    assert {"reward/reward_model_mean", "reward/aligned_length_mean"} <= set(metrics)
    assert metrics["kl/ref_mean"] == 0 and metrics["loss/kl"] == 0


def test_evaluation_on_its_own_prompt_file(tiny_llama, tmp_path):
    """--eval_data_path: the held-out prompts come from that file (all its rows), cut to --eval_num_prompts,
    in batches of a rollout's generate call (prompts x samples)."""
    write_rows(tmp_path)
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(
        "".join(
            json.dumps({"prompt": f"Human: #{100 + i} plot story ?\n\nAssistant:", "answer": "story", "id": 100 + i})
            + "\n"
            for i in range(7)
        )
    )
    run = setup(
        parse_args(
            grpo_args(
                tiny_llama,
                tmp_path,
                "--actor_zero_stage",
                0,
                "--eval_interval",
                1,
                "--eval_data_path",
                held_out,
                "--eval_num_prompts",
                6,
            )
        )
    )
    assert [len(b["rows"]) for b in run.eval_batches] == [4, 2]
    ids = [r["extra"]["id"] for b in run.eval_batches for r in b["rows"]]
    assert len(set(ids)) == 6 and set(ids) <= set(range(100, 107))  # the held-out file's rows, none of the train
    metrics = run.trainer.evaluate(run.eval_batches)
    assert metrics["eval/prompts"] == 6 and metrics["eval/reward/aligned_length_mean"] > 0


@pytest.mark.slow
def test_two_ranks_zero3_hybrid_no_critic_checkpoint_resume(tiny_gpt2, tmp_path):
    """2 ranks, ZeRO-3 + hybrid, RLOO at lr 0 on shuffled rows: every function call gets its rows' own
    fields (else it raises and the run fails), the log-ratio stays ~0, the checkpoint and the output hold
    no critic, --resume continues from it; the held-out evaluation runs at step 0, every 2 and at the end,
    with each component and the accuracy of math_exact (0 here: the answers are words)."""
    write_rows(tmp_path, 40)
    out = tmp_path / "out"
    args = grpo_args(
        tiny_gpt2,
        tmp_path,
        "--advantage_estimator",
        "rloo",
        "--actor_zero_stage",
        3,
        "--enable_hybrid_engine",
        "--actor_learning_rate",
        0,
        "--generation_batches",
        2,
        "--per_device_training_batch_size",
        4,
        "--save_interval",
        1,
        "--eval_interval",
        2,
        "--eval_num_prompts",
        4,
        "--max_steps",
        2,
    )
    args[args.index("--reward_funcs") + 1 : args.index("--reward_funcs") + 2] = [
        f"{tmp_path / 'rewards.py'}:aligned_length",
        "math_exact",
        "--reward_weights",
        "1",
        "0.5",
    ]
    proc = run_deepspeed("step3_ppo.main", args, log_path=str(tmp_path / "log1.txt"))
    assert os.path.exists(out / "actor" / "model.safetensors"), tail(proc)
    assert not os.path.exists(out / "critic") and not os.path.exists(out / "actor_ema")
    checkpoints = [p for p in out.rglob("*") if p.is_dir() and "critic" in p.name]
    assert checkpoints == []
    rows = metrics(str(out))
    assert [r["step"] for r in rows] == [0, 1, 2]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all(
        r["eval/prompts"] == 4 and r["eval/accuracy"] == 0 and r["eval/reward/aligned_length_mean"] > 0 for r in evals
    )
    for row in rows[1:]:
        assert row["ppo/log_ratio_max_abs"] <= 1e-4 and row["kl/ref_mean"] == pytest.approx(0.0, abs=1e-4), row
        assert "loss/critic" not in row and row["reward/aligned_length_mean"] > 0
    proc = run_deepspeed("step3_ppo.main", [*args[:-1], 3, "--resume"], log_path=str(tmp_path / "log2.txt"))
    assert proc.returncode == 0, tail(proc)
    assert "resumed from" in proc.stdout + proc.stderr
    assert [r["step"] for r in metrics(str(out))] == [0, 1, 2, 3]
