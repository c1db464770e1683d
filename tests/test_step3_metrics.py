"""The metrics of a step-3 iteration (step3_ppo/metrics.py): the names each configuration logs are pinned (a
renamed or lost metric fails here, not on a dashboard), and each family's arithmetic is checked by hand.
The names come from real in-process iterations (ZeRO-0, one rank, lr 0; slow: minutes on a loaded machine): PPO
with a critic, a group estimator with dynamic sampling, a multi-turn rollout."""

from types import SimpleNamespace

import pytest
import torch

from step3_ppo import metrics as m
from step3_ppo.main import parse_args, setup
from tests.test_agents import agent_setup
from tests.test_step3_grpo import grpo_args, write_rows
from tests.test_step3_lr0 import lr0_setup, prompt_batches
from utils.data import PromptCollator

# every iteration that trains logs these
ALWAYS = {
    "reward/score_mean",
    "reward/total_mean",
    "kl/ref_mean",
    "kl/coef",
    "gen/response_len_mean",
    "gen/eos_fraction",
    "ppo/log_ratio_max_abs",
    "ppo/skipped_non_finite",
    "train/overflow_skipped",
    "loss/actor",
    "loss/kl",
    "loss/ptx",
    "ppo/clipfrac",
    "ppo/approx_kl_old",
    "ppo/entropy",
    "time/generation_s",
    "time/experience_s",
    "time/train_s",
    "samples_per_s",
    # the training forwards' tokens and each phase's token rate and MFU (throughput_metrics)
    "tokens/real",
    "tokens/processed",
    "tokens/padding_fraction",
    "perf/generation_tokens_per_s",
    "perf/generation_mfu",
    "perf/experience_tokens_per_s",
    "perf/experience_mfu",
    "perf/training_tokens_per_s",
    "perf/training_mfu",
}
CRITIC = {"loss/critic", "value/clipfrac", "value/explained_variance"}
MISMATCH = {"rollout/logprob_diff_mean", "rollout/logprob_diff_max"}  # the generator's log-probs compared
CORRECTION = {"rollout/correction_weight_mean", "rollout/correction_masked_fraction"}
SELECTION = {"train/dropped_rows", "train/trained_tokens"}
DYNAMIC = {
    "dynamic/generated_groups",
    "dynamic/kept_groups",
    "dynamic/dropped_groups",
    "dynamic/missing_groups",
    "dynamic/rounds",
}
AGENT = {
    "rollout/turns_mean",
    "rollout/tool_calls_mean",
    "rollout/tool_errors_mean",
    "rollout/env_tokens_mean",
    "rollout/action_tokens_mean",
    "rollout/tool_call_rate",
    "rollout/tool_error_rate",
    "rollout/tool_errors",
    "rollout/tool_calls_dropped",
    "rollout/truncated",
    "rollout/env_failures",
    "time/env_s",
}


def iteration(run, batches, changes: dict, seed: int, **kwargs) -> set:
    for name, value in changes.items():
        setattr(run.trainer.config, name, value)
    torch.manual_seed(seed)
    metrics, _ = run.trainer.step(batches, step=seed, **kwargs)
    return set(metrics)


@pytest.mark.slow
def test_ppo_with_a_critic_logs_its_names(tiny_gpt2, tiny_gpt2_reward, tmp_path):
    run = lr0_setup(tiny_gpt2, tiny_gpt2_reward, tmp_path)
    plain = ALWAYS | CRITIC | MISMATCH | {"reward/reward_model_mean"}
    assert iteration(run, prompt_batches(run, 2), {}, 0) == plain
    shaped = {
        "overlong_buffer_len": 4,
        "truncation_penalty": 0.5,
        "skip_bad_rewards": True,
        "rollout_correction": "tis",
    }
    assert iteration(run, prompt_batches(run, 2, offset=1), shaped, 1) == plain | CORRECTION | SELECTION | {
        "reward/length_penalty_mean",
        "reward/skipped_rows",
    }
    # the generator's log-probs as the old ones: nothing to compare them with
    assert iteration(
        run, prompt_batches(run, 2, offset=2), {"rollout_correction": "none", "old_logprobs": "rollout"}, 2
    ) == (plain - MISMATCH) | SELECTION | {"reward/length_penalty_mean", "reward/skipped_rows"}


@pytest.mark.slow
def test_a_group_estimator_with_dynamic_sampling_logs_its_names(tiny_llama, tmp_path):
    write_rows(tmp_path)
    run = setup(parse_args(grpo_args(tiny_llama, tmp_path, "--actor_zero_stage", 0, "--actor_learning_rate", 0)))
    more = iter(run.loader)
    names = iteration(
        run,
        prompt_batches(run, 2),
        {"dynamic_sampling": True, "max_sampling_rounds": 2},
        0,
        more_prompts=lambda: next(more, None),
    )
    assert names == ALWAYS | MISMATCH | SELECTION | DYNAMIC | {
        "reward/aligned_length_mean",
        "reward/zero_variance_group_fraction",
    }


@pytest.mark.slow
def test_a_multi_turn_rollout_logs_its_names(tiny_chat_llama, tiny_chat_llama_reward, tmp_path):
    run = agent_setup(tiny_chat_llama, tiny_chat_llama_reward, tmp_path)
    examples, collate = list(run.loader.dataset), PromptCollator(run.tokenizer.pad_token_id)
    names = iteration(run, [collate(examples[0:2]), collate(examples[2:4])], {}, 0)
    assert names == ALWAYS | CRITIC | MISMATCH | AGENT | {"reward/math_exact_mean", "reward/env_mean"}


# ---------------------------------------------------------------------------- each family's arithmetic
def config(**changes):
    fields = {
        "overlong_buffer_len": 0,
        "truncation_penalty": 0.0,
        "skip_bad_rewards": False,
        "n_samples_per_prompt": 1,
        "mask_truncated_completions": False,
        "filter_zero_variance_groups": False,
        "dynamic_sampling": False,
    }
    return SimpleNamespace(**{**fields, **changes})


def test_component_sums_skip_the_nan_scores():
    rows = [
        SimpleNamespace(score_parts={"a": 1.0, "b": float("nan")}),
        SimpleNamespace(score_parts={"a": 2.5, "b": 4.0}),
    ]
    assert m.component_sums(rows, ["a", "b"]) == {
        "part/a_sum": 3.5,
        "part/a_count": 2,
        "part/b_sum": 4.0,
        "part/b_count": 1,
    }


def test_a_loss_is_its_optimizer_steps_mean_and_other_figures_the_minibatches_mean():
    stats = [
        {"loss/actor": 0.5, "ppo/clipfrac": 0.1},
        {"loss/actor": 0.25, "ppo/clipfrac": 0.3},
        {"loss/actor": 1.0, "ppo/clipfrac": 0.2},
    ]
    # 3 mini-batches in 2 optimizer steps: each mini-batch's loss is its part of its step's
    assert m.minibatch_sums(stats, 2) == {"loss/actor_sum": 0.875, "ppo/clipfrac_sum": pytest.approx(0.2)}


def test_local_sums_count_rows_lengths_and_trained_tokens():
    rows = [
        SimpleNamespace(response_ids=torch.zeros(3), ended_with_eos=True, action_count=3, trained=True),
        SimpleNamespace(response_ids=torch.zeros(5), ended_with_eos=False, action_count=5, trained=False),
    ]
    experience = {"kl_seq_sum": 1.5, "explained_variance": 0.25, "logprob_diff_max": 0.5, "bad_rows": 0}
    local = m.local_sums(rows, experience, {"kept_groups": 1, "rounds": 2}, [{"loss/actor": 0.5}], 1, agent=False)
    assert local == {
        "rows": 2,
        "kl_seq_sum": 1.5,
        "bad_rows": 0,
        "dynamic/kept_groups": 1,
        "response_len_sum": 8,
        "eos_sum": 1,
        "explained_variance_sum": 0.25,
        "trained_tokens": 3,
        "loss/actor_sum": 0.5,
    }


def test_reward_means_and_what_the_config_turns_on():
    totals = {
        "rows": 4,
        "score_sum": 3.0,
        "scored_rows": 3,
        "total_reward_sum": 2.0,
        "part/acc_sum": 1.0,
        "part/acc_count": 0,
        "length_penalty_sum": -1.0,
        "bad_rows": 1,
        "zero_variance_rows": 2,
    }
    assert m.reward_metrics(totals, ["acc"], config()) == {
        "reward/score_mean": 1.0,
        "reward/total_mean": 0.5,
        "reward/acc_mean": 1.0,
    }  # no count: divided by 1
    shaped = m.reward_metrics(totals, [], config(truncation_penalty=0.5, skip_bad_rewards=True, n_samples_per_prompt=2))
    assert shaped["reward/length_penalty_mean"] == -0.25 and shaped["reward/skipped_rows"] == 1
    assert shaped["reward/zero_variance_group_fraction"] == 0.5
    assert m.reward_metrics({**totals, "scored_rows": 0}, [], config())["reward/score_mean"] == 3.0


def test_kl_lengths_value_and_selection():
    totals = {
        "rows": 4,
        "kl_seq_sum": 2.0,
        "response_len_sum": 10,
        "eos_sum": 3,
        "explained_variance_sum": 0.5,
        "dropped_rows": 1,
        "trained_tokens": 7,
    }
    assert m.kl_metrics(totals, 0.1) == {"kl/ref_mean": 0.5, "kl/coef": 0.1}
    assert m.length_metrics(totals) == {"gen/response_len_mean": 2.5, "gen/eos_fraction": 0.75}
    assert m.value_metrics(totals, 2, critic=True) == {"value/explained_variance": 0.25}
    assert m.value_metrics(totals, 2, critic=False) == {}
    assert m.selection_metrics(totals, config()) == {}
    assert m.selection_metrics(totals, config(filter_zero_variance_groups=True)) == {
        "train/dropped_rows": 1,
        "train/trained_tokens": 7,
    }


def test_policy_losses_are_summed_over_ranks_and_other_figures_averaged():
    totals = {"loss/actor_sum": 0.6, "ppo/clipfrac_sum": 0.4, "ppo/log_ratio_max_abs_sum": 9.0}
    assert m.policy_metrics(totals, ["loss/actor", "ppo/clipfrac", "ppo/log_ratio_max_abs"], 1e-5, 2, ranks=2) == {
        "ppo/log_ratio_max_abs": 1e-5,
        "ppo/skipped_non_finite": 0.0,
        "train/overflow_skipped": 2.0,
        "loss/actor": 0.6,
        "ppo/clipfrac": 0.2,
    }


def test_dynamic_sampling_counts_the_dropped_groups():
    totals = {"dynamic/generated_groups": 6, "dynamic/kept_groups": 4, "dynamic/missing_groups": 0}
    assert m.dynamic_metrics(totals, {"rounds": 3}) == {
        "dynamic/generated_groups": 6,
        "dynamic/kept_groups": 4,
        "dynamic/dropped_groups": 2,
        "dynamic/missing_groups": 0,
        "dynamic/rounds": 3,
    }
    assert m.dynamic_metrics(totals, {}) == {}


def test_rollout_mismatch_and_correction():
    totals = {
        "logprob_diff_sum": 0.3,
        "logprob_diff_count": 6,
        "rollout_weight_sum": 3.0,
        "rollout_masked_sum": 1,
        "rollout_weight_count": 4,
    }
    assert m.rollout_metrics(totals, 0.2, "tis") == {
        "rollout/logprob_diff_mean": pytest.approx(0.05),
        "rollout/logprob_diff_max": 0.2,
        "rollout/correction_weight_mean": 0.75,
        "rollout/correction_masked_fraction": 0.25,
    }
    assert m.rollout_metrics({}, 0.0, "none") == {}


def test_agent_means_rates_and_counts():
    totals = {
        "rows": 4,
        "agent/rows_sum": 4,
        "agent/turns_sum": 6,
        "agent/tool_calls_sum": 4,
        "agent/calling_sum": 2,
        "agent/tool_errors_sum": 1,
        "agent/tool_calls_dropped_sum": 0,
        "agent/env_tokens_sum": 20,
        "agent/action_tokens_sum": 12,
        "agent/truncated_sum": 1,
        "agent/env_failures_sum": 0,
    }
    assert m.agent_metrics(totals, agent=True) == {
        "rollout/turns_mean": 1.5,
        "rollout/tool_calls_mean": 1.0,
        "rollout/tool_errors_mean": 0.25,
        "rollout/env_tokens_mean": 5.0,
        "rollout/action_tokens_mean": 3.0,
        "rollout/tool_call_rate": 0.5,
        "rollout/tool_error_rate": 0.25,
        "rollout/tool_errors": 1,
        "rollout/tool_calls_dropped": 0,
        "rollout/truncated": 1,
        "rollout/env_failures": 0,
    }
    assert m.agent_metrics(totals, agent=False) == {}


def test_timings_and_throughput_with_the_environment_apart():
    assert m.timing_metrics(8, 2.0, 1.0, 1.0) == {
        "time/generation_s": 2.0,
        "time/experience_s": 1.0,
        "time/train_s": 1.0,
        "samples_per_s": 2.0,
    }
    timed = m.timing_metrics(8, 2.0, 1.0, 1.0, env_s=0.5)  # the environment's seconds were inside generation's
    assert timed["time/generation_s"] == 1.5 and timed["time/env_s"] == 0.5 and timed["samples_per_s"] == 2.0
    assert m.skipped_metrics(2.0, 1.0) == {
        "ppo/skipped_non_finite": 1.0,
        "time/generation_s": 2.0,
        "time/experience_s": 1.0,
    }


def test_throughput_sums_and_rates_by_hand():
    rows = [
        SimpleNamespace(prompt_ids=torch.zeros(4), response_ids=torch.zeros(3)),
        SimpleNamespace(prompt_ids=torch.zeros(2), response_ids=torch.zeros(5)),
    ]
    assert m.throughput_sums(rows, (28, 32), 1e3) == {
        "tokens/sequence_sum": 14,
        "tokens/real_sum": 28,
        "tokens/processed_sum": 32,
        "perf/peak_flops_sum": 1e3,
    }
    totals = {"tokens/sequence_sum": 14, "tokens/real_sum": 28, "tokens/processed_sum": 32, "perf/peak_flops_sum": 2e3}
    seconds = {"generation": 0.5, "experience": 0.25, "training": 2.0}
    flops = {"generation": 20, "experience": 60, "training": 60}  # 2 x 10 params; 2 x 30 scored; 6 x 10 trained
    assert m.throughput_metrics(totals, seconds, flops) == {
        "tokens/real": 28,
        "tokens/processed": 32,
        "tokens/padding_fraction": 0.125,
        "perf/generation_tokens_per_s": 28.0,
        "perf/generation_mfu": pytest.approx(14 * 20 / (0.5 * 2e3)),
        "perf/experience_tokens_per_s": 56.0,
        "perf/experience_mfu": pytest.approx(14 * 60 / (0.25 * 2e3)),
        "perf/training_tokens_per_s": 14.0,
        "perf/training_mfu": pytest.approx(28 * 60 / (2.0 * 2e3)),
    }
