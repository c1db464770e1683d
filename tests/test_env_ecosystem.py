"""OpenEnv and verifiers environments under `--env` (step3_ppo/agents/ecosystem.py), with real environments of each.

OpenEnv: the echo environment that openenv-core ships as the template of `openenv init` (its wheel holds no other
environment), generated here by the package's own templating functions into a package on sys.path. verifiers:
a taskset package written with verifiers' own classes (vf.Taskset, vf.Task with @vf.reward, a vf.Env whose run()
holds an interaction), loadable by id through vf.load_environment (verifiers 0.4.0 ships no environment that
runs offline: its tasksets need Docker, uv, harbor or textarena)."""

import json
import textwrap

import pytest

from step3_ppo.agents.environments import EnvError, EnvFailed, load_environment
from step3_ppo.agents.loop import AgentLimits, MultiTurn
from tests.test_agents import ScriptedEngine, agent_setup, prompt_batch
from utils.data.chat import stop_token_ids
from utils.models.forward import GenerationSettings
from utils.models.loading import load_tokenizer

ECHO = "openenv:echo_env.server.echo_env_environment:EchoEnvironment"
GUESS = "verifiers:guess_number"

GUESS_PACKAGE = '''
"""A guessing game written for verifiers 0.4.0: the answer is the row's; a wrong guess is told to try again."""

import verifiers.v1 as vf


class GuessData(vf.TaskData):
    answer: str


class GuessTask(vf.Task[GuessData]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply.strip() == task.answer)

    @vf.reward(weight=0.5)
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class GuessTaskset(vf.Taskset[GuessTask]):
    def load(self):
        yield GuessTask(GuessData(prompt="Guess my number.", answer="7"), self.config.task)


class GuessEnv(vf.Env[vf.SingleAgentEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            segment = await chat.turn()
            attempt = 1
            while not segment.terminated and segment.last_reply != task.data.answer:
                if "boom" in segment.last_reply:
                    raise ValueError("the env broke")
                attempt += 1
                segment = await chat.turn(f"No. Attempt {attempt}: guess again.")


__all__ = ["GuessTaskset", "GuessEnv"]
'''

LOADERS = """
import guess_number

import verifiers.v1 as vf


def taskset_alone():
    return guess_number.GuessTaskset(vf.TasksetConfig())


def broken():
    raise RuntimeError("no data here")


def two_seats():
    from verifiers.v1.envs.user_sim import UserSimEnv

    config = vf.resolve_env_config({"id": "user-sim", "taskset": {"id": "guess_number"}})
    return UserSimEnv(config)
"""


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    """A folder holding the echo env generated from openenv-core's template, and the guess_number taskset."""
    from pathlib import Path

    from openenv.cli.commands.init import _copy_template_directory, _create_template_replacements

    root = tmp_path_factory.mktemp("ecosystem")
    template = "openenv.cli.templates.openenv_env"
    _copy_template_directory(
        template, "", Path(root / "echo_env"), _create_template_replacements("echo_env"), "echo_env"
    )
    (root / "guess_number").mkdir()
    (root / "guess_number" / "__init__.py").write_text(GUESS_PACKAGE)
    (root / "loaders.py").write_text(LOADERS)
    return root


@pytest.fixture(autouse=True)
def on_path(packages, monkeypatch):
    monkeypatch.syspath_prepend(str(packages))  # the worker process gets the parent's sys.path


ROW = {"prompt": [{"role": "user", "content": "Guess my number."}], "origin": "x.jsonl:1", "answer": "7"}


# ---------------------------------------------------------------- OpenEnv


def test_openenv_echo_maps_reset_action_observation_and_sums_the_step_rewards():
    environment = load_environment(ECHO)
    assert environment.name == "EchoEnvironment" and environment.has_reward
    episode = environment.make(ROW)  # EchoEnvironment() then reset(): it takes none of the row's fields
    assert episode.step("hello") == {"role": "user", "content": "hello"}  # EchoAction(message=...) -> echoed_message
    assert episode.step("abc") == {"role": "user", "content": "abc"}
    assert episode.reward() == pytest.approx(0.1 * 5 + 0.1 * 3)  # the echo's rewards (0.1 per character), summed


def test_openenv_done_ends_the_episode_json_actions_and_reset_gets_the_rows_fields(tmp_path):
    (tmp_path / "count_env.py").write_text(
        textwrap.dedent(
            """
            from openenv.core import Action, Environment, Observation, State


            class Move(Action):
                steps: int
                note: str = ""


            class Board(Observation):
                position: int = 0
                target: int = 0


            class CountEnv(Environment[Move, Board, State]):
                def reset(self, seed=None, episode_id=None, target=3, **kwargs):
                    self.position, self.target, self.kwargs = 0, int(target), kwargs
                    return Board(position=0, target=self.target)

                def step(self, action, timeout_s=None, **kwargs):
                    self.position += action.steps
                    done = self.position >= self.target
                    return Board(position=self.position, target=self.target, done=done, reward=1.0 if done else -0.25)

                @property
                def state(self):
                    return State()
            """
        )
    )
    environment = load_environment(f"openenv:{tmp_path / 'count_env.py'}:CountEnv")
    episode = environment.make({**ROW, "target": "2"})
    assert episode.env.env.target == 2 and episode.env.env.kwargs == {"answer": "7"}  # not "prompt", not "origin"
    bad = episode.step("two steps please")["content"]
    assert bad.startswith("error: the action must be a JSON object with the fields of Move (steps, note)")
    wrong = episode.step('{"steps": "many"}')["content"]
    assert wrong == "error: not a valid Move (steps, note): steps: Input should be a valid integer, " + (
        "unable to parse string as an integer"
    )
    assert json.loads(episode.step('{"steps": 1}')["content"]) == {"position": 1, "target": 2}
    assert episode.step('```json\n{"steps": 1}\n```') is None  # done
    assert episode.reward() == pytest.approx(-0.25 + 1.0)


def test_openenv_errors_are_one_line_naming_the_spec(tmp_path):
    (tmp_path / "broken_env.py").write_text(
        textwrap.dedent(
            """
            from openenv.core import Action, Environment, Observation, State


            class Say(Action):
                text: str


            class Broken(Environment):
                def reset(self, **kwargs):
                    return Observation()

                def step(self, action: Say, **kwargs):
                    raise RuntimeError("the server is down")

                @property
                def state(self):
                    return State()


            class Untyped(Broken):
                def step(self, action, **kwargs):
                    return Observation()


            class NotAnEnv:
                def step(self, action):
                    return None
            """
        )
    )
    path = tmp_path / "broken_env.py"
    with pytest.raises(EnvError, match=r"^environment openenv:.*:Untyped: cannot tell Untyped's Action class"):
        load_environment(f"openenv:{path}:Untyped")
    with pytest.raises(EnvError, match=r"NotAnEnv is not an OpenEnv Environment"):
        load_environment(f"openenv:{path}:NotAnEnv")
    with pytest.raises(EnvError, match=r"^environment openenv:no_such_module:X: no module named 'no_such_module'"):
        load_environment("openenv:no_such_module:X")
    with pytest.raises(EnvError, match=r"missing what to load after 'openenv:'"):
        load_environment("openenv:")
    episode = load_environment(f"openenv:{path}:Broken").make(ROW)
    with pytest.raises(EnvFailed) as info:
        episode.step("hi")
    assert str(info.value) == (
        "environment Broken failed on row x.jsonl:1: step() raised RuntimeError: the server is down"
    )


@pytest.fixture(scope="module")
def echo_server(packages):
    """The echo environment served by openenv's own HTTP/WebSocket server (create_app, as the template's
    server/app.py builds it, with room for 4 sessions), under uvicorn in a thread of this process."""
    import sys
    import threading
    import time

    import uvicorn
    from openenv.core.env_server.http_server import create_app

    from utils.runtime.ports import free_port

    sys.path.insert(0, str(packages))
    try:
        from echo_env.models import EchoAction, EchoObservation
        from echo_env.server.echo_env_environment import EchoEnvironment
    finally:
        sys.path.remove(str(packages))
    app = create_app(EchoEnvironment, EchoAction, EchoObservation, env_name="echo_env", max_concurrent_envs=4)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_openenv_server_is_reached_by_url_with_the_same_mapping(echo_server):
    environment = load_environment(f"openenv:{echo_server}")  # reads the Action schema: EchoAction(message: str)
    assert environment.name == "OpenEnvServer" and environment.cls.text_field == "message"
    episode = environment.make(ROW)  # one WebSocket session per trajectory
    assert episode.step("hello") == {"role": "user", "content": "hello"}
    assert episode.step("abc") == {"role": "user", "content": "abc"}
    assert episode.reward() == pytest.approx(0.1 * 5 + 0.1 * 3)
    with pytest.raises(EnvError, match=r"^environment openenv:http://127.0.0.1:1: cannot read the OpenEnv server's"):
        load_environment("openenv:http://127.0.0.1:1")


# ---------------------------------------------------------------- verifiers


def test_verifiers_env_runs_its_interaction_and_the_tasks_rewards_score_it():
    environment = load_environment(GUESS)  # vf.load_environment on the installed taskset id
    assert environment.name == "GuessEnv" and environment.has_reward
    episode = environment.make(ROW)
    assert episode.step("3") == {"role": "user", "content": "No. Attempt 2: guess again."}
    assert episode.step("5") == {"role": "user", "content": "No. Attempt 3: guess again."}
    assert episode.step("7") is None  # run() returned: the episode ends
    assert episode.reward() == pytest.approx(1.0 + 0.5 * 3)  # correct + 0.5 x turns, verifiers' trace.reward
    trace = episode.env.trace
    assert [m.role for m in trace.messages] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert trace.rewards["correct"].score == 1.0 and trace.task.data.answer == "7"

    cut = environment.make(ROW)  # the trajectory ends (--max_turns) while run() waits: a terminated Segment
    assert cut.step("1")["content"] == "No. Attempt 2: guess again."
    assert cut.reward() == pytest.approx(0.5 * 1)
    assert cut.env.trace.stop_condition == "max_turns"


def test_verifiers_taskset_alone_is_one_turn_and_errors_are_one_line(packages):
    environment = load_environment(f"verifiers:{packages / 'loaders.py'}:taskset_alone")
    assert environment.name == "GuessTaskset"
    episode = environment.make(ROW)
    assert episode.step("7") is None and episode.reward() == pytest.approx(1.0 + 0.5)

    with pytest.raises(EnvError, match=r"^environment verifiers:.*:broken: broken\(\) raised RuntimeError: no data"):
        load_environment(f"verifiers:{packages / 'loaders.py'}:broken")
    with pytest.raises(
        EnvError, match=r"^environment verifiers:no_such_env: vf.load_environment\('no_such_env'\) raised"
    ):
        load_environment("verifiers:no_such_env")
    guess = load_environment(GUESS)
    with pytest.raises(EnvError, match=r"^environment verifiers:guess_number: row x.jsonl:1 does not make a GuessData"):
        guess.make({k: v for k, v in ROW.items() if k != "answer"})
    episode = guess.make(ROW)
    with pytest.raises(EnvFailed) as info:
        episode.step("boom")
    assert str(info.value) == "environment GuessEnv failed on row x.jsonl:1: step() raised ValueError: the env broke"
    with pytest.raises(EnvError, match=r"agent seats \['assistant', 'user'\] leave 1 trainable|seat 'user' needs"):
        load_environment(f"verifiers:{packages / 'loaders.py'}:two_seats").make(ROW)


# ---------------------------------------------------------------- in the multi-turn loop and a step-3 iteration


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_llama):
    return load_tokenizer(tiny_chat_llama, padding_side="left")


@pytest.mark.parametrize("spec", [ECHO, GUESS, "server"])
def test_the_loop_runs_them_in_the_worker_and_masks_their_replies(tokenizer, spec, request):
    if spec == "server":  # the echo again, through its server
        spec = f"openenv:{request.getfixturevalue('echo_server')}"
    engine = ScriptedEngine(tokenizer, ["3", "7", "9"])
    limits = AgentLimits(max_turns=3, max_answer_seq_len=20, max_trajectory_len=300, max_observation_len=50)
    agent = MultiTurn(tokenizer, limits, environment=load_environment(spec))
    batch = prompt_batch(tokenizer, ["Guess my number."])
    batch["rows"] = [{**batch["rows"][0], "extra": {"answer": "7"}}]
    try:
        (row,) = agent.rollout(engine, batch, GenerationSettings(20), 1, stop_token_ids(tokenizer, chat=True), 0)
    finally:
        agent.close()
    roles = [m["role"] for m in row.agent["messages"]]
    if spec != GUESS:  # the echo echoes each guess, never done: 3 turns, 0.1 per character
        assert roles == ["assistant", "user", "assistant", "user", "assistant"]
        assert row.agent["env_reward"] == pytest.approx(0.3)
        assert row.agent["messages"][1]["content"] == "3"
    else:  # "7" is right at the second turn
        assert roles == ["assistant", "user", "assistant"] and row.agent["env_reward"] == 1.0 + 0.5 * 2
    mask = row.response_action_mask.tolist()
    assert 0 in mask and mask[-1] == 1 and row.agent["env_tokens"] == mask.count(0)


def _expected_env_reward(spec: str, row) -> float:
    said = [m["content"] for m in row.agent["messages"] if m["role"] == "assistant"]
    if spec == ECHO:
        return sum(0.1 * len(text) for text in said)
    return float(said[-1].strip() == row.prompt["extra"]["answer"]) + 0.5 * len(said)


@pytest.mark.slow
@pytest.mark.parametrize("spec", [GUESS])  # OpenEnv's echo: the same loop in the worker, above (each costs ~20 s)
def test_a_step3_iteration_at_lr0_with_the_package_environment(tiny_chat_llama, tiny_chat_llama_reward, tmp_path, spec):
    """One multi-turn iteration (GAE, lr 0) with `--env openenv:...` / `--env verifiers:...`: rows of several turns,
    the environment's tokens masked out, log-ratio ~0, and the environment's reward is the row's `env` component."""
    from utils.data import PromptCollator

    run_ = agent_setup(tiny_chat_llama, tiny_chat_llama_reward, tmp_path, "--env", spec, "--env_timeout", "30")
    trainer = run_.trainer
    try:
        examples = list(run_.loader.dataset)
        collate = PromptCollator(run_.tokenizer.pad_token_id)
        metrics, rows = trainer.step([collate(examples[0:3]), collate(examples[3:6])], step=0)
    finally:
        trainer.agent.close()
    assert len(rows) == 6 and any(r.agent["turns"] > 1 for r in rows)
    assert metrics["rollout/env_tokens_mean"] > 0
    for row in rows:
        mask = row.response_action_mask.tolist()
        assert row.agent["env_tokens"] == mask.count(0) and (row.agent["turns"] == 1 or 0 in mask)
        assert row.score_parts["env"] == pytest.approx(_expected_env_reward(spec, row), abs=1e-5)
    assert metrics["reward/env_mean"] == pytest.approx(sum(r.score_parts["env"] for r in rows) / len(rows), abs=1e-5)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4, metrics["ppo/log_ratio_max_abs"]
