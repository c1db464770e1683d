"""Environments (step3_ppo/agents/environments.py): loading by name, file or module, one-line errors, the reply
and reward checks, failures as EnvFailed naming the environment and the row, math_retry's episodes, and the
worker process environments run in (an exit, a crash or a hang is one line, and this process lives on)."""

import contextlib
import sys

import pytest

from step3_ppo.agents.environments import (
    ENVIRONMENTS,
    EnvError,
    EnvFailed,
    EnvironmentSpec,
    EnvironmentWorker,
    MathRetry,
    environments_help,
    load_environment,
    normalise_reply,
)
from step3_ppo.agents.flags import add_agent_args, check_agent_args
from utils.cli import FlagParser
from utils.errors import UsageError

ENVS = '''
class Echo:
    """Says the message back as a tool turn, twice; its reward is the number of steps."""

    def __init__(self, row):
        self.row, self.steps = row, 0

    def step(self, message):
        self.steps += 1
        return {"role": "tool", "content": message.upper()} if self.steps < 3 else None

    def reward(self):
        return self.steps


class Broken:
    def __init__(self, row):
        if row.get("fail") == "init":
            raise KeyError("no board")
        self.fail = row.get("fail")

    def step(self, message):
        if self.fail == "step":
            raise ValueError("bad move")
        return self.fail

    def reward(self):
        if self.fail == "reward":
            raise RuntimeError("no score")
        return {"nan": float("nan"), "text": "1.0", "bool": True}.get(self.fail, 0.5)


class NoStep:
    def __init__(self, row):
        pass


def not_a_class(row):
    return None
'''

ROW = {"prompt": "What is 6 * 7?", "origin": "data/math.jsonl:4", "extra": {"answer": "42"}}


@pytest.fixture()
def envs(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def one_line(exc) -> str:
    text = str(exc)
    assert "\n" not in text
    return text


def test_a_built_in_loads_by_name_and_is_listed_in_the_help():
    env = load_environment("math_retry")
    assert (env.name, env.cls, env.has_reward, env.spec) == ("math_retry", MathRetry, True, "math_retry")
    assert set(ENVIRONMENTS) == {"math_retry"} and environments_help().startswith("math_retry (")


def test_a_class_loads_from_a_file_and_gets_the_flat_row(envs):
    env = load_environment(f"{envs}:Echo")
    assert (env.name, env.has_reward) == ("Echo", True)
    episode = env.make(ROW)
    assert episode.env.row == {"prompt": "What is 6 * 7?", "origin": "data/math.jsonl:4", "answer": "42"}
    assert episode.step("hi") == {"role": "tool", "content": "HI"}
    assert episode.step("again") == {"role": "tool", "content": "AGAIN"}
    assert episode.step("done") is None
    assert env.reward_of(episode, ROW) == 3.0


def test_a_class_loads_from_a_module(envs, monkeypatch):
    monkeypatch.syspath_prepend(str(envs.parent))
    monkeypatch.delitem(sys.modules, "envs", raising=False)
    env = load_environment("envs:Broken")
    assert (env.name, env.has_reward) == ("Broken", True)
    assert load_environment("step3_ppo.agents.environments:MathRetry").name == "MathRetry"


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("{dir}/missing.py:Env", "no such file: {dir}/missing.py"),
        ("{path}:Nope", "has no class 'Nope'"),
        ("{path}:not_a_class", "'not_a_class' is a function, not a class"),
        ("{path}:NoStep", "class NoStep has no step(message) method"),
        ("{path}", "missing the ':class' part"),
        ("math_retyr", "unknown environment; expected a built-in (math_retry), path/to/file.py:Class"),
        ("no_such_pkg_x.envs:Env", "no module named 'no_such_pkg_x'"),
    ],
)
def test_specs_that_do_not_load_are_one_line_naming_the_spec(envs, spec, expected):
    spec = spec.format(dir=envs.parent, path=envs)
    with pytest.raises(EnvError) as info:
        load_environment(spec)
    assert one_line(info.value).startswith(f"environment {spec}: ")
    assert expected.format(dir=envs.parent) in str(info.value)


def test_a_syntax_error_names_the_line(tmp_path):
    (tmp_path / "bad.py").write_text("class Env:\n    def step(self, message:\n")
    with pytest.raises(EnvError, match="syntax error at line 2"):
        load_environment(f"{tmp_path / 'bad.py'}:Env")


@pytest.mark.parametrize(
    "reply, expected",
    [
        (None, None),
        ("Try again", {"role": "user", "content": "Try again"}),
        ({"role": "tool", "content": "4"}, {"role": "tool", "content": "4"}),
        ({"role": "user", "content": ""}, {"role": "user", "content": ""}),
    ],
)
def test_normalise_reply_accepts_a_string_a_message_or_none(reply, expected):
    assert normalise_reply(reply, "Echo", "x.jsonl:1") == expected


@pytest.mark.parametrize(
    "reply, shown",
    [
        ({"role": "assistant", "content": "hi"}, "a dict ({'role': 'assistant', 'content': 'hi'})"),
        ({"role": "tool", "content": 4}, "a dict ({'role': 'tool', 'content': 4})"),
        ({"role": "tool", "content": "4", "name": "calc"}, "a dict ("),
        ({"content": "4"}, "a dict ({'content': '4'})"),
        (42, "an int (42)"),
        (["a"], "a list (['a'])"),
    ],
)
def test_normalise_reply_refuses_anything_else_in_one_line(reply, shown):
    with pytest.raises(EnvFailed) as info:
        normalise_reply(reply, "Echo", "x.jsonl:1")
    assert one_line(info.value).startswith(f"environment Echo failed on row x.jsonl:1: step() returned {shown}")
    assert "expected a str, {'role': 'tool' | 'user', 'content': str} or None" in str(info.value)


@pytest.mark.parametrize(
    "fail, call, expected",
    [
        ("init", "make", "Broken(row) raised KeyError: 'no board'"),
        ("step", "step", "step() raised ValueError: bad move"),
        ("reward", "reward", "reward() raised RuntimeError: no score"),
        (7, "step", "step() returned an int (7); expected a str"),
        ("nan", "reward", "reward() returned nan (float); expected a finite number"),
        ("text", "reward", "reward() returned '1.0' (str); expected a finite number"),
    ],
)
def test_a_raising_or_misbehaving_environment_is_env_failed_naming_it_and_the_row(envs, fail, call, expected):
    env = load_environment(f"{envs}:Broken")
    row = {**ROW, "extra": {"fail": fail}}
    with pytest.raises(EnvFailed) as info:
        episode = env.make(row)
        if call == "step":
            episode.step("move")
        elif call == "reward":
            assert episode.step("move") == {"role": "user", "content": fail}
            env.reward_of(episode, row)
    assert one_line(info.value).startswith(f"environment Broken failed on row data/math.jsonl:4: {expected}")
    assert (info.value.env, info.value.origin) == ("Broken", "data/math.jsonl:4")


def test_a_bool_reward_is_zero_or_one(envs):
    env = load_environment(f"{envs}:Broken")
    assert env.reward_of(env.make({**ROW, "extra": {"fail": "bool"}})) == 1.0


def test_math_retry_asks_again_until_right():
    env = load_environment("math_retry")
    episode = env.make(ROW)
    assert episode.step("It is 41.") == {"role": "user", "content": MathRetry.retry}
    assert "\\boxed{...}" in MathRetry.retry
    assert episode.step("Then \\boxed{43}") == {"role": "user", "content": MathRetry.retry}
    assert episode.step("6 * 7 = \\boxed{42}") is None
    assert env.reward_of(episode) == 1.0 and episode.env.attempts == 3


def test_math_retry_stops_after_max_attempts_with_reward_zero():
    env = load_environment("math_retry")
    episode = env.make({**ROW, "extra": {"answer": 42}})
    assert episode.step("\\boxed{40}") is not None and episode.step("\\boxed{41}") is not None
    assert episode.step("\\boxed{43}") is None
    assert env.reward_of(episode) == 0.0


def test_math_retry_right_at_once_ends_the_episode():
    episode = load_environment("math_retry").make({**ROW, "extra": {"answer": "1,234"}})
    assert episode.step("The total is 1234.") is None and episode.reward() == 1.0


def test_math_retry_without_an_answer_stops_the_run_naming_the_row():
    with pytest.raises(EnvError) as info:
        load_environment("math_retry").make({"prompt": "hi", "origin": "data/math.jsonl:9", "extra": {}})
    assert one_line(info.value).startswith("environment math_retry: row data/math.jsonl:9 has no 'answer' field")


# ---------------------------------------------------------------- in a worker process

HOSTILE = """
import os
import time

HOW, WHEN = {how!r}, {when!r}


def act(when, row):
    if when != WHEN or not row.get("origin", "").endswith(":1"):  # row 1 only: the others are bystanders
        return
    if HOW == "os_exit":
        os._exit(0)
    if HOW == "system_exit":
        raise SystemExit(0)
    if HOW == "raise":
        raise RuntimeError("broken board")
    if HOW == "hang":
        time.sleep(3600)


class Hostile:
    def __init__(self, row):
        self.row = row
        act("init", row)

    def step(self, message):
        act("step", self.row)
        return "again"

    def reward(self):
        act("reward", self.row)
        return 1.0
"""

BAD, GOOD = {"prompt": "p", "origin": "x.jsonl:1"}, {"prompt": "p", "origin": "x.jsonl:2"}

# how the environment misbehaves: what the one line says after "<call> " (a death: "during <call>, ...")
HOSTILITIES = {
    "os_exit": "during {call}, its worker process died (exit status 0)",
    "system_exit": "{call} called sys.exit(0)",
    "raise": "{call} raised RuntimeError: broken board",
    "hang": "{call} ran past --env_timeout 0.5 s (its worker process was killed)",
}


def write_hostile(folder, how: str, when: str):
    """The Hostile environment loaded from a file: on rows whose origin ends with ':1', its constructor
    (when="init"), step() or reward() does `how` (a HOSTILITIES key)."""
    path = folder / f"hostile_{how}_{when}.py"
    path.write_text(HOSTILE.format(how=how, when=when))
    return load_environment(f"{path}:Hostile")


@pytest.mark.parametrize("how", list(HOSTILITIES))
@pytest.mark.parametrize("when, call", [("init", "Hostile(row)"), ("step", "step()"), ("reward", "reward()")])
def test_an_environment_that_exits_raises_or_hangs_is_one_line_and_the_worker_goes_on(tmp_path, how, when, call):
    """os._exit(0), SystemExit(0), an exception or a hang in the constructor, step() or reward(): one line naming
    the environment class, the row and the call; this process lives on. A death or a kill takes the environments
    of the other trajectories in the worker with it ("lost", one line too); the next trajectory starts a new one."""
    env = write_hostile(tmp_path, how, when)
    worker = EnvironmentWorker(env, timeout=0.5)
    try:
        bystander = worker.make(GOOD)
        with pytest.raises(EnvFailed) as info:
            episode = worker.make(BAD)
            assert worker.step(episode, "move") == {"role": "user", "content": "again"}
            worker.reward(episode)
        assert one_line(info.value) == f"environment Hostile failed on row x.jsonl:1: {HOSTILITIES[how]}".format(
            call=call
        )
        if how == "raise":  # the worker lives on, and so does the other trajectory's environment
            assert worker.step(bystander, "move") == {"role": "user", "content": "again"}
        else:
            with pytest.raises(EnvFailed) as lost:
                worker.step(bystander, "move")
            assert one_line(lost.value).startswith(
                "environment Hostile failed on row x.jsonl:2: step(): its environment was lost with its worker process"
            )
        fresh = worker.make(GOOD)
        assert worker.step(fresh, "move") == {"role": "user", "content": "again"} and worker.reward(fresh) == 1.0
    finally:
        worker.close()


def test_an_environment_that_cannot_be_loaded_in_a_worker_says_so_in_one_line():
    class Local:  # made here: no spec a worker process can load it by
        def __init__(self, row):
            pass

        def step(self, message):
            return None

    worker = EnvironmentWorker(EnvironmentSpec("Local", Local, False, "Local"), timeout=5)
    with pytest.raises(EnvError) as info:
        worker.make(GOOD)
    assert one_line(info.value).startswith(
        "environment Local: cannot be loaded in a worker process (environments run in one): unknown environment"
    )


def test_a_wrong_setup_in_the_worker_still_stops_the_run_naming_the_row():
    worker = EnvironmentWorker(load_environment("math_retry"), timeout=5)
    try:
        with pytest.raises(EnvError) as info:
            worker.make({"prompt": "hi", "origin": "data/math.jsonl:9", "extra": {}})
        assert one_line(info.value).startswith("environment math_retry: row data/math.jsonl:9 has no 'answer' field")
        episode = worker.make(ROW)  # the worker's replies are the in-process environment's
        assert worker.step(episode, "It is 41.") == {"role": "user", "content": MathRetry.retry}
        assert worker.step(episode, "\\boxed{42}") is None and worker.reward(episode) == 1.0
    finally:
        worker.close()


@pytest.mark.parametrize(
    "given, error",
    [
        (["--env_timeout", "0"], "--env_timeout must be > 0, got 0"),
        (["--env_timeout=nan"], "--env_timeout must be > 0, got nan"),
        (["--env_timeout=inf"], "--env_timeout must be > 0, got inf"),
        (["--tools", "calculator", "--env_timeout", "5"], "--env_timeout is for an environment's calls: give --env"),
        (["--env_timeout", "5"], None),
    ],
)
def test_env_timeout_is_checked(given, error):
    parser = FlagParser()
    add_agent_args(parser)
    argv = given if "--tools" in given else ["--env", "math_retry", *given]
    with pytest.raises(UsageError) if error and "must be" in error else contextlib.nullcontext() as info:
        args = parser.parse_args(argv)  # the range: the flag's own type
    if error and "must be" in error:
        assert str(info.value).startswith(error)
        return
    args.max_answer_seq_len = 8
    if error is None:
        check_agent_args(args)
        assert args.env_timeout == 5.0
        return
    with pytest.raises(UsageError) as info:
        check_agent_args(args)
    assert str(info.value).startswith(error)
