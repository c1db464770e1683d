"""Environments written for OpenEnv (openenv-core) and verifiers, run under `--env` unchanged.

Each adapter turns a package's environment into this project's contract (step3_ppo/agents/environments.py):
a class made once per trajectory from the prompt row, `step(message) -> reply | None`, `reward() -> float`.
It runs, like any environment, in the EnvironmentWorker's process, so a package environment that hangs or
exits cannot stall training either. The policy always opens: its first turn answers the row's prompt (as the
data gives it); the package environment answers every turn after that.

OpenEnv (`--env openenv:package.module:EnvClass` or `openenv:path/to/file.py:EnvClass`): an in-process
`openenv.core.Environment` subclass, made with no arguments (as OpenEnv's server makes it), then
`reset(**fields)` with the row's fields that reset() names (all but "prompt" and "origin" if it takes
**kwargs). The policy's message becomes the env's Action: the text itself when the Action class has exactly
one required field and it is a str (`EchoAction(message=...)`), else the text parsed as a JSON object (a
```fenced``` block allowed) and validated as the Action; a message that is not a valid Action is answered
with one `error:` line naming the fields (the env is not stepped). The Observation becomes the next `user`
message: its one str field if it has exactly one besides done/reward/metadata, else its fields as JSON.
`done` ends the episode; reward() is the sum of the rewards step() returned (None counts 0), as
verifiers' OpenEnv taskset sums them. reset()'s own observation is not shown (the row's prompt opens).
`openenv:http://HOST:PORT` (or ws://) reaches an environment server instead (a Docker image, a Space, uvicorn)
through openenv's GenericEnvClient, one session per trajectory, with the same mapping read off the server's
Action schema (GET /schema); the server must allow as many concurrent sessions as trajectories in flight.

verifiers (`--env verifiers:TASKSET_ID`, an installed environment package that `vf.load_environment`
loads, or `verifiers:path/to/file.py:function` / `verifiers:package.module:function` returning a `vf.Env`
or a `vf.Taskset`): the row fills the taskset's TaskData (its fields by name, the prompt included), and the
Env's own `setup()` / `run(task, agents)` / `finalize()` run on an event loop of the trajectory, with the
policy as its one agent seat: each `interaction.turn(text)` of the env is the env's reply to the policy, and
the policy's next message is the turn's reply (a Segment); a bare `turn()` (a prompted task speaks first)
takes the policy's first message; `agent.run(task)` is one turn. The episode ends when run() returns or its
turn gets a terminated Segment (the trajectory ended at --max_turns). The task's `@vf.reward` functions then
score the trace (vf.Task.score) and finalize() may add to it; reward() is `trace.reward`, their weighted sum.
verifiers' own rollout (a harness program calling a model server) is not used: the policy's tokens come
from this project's engine. A taskset alone runs as verifiers' SingleAgentEnv does: one turn, then scoring.

This is verifiers 0.4.0's API (`verifiers.v1`: Taskset, Task, Env, interactions); the MultiTurnEnv /
env_response / Rubric classes of earlier versions are gone from it.

What does not carry over: a verifiers env whose task has no prompt (the env opens the conversation), or that
plays a second agent seat (user-sim's modeled user), stops the run in one line (EnvError); harness tools, MCP
toolsets and runtimes are not run (use --tools); an OpenEnv MCP env (CallToolAction) has no text mapping.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import re
import typing
import urllib.request
from typing import Callable

from step3_ppo.specs import load_object
from utils.errors import one_line

_MESSAGE_LIMIT = 200
Error = Callable[[str, str], Exception]  # error(spec, problem): EnvError, one line naming the spec

# ---------------------------------------------------------------- OpenEnv

_OBSERVATION_OWN = ("done", "reward", "metadata")  # Observation's base fields, not the env's text
_URL_SCHEMES = ("http://", "https://", "ws://", "wss://")  # openenv:URL: an environment server
_SCHEMA_TIMEOUT_S = 10.0
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\n(.*)\n```$", re.DOTALL)


def _action_class(env_cls: type, action_base: type):
    """The Action class `env_cls.step` takes: its `action` annotation, else Environment[ActT, ...]'s argument."""
    try:
        hinted = typing.get_type_hints(env_cls.step).get("action")
    except Exception:  # an annotation that does not resolve: try the generic parameters
        hinted = None
    if isinstance(hinted, type) and issubclass(hinted, action_base) and hinted is not action_base:
        return hinted
    for klass in env_cls.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            for arg in typing.get_args(base)[:1]:
                if isinstance(arg, type) and issubclass(arg, action_base) and arg is not action_base:
                    return arg
    return None


def _text_field(action_cls) -> str | None:
    """The field the policy's text fills verbatim: the Action's one required field, if it is a str."""
    required = [name for name, f in action_cls.model_fields.items() if f.is_required()]
    if len(required) == 1 and action_cls.model_fields[required[0]].annotation is str:
        return required[0]
    return None


def _parsed_object(text: str):
    text = text.strip()
    fenced = _FENCE.match(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def observation_text(observation) -> str:
    """An OpenEnv Observation (or a server's observation dict) as the next message's text: its one str field
    besides done/reward/metadata, else those fields as JSON."""
    dumped = observation if isinstance(observation, dict) else observation.model_dump()
    fields = {k: v for k, v in dumped.items() if k not in _OBSERVATION_OWN}
    texts = [v for v in fields.values() if isinstance(v, str)]
    return texts[0] if len(texts) == 1 else json.dumps(fields, ensure_ascii=False, default=str)


class OpenEnvEpisode:
    """One trajectory of an OpenEnv Environment (a subclass is made per spec, binding `env_cls`, `action_cls` and
    `text_field`, the Action field the policy's text fills verbatim or None: the text is JSON)."""

    env_cls: type
    action_cls: type
    text_field: str | None

    def __init__(self, row: dict):
        self.env = self.env_cls()
        self.total, self.done = 0.0, False
        opening = self.env.reset(**self.reset_kwargs(self.env.reset, row))
        self.done = bool(getattr(opening, "done", False))

    @staticmethod
    def reset_kwargs(reset, row: dict) -> dict:
        """The row's fields that reset() names; every field but "prompt" and "origin" if it takes **kwargs."""
        params = inspect.signature(reset).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return {k: v for k, v in row.items() if k not in ("prompt", "origin")}
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        return {k: v for k, v in row.items() if k in named}

    def action(self, message: str):
        """The Action for the policy's message, or the one-line error the policy gets instead."""
        fields = ", ".join(n for n in self.action_cls.model_fields if n != "metadata")
        value = {self.text_field: message} if self.text_field is not None else _parsed_object(message)
        if value is None:
            return (
                None,
                f"error: the action must be a JSON object with the fields of {self.action_cls.__name__} ({fields})",
            )
        try:
            return self.action_cls.model_validate(value), None
        except ValueError as exc:  # pydantic's ValidationError is a ValueError
            errors = exc.errors() if callable(getattr(exc, "errors", None)) else []
            listed = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'action'}: {e['msg']}" for e in errors)
            problem = one_line(listed or exc, _MESSAGE_LIMIT)
            return None, f"error: not a valid {self.action_cls.__name__} ({fields}): {problem}"

    def step(self, message: str):
        if self.done:
            return None
        action, problem = self.action(message)
        if action is None:
            return problem
        observation = self.env.step(action)
        reward = getattr(observation, "reward", None)
        self.total += 0.0 if reward is None else float(reward)
        if getattr(observation, "done", False):
            self.done = True
            return None
        return observation_text(observation)

    def reward(self) -> float:
        self.env.close()
        return self.total


class OpenEnvServerEpisode(OpenEnvEpisode):
    """One trajectory of an OpenEnv environment server (HTTP/WebSocket: a Docker image, a Space, uvicorn), through
    openenv's GenericEnvClient, one session per trajectory (a subclass per spec binds `url`, the Action's JSON
    schema `action_schema` and `text_field`). The same mapping as in process; the server filters reset()'s
    arguments by its signature, so it is sent every field of the row but "prompt" and "origin"."""

    url: str
    action_schema: dict

    def __init__(self, row: dict):
        from openenv.core import GenericEnvClient  # lazy: openenv takes seconds to import

        self.client = GenericEnvClient(base_url=self.url).sync()
        self.client.connect()
        self.total = 0.0
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", "origin")}
        self.done = bool(self.client.reset(**kwargs).done)

    def action(self, message: str):
        if self.text_field is not None:
            return {self.text_field: message}, None
        properties = self.action_schema.get("properties") or {}
        fields = ", ".join(n for n in properties if n != "metadata")
        title = self.action_schema.get("title") or "Action"
        value = _parsed_object(message)
        if value is None:
            return None, f"error: the action must be a JSON object with the fields of {title} ({fields})"
        missing = [n for n in self.action_schema.get("required") or [] if n not in value]
        unknown = [n for n in value if properties and n not in properties]
        if missing or unknown:
            problem = "; ".join(filter(None, [missing and f"missing {missing}", unknown and f"unknown {unknown}"]))
            return None, f"error: not a valid {title} ({fields}): {problem}"
        return value, None

    def step(self, message: str):
        if self.done:
            return None
        action, problem = self.action(message)
        if action is None:
            return problem
        result = self.client.step(action)
        self.total += 0.0 if result.reward is None else float(result.reward)
        if result.done:
            self.done = True
            return None
        return observation_text(result.observation or {})

    def reward(self) -> float:
        self.client.close()
        return self.total

    def __del__(self):
        with contextlib.suppress(Exception):
            self.client.close()


def _server_environment(spec: str, url: str, error: Error) -> type:
    """An OpenEnv server at `url`, checked by reading its Action schema (GET /schema)."""
    base = url.rstrip("/")
    schema_url = re.sub(r"^ws", "http", base) + "/schema"
    try:
        with urllib.request.urlopen(schema_url, timeout=_SCHEMA_TIMEOUT_S) as response:
            schema = json.load(response)["action"]
    except Exception as exc:
        problem = one_line(f"{type(exc).__name__}: {exc}", _MESSAGE_LIMIT)
        raise error(spec, f"cannot read the OpenEnv server's action schema at {schema_url}: {problem}") from None
    required = schema.get("required") or []
    kind = (schema.get("properties") or {}).get(required[0], {}).get("type") if len(required) == 1 else None
    attrs = {"url": base, "action_schema": schema, "text_field": required[0] if kind == "string" else None}
    return type("OpenEnvServer", (OpenEnvServerEpisode,), attrs)


def openenv_environment(spec: str, target: str, error: Error) -> type:
    """The `openenv:` adapter: the Environment class `target` names (path/to/file.py:Class or
    package.module:Class), bound into an OpenEnvEpisode subclass, or the server at the URL `target` is
    (http(s):// or ws(s)://: OpenEnvServerEpisode); `error(spec, problem)` when it is neither."""
    if target.startswith(_URL_SCHEMES):
        return _server_environment(spec, target, error)
    from openenv.core.env_server.interfaces import Environment  # lazy: openenv takes seconds to import
    from openenv.core.env_server.types import Action  # lazy: as above

    forms = "openenv:path/to/file.py:EnvClass or openenv:package.module:EnvClass"
    env_cls = load_object(
        target, lambda _, problem: error(spec, problem), what="OpenEnv environment", kind="class", forms=forms
    )
    if not issubclass(env_cls, Environment):
        raise error(spec, f"{env_cls.__name__} is not an OpenEnv Environment (openenv.core.Environment)")
    action_cls = _action_class(env_cls, Action)
    if action_cls is None:
        raise error(
            spec,
            f"cannot tell {env_cls.__name__}'s Action class: annotate step(self, action: MyAction) or subclass "
            f"Environment[MyAction, MyObservation, State]",
        )
    attrs = {"env_cls": env_cls, "action_cls": action_cls, "text_field": _text_field(action_cls)}
    return type(env_cls.__name__, (OpenEnvEpisode,), attrs)


# ---------------------------------------------------------------- verifiers


class _Turns:
    """The two ends of one trajectory's exchange on its event loop: the env side awaits `ask(text)` (its reply
    to the policy; None at the first turn) and gets the policy's next message (None: the trajectory ended);
    the driver side (step) hands that message in and runs the loop until the env asks again or finishes."""

    def __init__(self, loop):
        self.loop = loop
        self.asked = loop.create_future()
        self.answer = None

    async def ask(self, text: str | None) -> str | None:
        self.answer = self.loop.create_future()
        self.asked.set_result(text)
        return await self.answer

    def give(self, message: str | None) -> None:
        self.asked = self.loop.create_future()
        self.answer.set_result(message)


class _Interaction:
    """What `agent.interaction(task)` yields to the env: `turn(message)` as verifiers' Interaction defines it,
    its replies the policy's messages; `trace` a vf.Trace of the exchange that the task's rewards score."""

    def __init__(self, episode: VerifiersEpisode, task, trace):
        self.episode, self.vf, self.task, self.trace, self.turns = episode, episode.vf, task, trace, episode.turns
        self.started = self.over = False

    def _add(self, message, sampled: bool = False) -> None:
        from verifiers.v1.graph import MessageNode  # lazy: verifiers is imported only for a verifiers: spec

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))

    async def turn(self, message=None):
        vf = self.vf
        if self.over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and self.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        if not self.started and message is not None:
            raise self.episode.unsupported(
                "its task has no prompt, so the env opens the conversation itself; under --env the row's prompt "
                "opens it (give the task a prompt from the row)"
            )
        if isinstance(message, list):  # a turn of several messages: their text, as one user message
            message = vf.TaskData(prompt=message).prompt_text
        self.started = True
        reply = await self.turns.ask(message)
        if reply is None:
            self.over = True
            self.trace.stop("max_turns")
            return vf.Segment(messages=[], terminated=True)
        if message is not None:
            self._add(vf.UserMessage(content=message))
        answer = vf.AssistantMessage(content=reply)
        self._add(answer, sampled=True)
        return vf.Segment(messages=[answer])


class _Seat:
    """One agent seat of the env: the policy's (`interaction`, `run`), or another that nobody plays here."""

    def __init__(self, episode: VerifiersEpisode, name: str, config):
        self.episode, self.name, self.config = episode, name, config
        self.trainable = True

    def _open(self, task):
        if self.name != self.episode.seat:
            raise self.episode.unsupported(
                f"its agent seat '{self.name}' needs a model of its own; under --env only the policy plays "
                f"(seat '{self.episode.seat}')"
            )
        if self.episode.trace is not None:
            raise self.episode.unsupported(
                "it runs the policy more than once in an episode; one trajectory is one conversation"
            )
        vf = self.episode.vf
        from verifiers.v1.trace import AgentInfo, TraceTask  # lazy: verifiers is imported only for a verifiers: spec

        data = TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash)
        trace = vf.Trace(task=data, agent=AgentInfo(config=self.config, name=self.name, trainable=self.trainable))
        self.episode.trace = trace
        interaction = _Interaction(self.episode, task, trace)
        prompt = task.data.prompt
        if prompt is not None:
            if task.data.system_prompt:
                interaction._add(vf.SystemMessage(content=task.data.system_prompt))
            for message in [vf.UserMessage(content=prompt)] if isinstance(prompt, str) else prompt:
                interaction._add(message)
        return interaction

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_):
        interaction = self._open(task)
        yield interaction
        await self._close(interaction)

    async def run(self, task, **_):
        interaction = self._open(task)
        await interaction.turn()
        interaction.trace.stop("agent_completed")
        await self._close(interaction)
        return interaction.trace

    async def _close(self, interaction) -> None:
        trace = interaction.trace
        trace.stop("user_closed")
        trace.ok = True
        await interaction.task.score(trace)


class _Agents:
    """`agents` as the env's run() addresses them: one _Seat per AgentConfig field of its config."""

    def __init__(self, seats: dict):
        self._seats = seats

    def __getattr__(self, name: str):
        seats = self.__dict__.get("_seats") or {}
        if name not in seats:
            raise AttributeError(f"no agent {name!r}; this config declares {sorted(seats)}")
        return seats[name]


class VerifiersEpisode:
    """One trajectory of a verifiers Env (or Taskset) on an event loop of its own (a subclass per spec binds
    `vf`, `env` (None for a taskset alone), `taskset`, `seats` (name -> AgentConfig), `setup_error`, `spec`)."""

    vf: object
    env: object
    taskset: object
    seats: dict
    setup_error: Error
    spec: str

    def __init__(self, row: dict):
        self.task = self.row_task(row)
        self.trace = None
        self.loop = asyncio.new_event_loop()
        self.turns = _Turns(self.loop)
        self.seat = "agent" if self.env is None else None
        self.runner = self.loop.create_task(self.episode())
        self._wait()  # until run() takes the policy's first message (a prompted task's bare turn())

    def unsupported(self, problem: str) -> Exception:
        """What a verifiers env asks that one policy in this loop cannot give (a second seat, its own opening):
        EnvError naming the spec (the run stops: every trajectory would fail the same way)."""
        return self.setup_error(self.spec, f"{type(self).__name__}: {problem}")

    def row_task(self, row: dict):
        """The taskset's Task made from the row: its TaskData's fields by name (the prompt included)."""
        task_cls = self.taskset.task_type()
        data_cls = task_cls.data_type()
        values = {k: row[k] for k in data_cls.model_fields if k in row and k != "idx"}
        try:
            data = data_cls.model_validate(values)
        except ValueError as exc:
            origin = row.get("origin") or "?"
            problem = one_line(exc, _MESSAGE_LIMIT)
            raise self.setup_error(self.spec, f"row {origin} does not make a {data_cls.__name__}: {problem}") from None
        return task_cls(data, self.taskset.config.task)

    async def episode(self) -> None:
        if self.env is None:  # a taskset alone: verifiers' SingleAgentEnv, one seat
            agents = _Agents({"agent": _Seat(self, "agent", self.vf.AgentConfig())})
            await agents.agent.run(self.task)
            return
        seats = {name: _Seat(self, name, config) for name, config in self.seats.items()}
        agents = _Agents(seats)
        await self.env.setup(agents)
        trainable = [name for name, seat in seats.items() if seat.trainable]
        if len(trainable) != 1:
            raise self.unsupported(
                f"its agent seats {sorted(seats)} leave {len(trainable)} trainable after setup(); the policy plays one"
            )
        self.seat = trainable[0]
        await self.env.run(self.task, agents)
        if self.trace is None:
            raise self.unsupported(f"{type(self.env).__name__}.run() ran no agent")
        episode = self.vf.Episode(task=self.trace.task, traces=[self.trace])
        await self.env.finalize(self.task, episode)

    def _wait(self):
        """Run the loop until the env asks the policy (its text; None at the first turn) or its episode ends
        (then the episode's exception, if any, is raised)."""
        self.loop.run_until_complete(asyncio.wait([self.turns.asked, self.runner], return_when=asyncio.FIRST_COMPLETED))
        if self.turns.asked.done():
            return self.turns.asked.result()
        self.close()  # the episode is over: its loop is closed now, not at interpreter exit
        self.runner.result()
        return None

    def step(self, message: str):
        if self.runner.done():
            return None
        self.turns.give(message)
        return self._wait()

    def reward(self) -> float:
        try:
            while not self.runner.done():  # a turn still waiting gets a terminated Segment (a turn after it raises)
                self.turns.give(None)
                self._wait()
            self.runner.result()
            if self.trace is None:
                raise self.unsupported("the episode ran no agent")
            return self.trace.reward
        finally:
            self.close()

    def close(self) -> None:
        if not self.loop.is_closed():
            if not self.runner.done():
                self.runner.cancel()
                with contextlib.suppress(BaseException):
                    self.loop.run_until_complete(self.runner)
            self.loop.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def verifiers_environment(spec: str, target: str, error: Error) -> type:
    """The `verifiers:` adapter: the environment `target` names (an installed taskset id for
    vf.load_environment, or path/to/file.py:function / package.module:function returning a vf.Env or
    vf.Taskset), bound into a VerifiersEpisode subclass; `error(spec, problem)` when it does not load."""
    import verifiers.v1 as vf  # lazy: verifiers takes seconds to import
    from verifiers.v1.configs.agent import agent_config_fields  # lazy: as above

    if ":" in target:
        forms = "verifiers:TASKSET_ID, verifiers:path/to/file.py:function or verifiers:package.module:function"
        make = load_object(target, lambda _, problem: error(spec, problem), what="verifiers environment", forms=forms)
        name = f"{getattr(make, '__name__', 'the function')}()"
        try:
            made = make()
        except Exception as exc:
            raise error(spec, f"{name} raised {type(exc).__name__}: {one_line(exc, _MESSAGE_LIMIT)}") from None
    else:
        name = f"vf.load_environment({target!r})"
        try:
            made = vf.load_environment(vf.resolve_env_config({"taskset": {"id": target}}))
        except Exception as exc:
            raise error(spec, f"{name} raised {type(exc).__name__}: {one_line(exc, _MESSAGE_LIMIT)}") from None
    if isinstance(made, vf.Env):
        env, taskset, seats = made, made.taskset, agent_config_fields(made.config)
        title = type(made).__name__
    elif isinstance(made, vf.Taskset):
        env, taskset, seats, title = None, made, {"agent": None}, type(made).__name__
    else:
        raise error(spec, f"{name} returned {type(made).__name__}, not a verifiers Env or Taskset")
    attrs = {"vf": vf, "env": env, "taskset": taskset, "seats": seats, "spec": spec}
    return type(title, (VerifiersEpisode,), {**attrs, "setup_error": staticmethod(error)})
