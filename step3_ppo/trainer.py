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
  `policy_loss`. Its log is `ppo/log_ratio_max_abs`, exactly 0 in theory at learning rate 0.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, fields

import torch

from step3_ppo.advantages import get_estimator
from step3_ppo.hybrid import gathered, generate
from step3_ppo.shaping import RunningMoments, compute_rewards
from utils import accelerator, losses
from utils.distributed import all_reduce_max, all_reduce_sum, world_size
from utils.forward import (GenerationSettings, eval_mode, generation_kwargs, lm_nll, model_device, to_device,
                           token_logprobs, token_values)
from utils.ops import explained_variance, masked_mean, masked_whiten
from utils.rollout import Row, from_token_layout, pack, split_generation, to_token_layout
from utils.training import OVERFLOW, backward_and_step


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
    advantage_estimator: str = "gae"
    kl_estimator: str = "k1"
    clip_reward_value: float | None = 5.0
    normalize_reward: bool = False
    kl_in_loss: bool = False
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
    """Runs RL iterations over the engines: actor, reference, critic (when the estimator needs one), reward.

    `logprobs_fn(model, packed_batch, temperature, return_entropy=False)` is the policy forward
    (utils.forward.token_logprobs); a benchmark can pass a variant without patching.
    """

    def __init__(self, engines, config: PPOConfig, kl_ctl, reward, unsup_batches=None, logprobs_fn=token_logprobs):
        self.config = config
        self.estimator = get_estimator(config.advantage_estimator)
        self.actor, self.ref = engines.actor, engines.ref
        self.critic = engines.critic if self.estimator.needs_critic else None
        self.ema = getattr(engines, "ema", None)
        self.reward = reward
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
    def generate_rows(self, prompt_batch: dict) -> list[Row]:
        c = self.config
        sequences = generate(self.actor, prompt_batch["input_ids"], prompt_batch["attention_mask"],
                             hybrid=c.enable_hybrid_engine, merge_lora=c.merge_lora_for_generation,
                             **generation_kwargs(c.generation, c.stop_token_ids, c.pad_token_id))
        return split_generation(sequences, prompt_batch["input_ids"], prompt_batch["attention_mask"], c.stop_token_ids)

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

    def store_scores(self, rows: list[Row]) -> None:
        for row, score in zip(rows, self.reward(rows).tolist()):
            row.score = score

    def make_experience(self, prompt_batches: list[dict]) -> tuple[list[Row], float, float]:
        """Rollout, then the no-grad forwards; returns the rows and the generation/experience seconds.

        The actor's old log-probs are computed while its weights are still gathered for generation
        (hybrid), on the unmerged weights training uses; each other engine is gathered once for
        all prompt batches.
        """
        rows_per_batch, generation_s, experience_s = [], 0.0, 0.0
        memory = self.memory
        with self.inference_weights(self.actor):
            for prompt_batch in prompt_batches:
                t0 = time.time()
                with memory.phase("generation"):
                    rows = self.generate_rows(prompt_batch)
                t1 = time.time()
                with memory.phase("experience"):
                    self.store_logprobs(rows, self.actor, "old_logprobs")
                generation_s, experience_s = generation_s + t1 - t0, experience_s + time.time() - t1
                rows_per_batch.append(rows)
        if self.config.release_inference_cache:
            accelerator.empty_cache()  # the KV caches and the gathered actor's blocks, before the other models
        t0 = time.time()
        phases = [(self.ref, lambda rows: self.store_logprobs(rows, self.ref, "ref_logprobs"))]
        if self.critic is not None:
            phases.append((self.critic, self.store_values))
        phases.append((self.reward.engine, self.store_scores))
        with memory.phase("experience"):
            for engine, store in phases:
                with self.inference_weights(engine):
                    for rows in rows_per_batch:
                        store(rows)
        if self.config.release_inference_cache:
            accelerator.empty_cache()  # the gathered models' blocks, before training's
        experience_s += time.time() - t0
        return [row for rows in rows_per_batch for row in rows], generation_s, experience_s

    def compute_advantages(self, rows: list[Row]) -> dict:
        """Rewards (score on the last action, KL penalty per action), advantages, whitening over the rollout."""
        c = self.config
        batch = pack(rows, c.pad_token_id)
        action_mask, p, length = batch["action_mask"], batch["prompt_len"], batch["input_ids"].shape[1]
        names = ("old_logprobs", "ref_logprobs") + (("old_values",) if self.critic is not None else ())
        layout = {name: to_token_layout(rows, name, p, length) for name in names}
        values = layout.get("old_values", torch.zeros_like(action_mask))
        raw_scores = torch.tensor([r.score for r in rows], dtype=torch.float32)
        scores = raw_scores
        if c.normalize_reward:
            self.reward_moments.update(raw_scores)
            scores = (raw_scores - self.reward_moments.mean) / max(self.reward_moments.std, 1e-8)
        kl_coef_in_reward = 0.0 if c.kl_in_loss else self.kl_ctl.value
        rewards, kl = compute_rewards(scores, layout["old_logprobs"], layout["ref_logprobs"], action_mask,
                                      kl_coef_in_reward, c.clip_reward_value, c.kl_estimator)
        advantages, returns = self.estimator.compute(values, rewards, action_mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, action_mask)
        for name, tensor in (("rewards", rewards), ("advantages", advantages), ("returns", returns), ("kl", kl)):
            from_token_layout(rows, name, tensor, p)
        explained = explained_variance(values, returns, action_mask).item() if self.critic is not None else 0.0
        return {
            "score_sum": raw_scores.sum().item(),
            "total_reward_sum": (rewards * action_mask).sum().item(),
            "kl_seq_sum": (kl * action_mask).sum().item(),
            "explained_variance": explained,
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

        logprobs, entropy = self.logprobs_fn(self.actor, batch, c.generation.logprob_temperature,
                                             return_entropy=True)
        actor_loss, actor_stats = losses.policy_loss(logprobs, old["old_logprobs"], old["advantages"], action_mask,
                                                     c.cliprange)
        loss = actor_loss
        kl_loss = torch.zeros(())
        if c.kl_in_loss:
            kl_loss = losses.kl_penalty_loss(logprobs, old["ref_logprobs"], action_mask)
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
                 "ppo/entropy": masked_mean(entropy, action_mask).item()}
        if self.critic is not None:
            critic_mask = action_mask.to(model_device(self.critic))
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

    # ------------------------------------------------------------------ one iteration
    def step(self, prompt_batches: list[dict], step: int) -> tuple[dict, list[Row]]:
        """Rollout over the prompt batches, then PPO epochs; returns metrics averaged over ranks."""
        rows, generation_s, experience_s = self.make_experience(prompt_batches)
        if not self.finite(torch.tensor([r.score for r in rows])):
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
            "score_sum": exp_stats["score_sum"],
            "total_reward_sum": exp_stats["total_reward_sum"],
            "kl_seq_sum": exp_stats["kl_seq_sum"],
            "response_len_sum": sum(r.response_ids.numel() for r in rows),
            "eos_sum": sum(r.ended_with_eos for r in rows),
            "explained_variance_sum": exp_stats["explained_variance"],
            **{k + "_sum": sum(s[k] for s in train_stats) / len(train_stats) for k in train_stats[0]},
        }
        keys = list(local)
        totals = dict(zip(keys, all_reduce_sum([local[k] for k in keys])))
        ranks, rows_total = world_size(), totals["rows"]
        log_ratio_max = all_reduce_max(max(s["ppo/log_ratio_max_abs"] for s in train_stats))
        kl_mean = totals["kl_seq_sum"] / rows_total
        metrics = {
            "reward/score_mean": totals["score_sum"] / rows_total,
            "reward/total_mean": totals["total_reward_sum"] / rows_total,
            "kl/ref_mean": kl_mean,
            "kl/coef": self.kl_ctl.value,
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
        if self.critic is not None:
            metrics["value/explained_variance"] = totals["explained_variance_sum"] / ranks
        for key in train_stats[0]:
            if key != "ppo/log_ratio_max_abs":
                metrics[key] = totals[key + "_sum"] / ranks
        self.kl_ctl.update(kl_mean, rows_total)
        return metrics, rows
