"""One PPO iteration: rollout -> experience (four forwards) -> PPO epochs over mini-batches.

The math lives in step3_ppo/ppo.py; batching in step3_ppo/experience.py; the actor's generation
mode in step3_ppo/hybrid.py. Two KL terms appear here and are never confused:
- the KL PENALTY: KL(actor || frozen SFT reference), per token, inside the reward
  (`compute_rewards`, coefficient `kl_ctl.value`, fixed or adaptive), or, with `kl_in_loss`,
  as a separate loss term instead;
- the PPO CLIP: the ratio of the current actor to the OLD (rollout-time) actor, clipped in
  `actor_loss`. Its log is `ppo/log_ratio_max_abs`, exactly 0 in theory at learning rate 0.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from step3_ppo import ppo
from step3_ppo.experience import Row, from_token_layout, pack, split_generation, to_token_layout
from step3_ppo.hybrid import gathered, generate
from utils.distributed import all_reduce_max, all_reduce_sum, world_size
from utils.model import causal_lm_logits
from utils.reward_model import sequence_score


@dataclass
class PPOConfig:
    """Every PPO hyper-parameter, one named flag each in step3_ppo/main.py."""
    eos_token_id: int
    pad_token_id: int
    max_answer_seq_len: int = 64
    min_answer_seq_len: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    per_device_training_batch_size: int = 4  # PPO mini-batch size
    ppo_epochs: int = 1
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
    seed: int = 1234


def policy_logprobs(engine, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float,
                    return_entropy: bool = False):
    """log p(token i+1 | prefix) [B, L-1] of a causal LM engine, with the sampling temperature applied.

    Sampling draws from softmax(logits / T), so the policy whose ratio PPO clips is that one; the
    reference is scored the same way so the KL compares like with like.
    """
    logits = causal_lm_logits(engine, input_ids, attention_mask)[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    logprobs = ppo.logprobs_from_logits(logits, input_ids[:, 1:])
    if return_entropy:
        return logprobs, ppo.entropy_from_logits(logits.detach())
    return logprobs


class PPOTrainer:
    """Runs PPO iterations over four engines (actor, reference, critic, reward model)."""

    def __init__(self, engines, config: PPOConfig, kl_ctl, unsup_batches=None):
        self.actor, self.ref, self.critic, self.reward = engines.actor, engines.ref, engines.critic, engines.reward
        self.ema = getattr(engines, "ema", None)
        self.config = config
        self.kl_ctl = kl_ctl
        self.reward_moments = ppo.RunningMoments()
        self.unsup_batches = unsup_batches
        self.guard = None  # BadStepGuard: skips updates with a non-finite reward or loss (set by main)

    def finite(self, *values) -> bool:
        return self.guard is None or self.guard.all_finite(*values)

    # ------------------------------------------------------------------ rollout + experience
    def generation_kwargs(self) -> dict:
        c = self.config
        kwargs = {"max_new_tokens": c.max_answer_seq_len, "min_new_tokens": c.min_answer_seq_len,
                  "eos_token_id": c.eos_token_id, "pad_token_id": c.pad_token_id, "do_sample": c.do_sample}
        if c.do_sample:
            kwargs.update(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        return kwargs

    def generate_rows(self, prompt_batch: dict) -> list[Row]:
        sequences = generate(self.actor, prompt_batch["input_ids"], prompt_batch["attention_mask"],
                             hybrid=self.config.enable_hybrid_engine,
                             merge_lora=self.config.merge_lora_for_generation, **self.generation_kwargs())
        return split_generation(sequences.cpu(), prompt_batch["input_ids"].cpu(),
                                prompt_batch["attention_mask"].cpu(), self.config.eos_token_id)

    def inference_weights(self, engine):
        """With the hybrid engine, a no-grad phase holds the whole model gathered once (hybrid.gathered).

        One model at a time, as large as the actor in generation mode; `gathered_experience=False`
        keeps the per-layer hooks for models bigger than that.
        """
        if self.config.enable_hybrid_engine and self.config.gathered_experience:
            return gathered(engine)
        return contextlib.nullcontext()

    @torch.no_grad()
    def score_rows(self, rows: list[Row], engine, name: str) -> None:
        """One no-grad forward of `engine` on the packed rows, stored on each row as `name`.

        old_logprobs (actor) / ref_logprobs (reference) / old_values (critic) per action, or the
        sequence `score` of the reward model.
        """
        c = self.config
        batch = pack(rows, c.pad_token_id)
        ids, mask, action_mask = batch["input_ids"], batch["attention_mask"], batch["action_mask"]
        was_training = engine.module.training
        engine.eval()
        try:
            if name == "score":
                for row, score in zip(rows, sequence_score(engine(ids, mask).float(), mask).tolist()):
                    row.score = score
                return
            if name == "old_values":
                tensor = engine(ids, mask)[:, :-1].float()
            else:
                tensor = policy_logprobs(engine, ids, mask, c.temperature if c.do_sample else 1.0)
            from_token_layout(rows, name, tensor * action_mask, batch["prompt_len"])
        finally:
            engine.train(was_training)

    def make_experience(self, prompt_batches: list[dict]) -> tuple[list[Row], float, float]:
        """Rollout, then the four no-grad forwards; returns the rows and the generation/experience seconds.

        The actor's old log-probs are computed while its weights are still gathered for generation
        (hybrid), on the unmerged weights training uses; each other engine is gathered once for
        all prompt batches.
        """
        rows_per_batch, generation_s, experience_s = [], 0.0, 0.0
        with self.inference_weights(self.actor):
            for prompt_batch in prompt_batches:
                t0 = time.time()
                rows = self.generate_rows(prompt_batch)
                t1 = time.time()
                self.score_rows(rows, self.actor, "old_logprobs")
                generation_s, experience_s = generation_s + t1 - t0, experience_s + time.time() - t1
                rows_per_batch.append(rows)
        t0 = time.time()
        for engine, name in ((self.ref, "ref_logprobs"), (self.critic, "old_values"), (self.reward, "score")):
            with self.inference_weights(engine):
                for rows in rows_per_batch:
                    self.score_rows(rows, engine, name)
        experience_s += time.time() - t0
        return [row for rows in rows_per_batch for row in rows], generation_s, experience_s

    def compute_advantages(self, rows: list[Row]) -> dict:
        """Rewards (score on the last action, KL penalty per action), GAE, whitening over the rollout."""
        c = self.config
        batch = pack(rows, c.pad_token_id)
        action_mask, p, length = batch["action_mask"], batch["prompt_len"], batch["input_ids"].shape[1]
        layout = {name: to_token_layout(rows, name, p, length) for name in ("old_logprobs", "ref_logprobs", "old_values")}
        raw_scores = torch.tensor([r.score for r in rows], dtype=torch.float32)
        scores = raw_scores
        if c.normalize_reward:
            self.reward_moments.update(raw_scores)
            scores = (raw_scores - self.reward_moments.mean) / max(self.reward_moments.std, 1e-8)
        kl_coef_in_reward = 0.0 if c.kl_in_loss else self.kl_ctl.value
        rewards, kl = ppo.compute_rewards(scores, layout["old_logprobs"], layout["ref_logprobs"], action_mask,
                                          kl_coef_in_reward, c.clip_reward_value, c.kl_estimator)
        advantages, returns = ppo.gae_advantages_and_returns(layout["old_values"], rewards, action_mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = ppo.masked_whiten(advantages, action_mask)
        for name, tensor in (("rewards", rewards), ("advantages", advantages), ("returns", returns), ("kl", kl)):
            from_token_layout(rows, name, tensor, p)
        return {
            "score_sum": raw_scores.sum().item(),
            "total_reward_sum": (rewards * action_mask).sum().item(),
            "kl_seq_sum": (kl * action_mask).sum().item(),
            "explained_variance": ppo.explained_variance(layout["old_values"], returns, action_mask).item(),
        }

    # ------------------------------------------------------------------ PPO epochs
    def train_minibatch(self, rows: list[Row]) -> dict:
        c = self.config
        batch = pack(rows, c.pad_token_id)
        ids, mask, action_mask = batch["input_ids"], batch["attention_mask"], batch["action_mask"]
        p, length = batch["prompt_len"], ids.shape[1]
        old = {name: to_token_layout(rows, name, p, length)
               for name in ("old_logprobs", "ref_logprobs", "old_values", "advantages", "returns")}

        logprobs, entropy = policy_logprobs(self.actor, ids, mask, c.temperature if c.do_sample else 1.0,
                                            return_entropy=True)
        actor_loss, actor_stats = ppo.actor_loss(logprobs, old["old_logprobs"], old["advantages"], action_mask,
                                                 c.cliprange)
        loss = actor_loss
        kl_loss = torch.zeros(())
        if c.kl_in_loss:
            kl_loss = ppo.kl_penalty_loss(logprobs, old["ref_logprobs"], action_mask)
            loss = loss + self.kl_ctl.value * kl_loss
        ptx_loss = torch.zeros(())
        if self.unsup_batches is not None:
            ptx_loss = self.ptx_loss(next(self.unsup_batches))
            loss = loss + c.unsup_coef * ptx_loss
        if self.finite(loss):
            self.actor.backward(loss)
            self.actor.step()

        values = self.critic(ids, mask)[:, :-1].float()
        critic_loss, critic_stats = ppo.critic_loss(values, old["old_values"], old["returns"], action_mask,
                                                    c.cliprange_value)
        if self.finite(critic_loss):
            self.critic.backward(critic_loss)
            self.critic.step()
        return {"loss/actor": actor_loss.item(), "loss/critic": critic_loss.item(), "loss/kl": kl_loss.item(),
                "loss/ptx": ptx_loss.item(), "ppo/clipfrac": actor_stats["clipfrac"].item(),
                "ppo/approx_kl_old": actor_stats["approx_kl"].item(),
                "ppo/log_ratio_max_abs": actor_stats["log_ratio_max_abs"].item(),
                "ppo/entropy": ppo.masked_mean(entropy, action_mask).item(),
                "value/clipfrac": critic_stats["value_clipfrac"].item()}

    def ptx_loss(self, batch: dict) -> torch.Tensor:
        """Language-modelling loss on pretraining text (PPO-ptx), trained tokens only."""
        logits = causal_lm_logits(self.actor, batch["input_ids"], batch["attention_mask"])[:, :-1]
        labels = batch["labels"][:, 1:]
        trained = labels != -100
        logprobs = ppo.logprobs_from_logits(logits, labels.clamp(min=0))
        return -ppo.masked_mean(logprobs, trained)

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
            "value/explained_variance": totals["explained_variance_sum"] / ranks,
            "gen/response_len_mean": totals["response_len_sum"] / rows_total,
            "gen/eos_fraction": totals["eos_sum"] / rows_total,
            "time/generation_s": generation_s,
            "time/experience_s": experience_s,
            "time/train_s": t3 - t2,
            "samples_per_s": rows_total / (generation_s + experience_s + t3 - t2),
            "ppo/skipped_non_finite": 0.0,
        }
        for key in train_stats[0]:
            if key != "ppo/log_ratio_max_abs":
                metrics[key] = totals[key + "_sum"] / ranks
        self.kl_ctl.update(kl_mean, rows_total)
        return metrics, rows
