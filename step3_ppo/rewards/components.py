"""Where a rollout's sequence rewards come from, behind ONE interface.

A reward component is a callable `component(rows) -> Tensor [B]` (fp32, one score per row; NaN
for a row whose score was skipped) with a `name` (logged as `reward/<name>_mean`), an `engine`
attribute: the DeepSpeed engine it runs (for the trainer's one-gather inference phase), or None
for one that runs no model, and `is_accuracy`: its mean is also the eval's `eval/accuracy`
(a 0/1 correctness score, like math_exact). Two kinds:
- `RewardModelReward`: a trained reward model's value at the last real token (step 2);
- `FunctionReward`: a Python function of the prompts, decoded completions, completion ids and
  every other field of the prompt rows (step3_ppo/rewards/functions.py: loading, built-ins, checks).
The trainer scores every component, then combines them with `--reward_weights` (`combine`, pure, in
step3_ppo/algo/advantages.py, with `--reward_norm`); step3_ppo/algo/shaping.py turns the total into per-token rewards.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from step3_ppo.rewards.functions import RewardFunction, score_batch
from step3_ppo.rewards.reward_worker import RewardWorker
from utils.math.rows import Row, pack
from utils.models.forward import eval_mode, sequence_scores


class Reward(Protocol):
    name: str
    engine: object | None
    is_accuracy: bool

    def __call__(self, rows: list[Row]) -> torch.Tensor: ...


class RewardModelReward:
    """A reward model's score of prompt + response: its value at the last real token."""

    is_accuracy = False

    def __init__(self, engine, pad_token_id: int, name: str = "reward_model"):
        self.engine, self.pad_token_id, self.name = engine, pad_token_id, name

    @torch.no_grad()
    def __call__(self, rows: list[Row]) -> torch.Tensor:
        batch = pack(rows, self.pad_token_id)
        with eval_mode(self.engine):
            return sequence_scores(self.engine, batch["input_ids"], batch["attention_mask"]).float().cpu()


# A reward function call's limit when none is given (step 3's --reward_timeout): a function that blocks forever
# (and catches every exception) then ends the run with one line naming it, instead of hanging it
DEFAULT_REWARD_TIMEOUT_S = 120.0
DEFAULT_DEADLINE = "the default limit of"  # "ran past the default limit of 120 s"


class FunctionReward:
    """A reward function (TRL's convention: keyword lists aligned with the completions) over rows.

    `completions` are the responses decoded without special tokens (a multi-turn trajectory's: its messages
    after the prompt, TRL's conversational shape, with `turns`, `tool_calls` and `tool_errors` as fields);
    `completion_ids` the generated ids (the stop token included when there is one; a trajectory's: every
    response id, the environment's included); `prompts` each row's prompt as the data gave
    it (a string or a message list); every field of `extra` is a list with None where a row lacks
    it. `skipped` counts the rows whose score was bad and skipped (`--skip_bad_rewards`); the first such
    error is printed once, so a function that always fails is not silent.

    A function loaded by its spec is called in its own worker process (step3_ppo/rewards/reward_worker.py: a hang
    is killed at `timeout`, an exit or a crash is a failed call); one handed over as an object
    (`RewardFunction.options` None) is called in this process. `timeout` None: DEFAULT_REWARD_TIMEOUT_S.
    """

    engine = None

    def __init__(self, func: RewardFunction, tokenizer, timeout: float | None = None, skip_bad: bool = False):
        self.func, self.tokenizer, self.skip_bad = func, tokenizer, skip_bad
        self.timeout = DEFAULT_REWARD_TIMEOUT_S if timeout is None else timeout
        self.deadline = DEFAULT_DEADLINE if timeout is None else "--reward_timeout"
        self.name, self.is_accuracy = func.name, func.is_accuracy
        self.skipped = 0
        # started at the first call
        self.worker = RewardWorker(func, self.deadline) if func.options is not None else None
        self.told_skip = False

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        keys = list(dict.fromkeys(k for r in rows for k in (r.prompt.get("extra") or {})))
        extra = {k: [(r.prompt.get("extra") or {}).get(k) for r in rows] for k in keys}
        if any(r.agent is not None for r in rows):  # multi-turn: the messages after the prompt, and the counters
            completions = [r.agent["messages"] for r in rows]
            extra.update({k: [r.agent[k] for r in rows] for k in ("turns", "tool_calls", "tool_errors")})
        else:
            completions = self.tokenizer.batch_decode([r.response_ids for r in rows], skip_special_tokens=True)
        scores, skipped = score_batch(
            self.func,
            prompts=[r.prompt.get("prompt") for r in rows],
            completions=completions,
            completion_ids=[r.response_ids.tolist() for r in rows],
            extra=extra,
            origins=[r.prompt.get("origin", "") for r in rows],
            timeout=self.timeout,
            deadline=self.deadline,
            skip_bad=self.skip_bad,
            on_skip=self.tell_first_skip,
            call=self.worker.call if self.worker is not None else None,
        )
        self.skipped += len(skipped)
        return scores

    def tell_first_skip(self, error: str) -> None:
        if not self.told_skip:
            self.told_skip = True
            print(
                f"[step3] warning: --skip_bad_rewards: {error}; its rows are skipped (only this function's first "
                f"error is printed, reward/skipped_rows counts them)",
                flush=True,
            )


def unique_names(components: list) -> None:
    """Two components of the same name (two files' `reward`) are logged as name, name_2, ..."""
    seen: dict[str, int] = {}
    for component in components:
        seen[component.name] = seen.get(component.name, 0) + 1
        if seen[component.name] > 1:
            component.name = f"{component.name}_{seen[component.name]}"


def reward_model_name(path: str) -> str:
    """`reward_model`, or the directory's name when several reward models are combined."""
    return os.path.basename(os.path.normpath(path)) or "reward_model"
