"""Rollout engines: what generates a rollout's answers from the actor's current weights (`--rollout_engine`).

An engine is built once per run, `ROLLOUT_ENGINES[name].build(actor, config)` (the actor's DeepSpeed
engine, the run's PPOConfig) on every rank, and offers `generate(input_ids, attention_mask, settings) -> sequences
[B, P + T]`: left-padded prompts [B, P] with their answers after them (padded with the pad id after a
stop token), decoded with `settings` (utils.models.forward.GenerationSettings) and stopping at the config's
stop tokens. The trainer computes the old log-probs with its own forward whatever the engine (an
engine's own log-probs may only measure the generator-trainer mismatch), so the lr=0 promise holds
for every engine that returns the tokens it sampled.

An engine whose entry says `logprobs=True` also offers `generate_with_logprobs(input_ids, attention_mask,
settings) -> (sequences, log-probs [B, T])`: its own log-probs of the tokens it sampled, at the rollout temperature
(`settings.logprob_temperature`): of its full tempered softmax, or, where the entry says `processed_logprobs=True`
(vLLM), of the distribution after top-k and top-p, and the trainer then compares its own of that distribution
(utils.math.sampling.processed_logprobs). The trainer logs their distance to its old log-probs
(`rollout/logprob_diff_*`) and `--rollout_correction` weights the loss by their ratio; an engine that cannot give
them says `logprobs=False`, and then neither is available.

`metrics()` are logged with each iteration's (an engine's own costs), `sleep()` comes before training (an engine
may free memory then and wake itself at its next call), `close()` ends what the engine started
(step 3 calls it when the run ends). Entries: "hf" (the actor's own `generate`, the default) and "vllm" (a
worker process per node, step3_ppo/rollout/vllm_engine.py); a multi-turn rollout (step3_ppo/agents/loop.py) calls the
engine once per turn, so both serve both.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from step3_ppo.rollout import vllm_teacher
from step3_ppo.rollout.hybrid import generate
from step3_ppo.rollout.vllm_engine import VLLMRollout, VLLMSettings, add_vllm_args, check_vllm_args
from utils.models.forward import GenerationSettings, generation_kwargs
from utils.train.flags import refuse_unread


class RolloutEngine(Protocol):
    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: GenerationSettings
    ) -> torch.Tensor: ...

    def metrics(self) -> dict: ...  # logged with each iteration's (the engine's own costs: weight sync)

    def sleep(self) -> None: ...  # before training: free what generation holds (the engine wakes itself)

    def close(self) -> None: ...


class ActorGenerate:
    """transformers' `generate` on the actor engine itself: with `--enable_hybrid_engine` in its generation
    mode (ZeRO-3 parameters gathered once, hooks lifted, KV cache, LoRA merged: step3_ppo/rollout/hybrid.py),
    else through ZeRO's per-layer hooks."""

    def __init__(self, actor, config):
        self.actor, self.config = actor, config

    def metrics(self) -> dict:
        return {}

    def sleep(self) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: GenerationSettings
    ) -> torch.Tensor:
        return self._generate(input_ids, attention_mask, settings)

    def generate_with_logprobs(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, settings: GenerationSettings
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same, with generate's raw logits turned into the sampled tokens' log-probs step by step."""
        return self._generate(input_ids, attention_mask, settings, logprob_temperature=settings.logprob_temperature)

    def _generate(self, input_ids, attention_mask, settings: GenerationSettings, **logprobs):
        c = self.config
        return generate(
            self.actor,
            input_ids,
            attention_mask,
            hybrid=c.enable_hybrid_engine,
            merge_lora=c.merge_lora_for_generation,
            **logprobs,
            **generation_kwargs(settings, c.stop_token_ids, c.pad_token_id),
        )


@dataclass(frozen=True)
class RolloutEngineEntry:
    """`build(actor, config) -> RolloutEngine`; `help`: the flag's one line; `logprobs`: whether its engine
    offers `generate_with_logprobs` (the generator's own log-probs of the sampled tokens); `add_args(parser)`:
    the engine's own flags (step 3 adds every engine's); `check_args(args)`: stops the run on a bad setting of
    them when the engine is chosen; `settings(args)`: what build reads of them, as the config's `engine_settings`
    (so a trainer built from a PPOConfig alone still gets them)."""

    build: Callable[..., RolloutEngine]
    help: str
    logprobs: bool = False
    add_args: Callable | None = None
    # its log-probs are of the distribution sampled (after top-k / top-p, vLLM's processed ones), not of the tempered
    # softmax the trainer trains: with a truncating top-k / top-p the trainer compares its own of that distribution
    processed_logprobs: bool = False
    prefetch: bool = False  # offers prefetch(ids, mask, settings, logprobs) and prefetched(...): --max_staleness
    check_args: Callable | None = None
    settings: Callable | None = None
    teacher: Callable | None = None  # (Teacher, args) -> a client whose store(rows, name, temperature) scores them
    check_teacher: Callable | None = None  # stops the run on a setting a teacher on this engine cannot serve
    teacher_help: str = ""  # what `--teacher_engine NAME` does


def check_engine_args(args) -> None:
    """The chosen `--rollout_engine`'s checks of its own flags, before any model is built; another engine's flag
    that was set does nothing with this one and stops the run."""
    for name, other in ROLLOUT_ENGINES.items():
        if name != args.rollout_engine and other.add_args is not None:
            flags = argparse.ArgumentParser(add_help=False)
            other.add_args(flags)
            refuse_unread(
                args, [a.dest for a in flags._actions], f"with --rollout_engine {args.rollout_engine} (read by {name})"
            )
    entry = ROLLOUT_ENGINES[args.rollout_engine]
    if entry.check_args is not None:
        entry.check_args(args)


def engine_settings(args):
    """The chosen `--rollout_engine`'s settings from its own flags (None: it has none)."""
    entry = ROLLOUT_ENGINES[args.rollout_engine]
    return entry.settings(args) if entry.settings is not None else None


def _vllm(actor, config):
    return VLLMRollout(actor, config, config.engine_settings)


# A new engine is one entry here and its own module: its class, flags, their checks and settings (with a test that
# its tokens train at lr=0).
ROLLOUT_ENGINES: dict[str, RolloutEngineEntry] = {
    "hf": RolloutEngineEntry(
        ActorGenerate,
        "transformers' generate on the actor (with --enable_hybrid_engine: "
        "ZeRO-3 parameters gathered once, KV cache, LoRA merged)",
        logprobs=True,
    ),
    "vllm": RolloutEngineEntry(
        _vllm,
        "a vLLM worker process per node (its own cores; token ids in and out), the "
        "actor's weights synced to it after each optimizer step through shared memory",
        logprobs=True,
        processed_logprobs=True,
        add_args=add_vllm_args,
        prefetch=True,
        check_args=check_vllm_args,
        settings=VLLMSettings.from_args,
        teacher=vllm_teacher.build_teacher,
        check_teacher=vllm_teacher.check_teacher_args,
        teacher_help="each teacher on its own vLLM worker that scores the sampled tokens (with --rollout_engine "
        "vllm, reverse_kl_sampled, temperature 1)",
    ),
}
