"""Environments for multi-turn step 3 (`--env SPEC`): what answers the policy between its turns.

Why a class per trajectory: an episode has state (attempts so far, a game board), and the same
`Class(row)` / `step(message)` / `reward()` shape is what OpenRLHF's agent executor and TRL's
`environment_factory` take, so an environment written for those ports with a few renames.

Contract: `Class(row)` is made once per trajectory; `row` is the prompt row, flat: "prompt" (as the data
gives it), "origin" (file:line) and every other field of the row ("answer", ...). `step(message)` gets the
policy's last assistant message and returns the next message: a str (a `user` turn), a dict
`{"role": "tool" | "user", "content": str}`, or None to end the episode. An optional `reward() -> float`,
called once at the end, is the reward component `env`. step3_ppo/agents/loop.py runs the loop.

Where it runs: in a worker process of its own (EnvironmentWorker, step3_ppo/function_worker.py's), one per
run and rank, holding the environments of every trajectory in flight; so an environment that calls
`sys.exit`/`os._exit`, crashes or hangs cannot end or stall training and evaluation (a call is killed at
`--env_timeout`).

What goes wrong: a spec that does not load (here or in the worker), or a setup the environment itself refuses
by raising EnvError (math_retry on a row without 'answer'), stops the run (EnvError, one line naming the spec).
A constructor, step() or reward() that raises anything else, exits, crashes or runs past --env_timeout, a reply
of the wrong shape or a reward that is not a finite number is EnvFailed (naming the environment, the row and
the call): the trajectory ends, and the run stops unless `--skip_bad_rewards` drops it. A worker that exits,
crashes or is killed takes the other trajectories' environments with it: their next call is EnvFailed too
("lost"). A built-in is one ENVIRONMENTS entry next to its class.

Environments written for other packages run unchanged through an adapter, one ADAPTERS entry each, named by
a prefix: `openenv:package.module:EnvClass` (an OpenEnv Environment) or `openenv:http://HOST:PORT` (its server),
and `verifiers:TASKSET_ID` or `verifiers:package.module:function` (a verifiers Env or Taskset);
step3_ppo/agents/ecosystem.py says how each maps onto this contract.
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass
from typing import Callable

from step3_ppo.agents.ecosystem import openenv_environment, verifiers_environment
from step3_ppo.function_worker import CallFailed, FunctionWorker
from step3_ppo.rewards.functions import answers_match, final_answer
from step3_ppo.specs import load_object
from utils.errors import ProjectError, one_line

_MESSAGE_LIMIT = 200
DEFAULT_ENV_TIMEOUT_S = 60.0  # --env_timeout: one constructor, step() or reward() call in the worker
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


@dataclass(frozen=True)
class Adapter:
    """Environments of another package, named `PREFIX:TARGET` in `--env`: `load(spec, target, error)` is a
    class of this contract (Class(row) / step / reward) running the package's environment unchanged
    (step3_ppo/agents/ecosystem.py), `error(spec, problem)` what it raises when the target does not load;
    `forms` the spec forms as help and errors show them."""

    load: Callable[[str, str, Callable[[str, str], Exception]], type]
    forms: str


# The one place another package's environments are registered: the prefix of their spec.
ADAPTERS: dict[str, Adapter] = {
    "openenv": Adapter(
        openenv_environment,
        "openenv:package.module:EnvClass (an OpenEnv Environment) or openenv:http://HOST:PORT (its server)",
    ),
    "verifiers": Adapter(
        verifiers_environment,
        "verifiers:TASKSET_ID or verifiers:package.module:function (a verifiers Env or Taskset)",
    ),
}


def adapters_help() -> str:
    """The adapters' spec forms as `--env`'s help lists them."""
    return ", ".join(adapter.forms for adapter in ADAPTERS.values())


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
    """The environment `spec` names: a built-in (ENVIRONMENTS), another package's (`PREFIX:TARGET`, ADAPTERS),
    `path/to/file.py:Class` or `package.module:Class`; EnvError (one line) when it does not load or has no
    step(message) method."""
    builtin = ENVIRONMENTS.get(spec)
    prefix, _, target = spec.partition(":")
    if builtin is not None:
        cls, name = builtin.cls, spec
    elif prefix in ADAPTERS:
        if not target:
            raise EnvError(spec, f"missing what to load after '{prefix}:' (expected {ADAPTERS[prefix].forms})")
        cls = ADAPTERS[prefix].load(spec, target, EnvError)
        name = cls.__name__
    else:
        forms = (
            "a built-in ("
            + ", ".join(ENVIRONMENTS)
            + f"), path/to/file.py:Class, package.module:Class, {adapters_help()}"
        )
        cls = load_object(spec, EnvError, what="environment", kind="class", forms=forms)
        name = cls.__name__
    if not callable(getattr(cls, "step", None)):
        raise EnvError(spec, f"class {cls.__name__} has no step(message) method")
    return EnvironmentSpec(name, cls, callable(getattr(cls, "reward", None)), spec)


# ---------------------------------------------------------------- in a worker process


@dataclass(frozen=True)
class RemoteEpisode:
    """One trajectory's environment, living in the EnvironmentWorker's process under `key`."""

    key: int
    origin: str


class EnvironmentWorker:
    """The run's environments in a worker process of their own (one per rank, started at the first `make`):
    `make(prompt_row)` builds a trajectory's environment there, `step(episode, message)` is its normalised
    reply, `reward(episode)` its finite reward (and forgets it). Every call is killed past `timeout` seconds.
    A failure of the call (it raised, exited, crashed, hung, or its environment was lost with a worker that
    another call ended) is EnvFailed naming the environment, the row and the call; an environment that cannot
    be loaded in the worker, or whose setup is wrong (EnvError), stops the run."""

    def __init__(self, environment: EnvironmentSpec, timeout: float = DEFAULT_ENV_TIMEOUT_S):
        self.environment, self.timeout = environment, timeout
        self.worker = FunctionWorker(environment.spec, f"{__name__}:serve", deadline_name="--env_timeout")
        self.keys = itertools.count()  # never reused: a restarted worker answers an old key with "lost"
        self.held: set[int] = set()  # keys whose environment the worker may still hold

    def _call(self, what: str, origin: str, op: str, key, arg=None):
        try:
            kind, value = self.worker.call({"op": op, "key": key, "arg": arg}, self.timeout)
        except CallFailed as exc:
            if exc.kind in ("start", "load"):
                raise EnvError(self.environment.spec, f"cannot be started in a worker process: {exc}") from None
            how = f"during {what}, {exc}" if exc.kind == "died" else f"{what} {exc}"
            raise EnvFailed(self.environment.name, origin, how) from None
        if kind == "failed":
            raise EnvFailed(self.environment.name, origin, value)
        if kind == "lost":
            raise EnvFailed(
                self.environment.name,
                origin,
                f"{what}: its environment was lost with its worker process, which another trajectory's "
                f"environment call ended (exit, crash or --env_timeout)",
            )
        return value

    def make(self, prompt_row: dict) -> RemoteEpisode:
        origin = str(env_row(prompt_row).get("origin") or "")
        episode = RemoteEpisode(next(self.keys), origin)
        self._call(f"{self.environment.cls.__name__}(row)", origin, "make", episode.key, prompt_row)
        self.held.add(episode.key)
        return episode

    def step(self, episode: RemoteEpisode, message: str) -> dict | None:
        return self._call("step()", episode.origin, "step", episode.key, message)

    def reward(self, episode: RemoteEpisode) -> float:
        self.held.discard(episode.key)  # the worker forgets it after reward(), whatever happens
        return self._call("reward()", episode.origin, "reward", episode.key)

    def forget(self, episodes) -> None:
        """Drop these trajectories' environments in the worker (a live one only: none is started for this)."""
        keys = [e.key for e in episodes if e is not None and e.key in self.held]
        self.held.difference_update(keys)
        process = self.worker.process
        if keys and process is not None and process.poll() is None:
            try:
                self.worker.call({"op": "drop", "key": keys}, self.timeout)
            except CallFailed:  # a __del__ that exits or hangs: the worker is restarted at the next call
                pass

    def close(self) -> None:
        self.worker.stop()
        self.held.clear()


def serve(spec: str):
    """In the worker: the environment `spec` names, loaded as the parent loaded it, and the function that
    answers the parent's calls. An EnvFailed is an answer ("failed"), not a raise, so the worker and the
    other trajectories' environments in it live on."""
    try:
        environment = load_environment(spec)
    except EnvError as exc:
        raise EnvError(spec, f"cannot be loaded in a worker process (environments run in one): {exc.problem}") from None
    episodes: dict[int, Episode] = {}

    def call(op: str, key, arg=None):
        if op == "drop":
            for k in key:
                episodes.pop(k, None)
            return "ok", None
        try:
            if op == "make":
                episodes[key] = environment.make(arg)
                return "ok", None
            episode = episodes.get(key)
            if episode is None:
                return "lost", None
            if op == "step":
                return "ok", episode.step(arg)
            del episodes[key]
            return "ok", episode.reward()
        except EnvFailed as exc:
            episodes.pop(key, None)
            return "failed", exc.problem

    return call
