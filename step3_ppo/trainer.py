"""One RL iteration: rollout -> experience (no-grad forwards) -> PPO epochs over mini-batches.

The math lives in utils/ops.py, utils/losses.py, step3_ppo/shaping.py (per-token rewards, KL
coefficient) and step3_ppo/advantages.py (estimators by name); rows and their packing in
utils/rollout.py; every forward in utils/forward.py; the actor's generation mode in
step3_ppo/hybrid.py; sequence rewards behind step3_ppo/rewards.py. Two KL terms appear here and
are never confused:
- the KL PENALTY: KL(actor || frozen SFT reference), per token, inside the reward
  (`compute_rewards`, coefficient `kl_ctl.value`, fixed or adaptive), or, with `kl_in_loss`,
  as a separate loss term instead;
- the PPO CLIP: the ratio of the current actor to the OLD (rollout-time) actor, clipped in
  the `--policy_loss` (utils.losses.POLICY_LOSSES). Its log is `ppo/log_ratio_max_abs`, exactly 0 in
  theory at learning rate 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, fields

import torch

from step3_ppo.advantages import advantages_and_returns, combine, get_estimator, zero_variance_groups
from step3_ppo.hybrid import gathered
from step3_ppo.rollout_engines import ROLLOUT_ENGINES
from step3_ppo.shaping import RunningMoments, clip_scores, compute_rewards, length_penalty
from utils import accelerator, losses
from utils.distributed import all_reduce_max, all_reduce_sum, world_size
from utils.forward import (GenerationSettings, eval_mode, lm_nll, model_device, to_device,
                           token_logprobs, token_values)
from utils.ops import explained_variance, masked_mean, masked_whiten, select
from utils.rollout import Row, from_token_layout, pack, split_generation, to_token_layout
from utils.training import OVERFLOW, backward_and_step


def component_sums(rows: list[Row], names: list[str]) -> dict:
    """Per reward component: the sum of its finite scores and how many there are (for its mean)."""
    out = {}
    for name in names:
        values = [v for v in (r.score_parts[name] for r in rows) if v == v]  # NaN: skipped
        out[f"part/{name}_sum"], out[f"part/{name}_count"] = sum(values), len(values)
    return out


@dataclass
class PPOConfig:
    """Every RL hyper-parameter; each field is the flag of the same name in step3_ppo/main.py."""
    stop_token_ids: tuple  # EOS, and for chat prompts the template's end-of-turn token: a response ends at the first
    pad_token_id: int
    max_answer_seq_len: int = 64
    min_answer_seq_len: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    per_device_training_batch_size: int = 4  # PPO mini-batch size
    ppo_epochs: int = 1
    n_samples_per_prompt: int = 1  # answers sampled per prompt; they form a group (group baselines, RLOO)
    advantage_estimator: str = "gae"
    policy_loss: str = "ppo"  # an entry of utils.losses.POLICY_LOSSES
    cliprange_low: float | None = None  # None: the policy loss's default (--cliprange; gspo: the paper's)
    cliprange_high: float | None = None
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    rollout_engine: str = "hf"  # an entry of step3_ppo.rollout_engines.ROLLOUT_ENGINES
    loss_agg: str | None = None  # None: the policy loss's default, else the estimator's
    reward_weights: tuple | None = None  # one per reward component; None: 1 each
    reward_norm: str = "sum_then_normalize"  # step3_ppo.advantages.REWARD_NORMS
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    truncation_penalty: float = 0.0
    mask_truncated_completions: bool = False
    filter_zero_variance_groups: bool = False
    skip_bad_rewards: bool = False
    kl_estimator: str = "k1"
    clip_reward_value: float | None = 5.0
    normalize_reward: bool = False
    kl_in_loss: bool = False
    kl_loss_estimator: str = "k2"  # utils.losses.KL_LOSS_ESTIMATORS
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    unsup_coef: float = 27.8
    enable_hybrid_engine: bool = False
    merge_lora_for_generation: bool = True
    gathered_experience: bool = True  # with the hybrid engine: score the rollout on models gathered whole
    release_inference_cache: bool = False  # hand the allocator's cached blocks back after generation
    seed: int = 1234

    @classmethod
    def from_args(cls, args, **overrides) -> "PPOConfig":
        """The config of parsed arguments: each field read from the flag of the same name."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    @property
    def generation(self) -> GenerationSettings:
        return GenerationSettings(max_new_tokens=self.max_answer_seq_len, min_new_tokens=self.min_answer_seq_len,
                                  do_sample=self.do_sample, temperature=self.temperature, top_p=self.top_p,
                                  top_k=self.top_k)


class PPOTrainer:
    """Runs RL iterations over the engines: actor, reference (when a KL term needs one), critic (when the
    estimator needs one) and the reward components (reward models and/or functions, step3_ppo/rewards.py).

    `logprobs_fn(model, packed_batch, temperature, return_entropy=False, entropy_grad=False)` is the policy
    forward (utils.forward.token_logprobs); a benchmark can pass a variant without patching.
    """

    def __init__(self, engines, config: PPOConfig, kl_ctl, rewards, unsup_batches=None, logprobs_fn=token_logprobs):
        self.config = config
        self.estimator = get_estimator(config.advantage_estimator)
        self.policy_loss = losses.POLICY_LOSSES[config.policy_loss]
        self.loss_agg = config.loss_agg or self.policy_loss.loss_agg or self.estimator.loss_agg
        self.actor, self.ref = engines.actor, engines.ref
        self.rollout = ROLLOUT_ENGINES[config.rollout_engine].build(self.actor, config)
        self.critic = engines.critic if self.estimator.needs_critic else None
        self.ema = getattr(engines, "ema", None)
        self.rewards = list(rewards)
        self.kl_ctl = kl_ctl
        self.reward_moments = RunningMoments()
        self.unsup_batches = unsup_batches
        self.logprobs_fn = logprobs_fn
        self.guard = None  # BadStepGuard: skips updates with a non-finite reward or loss (set by main)
        self.memory = accelerator.PhaseMemory()  # peak memory of generation / experience / training
        self.overflow_skipped = 0  # updates of this iteration the fp16 loss scaler skipped

    def finite(self, *values) -> bool:
        return self.guard is None or self.guard.all_finite(*values)

    # ------------------------------------------------------------------ rollout + experience
    def generate_rows(self, prompt_batch: dict, first_group: int = 0, settings: GenerationSettings | None = None,
                      n: int | None = None) -> list[Row]:
        """`n_samples_per_prompt` answers to each prompt of the batch, generated together (a group never
        straddles generation batches); group ids count from `first_group`, each row keeps its prompt row.
        `settings` / `n` replace the rollout's (evaluation: greedy, one answer)."""
        c = self.config
        n = c.n_samples_per_prompt if n is None else n
        ids, mask = prompt_batch["input_ids"], prompt_batch["attention_mask"]
        sequences = self.rollout.generate(ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0),
                                          settings or c.generation)
        rows = split_generation(sequences, ids, mask, c.stop_token_ids, samples_per_prompt=n)
        prompt_rows = prompt_batch.get("rows") or [{} for _ in range(ids.shape[0])]
        for i, row in enumerate(rows):
            row.group, row.prompt = first_group + i // n, prompt_rows[i // n]
        return rows

    def inference_weights(self, engine):
        """With the hybrid engine, a no-grad phase holds the whole model gathered once (hybrid.gathered).

        One model at a time, as large as the actor in generation mode; `gathered_experience=False`
        keeps the per-layer hooks for models bigger than that.
        """
        if engine is not None and self.config.enable_hybrid_engine and self.config.gathered_experience:
            return gathered(engine)
        return contextlib.nullcontext()

    @torch.no_grad()
    def store_logprobs(self, rows: list[Row], engine, name: str) -> None:
        """One no-grad forward of a causal LM on the packed rows; per-action log-probs stored as `name`."""
        batch = pack(rows, self.config.pad_token_id)
        with eval_mode(engine):
            logprobs = self.logprobs_fn(engine, batch, self.config.generation.logprob_temperature)
        from_token_layout(rows, name, logprobs, batch["prompt_len"])

    @torch.no_grad()
    def store_values(self, rows: list[Row]) -> None:
        batch = pack(rows, self.config.pad_token_id)
        with eval_mode(self.critic):
            values = token_values(self.critic, batch["input_ids"], batch["attention_mask"])
        from_token_layout(rows, "old_values", values, batch["prompt_len"])

    def score_rewards(self, rows_per_batch: list[list[Row]]) -> None:
        """Every reward component on every batch (each engine gathered once for all of them), then each
        row's score: the weighted sum of its components (NaN if one was skipped)."""
        for component in self.rewards:
            with self.inference_weights(component.engine):
                for rows in rows_per_batch:
                    for row, score in zip(rows, component(rows).tolist()):
                        row.score_parts[component.name] = score
        for rows in rows_per_batch:
            parts = {c.name: torch.tensor([r.score_parts[c.name] for r in rows], dtype=torch.float32)
                     for c in self.rewards}
            for row, score in zip(rows, combine(parts, self.config.reward_weights).tolist()):
                row.score = score

    def make_experience(self, prompt_batches: list[dict]) -> tuple[list[Row], float, float]:
        """Rollout, then the no-grad forwards; returns the rows and the generation/experience seconds.

        The actor's old log-probs are computed while its weights are still gathered for generation
        (hybrid), on the unmerged weights training uses; each other engine is gathered once for
        all prompt batches.
        """
        rows_per_batch, generation_s, experience_s = [], 0.0, 0.0
        memory, n = self.memory, self.config.n_samples_per_prompt
        with self.inference_weights(self.actor):
            for prompt_batch in prompt_batches:
                t0 = time.time()
                with memory.phase("generation"):
                    rows = self.generate_rows(prompt_batch, first_group=sum(map(len, rows_per_batch)) // n)
                t1 = time.time()
                with memory.phase("experience"):
                    self.store_logprobs(rows, self.actor, "old_logprobs")
                generation_s, experience_s = generation_s + t1 - t0, experience_s + time.time() - t1
                rows_per_batch.append(rows)
        if self.config.release_inference_cache:
            accelerator.empty_cache()  # the KV caches and the gathered actor's blocks, before the other models
        t0 = time.time()
        phases = []
        if self.ref is not None:
            phases.append((self.ref, lambda rows: self.store_logprobs(rows, self.ref, "ref_logprobs")))
        if self.critic is not None:
            phases.append((self.critic, self.store_values))
        with memory.phase("experience"):
            for engine, store in phases:
                with self.inference_weights(engine):
                    for rows in rows_per_batch:
                        store(rows)
            self.score_rewards(rows_per_batch)
        if self.ref is None:  # no KL term: the reference would be the old policy's copy, KL 0
            for row in (row for rows in rows_per_batch for row in rows):
                row.per_action["ref_logprobs"] = row.per_action["old_logprobs"]
        if self.config.release_inference_cache:
            accelerator.empty_cache()  # the gathered models' blocks, before training's
        experience_s += time.time() - t0
        return [row for rows in rows_per_batch for row in rows], generation_s, experience_s

    def select_trained(self, rows: list[Row], scores: torch.Tensor, groups: torch.Tensor) -> dict:
        """Mark the rows the loss leaves out (`Row.trained`), and count them:
        - a skipped (NaN) score (`--skip_bad_rewards`): the whole group, whose baseline it would bias;
        - `--mask_truncated_completions`: an answer cut at the length limit (TRL's);
        - `--filter_zero_variance_groups`: a group whose rewards are all equal (DAPO's dynamic sampling).
        NaN scores become 0 so the arithmetic stays finite (those rows are not trained on)."""
        c = self.config
        bad = torch.isnan(scores)
        bad_groups = torch.isin(groups, groups[bad])
        scores = torch.where(bad, torch.zeros_like(scores), scores)
        truncated = torch.tensor([not r.ended_with_eos for r in rows])
        flat = zero_variance_groups(scores, groups) & ~bad_groups
        drop = bad_groups | (truncated if c.mask_truncated_completions else torch.zeros_like(bad))
        drop = drop | (flat if c.filter_zero_variance_groups else torch.zeros_like(bad))
        for row, dropped in zip(rows, drop.tolist()):
            row.trained = not dropped
        return {"scores": scores, "bad_rows": int(bad.sum()), "dropped_rows": int(drop.sum()),
                "zero_variance_rows": int(flat.sum())}

    def compute_advantages(self, rows: list[Row]) -> dict:
        """Sequence rewards (components, length penalty, normalisation, clip, the estimator's group
        baseline) on the last action, the KL penalty per action, advantages, whitening over the rollout."""
        c = self.config
        lengths = torch.tensor([r.response_ids.numel() for r in rows])
        ended = torch.tensor([r.ended_with_eos for r in rows])
        penalty = length_penalty(lengths, ended, c.max_answer_seq_len, c.overlong_buffer_len,
                                 c.overlong_penalty_factor, c.truncation_penalty)
        raw_scores = torch.tensor([r.score for r in rows], dtype=torch.float32)
        groups = torch.tensor([r.group for r in rows])
        scores = raw_scores
        if c.reward_norm != "sum_then_normalize":  # each component normalised in its group before the sum
            parts = {comp.name: torch.tensor([r.score_parts[comp.name] for r in rows], dtype=torch.float32)
                     for comp in self.rewards}
            scores = combine(parts, c.reward_weights, groups, c.reward_norm)
        selected = self.select_trained(rows, scores + penalty, groups)
        batch = pack(rows, c.pad_token_id)
        action_mask, loss_mask = batch["action_mask"], batch["loss_mask"]
        p, length = batch["prompt_len"], batch["input_ids"].shape[1]
        names = ("old_logprobs", "ref_logprobs") + (("old_values",) if self.critic is not None else ())
        layout = {name: to_token_layout(rows, name, p, length) for name in names}
        values = layout.get("old_values", torch.zeros_like(action_mask))
        scores = selected["scores"]
        if c.normalize_reward:
            self.reward_moments.update(scores[loss_mask.sum(-1) > 0] if loss_mask.any() else scores)
            scores = (scores - self.reward_moments.mean) / max(self.reward_moments.std, 1e-8)
        scores = clip_scores(scores, c.clip_reward_value)
        if self.estimator.baseline is not None:
            scores = self.estimator.baseline(scores, groups)
        kl_coef_in_reward = 0.0 if c.kl_in_loss else self.kl_ctl.value
        rewards, kl = compute_rewards(scores, layout["old_logprobs"], layout["ref_logprobs"], action_mask,
                                      kl_coef_in_reward, c.kl_estimator)
        advantages, returns = advantages_and_returns(self.estimator, values, rewards, action_mask, c.gamma, c.lam)
        if self.estimator.whiten and c.whiten_advantages and loss_mask.sum() > 1:
            advantages = masked_whiten(advantages, loss_mask)
        advantages = select(advantages, loss_mask)
        for name, tensor in (("rewards", rewards), ("advantages", advantages), ("returns", returns), ("kl", kl)):
            from_token_layout(rows, name, tensor, p)
        explained = explained_variance(values, returns, loss_mask).item() if self.critic is not None else 0.0
        finite = ~torch.isnan(raw_scores)
        return {
            "score_sum": raw_scores[finite].sum().item(),
            "scored_rows": int(finite.sum()),
            "length_penalty_sum": penalty.sum().item(),
            "total_reward_sum": (rewards * action_mask).sum().item(),
            "kl_seq_sum": (kl * action_mask).sum().item(),
            "explained_variance": explained,
            "bad_rows": selected["bad_rows"],
            "dropped_rows": selected["dropped_rows"],
            "zero_variance_rows": selected["zero_variance_rows"],
            **component_sums(rows, [comp.name for comp in self.rewards]),
        }

    # ------------------------------------------------------------------ PPO epochs
    def train_minibatch(self, rows: list[Row]) -> dict:
        c = self.config
        batch = pack(rows, c.pad_token_id)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        p, length = batch["prompt_len"], ids.shape[1]
        names = ("old_logprobs", "ref_logprobs", "advantages") + (("old_values", "returns") if self.critic is not None else ())
        old = to_device({name: to_token_layout(rows, name, p, length) for name in names}, model_device(self.actor))
        action_mask = batch["action_mask"].to(model_device(self.actor))
        loss_mask = batch["loss_mask"].to(model_device(self.actor))  # the actions of the rows still trained on
        agg = {"loss_agg": self.loss_agg, "agg_constant": c.max_answer_seq_len}

        logprobs, entropy = self.logprobs_fn(self.actor, batch, c.generation.logprob_temperature,
                                             return_entropy=True, entropy_grad=c.entropy_coef != 0)
        actor_loss, actor_stats = self.policy_loss.fn(logprobs, old["old_logprobs"], old["advantages"], action_mask,
                                                      loss_mask=loss_mask, **agg,
                                                      **{name: getattr(c, name) for name in self.policy_loss.options})
        loss = actor_loss
        if c.entropy_coef:
            loss = loss - c.entropy_coef * losses.entropy_bonus(entropy, loss_mask, **agg)
        kl_loss = torch.zeros(())
        if c.kl_in_loss and self.ref is not None:
            kl_loss = losses.kl_penalty_loss(logprobs, old["ref_logprobs"], loss_mask, **agg,
                                             estimator=c.kl_loss_estimator, old_logprobs=old["old_logprobs"])
            loss = loss + self.kl_ctl.value * kl_loss
        ptx_loss = torch.zeros(())
        if self.unsup_batches is not None:
            nll, count = lm_nll(self.actor, next(self.unsup_batches))
            ptx_loss = nll / count.clamp(min=1)
            loss = loss + c.unsup_coef * ptx_loss
        if self.finite(loss):
            self.count_overflow(backward_and_step(self.actor, loss))

        stats = {"loss/actor": actor_loss.item(), "loss/kl": kl_loss.item(), "loss/ptx": ptx_loss.item(),
                 "ppo/clipfrac": actor_stats["clipfrac"].item(),
                 "ppo/approx_kl_old": actor_stats["approx_kl"].item(),
                 "ppo/log_ratio_max_abs": actor_stats["log_ratio_max_abs"].item(),
                 "ppo/entropy": masked_mean(entropy.detach(), loss_mask).item()}  # nats per trained token
        if self.critic is not None:
            critic_mask = loss_mask.to(model_device(self.critic))
            values = token_values(self.critic, ids, mask)
            critic_loss, critic_stats = losses.value_loss(values, old["old_values"].to(values.device),
                                                          old["returns"].to(values.device), critic_mask,
                                                          c.cliprange_value)
            if self.finite(critic_loss):
                self.count_overflow(backward_and_step(self.critic, critic_loss))
            stats.update({"loss/critic": critic_loss.item(), "value/clipfrac": critic_stats["value_clipfrac"].item()})
        return stats

    def count_overflow(self, outcome) -> None:
        if outcome == OVERFLOW:
            self.overflow_skipped += 1

    def minibatches(self, rows: list[Row], step: int, epoch: int) -> list[list[Row]]:
        """Rows shuffled with a generator seeded by (seed, step, epoch), cut into mini-batches."""
        size = self.config.per_device_training_batch_size
        if len(rows) % size:
            raise ValueError(f"the rollout of {len(rows)} rows per rank is not divisible by "
                             f"--per_device_training_batch_size {size}")
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 1009 + epoch)
        order = torch.randperm(len(rows), generator=generator).tolist()
        return [[rows[i] for i in order[k:k + size]] for k in range(0, len(rows), size)]

    # ------------------------------------------------------------------ evaluation during training
    @torch.no_grad()
    def evaluate(self, prompt_batches: list[dict], do_sample: bool = False) -> dict:
        """One answer per held-out prompt (greedy unless `do_sample`), scored by every reward component;
        `eval/...` metrics over all ranks: each component's mean, the weighted total, the accuracy (the
        mean of the first accuracy-like component, e.g. math_exact), length and EOS fraction. Every rank
        must pass the same number of batches (ZeRO-3 generation is collective)."""
        settings = dataclasses.replace(self.config.generation, do_sample=do_sample)
        batches = []
        with eval_mode(self.actor), self.inference_weights(self.actor):
            for prompt_batch in prompt_batches:
                batches.append(self.generate_rows(prompt_batch, settings=settings, n=1))
        self.score_rewards(batches)
        rows = [row for rows in batches for row in rows]
        local = {"rows": len(rows), "response_len_sum": sum(r.response_ids.numel() for r in rows),
                 "eos_sum": sum(r.ended_with_eos for r in rows),
                 **component_sums(rows, [c.name for c in self.rewards])}
        finite = [r.score for r in rows if r.score == r.score]
        local.update(score_sum=sum(finite), score_count=len(finite))
        keys = list(local)
        totals = dict(zip(keys, all_reduce_sum([local[k] for k in keys])))
        n = max(totals["rows"], 1)
        metrics = {"eval/score_mean": totals["score_sum"] / max(totals["score_count"], 1),
                   "eval/response_len_mean": totals["response_len_sum"] / n, "eval/eos_fraction": totals["eos_sum"] / n,
                   "eval/prompts": totals["rows"]}
        for c in self.rewards:
            mean = totals[f"part/{c.name}_sum"] / max(totals[f"part/{c.name}_count"], 1)
            metrics[f"eval/reward/{c.name}_mean"] = mean
            if c.is_accuracy and "eval/accuracy" not in metrics:
                metrics["eval/accuracy"] = mean
        return metrics

    # ------------------------------------------------------------------ one iteration
    def step(self, prompt_batches: list[dict], step: int) -> tuple[dict, list[Row]]:
        """Rollout over the prompt batches, then PPO epochs; returns metrics averaged over ranks."""
        rows, generation_s, experience_s = self.make_experience(prompt_batches)
        scores = torch.tensor([r.score for r in rows])
        if self.config.skip_bad_rewards:  # NaN: a skipped score, left out of the loss (select_trained)
            scores = scores[~torch.isnan(scores)]
        if not self.finite(scores):
            # a NaN/inf reward would poison advantages and every update: skip the whole iteration
            return {"ppo/skipped_non_finite": 1.0, "time/generation_s": generation_s,
                    "time/experience_s": experience_s}, rows
        t0 = time.time()
        exp_stats = self.compute_advantages(rows)
        t2 = time.time()
        experience_s += t2 - t0

        self.overflow_skipped = 0
        with self.memory.phase("training"):
            train_stats = [self.train_minibatch(mb) for epoch in range(self.config.ppo_epochs)
                           for mb in self.minibatches(rows, step, epoch)]
        if self.ema is not None:
            self.ema.update(self.actor)
        t3 = time.time()

        n = len(rows)
        local = {
            "rows": n,
            **{k: v for k, v in exp_stats.items() if k != "explained_variance"},
            "kl_seq_sum": exp_stats["kl_seq_sum"],
            "response_len_sum": sum(r.response_ids.numel() for r in rows),
            "eos_sum": sum(r.ended_with_eos for r in rows),
            "explained_variance_sum": exp_stats["explained_variance"],
            "trained_tokens": sum(r.response_ids.numel() for r in rows if r.trained),
            **{k + "_sum": sum(s[k] for s in train_stats) / len(train_stats) for k in train_stats[0]},
        }
        keys = list(local)
        totals = dict(zip(keys, all_reduce_sum([local[k] for k in keys])))
        ranks, rows_total = world_size(), totals["rows"]
        log_ratio_max = all_reduce_max(max(s["ppo/log_ratio_max_abs"] for s in train_stats))
        kl_mean = totals["kl_seq_sum"] / rows_total
        metrics = {
            "reward/score_mean": totals["score_sum"] / max(totals["scored_rows"], 1),
            "reward/total_mean": totals["total_reward_sum"] / rows_total,
            "kl/ref_mean": kl_mean,
            "kl/coef": self.kl_ctl.value,
            **{f"reward/{c.name}_mean": totals[f"part/{c.name}_sum"] / max(totals[f"part/{c.name}_count"], 1)
               for c in self.rewards},
            "ppo/log_ratio_max_abs": log_ratio_max,
            "gen/response_len_mean": totals["response_len_sum"] / rows_total,
            "gen/eos_fraction": totals["eos_sum"] / rows_total,
            "time/generation_s": generation_s,
            "time/experience_s": experience_s,
            "time/train_s": t3 - t2,
            "samples_per_s": rows_total / (generation_s + experience_s + t3 - t2),
            "ppo/skipped_non_finite": 0.0,
            "train/overflow_skipped": float(self.overflow_skipped),  # the same on every rank
        }
        c = self.config
        if c.overlong_buffer_len or c.truncation_penalty:
            metrics["reward/length_penalty_mean"] = totals["length_penalty_sum"] / rows_total
        if c.skip_bad_rewards:
            metrics["reward/skipped_rows"] = totals["bad_rows"]
        if c.skip_bad_rewards or c.mask_truncated_completions or c.filter_zero_variance_groups:
            metrics["train/dropped_rows"] = totals["dropped_rows"]
            metrics["train/trained_tokens"] = totals["trained_tokens"]
        if c.n_samples_per_prompt > 1:
            metrics["reward/zero_variance_group_fraction"] = totals["zero_variance_rows"] / rows_total
        if self.critic is not None:
            metrics["value/explained_variance"] = totals["explained_variance_sum"] / ranks
        for key in train_stats[0]:
            if key != "ppo/log_ratio_max_abs":
                metrics[key] = totals[key + "_sum"] / ranks
        self.kl_ctl.update(kl_mean, rows_total)
        return metrics, rows
