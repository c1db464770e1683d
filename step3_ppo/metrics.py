"""The metrics one RL iteration logs (PPOTrainer.step), one function per family, each returning its names.

Each rank first sums what it saw (`local_sums`); `all_ranks` adds those sums over the ranks in one collective
(and takes a few maxima in another), and every family then divides totals of all ranks, so each metric is the
same on every rank. A family whose feature is off returns {}: its names are not logged at all.
"""

from __future__ import annotations

from step3_ppo.agents.loop import agent_rates, agent_sums
from utils.math.rows import Row
from utils.math.throughput import phase_rate_metrics, token_metrics
from utils.runtime.distributed import all_reduce_max_list, all_reduce_sum

# the loss figures logged as their optimizer steps' mean (each mini-batch logs its part of its step's loss)
STEP_LOSSES = ("loss/actor", "loss/kl", "loss/critic", "loss/distill")
# the experience figures that are not sums over rows (the critic's fit; a maximum, reduced apart)
NOT_SUMMED = ("explained_variance", "logprob_diff_max")


def component_sums(rows: list[Row], names: list[str]) -> dict:
    """Per reward component: the sum of its finite scores and how many there are (for its mean)."""
    out = {}
    for name in names:
        values = [v for v in (r.score_parts[name] for r in rows) if v == v]  # NaN: skipped
        out[f"part/{name}_sum"], out[f"part/{name}_count"] = sum(values), len(values)
    return out


def minibatch_sums(train_stats: list[dict], optimizer_steps: int) -> dict:
    """A loss as its optimizer steps' mean (each mini-batch holds its part of its step's loss, then summed over
    ranks); every other mini-batch figure as the mini-batches' mean (then averaged over ranks)."""
    return {
        k + "_sum": sum(s[k] for s in train_stats) / (optimizer_steps if k in STEP_LOSSES else len(train_stats))
        for k in train_stats[0]
    }


def local_sums(
    rows: list[Row], experience: dict, sampling: dict, train_stats: list[dict], optimizer_steps: int, agent: bool
) -> dict:
    """This rank's sums: its rows, the experience's sums (PPOTrainer.compute_advantages), the dynamic sampling's
    group counts, lengths, trained tokens, the multi-turn counters (with an `agent`) and the mini-batches' figures."""
    return {
        "rows": len(rows),
        **{k: v for k, v in experience.items() if k not in NOT_SUMMED},
        **{f"dynamic/{k}": v for k, v in sampling.items() if k != "rounds"},
        "response_len_sum": sum(r.response_ids.numel() for r in rows),
        "eos_sum": sum(r.ended_with_eos for r in rows),
        "explained_variance_sum": experience["explained_variance"],
        "trained_tokens": sum(r.action_count for r in rows if r.trained),
        **(agent_sums(rows) if agent else {}),
        **minibatch_sums(train_stats, optimizer_steps),
    }


def all_ranks(local: dict, maxima: list[float]) -> tuple[dict, list[float]]:
    """`local`'s sums over all ranks (one collective) and each of `maxima` at its largest over all ranks."""
    keys = list(local)
    return dict(zip(keys, all_reduce_sum([local[k] for k in keys]))), all_reduce_max_list(maxima)


def reward_metrics(totals: dict, components: list[str], config) -> dict:
    """The mean raw score (skipped scores left out), the mean reward with its KL penalty (per row, summed over
    its actions), each component's mean; the length penalty, skipped rows and zero-variance groups when the
    config makes them."""
    c, n = config, totals["rows"]
    out = {
        "reward/score_mean": totals["score_sum"] / max(totals["scored_rows"], 1),
        "reward/total_mean": totals["total_reward_sum"] / n,
        **{
            f"reward/{name}_mean": totals[f"part/{name}_sum"] / max(totals[f"part/{name}_count"], 1)
            for name in components
        },
    }
    if c.overlong_buffer_len or c.truncation_penalty:
        out["reward/length_penalty_mean"] = totals["length_penalty_sum"] / n
    if c.skip_bad_rewards:
        out["reward/skipped_rows"] = totals["bad_rows"]
    if c.n_samples_per_prompt > 1:
        out["reward/zero_variance_group_fraction"] = totals["zero_variance_rows"] / n
    return out


def kl_metrics(totals: dict, coef: float) -> dict:
    """KL(actor || reference) per row (summed over its actions) and the coefficient it was charged with."""
    return {"kl/ref_mean": totals["kl_seq_sum"] / totals["rows"], "kl/coef": coef}


def length_metrics(totals: dict) -> dict:
    """The mean answer length in tokens and the share of answers that ended with a stop token."""
    return {
        "gen/response_len_mean": totals["response_len_sum"] / totals["rows"],
        "gen/eos_fraction": totals["eos_sum"] / totals["rows"],
    }


def policy_metrics(totals: dict, stat_names, log_ratio_max: float, overflow_skipped: int, ranks: int) -> dict:
    """The mini-batches' figures (`stat_names`, PPOTrainer.train_minibatch's: losses, clip fractions, entropy):
    a loss its optimizer steps' mean, every other figure averaged over ranks; |log ratio| at its largest on any
    rank; the updates the fp16 loss scaler skipped (the same on every rank)."""
    return {
        "ppo/log_ratio_max_abs": log_ratio_max,
        "ppo/skipped_non_finite": 0.0,
        "train/overflow_skipped": float(overflow_skipped),
        **{
            k: totals[k + "_sum"] / (1 if k in STEP_LOSSES else ranks)
            for k in stat_names
            if k != "ppo/log_ratio_max_abs"
        },
    }


def value_metrics(totals: dict, ranks: int, critic: bool) -> dict:
    """With a critic: how much of the returns' variance its values explain, averaged over ranks."""
    return {"value/explained_variance": totals["explained_variance_sum"] / ranks} if critic else {}


def selection_metrics(totals: dict, config) -> dict:
    """When rows can be left out of the loss (skipped rewards, truncated answers, groups without signal): how many
    were, and the tokens trained on."""
    c = config
    if not (c.skip_bad_rewards or c.mask_truncated_completions or c.filter_zero_variance_groups or c.dynamic_sampling):
        return {}
    return {"train/dropped_rows": totals["dropped_rows"], "train/trained_tokens": totals["trained_tokens"]}


def dynamic_metrics(totals: dict, sampling: dict) -> dict:
    """Dynamic sampling's groups over all ranks (generated, kept with signal, dropped, missing) and its rounds (the
    same on every rank); {} without it."""
    if not sampling:
        return {}
    generated, kept = totals["dynamic/generated_groups"], totals["dynamic/kept_groups"]
    return {
        "dynamic/generated_groups": generated,
        "dynamic/kept_groups": kept,
        "dynamic/dropped_groups": generated - kept,
        "dynamic/missing_groups": totals["dynamic/missing_groups"],
        "dynamic/rounds": sampling["rounds"],
    }


def rollout_metrics(totals: dict, logprob_diff_max: float, correction: str) -> dict:
    """The generator's log-probs against the trainer's, when compared (mean and largest |difference| per action),
    and --rollout_correction's mean weight and masked share over the trained actions."""
    out = {}
    if "logprob_diff_count" in totals:
        out["rollout/logprob_diff_mean"] = totals["logprob_diff_sum"] / max(totals["logprob_diff_count"], 1)
        out["rollout/logprob_diff_max"] = logprob_diff_max
    if correction != "none":
        trained = max(totals["rollout_weight_count"], 1)
        out["rollout/correction_weight_mean"] = totals["rollout_weight_sum"] / trained
        out["rollout/correction_masked_fraction"] = totals["rollout_masked_sum"] / trained
    return out


def staleness_metrics(totals: dict, largest: float, smallest: float, max_staleness: int) -> dict:
    """With --max_staleness: how many optimizer steps old the weights that generated the rows were, over the
    rows (their least, mean and most)."""
    if not max_staleness:
        return {}
    return {
        "rollout/staleness_min": smallest,
        "rollout/staleness_mean": totals["staleness_sum"] / max(totals["staleness_rows"], 1),
        "rollout/staleness_max": largest,
    }


def agent_metrics(totals: dict, agent: bool) -> dict:
    """Multi-turn rollouts: per trajectory the turns, tool calls, errors and tokens; the rates of calling a tool
    and of a call failing; the counts of tool errors, of calls past --max_tool_calls_per_turn (not run), truncated
    trajectories and failed environments."""
    if not agent:
        return {}
    n = totals["rows"]
    return {
        **{
            f"rollout/{name}_mean": totals[f"agent/{name}_sum"] / n
            for name in ("turns", "tool_calls", "tool_errors", "env_tokens", "action_tokens")
        },
        **agent_rates(totals, "rollout/"),
        **{
            f"rollout/{name}": totals[f"agent/{name}_sum"]
            for name in ("tool_errors", "tool_calls_dropped", "truncated", "env_failures")
        },
    }


def timing_metrics(
    rows_total: float, generation_s: float, experience_s: float, train_s: float, env_s: float | None = None
) -> dict:
    """Each phase's seconds and the rows per second of the whole iteration; with a multi-turn rollout (`env_s`)
    the environment's and tools' seconds apart from generation's."""
    out = {
        "time/generation_s": generation_s,
        "time/experience_s": experience_s,
        "time/train_s": train_s,
        "samples_per_s": rows_total / (generation_s + experience_s + train_s),
    }
    if env_s is not None:
        out.update({"time/env_s": env_s, "time/generation_s": generation_s - env_s})
    return out


def throughput_sums(rows: list[Row], trained_tokens: tuple[int, int], peak_flops: float) -> dict:
    """This rank's sequence tokens (each row's prompt + answer, what generation and the experience forwards
    processed), the training forwards' real and processed tokens (PPOTrainer.train_epochs: every mini-batch of
    every PPO epoch, padded to its longest row) and its device's peak FLOP/s."""
    return {
        "tokens/sequence_sum": sum(r.prompt_ids.numel() + r.response_ids.numel() for r in rows),
        "tokens/real_sum": trained_tokens[0],
        "tokens/processed_sum": trained_tokens[1],
        "perf/peak_flops_sum": peak_flops,
    }


def throughput_metrics(totals: dict, seconds: dict, flops_per_token: dict) -> dict:
    """The training forwards' tokens over all ranks (`tokens/real`, `tokens/processed`, `tokens/padding_fraction`)
    and per phase the real tokens per second and MFU (`perf/<phase>_tokens_per_s`, `perf/<phase>_mfu`): all ranks'
    tokens and model FLOPs (`flops_per_token[phase]`) over the slowest rank's `seconds[phase]` (generation's without
    the environment's), against all ranks' peak FLOP/s. Generation and experience count the rows' sequence tokens."""
    peak, sequence, real = totals["perf/peak_flops_sum"], totals["tokens/sequence_sum"], totals["tokens/real_sum"]
    out = token_metrics(real, totals["tokens/processed_sum"])
    for phase, tokens in (("generation", sequence), ("experience", sequence), ("training", real)):
        out.update(phase_rate_metrics(phase, tokens, tokens * flops_per_token[phase], seconds[phase], peak))
    return out


def skipped_metrics(generation_s: float, experience_s: float) -> dict:
    """An iteration skipped for a non-finite reward (no update): the flag and the seconds it took."""
    return {"ppo/skipped_non_finite": 1.0, "time/generation_s": generation_s, "time/experience_s": experience_s}
