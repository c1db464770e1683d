"""A reward function's own worker process (step3_ppo/function_worker.py): what is particular to reward functions.

Why a worker: a call stuck in C code, one that catches every BaseException, or a `sys.exit` cannot take
step 3 with it (step3_ppo/function_worker.py says how). Here: the worker loads the function by its spec and its
built-in's options (a built-in registered by another module imports that module first), a spec that
does not load there is a RewardFunctionError saying so, and a deadline is `--reward_timeout`'s (or, without it,
step3_ppo/rewards/components.py's default).
"""

from __future__ import annotations

from step3_ppo.function_worker import CallFailed, FunctionWorker
from step3_ppo.rewards.functions import BUILTINS, RewardFunction, RewardFunctionError, load_reward_function
from utils.errors import one_line

_MESSAGE_LIMIT = 200


class RewardWorker(FunctionWorker):
    """The parent's end: `call(kwargs, timeout)` is the function's result, or raises CallFailed (it raised,
    ran past `timeout`, exited or crashed) or RewardFunctionError (it cannot be loaded: stops the run)."""

    def __init__(self, func: RewardFunction, deadline_name: str = "--reward_timeout"):
        builtin = BUILTINS.get(func.spec)
        options = {"options": func.options, "builtin_module": builtin.make.__module__ if builtin else None}
        super().__init__(func.spec, f"{__name__}:load", options, deadline_name=deadline_name)
        self.func = func

    def call(self, kwargs: dict, timeout: float | None):
        try:
            return super().call(kwargs, timeout)
        except CallFailed as exc:
            if exc.kind == "unpicklable":
                raise CallFailed(f"{exc}; return a list", exc.kind) from None
            raise


def load(spec: str, options: dict, builtin_module: str | None = None):
    """In the worker: the function `spec` names, loaded as the parent loaded it."""
    try:
        if builtin_module and spec not in BUILTINS:  # a built-in registered by another module when it is imported
            __import__(builtin_module)
        return load_reward_function(spec, **options).fn
    except RewardFunctionError as exc:
        raise RewardFunctionError(exc.function, f"in its worker process: {exc.problem}", exc.origin, exc.index)
    except Exception as exc:
        raise RewardFunctionError(
            spec, f"its worker process could not load it: {one_line(f'{type(exc).__name__}: {exc}', _MESSAGE_LIMIT)}"
        ) from None
