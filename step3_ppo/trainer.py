"""One RL iteration: rollout -> experience (no-grad forwards) -> PPO epochs over mini-batches.

The math lives in utils/math/ops.py, utils/math/losses.py, step3_ppo/algo/shaping.py (per-token rewards, KL
coefficient) and step3_ppo/algo/advantages.py (estimators by name); rows and their packing in
utils/math/rows.py; every forward in utils/models/forward.py; the actor's generation mode in
step3_ppo/rollout/hybrid.py; sequence rewards behind step3_ppo/rewards/components.py. Two KL terms appear here and
are never confused:
- the KL PENALTY: KL(actor || frozen SFT reference), per token, inside the reward
  (`compute_rewards`, coefficient `kl_ctl.value`, fixed or adaptive), or, with `kl_in_loss`,
  as a separate loss term instead;
- the PPO CLIP: the ratio of the current actor to the OLD (rollout-time) actor, clipped in
  the `--policy_loss` (utils.math.losses.POLICY_LOSSES). Its log is `ppo/log_ratio_max_abs`, exactly 0 in
  theory at learning rate 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from dataclasses import dataclass, fields

import torch

from step3_ppo import metrics as step_metrics
from step3_ppo.agents.loop import agent_rates, agent_sums
from step3_ppo.algo.advantages import advantages_and_returns, get_estimator
from step3_ppo.algo.distill import DISTILL_SIGNALS, chunked_signal, reverse_kl_sampled
from step3_ppo.algo.shaping import RunningMoments, clip_scores, compute_rewards, length_penalty
from step3_ppo.metrics import component_sums
from step3_ppo.rewards.combine import combine, zero_variance_groups
from step3_ppo.rollout.engines import ROLLOUT_ENGINES
from step3_ppo.rollout.hybrid import gathered
from step3_ppo.teachers import distill_metrics, distill_sums, row_teacher
from utils.errors import ProjectError
from utils.math import losses
from utils.math.ops import (
    aggregate,
    explained_variance,
    masked_mean,
    masked_whiten,
    rollout_correction_weights,
    select,
)
from utils.math.rows import Row, from_token_layout, pack, split_generation, to_token_layout
from utils.math.sampling import PROCESSED_LOGPROB_FLOOR, truncates
from utils.math.throughput import (
    FORWARD_FLOPS_PER_PARAM,
    TRAIN_FLOPS_PER_PARAM,
    non_embedding_params,
    packed_tokens,
)
from utils.models.export import is_zero3
from utils.models.forward import (
    LOGPROB_CHUNK_TOKENS,
    GenerationSettings,
    HeadInput,
    eval_mode,
    head_chunk_count,
    head_input,
    lm_nll,
    model_device,
    to_device,
    token_logprobs,
    token_values,
)
from utils.runtime import accelerator
from utils.runtime.distributed import all_reduce_max, all_reduce_sum, world_size
from utils.train.loop import (
    OVERFLOW,
    accumulation_windows,
    backward_and_step,
    budget_groups,
    step_normalised_loss,
    window_totals,
)
from utils.train.metrics_logger import print_rank0


class NothingToTrain(ProjectError):
    """An iteration with no row left to train on: every rank decides it together, rank 0 prints it."""


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
    policy_loss: str = "ppo"  # an entry of utils.math.losses.POLICY_LOSSES
    cliprange_low: float | None = None  # None: the policy loss's default (--cliprange; gspo: the paper's)
    cliprange_high: float | None = None
    dual_clip: float | None = None
    entropy_coef: float = 0.0
    rollout_engine: str = "hf"  # an entry of step3_ppo.rollout.engines.ROLLOUT_ENGINES
    engine_settings: object = None  # the rollout engine's own flags (its entry's settings(args); None: defaults)
    # the engine generates later iterations while this one trains, with weights at most this many optimizer steps
    # older than the ones the rows train under (0: synchronous); staler rows are generated again
    max_staleness: int = 0
    loss_agg: str | None = None  # None: the policy loss's default, else the estimator's
    reward_weights: tuple | None = None  # one per reward component; None: 1 each
    reward_norm: str = "sum_then_normalize"  # step3_ppo.rewards.combine.REWARD_NORMS
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    truncation_penalty: float = 0.0
    mask_truncated_completions: bool = False
    filter_zero_variance_groups: bool = False
    dynamic_sampling: bool = False  # DAPO: more prompt batches until the rollout holds its groups with signal
    max_sampling_rounds: int = 4  # generation rounds of one iteration with dynamic_sampling, the first included
    skip_bad_rewards: bool = False
    rollout_logprobs: bool = True  # keep the rollout engine's own log-probs of its tokens (when it gives them)
    old_logprobs: str = "forward"  # forward: the actor's no-grad forward after generation; rollout: the generator's
    rollout_correction: str = "none"  # utils.math.ops.ROLLOUT_CORRECTIONS
    rollout_correction_threshold: float = 2.0  # C of the rollout correction (> 1)
    kl_estimator: str = "k1"
    clip_reward_value: float | None = 5.0
    normalize_reward: bool = False
    kl_in_loss: bool = False
    kl_loss_estimator: str = "k2"  # utils.math.losses.KL_LOSS_ESTIMATORS
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
    logprob_chunk_tokens: int = LOGPROB_CHUNK_TOKENS  # tokens per LM-head chunk of every log-prob forward (0: whole)
    padding_free: bool = False  # the actor's and critic's forwards on real tokens only, rows packed in one sequence
    max_tokens_per_micro_batch: int = 0  # > 0: an optimizer step's rows re-cut into micro-batches of this many tokens
    distill_signal: str = "reverse_kl_sampled"  # with teachers: step3_ppo.algo.distill.DISTILL_SIGNALS
    distill_coef: float = 1.0  # its weight beside the task's advantage
    distill_jsd_beta: float = 0.5  # the jsd signal's beta
    teacher_key: str = "teacher"  # the prompt rows' field naming a row's teacher (several teachers)
    seed: int = 1234

    @classmethod
    def from_args(cls, args, **overrides) -> "PPOConfig":
        """The config of parsed arguments: each field read from the flag of the same name."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    @property
    def generation(self) -> GenerationSettings:
        return GenerationSettings(
            max_new_tokens=self.max_answer_seq_len,
            min_new_tokens=self.min_answer_seq_len,
            do_sample=self.do_sample,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )


class PPOTrainer:
    """Runs RL iterations over the engines: actor, reference (when a KL term needs one), critic (when the
    estimator needs one) and the reward components (reward models and/or functions, step3_ppo/rewards/components.py).

    `logprobs_fn(model, packed_batch, temperature, return_entropy=False, entropy_grad=False)` is the policy
    forward (None: utils.models.forward.token_logprobs with `--logprob_chunk_tokens`); a benchmark can pass a
    variant without patching. `agent`
    (step3_ppo.agents.loop.MultiTurn) makes each rollout row a multi-turn trajectory.
    """

    def __init__(self, engines, config: PPOConfig, kl_ctl, rewards, unsup_batches=None, logprobs_fn=None, agent=None):
        self.config = config
        self.estimator = get_estimator(config.advantage_estimator)
        self.policy_loss = losses.POLICY_LOSSES[config.policy_loss]
        self.loss_agg = config.loss_agg or self.policy_loss.loss_agg or self.estimator.loss_agg
        self.actor, self.ref = engines.actor, engines.ref
        engine_entry = ROLLOUT_ENGINES[config.rollout_engine]
        self.rollout = engine_entry.build(self.actor, config)
        self.rollout_logprobs = engine_entry.logprobs and config.rollout_logprobs  # rows keep "rollout_logprobs"
        self.rollout_processed = engine_entry.processed_logprobs  # of the truncated distribution sampled
        readers = (["--old_logprobs rollout"] if config.old_logprobs == "rollout" else []) + (
            [f"--rollout_correction {config.rollout_correction}"] if config.rollout_correction != "none" else []
        )
        if readers and not self.rollout_logprobs:
            cause = (
                "--no_rollout_logprobs leaves them out"
                if engine_entry.logprobs
                else f"--rollout_engine {config.rollout_engine} does not give them"
            )
            raise ValueError(f"{' and '.join(readers)} need(s) the rollout engine's own log-probs: {cause}")
        self.critic = engines.critic if self.estimator.needs_critic else None
        self.ema = getattr(engines, "ema", None)
        self.rewards = list(rewards)
        self.kl_ctl = kl_ctl
        self.reward_moments = RunningMoments()
        self.unsup_batches = unsup_batches
        self.logprobs_fn = logprobs_fn or self.policy_logprobs
        self.agent = agent  # step3_ppo.agents.loop.MultiTurn: rollouts of several turns with an environment / tools
        self.guard = None  # BadStepGuard: skips updates with a non-finite reward or loss (set by main)
        self.memory = accelerator.PhaseMemory()  # peak memory of generation / experience / training
        self.overflow_skipped = 0  # updates of this iteration the fp16 loss scaler skipped
        self.said_too_stale = False  # --max_staleness below one iteration's optimizer steps: said once
        self.trained_tokens = (0, 0)  # (real, processed) tokens of the last iteration's training forwards
        self._flops_per_token = None  # model FLOPs per token of each phase (flops_per_token)
        self.used = {}  # per engine, whether the last mini-batch's loss was finite and trained on
        self.teachers = dict(getattr(engines, "teachers", None) or {})  # name -> frozen engine (distillation)
        self.distill = DISTILL_SIGNALS[config.distill_signal] if self.teachers else None

    def policy_logprobs(self, engine, batch: dict, temperature: float, **options):
        """utils.models.forward.token_logprobs with the run's `--logprob_chunk_tokens` and `--padding_free`."""
        c = self.config
        return token_logprobs(
            engine, batch, temperature, chunk_tokens=c.logprob_chunk_tokens, padding_free=c.padding_free, **options
        )

    def finite(self, *values) -> bool:
        return self.guard is None or self.guard.all_finite(*values)

    # ------------------------------------------------------------------ rollout + experience
    def generate_rows(
        self,
        prompt_batch: dict,
        first_group: int = 0,
        settings: GenerationSettings | None = None,
        n: int | None = None,
        logprobs: bool = False,
    ) -> list[Row]:
        """`n_samples_per_prompt` answers to each prompt of the batch, generated together (a group never
        straddles generation batches); group ids count from `first_group`, each row keeps its prompt row.
        `settings` / `n` replace the rollout's (evaluation: greedy, one answer). With `logprobs` (an engine
        that gives them) each row keeps the generator's own log-probs of its answer, "rollout_logprobs"."""
        c = self.config
        n = c.n_samples_per_prompt if n is None else n
        if self.agent is not None:  # multi-turn: each row a trajectory (step3_ppo/agents/loop.py)
            rows = self.agent.rollout(
                self.rollout,
                prompt_batch,
                settings or c.generation,
                n,
                c.stop_token_ids,
                c.pad_token_id,
                logprobs=logprobs,
            )
            for i, row in enumerate(rows):
                row.group, row.weight_version = first_group + i // n, self.generated_version()
            return rows
        ids, mask = prompt_batch["input_ids"], prompt_batch["attention_mask"]
        inputs = self.rollout_inputs(prompt_batch, n, settings or c.generation)
        if logprobs:
            sequences, generated = self.rollout.generate_with_logprobs(*inputs)
        else:
            sequences = self.rollout.generate(*inputs)
        rows = split_generation(sequences, ids, mask, c.stop_token_ids, samples_per_prompt=n)
        prompt_rows = prompt_batch.get("rows") or [{} for _ in range(ids.shape[0])]
        version = self.generated_version()
        for i, row in enumerate(rows):
            row.group, row.prompt, row.weight_version = first_group + i // n, prompt_rows[i // n], version
            if logprobs:
                row.per_action["rollout_logprobs"] = generated[i, : row.response_ids.numel()].float().cpu().clone()
        return rows

    @staticmethod
    def rollout_inputs(prompt_batch: dict, n: int, settings: GenerationSettings) -> tuple:
        """What the rollout engine is given for a prompt batch: each prompt `n` times, and the settings."""
        ids, mask = prompt_batch["input_ids"], prompt_batch["attention_mask"]
        return ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), settings

    def generated_version(self) -> int:
        """The weight version (the actor's optimizer steps) the engine's last answers came from: the one its reply
        names (an engine in another process), else the actor's current one (it generates with the actor itself)."""
        version = getattr(self.rollout, "weight_version", None)
        return getattr(self.actor, "global_steps", 0) if version is None else version

    def optimizer_steps(self, rows: int) -> int:
        """The optimizer steps an iteration of `rows` rollout rows takes (train_epochs' windows)."""
        c = self.config
        minibatches = c.ppo_epochs * (rows // c.per_device_training_batch_size)
        return len(list(accumulation_windows(range(minibatches), self.actor.gradient_accumulation_steps())))

    def generate_ahead(self, rows: list[Row], next_prompts) -> bool:
        """`--max_staleness k`: the prompt batches of the next iterations handed to the engine now, generated while
        this one trains with the weights of this moment: as many iterations ahead as keep their rows at most k
        optimizer steps stale when they train (k // the steps of one iteration). `next_prompts(j)` gives the
        batches of the iteration j ahead (None past the run's end). Returns whether anything is generated ahead."""
        c = self.config
        steps = max(self.optimizer_steps(len(rows)), 1)
        depth = c.max_staleness // steps
        if depth == 0:
            if not self.said_too_stale:
                print_rank0(
                    f"[step3] --max_staleness {c.max_staleness} is below the {steps} optimizer steps of one iteration: "
                    f"rows generated ahead would be too stale to train, so rollouts stay synchronous (raise it to "
                    f"{steps} to generate one iteration ahead)"
                )
                self.said_too_stale = True
            return False
        ahead = False
        for j in range(1, depth + 1):
            batches = next_prompts(j)
            if not batches:
                break
            for batch in batches:
                inputs = self.rollout_inputs(batch, c.n_samples_per_prompt, c.generation)
                if not self.rollout.prefetched(*inputs, logprobs=self.rollout_logprobs):
                    self.rollout.prefetch(*inputs, logprobs=self.rollout_logprobs)
                ahead = True
        return ahead

    def inference_weights(self, engine):
        """With the hybrid engine, a no-grad phase holds the whole model gathered once (hybrid.gathered).

        One model at a time, as large as the actor in generation mode; `gathered_experience=False`
        keeps the per-layer hooks for models bigger than that.
        """
        if engine is not None and self.config.enable_hybrid_engine and self.config.gathered_experience:
            return gathered(engine)
        return contextlib.nullcontext()

    @torch.no_grad()
    def store_logprobs(
        self, rows: list[Row], engine, name: str, share_prompts: bool = False, top1: str | None = None
    ) -> None:
        """One no-grad forward of a causal LM on the packed rows; per-action log-probs stored as `name`.
        `share_prompts`: a group's prompt runs once (utils.models.forward.token_logprobs), for the reference;
        `top1`: the model's most likely token at each action is stored as that too (the distillation metrics).

        The actor's "old_logprobs", when the rows carry the generator's own log-probs and the rollout samples with
        top-k / top-p (processed_sampling), also stores "old_processed_logprobs" from the same forward: each
        action's log-prob under the distribution sampled (softmax(logits / T) renormalised over the tokens top-k
        then top-p keep), the kind of the vLLM worker's (vLLM's processed log-probs; the hf engine's are of the
        tempered softmax), which the mismatch metric and the rollout correction compare (rollout_mismatch)."""
        batch = pack(rows, self.config.pad_token_id)
        processed = self.processed_sampling() if name == "old_logprobs" else None
        extra = {"return_top1": True} if top1 else {}
        extra.update({"return_processed": processed} if processed else {})
        with eval_mode(engine):
            if share_prompts:
                logprobs = token_logprobs(
                    engine,
                    batch,
                    self.config.generation.logprob_temperature,
                    share_prompts=True,
                    chunk_tokens=self.config.logprob_chunk_tokens,
                    **extra,
                )
            else:
                logprobs = self.logprobs_fn(engine, batch, self.config.generation.logprob_temperature, **extra)
        logprobs, *more = logprobs if extra else (logprobs,)
        if top1:
            from_token_layout(rows, top1, more.pop(0), batch["prompt_len"])
        if processed:
            from_token_layout(rows, "old_processed_logprobs", more.pop(0), batch["prompt_len"])
        from_token_layout(rows, name, logprobs, batch["prompt_len"])

    def processed_sampling(self) -> tuple[int, float] | None:
        """(top_k, top_p) of the rollout's sampling when it truncates and the rows carry an engine's log-probs of the
        truncated distribution (vLLM's processed ones; the hf engine's are of the tempered softmax, as the trainer's)
        to compare with (store_logprobs keeps the trainer's log-probs of that distribution); else None.

        Only the comparison reads them: the PPO ratio stays on "old_logprobs", the plain softmax(logits / T), since
        that is the policy trained (its new log-probs are the same forward's with a gradient); --old_logprobs
        rollout with a truncating top-k / top-p is refused (step3_ppo/main.py), as its ratio would compare the
        generator's processed log-probs with the trainer's plain ones."""
        g = self.config.generation
        if self.rollout_logprobs and self.rollout_processed and g.do_sample and truncates(g.top_k, g.top_p):
            return g.top_k, g.top_p
        return None

    def shares_prompts(self, engine) -> bool:
        """Whether the reference's scoring runs each group's prompt once: with several samples per prompt and
        the engine's weights whole on the rank (below ZeRO-3, or gathered by the hybrid engine), so that its
        two forwards are no collectives a rank could call a different number of times. The old log-probs keep
        the one-pass forward training repeats (their ratio is the PPO clip's)."""
        c = self.config
        whole = not is_zero3(engine) or (c.enable_hybrid_engine and c.gathered_experience)
        return c.n_samples_per_prompt > 1 and whole

    @torch.no_grad()
    def store_values(self, rows: list[Row]) -> None:
        batch = pack(rows, self.config.pad_token_id)
        with eval_mode(self.critic):
            values = token_values(self.critic, batch["input_ids"], batch["attention_mask"], self.config.padding_free)
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
            parts = {
                c.name: torch.tensor([r.score_parts[c.name] for r in rows], dtype=torch.float32) for c in self.rewards
            }
            combined = (
                combine(parts, self.config.reward_weights) if parts else torch.zeros(len(rows))
            )  # distillation alone
            for row, score in zip(rows, combined.tolist()):
                failed = row.agent is not None and row.agent["failed"] is not None  # its environment raised
                row.score = float("nan") if failed else score

    def make_experience(self, prompt_batches: list[dict], first_group: int = 0) -> tuple[list[Row], float, float]:
        """Rollout, then the no-grad forwards; returns the rows and the generation/experience seconds.

        The actor's old log-probs are computed while its weights are still gathered for generation
        (hybrid), on the unmerged weights training uses; each other engine is gathered once for
        all prompt batches. Group ids count from `first_group` (a later round of dynamic sampling).
        """
        rows_per_batch, generation_s, experience_s = [], 0.0, 0.0
        memory, n = self.memory, self.config.n_samples_per_prompt
        with self.inference_weights(self.actor):
            for prompt_batch in prompt_batches:
                t0 = time.time()
                with memory.phase("generation"):
                    group = first_group + sum(map(len, rows_per_batch)) // n
                    rows = self.generate_rows(prompt_batch, first_group=group, logprobs=self.rollout_logprobs)
                t1 = time.time()
                if self.config.old_logprobs == "rollout":  # the generator's own: no forward (exact with hybrid)
                    for row in rows:
                        row.per_action["old_logprobs"] = row.per_action["rollout_logprobs"]
                else:
                    with memory.phase("experience"):
                        top1 = "student_top1" if self.teachers else None  # the distillation's agreement metric
                        self.store_logprobs(rows, self.actor, "old_logprobs", top1=top1)
                generation_s, experience_s = generation_s + t1 - t0, experience_s + time.time() - t1
                rows_per_batch.append(rows)
        if self.config.release_inference_cache:
            accelerator.empty_cache()  # the KV caches and the gathered actor's blocks, before the other models
        t0 = time.time()
        phases = []
        if self.ref is not None:
            share = self.shares_prompts(self.ref)
            phases.append((self.ref, lambda rows: self.store_logprobs(rows, self.ref, "ref_logprobs", share)))
        if self.critic is not None:
            phases.append((self.critic, self.store_values))
        for name, teacher in self.teachers.items():  # every teacher on every row: a ZeRO-3 forward is a collective
            if isinstance(teacher, torch.nn.Module):  # a frozen engine
                store = functools.partial(
                    self.store_logprobs, engine=teacher, name=f"teacher_logprobs/{name}", top1=f"teacher_top1/{name}"
                )
                phases.append((teacher, store))
            else:  # its own vLLM worker (--teacher_engine vllm): each rank sends its rows
                temperature = self.config.generation.logprob_temperature
                store = functools.partial(teacher.store, name=f"teacher_logprobs/{name}", temperature=temperature)
                phases.append((None, store))
        with memory.phase("experience"):
            for engine, store in phases:
                with self.inference_weights(engine):
                    for rows in rows_per_batch:
                        store(rows)
            self.score_rewards(rows_per_batch)
        if self.ref is None:  # no KL term: the reference would be the old policy's copy, KL 0
            for row in (row for rows in rows_per_batch for row in rows):
                row.per_action["ref_logprobs"] = row.per_action["old_logprobs"]
        if self.teachers:  # each row keeps its own teacher's log-probs
            names = list(self.teachers)
            for row in (row for rows in rows_per_batch for row in rows):
                own = row_teacher(row.prompt, self.config.teacher_key, names)
                for kind in ("logprobs", "top1"):  # a teacher on a vLLM worker gives no top-1
                    scored = {name: row.per_action.pop(f"teacher_{kind}/{name}", None) for name in names}
                    if scored[own] is not None:
                        row.per_action[f"teacher_{kind}"] = scored[own]
        if self.config.release_inference_cache:
            accelerator.empty_cache()  # the gathered models' blocks, before training's
        experience_s += time.time() - t0
        return [row for rows in rows_per_batch for row in rows], generation_s, experience_s

    def select_trained(self, rows: list[Row], scores: torch.Tensor, groups: torch.Tensor) -> dict:
        """Mark the rows the loss leaves out (`Row.trained`), and count them:
        - a skipped (NaN) score (`--skip_bad_rewards`): the whole group, whose baseline it would bias;
        - `--mask_truncated_completions`: an answer cut at the length limit (TRL's);
        - `--filter_zero_variance_groups` (and `--dynamic_sampling`, whose rollout is filled up with such
          groups when too few had signal): a group whose rewards are all equal (DAPO's).
        NaN scores become 0 so the arithmetic stays finite (those rows are not trained on)."""
        c = self.config
        bad = torch.isnan(scores)
        bad_groups = torch.isin(groups, groups[bad])
        scores = torch.where(bad, torch.zeros_like(scores), scores)
        truncated = torch.tensor([not r.ended_with_eos for r in rows])
        flat = zero_variance_groups(scores, groups) & ~bad_groups
        drop = bad_groups | (truncated if c.mask_truncated_completions else torch.zeros_like(bad))
        drop = drop | (flat if c.filter_zero_variance_groups or c.dynamic_sampling else torch.zeros_like(bad))
        for row, dropped in zip(rows, drop.tolist()):
            row.trained = not dropped
        return {
            "scores": scores,
            "bad_rows": int(bad.sum()),
            "dropped_rows": int(drop.sum()),
            "zero_variance_rows": int(flat.sum()),
        }

    def sequence_rewards(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(raw scores [B] (NaN: skipped), the scores the loss selection and baselines see: the components
        combined by --reward_norm plus the length penalty [B], the penalty [B], group ids [B])."""
        c = self.config
        lengths = torch.tensor([r.action_count for r in rows])
        ended = torch.tensor([r.ended_with_eos for r in rows])
        penalty = length_penalty(
            lengths, ended, c.max_answer_seq_len, c.overlong_buffer_len, c.overlong_penalty_factor, c.truncation_penalty
        )
        raw_scores = torch.tensor([r.score for r in rows], dtype=torch.float32)
        groups = torch.tensor([r.group for r in rows])
        scores = raw_scores
        if c.reward_norm != "sum_then_normalize" and self.rewards:  # each component normalised in its group first
            parts = {
                comp.name: torch.tensor([r.score_parts[comp.name] for r in rows], dtype=torch.float32)
                for comp in self.rewards
            }
            scores = combine(parts, c.reward_weights, groups, c.reward_norm)
        return raw_scores, scores + penalty, penalty, groups

    def groups_with_signal(self, rows: list[Row]) -> list[int]:
        """The ids of the groups (in rollout order) whose rewards are all finite and not all equal: under a
        group baseline the only ones with non-zero advantages (what DAPO's dynamic sampling collects)."""
        _, scores, _, groups = self.sequence_rewards(rows)
        bad = torch.isnan(scores)
        dead = zero_variance_groups(torch.where(bad, torch.zeros_like(scores), scores), groups)
        dead = dead | torch.isin(groups, groups[bad])
        return list(dict.fromkeys(g for g, no_signal in zip(groups.tolist(), dead.tolist()) if not no_signal))

    def compute_advantages(self, rows: list[Row]) -> dict:
        """Sequence rewards (components, length penalty, normalisation, clip, the estimator's group
        baseline) on the last action, the KL penalty per action, advantages, whitening over the rollout;
        with the generator's log-probs, their distance to the old log-probs and the rollout correction's
        weights ("rollout_weights")."""
        c = self.config
        raw_scores, scores, penalty, groups = self.sequence_rewards(rows)
        selected = self.select_trained(rows, scores, groups)
        batch = pack(rows, c.pad_token_id)
        action_mask, loss_mask = batch["action_mask"], batch["loss_mask"]
        p, length = batch["prompt_len"], batch["input_ids"].shape[1]
        names = ("old_logprobs", "ref_logprobs") + (("old_values",) if self.critic is not None else ())
        compared = self.rollout_logprobs and c.old_logprobs == "forward"  # else they ARE the old log-probs
        names += ("rollout_logprobs",) if self.rollout_logprobs else ()
        names += ("old_processed_logprobs",) if compared and self.processed_sampling() else ()
        layout = {name: to_token_layout(rows, name, p, length) for name in names}
        mismatch = self.rollout_mismatch(rows, layout, action_mask, loss_mask, p) if compared else {}
        values = layout.get("old_values", torch.zeros_like(action_mask))
        scores = selected["scores"]
        if c.normalize_reward:
            self.reward_moments.update(scores[loss_mask.sum(-1) > 0] if loss_mask.any() else scores)
            scores = (scores - self.reward_moments.mean) / max(self.reward_moments.std, 1e-8)
        scores = clip_scores(scores, c.clip_reward_value)
        if self.estimator.baseline is not None:
            scores = self.estimator.baseline(scores, groups)
        kl_coef_in_reward = 0.0 if c.kl_in_loss else self.kl_ctl.value
        rewards, kl = compute_rewards(
            scores, layout["old_logprobs"], layout["ref_logprobs"], action_mask, kl_coef_in_reward, c.kl_estimator
        )
        advantages, returns = advantages_and_returns(self.estimator, values, rewards, action_mask, c.gamma, c.lam)
        if self.estimator.whiten and c.whiten_advantages and loss_mask.sum() > 1:
            advantages = masked_whiten(advantages, loss_mask)
        advantages = select(advantages, loss_mask)
        distilled = {}
        if self.teachers:  # the sampled tokens' reverse KL to each row's teacher, over the trained actions
            teacher = to_token_layout(rows, "teacher_logprobs", p, length)
            signal = reverse_kl_sampled(layout["old_logprobs"], teacher, loss_mask)
            if not self.distill.needs_logits:  # a dense per-token advantage, after the estimator's whitening
                advantages = advantages - c.distill_coef * signal
            owners = [row_teacher(r.prompt, c.teacher_key, list(self.teachers)) for r in rows]
            agree = None  # the two models' most likely tokens, where both were read (an in-process teacher)
            if all("student_top1" in r.per_action and "teacher_top1" in r.per_action for r in rows):
                student, top = (to_token_layout(rows, name, p, length) for name in ("student_top1", "teacher_top1"))
                agree = (student == top).float()
            distilled = distill_sums(signal, teacher, loss_mask, owners, list(self.teachers), agree)
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
            **mismatch,
            **distilled,
            **component_sums(rows, [comp.name for comp in self.rewards]),
        }

    def rollout_mismatch(
        self, rows: list[Row], layout: dict, action_mask: torch.Tensor, loss_mask: torch.Tensor, prompt_len: int
    ) -> dict:
        """|generator - trainer| log-prob of every action (the trainer's old log-probs against the rollout
        engine's own), as sums for the iteration's mean and max; with --rollout_correction the per-action
        off-policy weights stored in the rows ("rollout_weights") and their sums over the trained actions.

        With a truncating top-k / top-p the trainer's side is "old_processed_logprobs" (store_logprobs), the
        distribution the generator sampled and gave the log-probs of: the plain tempered ones would differ by
        log(kept mass) with identical weights. A sampled token the trainer's own top-k / top-p leaves out (a near
        tie at the cut, the engines' numerics apart) has log-prob -inf there: it counts as PROCESSED_LOGPROB_FLOOR
        (a finite outlier in the max rather than an infinite mean), its weight ~0 (the trainer would not draw it).
        """
        c = self.config
        mask = action_mask != 0
        trainer = layout["old_logprobs"]
        if "old_processed_logprobs" in layout:
            trainer = layout["old_processed_logprobs"].clamp(min=PROCESSED_LOGPROB_FLOOR)
        diff = select((trainer - layout["rollout_logprobs"]).abs(), mask)
        out = {
            "logprob_diff_sum": diff.sum().item(),
            "logprob_diff_count": int(mask.sum()),
            "logprob_diff_max": diff.max().item() if diff.numel() else 0.0,
        }
        if c.rollout_correction != "none":
            weights = rollout_correction_weights(
                trainer,
                layout["rollout_logprobs"],
                action_mask,
                c.rollout_correction,
                c.rollout_correction_threshold,
            )
            from_token_layout(rows, "rollout_weights", weights, prompt_len)
            trained = loss_mask != 0
            out.update(
                rollout_weight_sum=select(weights, trained).sum().item(),
                rollout_masked_sum=int((trained & (weights == 0)).sum()),
                rollout_weight_count=int(trained.sum()),
            )
        return out

    # ------------------------------------------------------------------ PPO epochs
    def loss_units(self, rows: list[Row]) -> dict:
        """What a mini-batch's losses are averaged over: its trained actions ("tokens": the actor's loss with
        token_mean, the critic's) and its trained answers ("sequences": seq_mean, constant_norm)."""
        trained = [r for r in rows if r.trained]
        return {"tokens": sum(r.action_count for r in trained), "sequences": len(trained)}

    def train_minibatch(
        self, rows: list[Row], counts: dict, totals: dict, boundary: bool, replay: dict | None = None
    ) -> dict:
        """One mini-batch's forward, backward and step of the actor (and critic) in its optimizer step
        (`train_epochs`). `counts` / `totals`: its loss units (`loss_units`) and those of its whole optimizer
        step on every rank, so that the step's loss is ONE mean (utils.train.loop.step_normalised_loss);
        `boundary`: whether its step() updates the weights (the window's last mini-batch). `replay`
        ({"actor": rows, "critic": rows} of an earlier mini-batch of the window): an engine whose loss here is
        non-finite at the boundary backwards 0 x that mini-batch's instead, so its window still closes. The
        PPO-ptx term keeps its own per-mini-batch mean."""
        c = self.config
        batch = pack(rows, c.pad_token_id)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        p, length = batch["prompt_len"], ids.shape[1]
        names = ("old_logprobs", "ref_logprobs", "advantages") + (
            ("old_values", "returns") if self.critic is not None else ()
        )
        names += ("rollout_weights",) if c.rollout_correction != "none" else ()
        old = to_device({name: to_token_layout(rows, name, p, length) for name in names}, model_device(self.actor))
        action_mask = batch["action_mask"].to(model_device(self.actor))
        loss_mask = batch["loss_mask"].to(model_device(self.actor))  # the actions of the rows still trained on
        agg = {"loss_agg": self.loss_agg, "agg_constant": c.max_answer_seq_len}
        unit = "tokens" if self.loss_agg == "token_mean" else "sequences"
        steps, ranks = self.actor.gradient_accumulation_steps(), world_size()

        vocabulary = self.distill is not None and self.distill.needs_logits  # the student's head input: kept
        logprobs, entropy, *student = self.logprobs_fn(
            self.actor,
            batch,
            c.generation.logprob_temperature,
            return_entropy=True,
            entropy_grad=c.entropy_coef != 0,
            **({"return_head_input": True} if vocabulary else {}),
        )
        actor_loss, actor_stats = self.policy_loss.fn(
            logprobs,
            old["old_logprobs"],
            old["advantages"],
            action_mask,
            loss_mask=loss_mask,
            weights=old.get("rollout_weights"),
            **agg,
            **{name: getattr(c, name) for name in self.policy_loss.options},
        )
        policy = actor_loss
        if c.entropy_coef:
            policy = policy - c.entropy_coef * losses.entropy_bonus(entropy, loss_mask, **agg)
        kl_loss = torch.zeros(())
        if c.kl_in_loss and self.ref is not None:
            kl_loss = losses.kl_penalty_loss(
                logprobs,
                old["ref_logprobs"],
                loss_mask,
                **agg,
                estimator=c.kl_loss_estimator,
                old_logprobs=old["old_logprobs"],
            )
            policy = policy + self.kl_ctl.value * kl_loss
        distill_loss = self.vocabulary_divergence(batch, loss_mask, agg, *student) if vocabulary else torch.zeros(())
        policy = policy + c.distill_coef * distill_loss
        loss, _ = step_normalised_loss({unit: policy}, counts, totals, steps, ranks)
        ptx_loss = torch.zeros(())
        if self.unsup_batches is not None:
            nll, count = lm_nll(self.actor, next(self.unsup_batches), c.logprob_chunk_tokens, c.padding_free)
            ptx_loss = nll / count.clamp(min=1)
            loss = loss + c.unsup_coef * ptx_loss
        self.used = {"actor": self.backward(self.actor, loss, boundary, (replay or {}).get("actor"))}

        share = counts[unit] / totals[unit] if totals[unit] else 0.0  # this mini-batch's part of the step's loss
        stats = {
            "loss/actor": actor_loss.item() * share,
            "loss/kl": kl_loss.item() * share,
            "loss/ptx": ptx_loss.item(),
            "ppo/clipfrac": actor_stats["clipfrac"].item(),
            "ppo/approx_kl_old": actor_stats["approx_kl"].item(),
            "ppo/log_ratio_max_abs": actor_stats["log_ratio_max_abs"].item(),
            "ppo/entropy": masked_mean(entropy.detach(), loss_mask).item(),
            **({"loss/distill": distill_loss.item() * share} if vocabulary else {}),
        }  # nats per trained token
        if self.critic is not None:
            critic_mask = loss_mask.to(model_device(self.critic))
            values = token_values(self.critic, ids, mask, c.padding_free)
            critic_loss, critic_stats = losses.value_loss(
                values,
                old["old_values"].to(values.device),
                old["returns"].to(values.device),
                critic_mask,
                c.cliprange_value,
            )
            scaled, logged = step_normalised_loss({"tokens": critic_loss}, counts, totals, steps, ranks)
            self.used["critic"] = self.backward(self.critic, scaled, boundary, (replay or {}).get("critic"))
            stats.update({"loss/critic": logged, "value/clipfrac": critic_stats["value_clipfrac"].item()})
        return stats

    def vocabulary_divergence(
        self, batch: dict, loss_mask: torch.Tensor, agg: dict, student: HeadInput
    ) -> torch.Tensor:
        """The full-vocabulary distillation signal (--distill_signal reverse_kl, forward_kl or jsd) of the
        mini-batch's trained actions against the (one) teacher, aggregated as the policy loss is. `student`: the
        LM head's input of the policy forward of this mini-batch (its gradient kept: one decoder pass serves both
        losses); the teacher runs without one; the vocabulary goes through both heads a chunk of positions at a
        time."""
        c = self.config
        (teacher,) = self.teachers.values()
        chunk, temperature = c.logprob_chunk_tokens, c.generation.logprob_temperature
        with torch.no_grad(), eval_mode(teacher):
            taught = head_input(teacher, batch, chunk)
        student_hidden, teacher_hidden = student.at(loss_mask), taught.at(loss_mask)
        student_head, teacher_head = student.head, taught.head
        count = head_chunk_count([student_head, teacher_head], student_hidden.shape[0], chunk)
        options = {"beta": c.distill_jsd_beta} if "beta" in self.distill.options else {}
        values = chunked_signal(
            c.distill_signal,
            student_hidden,
            student_head,
            (teacher_hidden, teacher_head),
            chunk,
            temperature,
            min_chunks=count,
            **options,
        )
        per_token = torch.zeros(loss_mask.shape, dtype=values.dtype, device=values.device)
        per_token = per_token.masked_scatter(loss_mask.to(values.device).bool(), values)
        loss = aggregate(per_token, loss_mask.to(values.device), agg["loss_agg"], agg["agg_constant"])
        return loss

    def backward(self, engine, loss, boundary: bool, replay_rows: list[Row] | None) -> bool:
        """`loss`'s backward and step on `engine` when it is finite on every rank (else the bad-step guard
        counts it); a skipped loss at the window's boundary backwards 0 x an earlier mini-batch's forward
        (`replay_rows`) so the window's update still happens. Returns whether `loss` was used."""
        if self.finite(loss):
            self.count_overflow(backward_and_step(engine, loss, boundary))
            return True
        if boundary and replay_rows:
            batch = pack(replay_rows, self.config.pad_token_id)
            if engine is self.critic:
                out = token_values(engine, batch["input_ids"], batch["attention_mask"], self.config.padding_free)
            else:
                out = self.logprobs_fn(engine, batch, self.config.generation.logprob_temperature)
            zero = 0.0 * select(out, batch["action_mask"].to(out.device)).sum()
            self.count_overflow(backward_and_step(engine, zero, True))
        return False

    def train_epochs(self, rows: list[Row], step: int) -> tuple[list[dict], int]:
        """`--ppo_epochs` passes over the rollout's mini-batches, in optimizer steps of
        `--gradient_accumulation_steps` mini-batches (the iteration's last step may hold fewer: its own
        window, so no gradient carries into the next rollout). Each step's losses are one mean over its
        trained tokens (or answers) on every rank: the window's counts are all-reduced once before its
        first backward. Returns the mini-batches' stats and the number of optimizer steps."""
        minibatches = [mb for epoch in range(self.config.ppo_epochs) for mb in self.minibatches(rows, step, epoch)]
        size = self.actor.gradient_accumulation_steps()
        stats, windows = [], list(accumulation_windows(minibatches, size))
        if self.config.max_tokens_per_micro_batch:
            windows = [self.budget_micro_batches(window) for window in windows]
        # (real, processed) tokens of the training forwards, for the metrics (throughput_sums)
        lengths = [[r.length for r in mb] for window in windows for mb in window]
        packed = [(sum(n), sum(n)) if self.config.padding_free else packed_tokens(n) for n in lengths]
        self.trained_tokens = (sum(real for real, _ in packed), sum(processed for _, processed in packed))
        for window in windows:
            counts = [self.loss_units(mb) for mb in window]
            totals = window_totals(counts)
            replay = {}  # per engine, a mini-batch of this window it trained on
            for j, mb in enumerate(window):
                stats.append(self.train_minibatch(mb, counts[j], totals, boundary=j == len(window) - 1, replay=replay))
                for engine, used in self.used.items():
                    if used:
                        replay.setdefault(engine, mb)
        return stats, len(windows)

    def budget_micro_batches(self, window: list[list[Row]]) -> list[list[Row]]:
        """An optimizer step's rows (its window of mini-batches) re-cut into micro-batches of at most
        `--max_tokens_per_micro_batch` tokens (utils.train.loop.budget_groups), as many on every rank as the
        rank that needs the most (each forward of a ZeRO engine, each backward's gradient reduction, is a
        collective). The step's loss stays one mean over its trained tokens (or answers) whatever the cut."""
        rows = [row for mb in window for row in mb]
        lengths = [r.length for r in rows]
        budget = self.config.max_tokens_per_micro_batch
        longest = max(range(len(rows)), key=lambda i: lengths[i])
        if lengths[longest] > budget:
            row = rows[longest]
            raise ProjectError(
                f"--max_tokens_per_micro_batch {budget}: a rollout row (group {row.group}) has {lengths[longest]} "
                f"tokens ({row.prompt_ids.numel()} prompt + {row.response_ids.numel()} answer); raise the budget to "
                f"at least that, or lower --max_prompt_seq_len / --max_answer_seq_len"
            )
        return [[rows[i] for i in group] for group in budget_groups(lengths, budget)]

    def count_overflow(self, outcome) -> None:
        if outcome == OVERFLOW:
            self.overflow_skipped += 1

    def minibatches(self, rows: list[Row], step: int, epoch: int) -> list[list[Row]]:
        """Rows shuffled with a generator seeded by (seed, step, epoch), cut into mini-batches."""
        size = self.config.per_device_training_batch_size
        if len(rows) % size:
            raise ValueError(
                f"the rollout of {len(rows)} rows per rank is not divisible by --per_device_training_batch_size {size}"
            )
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step * 1009 + epoch)
        order = torch.randperm(len(rows), generator=generator).tolist()
        return [[rows[i] for i in order[k : k + size]] for k in range(0, len(rows), size)]

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
        local = {
            "rows": len(rows),
            "response_len_sum": sum(r.response_ids.numel() for r in rows),
            "eos_sum": sum(r.ended_with_eos for r in rows),
            **component_sums(rows, [c.name for c in self.rewards]),
        }
        finite = [r.score for r in rows if r.score == r.score]
        local.update(score_sum=sum(finite), score_count=len(finite))
        if self.agent is not None:
            local.update(agent_sums(rows))
        keys = list(local)
        totals = dict(zip(keys, all_reduce_sum([local[k] for k in keys])))
        n = max(totals["rows"], 1)
        metrics = {
            "eval/score_mean": totals["score_sum"] / max(totals["score_count"], 1),
            "eval/response_len_mean": totals["response_len_sum"] / n,
            "eval/eos_fraction": totals["eos_sum"] / n,
            "eval/prompts": totals["rows"],
        }
        if self.agent is not None:  # per trajectory; the rates of calling a tool and of a call failing
            metrics.update(
                {
                    f"eval/{name}_mean": totals[f"agent/{name}_sum"] / n
                    for name in ("turns", "tool_calls", "tool_errors", "env_tokens")
                }
            )
            metrics.update(agent_rates(totals, "eval/"))
        for c in self.rewards:
            mean = totals[f"part/{c.name}_sum"] / max(totals[f"part/{c.name}_count"], 1)
            metrics[f"eval/reward/{c.name}_mean"] = mean
            if c.is_accuracy and "eval/accuracy" not in metrics:
                metrics["eval/accuracy"] = mean
        return metrics

    # ------------------------------------------------------------------ dynamic sampling (DAPO)
    def sample_dynamically(self, rows: list[Row], more_prompts) -> tuple[list[Row], dict, float, float]:
        """DAPO's dynamic sampling: while this rank's rollout holds fewer groups with signal
        (`groups_with_signal`) than the groups it asked for, generate one more prompt batch from
        `more_prompts() -> batch | None` (the run's loader, counted in its resume position), at most
        `max_sampling_rounds` rounds in all, the first included. Every rank runs the same rounds (ZeRO-3
        generation is collective): a round happens when any rank is short and every rank got a batch.
        The rollout keeps its size: the first groups with signal, filled up (when still short) with groups
        without, which select_trained drops from the loss. Returns the rows, the counts (this rank's) and
        the extra generation / experience seconds."""
        c, n = self.config, self.config.n_samples_per_prompt
        wanted = len(rows) // n
        rounds, generation_s, experience_s = 1, 0.0, 0.0
        while rounds < c.max_sampling_rounds:
            if not all_reduce_max(float(len(self.groups_with_signal(rows)) < wanted)):
                break
            batch = more_prompts() if more_prompts is not None else None
            if all_reduce_max(float(batch is None)):
                break
            more, g_s, e_s = self.make_experience([batch], first_group=max(r.group for r in rows) + 1)
            rows, rounds = rows + more, rounds + 1
            generation_s, experience_s = generation_s + g_s, experience_s + e_s
        signal = self.groups_with_signal(rows)
        kept = signal[:wanted]
        others = [g for g in dict.fromkeys(r.group for r in rows) if g not in set(signal)]
        chosen = set(kept + others[: wanted - len(kept)])
        counts = {
            "generated_groups": len({r.group for r in rows}),
            "kept_groups": len(kept),
            "missing_groups": wanted - len(kept),
            "rounds": rounds,
        }
        return [r for r in rows if r.group in chosen], counts, generation_s, experience_s

    def stop_if_nothing_to_train(self, rows: list[Row], step: int) -> None:
        """With --skip_bad_rewards, an iteration whose skipped rewards left no row to train on (any rank) stops
        the run: training on nothing would go on silently to the end and exit 0 (a function that always fails)."""
        trained, bad, total = all_reduce_sum(
            [sum(r.trained for r in rows), sum(r.score != r.score for r in rows), len(rows)]
        )
        if trained == 0 and bad > 0:
            failing = [
                name
                for name in (comp.name for comp in self.rewards)
                if any(r.score_parts[name] != r.score_parts[name] for r in rows)
            ]
            raise NothingToTrain(
                f"iteration {step + 1}: nothing left to train: {bad:.0f} of {total:.0f} rows have a "
                f"skipped reward (--skip_bad_rewards: {', '.join(failing) or 'another rank'}), and "
                f"their groups were dropped; the first error of each function is printed above"
            )

    # ------------------------------------------------------------------ one iteration
    def step(
        self, prompt_batches: list[dict], step: int, more_prompts=None, next_prompts=None
    ) -> tuple[dict, list[Row]]:
        """Rollout over the prompt batches (with dynamic sampling, more from `more_prompts`), then PPO epochs;
        returns metrics averaged over ranks. With `--max_staleness`, `next_prompts(j)` (the prompt batches of the
        iteration j ahead, or None) are handed to the engine before training starts (generate_ahead)."""
        c = self.config
        env_s0 = self.agent.env_s if self.agent is not None else 0.0
        rows, generation_s, experience_s = self.make_experience(prompt_batches)
        sampling = {}
        if c.dynamic_sampling:
            rows, sampling, g_s, e_s = self.sample_dynamically(rows, more_prompts)
            generation_s, experience_s = generation_s + g_s, experience_s + e_s
        scores = torch.tensor([r.score for r in rows])
        if c.skip_bad_rewards:  # NaN: a skipped score, left out of the loss (select_trained)
            scores = scores[~torch.isnan(scores)]
        if not self.finite(scores):
            # a NaN/inf reward would poison advantages and every update: skip the whole iteration
            return step_metrics.skipped_metrics(generation_s, experience_s), rows
        t0 = time.time()
        exp_stats = self.compute_advantages(rows)
        # optimizer steps between the weights that generated each row and those its old log-probs are taken under
        exp_stats["staleness"] = [
            self.actor.global_steps - r.weight_version for r in rows if r.weight_version is not None
        ]
        if c.skip_bad_rewards:
            self.stop_if_nothing_to_train(rows, step)
        t2 = time.time()
        experience_s += t2 - t0

        if not (c.max_staleness and next_prompts is not None and self.generate_ahead(rows, next_prompts)):
            self.rollout.sleep()
        self.overflow_skipped = 0
        with self.memory.phase("training"):
            train_stats, optimizer_steps = self.train_epochs(rows, step)
        if self.ema is not None:
            self.ema.update(self.actor)
        seconds = {
            "generation_s": generation_s,
            "experience_s": experience_s,
            "train_s": time.time() - t2,
            "env_s": self.agent.env_s - env_s0 if self.agent is not None else None,
        }
        metrics, rows_total = self.iteration_metrics(rows, exp_stats, sampling, train_stats, optimizer_steps, seconds)
        self.kl_ctl.update(metrics["kl/ref_mean"], rows_total)
        return metrics, rows

    def flops_per_token(self) -> dict:
        """Model FLOPs per token of each phase (utils/math/throughput.py; parameters less the input embeddings):
        generation 2 x the actor's; experience 2 x each model that scores the rows (the actor unless its old
        log-probs are the generator's, the reference, the critic, each reward model); training 6 x the actor's
        and the critic's (the PPO-ptx term's own forwards left out). Counted once."""
        if self._flops_per_token is None:
            n = {name: non_embedding_params(getattr(engine, "module", None)) for name, engine in self.scored_engines()}
            scored = sum(v for k, v in n.items() if k != "actor" or self.config.old_logprobs != "rollout")
            self._flops_per_token = {
                "generation": FORWARD_FLOPS_PER_PARAM * n["actor"],
                "experience": FORWARD_FLOPS_PER_PARAM * scored,
                "training": TRAIN_FLOPS_PER_PARAM * (n["actor"] + n.get("critic", 0)),
            }
        return self._flops_per_token

    def scored_engines(self) -> list[tuple[str, object]]:
        """(name, engine) of the actor, reference, critic and each reward component's model (those that have one)."""
        named = [("actor", self.actor), ("ref", self.ref), ("critic", self.critic)]
        named += [(f"reward:{comp.name}", getattr(comp, "engine", None)) for comp in self.rewards]
        named += [(f"teacher:{name}", engine) for name, engine in self.teachers.items()]
        return [(name, engine) for name, engine in named if engine is not None]

    def iteration_metrics(
        self,
        rows: list[Row],
        exp_stats: dict,
        sampling: dict,
        train_stats: list[dict],
        optimizer_steps: int,
        seconds: dict,
    ) -> tuple[dict, float]:
        """The iteration's metrics over all ranks, family by family (step3_ppo/metrics.py), and the rows of all
        ranks (for the KL controller)."""
        c = self.config
        stale = exp_stats.pop("staleness")  # per row, not a sum
        local = {
            **step_metrics.local_sums(rows, exp_stats, sampling, train_stats, optimizer_steps, self.agent is not None),
            **step_metrics.throughput_sums(rows, self.trained_tokens, accelerator.peak_flops()),
        }
        phase_s = {
            "generation": seconds["generation_s"] - (seconds["env_s"] or 0.0),
            "experience": seconds["experience_s"],
            "training": seconds["train_s"],
        }
        local.update(staleness_sum=float(sum(stale)), staleness_rows=float(len(stale)))
        totals, (log_ratio_max, diff_max, stale_max, stale_min, *slowest) = step_metrics.all_ranks(
            local,
            [
                max(s["ppo/log_ratio_max_abs"] for s in train_stats),
                exp_stats.get("logprob_diff_max", 0.0),
                max(stale, default=0),
                -min(stale, default=0),
                *phase_s.values(),
            ],
        )
        ranks = world_size()
        return {
            **step_metrics.reward_metrics(totals, [comp.name for comp in self.rewards], c),
            **step_metrics.kl_metrics(totals, self.kl_ctl.value),
            **step_metrics.length_metrics(totals),
            **step_metrics.policy_metrics(totals, train_stats[0], log_ratio_max, self.overflow_skipped, ranks),
            **step_metrics.value_metrics(totals, ranks, self.critic is not None),
            **step_metrics.selection_metrics(totals, c),
            **step_metrics.dynamic_metrics(totals, sampling),
            **step_metrics.rollout_metrics(totals, diff_max, c.rollout_correction),
            **step_metrics.staleness_metrics(totals, stale_max, -stale_min, c.max_staleness),
            **step_metrics.agent_metrics(totals, self.agent is not None),
            **distill_metrics(totals, list(self.teachers), c.distill_signal),
            **step_metrics.timing_metrics(totals["rows"], **seconds),
            **step_metrics.throughput_metrics(totals, dict(zip(phase_s, slowest)), self.flops_per_token()),
            **self.rollout.metrics(),
        }, totals["rows"]
