"""The `reasoning_gym` built-in reward: reasoning-gym's own scorer of the row's task.

Rows come from `--data_path reasoning_gym:TASK...` (utils/data/reasoning_gym.py) and carry `task`, `task_config`,
`question`, `answer` and `metadata`. The answer is taken from the completion by reasoning-gym's `extract_answer`
(the last `<answer>...</answer>`; None without one) and scored by the task's `score_answer(answer, entry)`,
exactly as the library returns it (1.0 for a right answer; some tasks give partial credit in (0, 1); an answer
without the tags usually 0.0). The library is imported when the function is loaded (~1 s, in its worker).
"""

from __future__ import annotations

import json
from typing import Callable

NAME = "reasoning_gym"
HELP = "reasoning-gym's score_answer of the row's task on the <answer>...</answer> (rows of reasoning_gym: data)"


def make_reasoning_gym() -> Callable:
    """The reward function; its tasks' datasets are built once per (task, config) and kept."""
    from reasoning_gym.utils import extract_answer  # lazy: ~1 s (all of reasoning-gym), only when this is used

    from step3_ppo.rewards.functions import RewardFunctionError, completion_text  # lazy: functions.py imports this
    from utils.data.reasoning_gym import create  # lazy: utils.data imports torch (+1 s a reward worker's start)
    from utils.data.sources import DataError  # lazy: as above

    datasets: dict = {}

    def dataset(task: str, config: dict | None):
        key = (task, json.dumps(config or {}, sort_keys=True))
        if key not in datasets:
            try:
                datasets[key] = create(task, dict(config or {}), seed=0, size=1)
            except DataError as e:
                raise RewardFunctionError(NAME, str(e)) from None
        return datasets[key]

    def reasoning_gym(completions, task=None, metadata=None, question=None, answer=None, task_config=None, **kwargs):
        if task is None or metadata is None:
            raise RewardFunctionError(
                NAME, "the prompt rows need 'task' and 'metadata' fields (rows of --data_path reasoning_gym:TASK)"
            )
        n = len(completions)
        question, answer, task_config = question or [None] * n, answer or [None] * n, task_config or [None] * n
        scores = []
        for c, t, q, a, m, cfg in zip(completions, task, question, answer, metadata, task_config):
            if t is None:
                raise RewardFunctionError(NAME, "a prompt row has no 'task' field (mixed with other data?)")
            entry = {"question": q, "answer": a, "metadata": m or {}}
            scores.append(float(dataset(t, cfg).score_answer(extract_answer(completion_text(c)), entry)))
        return scores

    return reasoning_gym
