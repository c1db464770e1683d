"""Environments for multi-turn step 3 (`--env SPEC`): what answers the policy between its turns.

Why a class per trajectory: an episode has state (attempts so far, a game board), and the same
`Class(row)` / `step(message)` / `reward()` shape is what OpenRLHF's agent executor and TRL's
`environment_factory` take, so an environment written for those ports with a few renames.

Contract: `Class(row)` is made once per trajectory; `row` is the prompt row, flat: "prompt" (as the data
gives it), "origin" (file:line) and every other field of the row ("answer", ...). `step(message)` gets the
policy's last assistant message and returns the next message: a str (a `user` turn), a dict
`{"role": "tool" | "user", "content": str}`, or None to end the episode. An optional `reward() -> float`,
called once at the end, is the reward component `env`. step3_ppo/agents/loop.py runs the loop.

What goes wrong: a spec that does not load, or a setup the environment itself refuses by raising EnvError
(math_retry on a row without 'answer'), stops the run (EnvError, one line naming the spec). A constructor,
step() or reward() that raises anything else, a reply of the wrong shape or a reward that is not a finite
number is EnvFailed (naming the environment and the row): the trajectory ends, and the run stops unless
`--skip_bad_rewards` drops it. A built-in is one ENVIRONMENTS entry next to its class.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from step3_ppo.rewards.functions import answers_match, final_answer
from step3_ppo.specs import load_object
from utils.errors import ProjectError, one_line

_MESSAGE_LIMIT = 200
_FLOAT32_MAX = 3.4028234663852886e38  # a reward becomes a float32 tensor
ROLES = ("tool", "user")


class EnvError(ProjectError):
    """An environment that does not load or whose setup is wrong; str() is one line naming its spec."""

    def __init__(self, spec: str, problem: str):
        self.spec, self.problem = spec, problem
        super().__init__(one_line(f"environment {spec}: {problem}"))


class EnvFailed(ProjectError):
    """An environment call that raised or returned something unusable; one line naming it and the row."""

    def __init__(self, env: str, origin: str, problem: str):
        self.env, self.origin, self.problem = env, origin, problem
        super().__init__(one_line(f"environment {env} failed on row {origin or '?'}: {problem}"))


# ---------------------------------------------------------------- built-ins


class MathRetry:
    """A math problem with retries: a wrong final answer (the last `\\boxed{}` or number, as math_exact
    reads it) gets one line asking again, up to `max_attempts` answers; reward() is 1.0 if the last was right."""

    max_attempts = 3
    retry = "That is not correct. Try again and give the final answer as \\boxed{...}."

    def __init__(self, row: dict):
        if row.get("answer") is None:
            raise EnvError(
                "math_retry",
                f"row {row.get('origin') or '?'} has no 'answer' field (the answer each attempt is checked against)",
            )
        self.answer, self.attempts, self.correct = row["answer"], 0, False

    def step(self, message: str) -> str | None:
        self.attempts += 1
        self.correct = answers_match(final_answer(message), self.answer)
        if self.correct or self.attempts >= self.max_attempts:
            return None
        return self.retry

    def reward(self) -> float:
        return float(self.correct)


@dataclass(frozen=True)
class BuiltinEnv:
    """A built-in environment, loaded by its name in `--env`: its class and one line of help."""

    cls: type
    help: str


# The one place a built-in is registered: its name is its spec; `--env`'s help follows.
ENVIRONMENTS: dict[str, BuiltinEnv] = {
    "math_retry": BuiltinEnv(
        MathRetry,
        "a wrong final answer vs the row's 'answer' is asked again, up to 3 attempts; reward 1 if the last is right",
    ),
}


def environments_help() -> str:
    """The built-ins as `--env`'s help lists them: `name (help), ...` in registry order."""
    return ", ".join(f"{name} ({entry.help})" for name, entry in ENVIRONMENTS.items())


# ---------------------------------------------------------------- loading and calling


def env_row(prompt_row: dict) -> dict:
    """The row an environment is made from: "prompt", "origin" and the row's other fields, flat (the
    loader keeps those under "extra")."""
    extra = prompt_row.get("extra") or {}
    flat = {k: v for k, v in prompt_row.items() if k != "extra"}
    return {**extra, **flat}


def _a(word: str) -> str:
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def _failure(exc: Exception) -> str:
    return one_line(f"{type(exc).__name__}: {exc}", _MESSAGE_LIMIT)


def normalise_reply(reply, env_name: str, origin: str) -> dict | None:
    """step()'s return as a message: a str is a `user` turn, a dict must be exactly {"role": "tool" | "user",
    "content": str}, None ends the episode; anything else is EnvFailed saying what came back."""
    if reply is None:
        return None
    if isinstance(reply, str):
        return {"role": "user", "content": reply}
    if (
        isinstance(reply, dict)
        and set(reply) == {"role", "content"}
        and reply["role"] in ROLES
        and isinstance(reply["content"], str)
    ):
        return dict(reply)
    shown = one_line(repr(reply), 80)
    raise EnvFailed(
        env_name,
        origin,
        f"step() returned {_a(type(reply).__name__)} ({shown}); expected a str, "
        f"{{'role': 'tool' | 'user', 'content': str}} or None",
    )


def _reward_value(value, env_name: str, origin: str) -> float:
    """reward()'s return as a float: a finite real number (a bool is 0 or 1, a one-element tensor its item)."""
    if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):
        number = float(value)
        if math.isfinite(number) and abs(number) <= _FLOAT32_MAX:
            return number
    shown = one_line(repr(value), 80)
    raise EnvFailed(env_name, origin, f"reward() returned {shown} ({type(value).__name__}); expected a finite number")


class Episode:
    """One trajectory's environment, called safely: `step(message)` is the normalised reply (a dict or None)
    and `reward()` a finite float; whatever the environment raises is EnvFailed (EnvError passes: the setup
    is wrong)."""

    def __init__(self, env, name: str, origin: str):
        self.env, self.name, self.origin = env, name, origin

    def _call(self, method: str, *args):
        try:
            return getattr(self.env, method)(*args)
        except (EnvError, EnvFailed):
            raise
        except Exception as exc:
            raise EnvFailed(self.name, self.origin, f"{method}() raised {_failure(exc)}") from exc

    def step(self, message: str) -> dict | None:
        return normalise_reply(self._call("step", message), self.name, self.origin)

    def reward(self) -> float:
        return _reward_value(self._call("reward"), self.name, self.origin)


@dataclass(frozen=True)
class EnvironmentSpec:
    """A loaded `--env`: `name` (the built-in's, else the class's) names it in errors, `spec` is what the user
    gave, `has_reward` whether the class defines reward() (then the reward component `env` exists)."""

    name: str
    cls: type
    has_reward: bool
    spec: str

    def make(self, prompt_row: dict) -> Episode:
        """The environment of one trajectory, made from its prompt row (as the data loader gives it)."""
        row = env_row(prompt_row)
        origin = str(row.get("origin") or "")
        try:
            env = self.cls(row)
        except (EnvError, EnvFailed):
            raise
        except Exception as exc:
            raise EnvFailed(self.name, origin, f"{self.cls.__name__}(row) raised {_failure(exc)}") from exc
        return Episode(env, self.name, origin)

    def reward_of(self, episode: Episode, prompt_row: dict | None = None) -> float:
        """The episode's reward() at its end (EnvFailed if it raises or is not a finite number)."""
        return episode.reward()


def load_environment(spec: str) -> EnvironmentSpec:
    """The environment `spec` names: a built-in (ENVIRONMENTS), `path/to/file.py:Class` or `package.module:Class`;
    EnvError (one line) when it does not load or has no step(message) method."""
    builtin = ENVIRONMENTS.get(spec)
    if builtin is not None:
        cls, name = builtin.cls, spec
    else:
        forms = "a built-in (" + ", ".join(ENVIRONMENTS) + "), path/to/file.py:Class or package.module:Class"
        cls = load_object(spec, EnvError, what="environment", kind="class", forms=forms)
        name = cls.__name__
    if not callable(getattr(cls, "step", None)):
        raise EnvError(spec, f"class {cls.__name__} has no step(message) method")
    return EnvironmentSpec(name, cls, callable(getattr(cls, "reward", None)), spec)
