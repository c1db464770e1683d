"""The multi-turn flags (--env, --tools and the limits) of step 3's training and evaluation and of chat.py,
and their checks before any model loads. Imports no torch, so --help and flag errors answer at once; the
loop itself is step3_ppo/agents/loop.py."""

from __future__ import annotations

from step3_ppo.agents.environments import (
    DEFAULT_ENV_TIMEOUT_S,
    EnvError,
    adapters_help,
    environments_help,
    load_environment,
)
from step3_ppo.agents.tools import (
    MAX_CALLS_PER_TURN,
    TOOL_CALL_PARSERS,
    TOOLS,
    ToolError,
    load_tools,
    sandbox_missing,
)
from utils.cli import Number
from utils.train.flags import fail

AGENT_DEFAULTS = {
    "max_turns": 4,
    "max_observation_len": 128,
    "tool_timeout": 10.0,
    "tool_parser": "hermes",
    "env_timeout": DEFAULT_ENV_TIMEOUT_S,
    "max_tool_calls_per_turn": MAX_CALLS_PER_TURN,
}


def add_agent_args(parser) -> None:
    """--env, --tools and the multi-turn limits (step 3's training and evaluation, chat.py)."""
    g = parser.add_argument_group("agents: multi-turn rollouts with an environment and tools")
    g.add_argument(
        "--env",
        default=None,
        metavar="SPEC",
        help="the environment that answers the policy between turns: a built-in ("
        + environments_help().replace("%", "%%")
        + "), path/to/file.py:Class, package.module:Class, "
        + adapters_help()
        + " (docs: guides/agents.md)",
    )
    g.add_argument(
        "--tools",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="functions the policy may call (--tool_parser): built-ins ("
        + ", ".join(f"{name} ({t.help})" for name, t in TOOLS.items()).replace("%", "%%")
        + "), path/to/file.py:function or package.module:function (TRL's convention: type hints "
        "and a docstring with Args)",
    )
    g.add_argument(
        "--tool_timeout",
        type=Number(float, above=0),
        default=None,
        help=f"seconds one tool call may take; then its process is killed and the model is told "
        f"(default {AGENT_DEFAULTS['tool_timeout']:g})",
    )
    g.add_argument(
        "--env_timeout",
        type=Number(float, above=0),
        default=None,
        help=f"seconds one call of the environment (its constructor, step() or reward()) may take in its worker "
        f"process; then the process is killed and the trajectory fails (default {AGENT_DEFAULTS['env_timeout']:g})",
    )
    g.add_argument(
        "--tool_parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="how tool calls are read from an answer: "
        + "; ".join(f"{name}: {p.help}" for name, p in TOOL_CALL_PARSERS.items()).replace("%", "%%")
        + f" (default {AGENT_DEFAULTS['tool_parser']})",
    )
    g.add_argument(
        "--max_tool_calls_per_turn",
        type=Number(int, low=1),
        default=None,
        help=f"tool calls run per assistant message; the rest are not run, the model is told how many, and they count "
        f"as failed calls (default {AGENT_DEFAULTS['max_tool_calls_per_turn']})",
    )
    g.add_argument(
        "--max_turns",
        type=Number(int, low=1),
        default=None,
        help=f"the policy's turns per trajectory (default {AGENT_DEFAULTS['max_turns']}); "
        f"the answer length limit (--max_answer_seq_len; eval's --max_new_tokens) is per turn",
    )
    g.add_argument(
        "--max_observation_len",
        type=Number(int, low=1),
        default=None,
        help=f"tokens of one environment or tool reply; longer ones are cut and marked "
        f"(default {AGENT_DEFAULTS['max_observation_len']})",
    )
    g.add_argument(
        "--max_trajectory_len",
        type=Number(int, low=1),
        default=None,
        help="response tokens of a whole trajectory, turns and replies (default: --max_turns x (the answer "
        "length limit + --max_observation_len)); one that reaches it ends, truncated",
    )


def check_agent_args(args) -> None:
    """The multi-turn flags, before any model is loaded: the environment and tools load (one line if not),
    (their ranges: the parser), and none is given without --env or --tools (it would change nothing).
    Sets `args.environment` (a loaded EnvironmentSpec or None), `args.tool_list` and the limits' defaults."""
    args.environment, args.tool_list = None, []
    multi_turn = bool(args.env or args.tools)
    if not multi_turn:
        given = [name for name in (*AGENT_DEFAULTS, "max_trajectory_len") if getattr(args, name, None) is not None]
        if given:
            fail(f"--{given[0]} is for multi-turn rollouts: give --env or --tools (or leave it out)")
        return
    if not args.env and getattr(args, "env_timeout", None) is not None:
        fail("--env_timeout is for an environment's calls: give --env (or leave it out)")
    for name, value in AGENT_DEFAULTS.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.max_trajectory_len is None:
        args.max_trajectory_len = args.max_turns * (args.max_answer_seq_len + args.max_observation_len)
    try:
        args.environment = load_environment(args.env) if args.env else None
        args.tool_list = load_tools(args.tools or [])
    except (EnvError, ToolError) as exc:
        fail(f"{'--env' if isinstance(exc, EnvError) else '--tools'}: {exc}")
    if "python" in (args.tools or []) and sandbox_missing():
        fail(f"--tools python: {sandbox_missing()}")
