"""Tools for multi-turn rollouts (step3_ppo/agents/tools.py): the calculator's values and refusals, the
Hermes call parser, TRL-style schemas and one-line spec errors, a Toolbox that turns every failed call into
text for the model (and stops a hung call, C code included, within 2x the timeout), and the python tool's
sandbox as the model meets it (step3_ppo/agents/python_sandbox.py: bubblewrap): output, errors, a fresh folder each
call, limits, the timeout, and nothing run at all without bubblewrap. What the sandbox denies is
tests/test_python_sandbox.py."""

import json
import os
import socket
import tempfile
import time
from types import SimpleNamespace

import pytest

from step3_ppo.agents import python_sandbox
from step3_ppo.agents.flags import check_agent_args
from step3_ppo.agents.tools import (
    MAX_NESTING,
    TOOL_CALL_PARSERS,
    TOOLS,
    Tool,
    Toolbox,
    ToolCall,
    ToolError,
    calculator,
    load_tools,
    python,
    run_python,
    template_supports_tools,
    tool_schema,
    tool_system_prompt,
)
from utils.errors import UsageError

SANDBOX_MISSING = python_sandbox.missing()
needs_sandbox = pytest.mark.skipif(
    SANDBOX_MISSING is not None, reason=f"the python tool refuses here: {SANDBOX_MISSING}"
)


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("(123 * 45 + 6789) / 2", "6162"),
        ("2 ** 100", "1267650600228229401496703205376"),
        ("0.1 + 0.2", "0.3"),
        ("7 / 2", "3.5"),
        ("-7 // 2", "-4"),
        ("17 % 5", "2"),
        ("+-3", "-3"),
        ("2 ** -1", "0.5"),
        (" 1_000 * 3 ", "3000"),
        ("123456789 * 987654321", "121932631112635269"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression, message",
    [
        ("9**9**9", "too large"),
        ("10**999 * 10**999", "too large"),
        ("2.0 ** 10000", "too large"),
        ("1e308 * 10", "too large"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("x + 1", "not the name 'x'"),
        ("__import__('os').system('true')", "not a function call"),
        ("(1).real", "not an attribute"),
        ("'a' * 3", "not the str"),
        ("True + 1", "not the bool"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1 << 3", "allowed"),
        ("1" * 2000, "longer than"),
    ],
)
def test_calculator_refusals(expression, message):
    with pytest.raises(ValueError, match=message) as info:
        calculator(expression)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------- parsing


def parse(message):
    return TOOL_CALL_PARSERS["hermes"].parse(message)


def test_parser_reads_one_and_two_calls():
    assert parse("Let me compute. " + call("calculator", expression="1+1")) == [
        ToolCall("calculator", {"expression": "1+1"})
    ]
    two = parse(call("a", x=1) + " and " + call("b") + " done")
    assert two == [ToolCall("a", {"x": 1}), ToolCall("b", {})]
    assert parse("no call here, just <tool_call the answer") == [] and parse("") == []


def test_parser_accepts_arguments_as_a_json_string():
    body = json.dumps({"name": "calculator", "arguments": json.dumps({"expression": "2*3"})})
    assert parse(f"<tool_call>{body}</tool_call>") == [ToolCall("calculator", {"expression": "2*3"})]


@pytest.mark.parametrize(
    "body, name, message",
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', None, "not valid JSON"),
        ('{"arguments": {"expression": "1"}}', None, 'no "name"'),
        ('["calculator"]', None, "got an array"),
        ('{"name": "calculator", "arguments": [1, 2]}', "calculator", "got an array"),
        ('{"name": "calculator", "arguments": "not json"}', "calculator", "not a JSON object"),
    ],
)
def test_parser_marks_malformed_calls(body, name, message):
    [parsed] = parse(f"<tool_call>{body}</tool_call>")
    assert parsed.name == name and parsed.arguments is None and message in parsed.error


def test_parser_marks_an_unclosed_block_after_good_ones():
    calls = parse(call("a") + ' <tool_call>{"name": "b", "argu')
    assert calls[0] == ToolCall("a", {}) and calls[1].error and "not closed" in calls[1].error and len(calls) == 2


# ---------------------------------------------------------------- loading

TRL_TOOL = '''
def get_weather(city: str, unit: str = "celsius") -> str:
    """Gets the current weather in a city.

    Args:
        city: The city's name.
        unit: The temperature unit, "celsius" or "fahrenheit".
    """
    return f"22 degrees {unit} in {city}"


def no_docstring(city: str) -> str:
    return city


def no_hints(city):
    """Echoes.

    Args:
        city: The city's name.
    """
    return city
'''


@pytest.fixture
def tool_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TRL_TOOL)
    return str(path)


def test_schema_of_a_trl_style_function(tool_file):
    [tool] = load_tools([f"{tool_file}:get_weather"])
    assert tool.name == "get_weather" and tool.spec == f"{tool_file}:get_weather"
    assert tool.schema == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Gets the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name."},
                    "unit": {"type": "string", "description": 'The temperature unit, "celsius" or "fahrenheit".'},
                },
                "required": ["city"],
            },
            "return": {"type": "string"},
        },
    }
    [builtin] = load_tools(["calculator"])
    assert builtin.schema["function"]["parameters"]["required"] == ["expression"]
    assert load_tools(["step3_ppo.agents.tools:calculator"])[0].schema == builtin.schema


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown tool; expected a built-in (calculator, python)"),
        ("missing_file.py:f", "no such file"),
        ("{file}:absent", "has no function 'absent'"),
        ("{file}:no_docstring", "no docstring"),
        ("{file}:no_hints", "missing a type hint"),
        ("step3_ppo.no_such_module:f", "no module named"),
    ],
)
def test_bad_specs_are_one_line(tool_file, spec, message):
    spec = spec.format(file=tool_file)
    with pytest.raises(ToolError) as info:
        load_tools([spec])
    text = str(info.value)
    assert text.startswith(f"tool {spec}: ") and message in text and "\n" not in text


def test_duplicate_names_are_refused(tool_file):
    with pytest.raises(ToolError, match="also the name of tool calculator"):
        load_tools(["calculator", "step3_ppo.agents.tools:calculator"])


def test_system_prompt_and_template_check():
    schemas = [tool.schema for tool in load_tools(["calculator"])]
    prompt = tool_system_prompt(schemas)
    function = json.loads(prompt.splitlines()[1])  # one compact JSON line per tool: the function's schema
    assert function == {k: v for k, v in schemas[0]["function"].items() if k != "return"}
    assert '<tool_call>{"name": ..., "arguments": {...}}</tool_call>' in prompt
    assert template_supports_tools(SimpleNamespace(chat_template="{% if tools %}{{ tools }}{% endif %}"))
    assert template_supports_tools(SimpleNamespace(chat_template={"default": "x", "tool_use": "{{ tools }}"}))
    assert not template_supports_tools(SimpleNamespace(chat_template="{{ messages }} tool_calls_x"))
    assert not template_supports_tools(SimpleNamespace(chat_template=None))


# ---------------------------------------------------------------- the Toolbox

USER_TOOLS = '''
import re, time

def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("the backend is down")


def table(n: int) -> dict:
    """A small table.

    Args:
        n: How many rows.
    """
    return {"rows": list(range(n))}


def spin(seconds: float) -> str:
    """Busy-waits in Python forever.

    Args:
        seconds: Ignored.
    """
    while True:
        pass


def regex(text: str) -> bool:
    """Matches a catastrophic regular expression (hangs in C code).

    Args:
        text: The text to match.
    """
    return re.match(r"(a+)+$", text) is not None
'''


@pytest.fixture
def user_tools(tmp_path):
    path = tmp_path / "user_tools.py"
    path.write_text(USER_TOOLS)
    names = ["add", "broken", "table", "spin", "regex"]
    return load_tools(["calculator"] + [f"{path}:{name}" for name in names])


def test_every_failed_call_comes_back_as_text(user_tools):
    with Toolbox(user_tools, timeout=30) as box:
        assert box.respond("The answer is 4.") == type(box.respond(""))([], 0, 0)
        message = " ".join(
            [
                call("calculator", expression="12 * 12"),
                call("add", a=2, b=3),
                call("table", n=2),
                "<tool_call>{not json}</tool_call>",
                call("search", query="x"),
                call("broken", x="1"),
                call("add", a=1),
                call("calculator", expression="9**9**9"),
            ]
        )
        turn = box.respond(message)
    contents = [m["content"] for m in turn.messages]
    assert [m["role"] for m in turn.messages] == ["tool"] * 8 and turn.calls == 8 and turn.errors == 5
    assert contents[:3] == ["144", "5", '{"rows": [0, 1]}']
    assert contents[3].startswith("error: malformed tool call: the <tool_call> block is not valid JSON")
    assert contents[4] == ("error: unknown tool 'search'; available: calculator, add, broken, table, spin, regex")
    assert contents[5] == "error: tool 'broken' raised RuntimeError: the backend is down"
    assert contents[6] == "error: tool 'add' got wrong arguments: missing a required argument: 'b'"
    assert contents[7].startswith("error: tool 'calculator' raised ValueError: the result is too large")
    assert [m["name"] for m in turn.messages][:5] == ["calculator", "add", "table", "", "search"]


DEEP = "[" * 10_000 + "]" * 10_000  # json.loads raises RecursionError on it
PAST = "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1)  # read by json.loads, refused before a worker pickles it
DIGITS = "9" * 5000  # json.loads raises ValueError past Python's 4300-digit limit
BAD_CALLS = {
    "a str given 5 (python)": (
        '{"name": "python", "arguments": {"code": 5}}',
        "tool 'python' got wrong arguments: 'code' must be a string, got 5",
    ),
    "a str given 5 (calculator)": (
        '{"name": "calculator", "arguments": {"expression": 5}}',
        "tool 'calculator' got wrong arguments: 'expression' must be a string, got 5",
    ),
    "an int given a string": (
        '{"name": "add", "arguments": {"a": "2", "b": 3}}',
        "tool 'add' got wrong arguments: 'a' must be an integer, got a string",
    ),
    "an int given true": (
        '{"name": "add", "arguments": {"a": true, "b": 3}}',
        "tool 'add' got wrong arguments: 'a' must be an integer, got true",
    ),
    "an int given 2.5": (
        '{"name": "add", "arguments": {"a": 2.5, "b": 3}}',
        "tool 'add' got wrong arguments: 'a' must be an integer, got 2.5",
    ),
    "an int given null": (
        '{"name": "add", "arguments": {"a": null, "b": 3}}',
        "tool 'add' got wrong arguments: 'a' must be an integer, got null",
    ),
    "an int given a huge number": (
        '{"name": "add", "arguments": {"a": 1e999, "b": 3}}',
        "tool 'add' got wrong arguments: 'a' must be an integer, got Infinity",
    ),
    "a missing argument": (
        '{"name": "add", "arguments": {"a": 1}}',
        "tool 'add' got wrong arguments: missing a required argument: 'b'",
    ),
    "an unknown argument": (
        '{"name": "python", "arguments": {"code": "1", "timeout": 99}}',
        "tool 'python' got wrong arguments: got an unexpected keyword argument 'timeout'",
    ),
    "null": ("null", 'malformed tool call: expected a JSON object {"name": ..., "arguments": {...}}, got null'),
    "a list": (
        '["calculator", {"expression": "1"}]',
        'malformed tool call: expected a JSON object {"name": ..., "arguments": {...}}, got an array',
    ),
    "a number": ("5", 'malformed tool call: expected a JSON object {"name": ..., "arguments": {...}}, got a number'),
    "a string": (
        '"calculator"',
        'malformed tool call: expected a JSON object {"name": ..., "arguments": {...}}, got a string',
    ),
    "no name": ('{"arguments": {"expression": "1"}}', 'malformed tool call: the call has no "name" (a string)'),
    "a name that is not a string": (
        '{"name": 5, "arguments": {}}',
        'malformed tool call: the call has no "name" (a string)',
    ),
    "arguments a list": (
        '{"name": "calculator", "arguments": [1]}',
        'malformed tool call: "arguments" must be a JSON object, got an array',
    ),
    "arguments null": (
        '{"name": "calculator", "arguments": null}',
        'malformed tool call: "arguments" must be a JSON object, got null',
    ),
    "arguments a number": (
        '{"name": "calculator", "arguments": 5}',
        'malformed tool call: "arguments" must be a JSON object, got a number',
    ),
    "arguments a JSON string of a list": (
        '{"name": "calculator", "arguments": "[1]"}',
        'malformed tool call: "arguments" must be a JSON object, got an array',
    ),
    "10,000 levels of [": (
        DEEP,
        "malformed tool call: the <tool_call> block is nested too deeply (more than 64 levels of [ and {)",
    ),
    "10,000 levels in the arguments": (
        '{"name": "calculator", "arguments": {"expression": ' + DEEP + "}}",
        "malformed tool call: the <tool_call> block is nested too deeply (more than 64 levels of [ and {)",
    ),
    "10,000 levels in an arguments string": (
        json.dumps({"name": "calculator", "arguments": DEEP}),
        'malformed tool call: "arguments" is a string that is not a JSON object: it is nested too deeply '
        "(more than 64 levels of [ and {)",
    ),
    "65 levels in the arguments": (
        '{"name": "table", "arguments": {"n": ' + PAST + "}}",
        "malformed tool call: the <tool_call> block is nested too deeply (more than 64 levels of [ and {)",
    ),
    "a 5000-digit number": (
        '{"name": "add", "arguments": {"a": ' + DIGITS + ', "b": 1}}',
        "malformed tool call: the <tool_call> block is not readable JSON (Exceeds the limit (4300 digits) for "
        "integer string conversion",
    ),
    "a lone surrogate as the name": (
        '{"name": "\\ud800"}',
        "unknown tool '?'; available: calculator, add, broken, table, spin, regex, python",
    ),
}


@pytest.mark.parametrize("body, text", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_a_malformed_or_mistyped_call_is_one_failed_call_never_an_exception(user_tools, body, text):
    def never(arguments, timeout, limit):
        raise AssertionError("a call with wrong arguments was run")

    python_tool = Tool("python", tool_schema("python", TOOLS["python"].fn), "python", TOOLS["python"].fn, never)
    with Toolbox(user_tools + [python_tool], timeout=30) as box:
        turn = box.respond(f"Let me call it. <tool_call>{body}</tool_call>")
        assert not box.workers  # refused before any tool ran
    assert (turn.calls, turn.errors) == (1, 1)
    [message] = turn.messages
    assert message["content"].startswith(f"error: {text}"), message["content"]
    message["content"].encode("utf-8")  # what the tokenizer gets is valid UTF-8


def test_argument_types_follow_the_schema(tmp_path):
    path = tmp_path / "typed.py"
    path.write_text(
        "from typing import Any, Literal\n\n"
        "def typed(x: float, unit: Literal['c', 'f'], n: int | None = None, anything: Any = None) -> str:\n"
        '    """Echoes.\n\n    Args:\n        x: A number.\n        unit: A unit.\n        n: A count.\n'
        '        anything: Anything.\n    """\n'
        "    return f'{x} {unit} {n} {anything}'\n"
    )
    with Toolbox(load_tools([f"{path}:typed"]), timeout=30) as box:
        good = box.respond(call("typed", x=2, unit="c", n=None, anything=[1, {"a": None}]))
        assert (good.errors, good.messages[0]["content"]) == (0, "2 c None [1, {'a': None}]")
        for arguments, problem in [
            ({"x": "2", "unit": "c"}, "'x' must be a number, got a string"),
            ({"x": False, "unit": "c"}, "'x' must be a number, got false"),
            ({"x": 1, "unit": "k"}, """'unit' must be one of "c", "f", got a string"""),
            ({"x": 1, "unit": "c", "n": 1.5}, "'n' must be an integer or null, got 1.5"),
        ]:
            turn = box.respond(call("typed", **arguments))
            assert (
                turn.errors == 1
                and turn.messages[0]["content"] == f"error: tool 'typed' got wrong arguments: {problem}"
            )


def test_results_are_cut_at_the_limit(user_tools):
    with Toolbox(user_tools, timeout=30, limit=100) as box:
        [message] = box.respond(call("table", n=1000)).messages
    assert len(message["content"]) == 100 and message["content"].endswith("[result cut at 100 characters]")


@pytest.mark.slow
@pytest.mark.parametrize("tool, arguments", [("spin", {"seconds": 1}), ("regex", {"text": "a" * 40 + "b"})])
def test_a_hung_call_is_killed_within_twice_the_timeout(user_tools, tool, arguments):
    timeout = 1.5
    with Toolbox(user_tools, timeout=timeout) as box:  # the worker's start counts here too
        started = time.monotonic()
        turn = box.respond(call(tool, **arguments))
        elapsed = time.monotonic() - started
        assert turn.errors == 1 and elapsed < 2 * timeout, elapsed
        assert turn.messages[0]["content"] == (
            f"error: tool '{tool}' ran past the time limit of {timeout:g} s (its worker process was killed)"
        )
        assert box.respond(call("regex", text="aaa")).messages[0]["content"] == "True"  # a fresh worker
        assert box.respond(call("add", a=1, b=2)).messages[0]["content"] == "3"


# ---------------------------------------------------------------- the python tool


def _fake_bwrap(folder, says: str) -> str:
    """A `bwrap` that knows the options but cannot create namespaces (a kernel without unprivileged ones)."""
    fake = folder / "bwrap"
    fake.write_text(
        '#!/bin/sh\n[ "$1" = --help ] && { echo "--size --disable-userns --userns-block-fd"; exit 0; }\n'
        f'echo "{says}" >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    return str(fake)


def test_python_refuses_to_start_without_bubblewrap(monkeypatch, tmp_path):
    monkeypatch.setattr(python_sandbox, "BWRAP", f"bwrap-not-installed-{os.getpid()}")
    with pytest.raises(
        ToolError,
        match=r"^tool python: needs bubblewrap \(bwrap\) to isolate the code; install it "
        r"\(apt-get install bubblewrap / "
        r"dnf install bubblewrap\); the code is never run unconfined$",
    ):
        load_tools(["python"])
    with pytest.raises(ToolError, match="apt-get install bubblewrap"):
        run_python("print(1)")
    assert load_tools(["calculator"])  # the other tools do not need it
    monkeypatch.setattr(python_sandbox, "BWRAP", _fake_bwrap(tmp_path, "bwrap: No permissions to create new namespace"))
    with pytest.raises(ToolError) as refused:
        run_python("print(1)")
    assert str(refused.value).startswith(
        "tool python: bubblewrap cannot create its namespaces here (bwrap: No permissions to create new namespace); "
        "it needs unprivileged user namespaces"
    )
    assert "\n" not in str(refused.value) and str(refused.value).endswith("the code is never run unconfined")


def test_python_refusal_is_one_flag_error(monkeypatch):
    monkeypatch.setattr(python_sandbox, "BWRAP", f"bwrap-not-installed-{os.getpid()}")
    args = SimpleNamespace(env=None, tools=["python"], max_answer_seq_len=8, max_trajectory_len=None)
    args.__dict__.update({name: None for name in ("max_turns", "max_observation_len", "tool_timeout", "tool_parser")})
    with pytest.raises(UsageError, match=r"^--tools: tool python: needs bubblewrap .*apt-get install bubblewrap"):
        check_agent_args(args)


@needs_sandbox
def test_python_prints_and_reports_errors():
    assert python("print(6 * 7)") == "42\n"
    assert python("") == "(no output)"
    assert python("import sys; sys.exit(3)") == "(no output)\n[exit status 3]"
    assert python("import os; os._exit(125)") == "(no output)\n[exit status 125]"  # the code's: the run goes on
    assert python("import os; os.kill(os.getpid(), 9)") == "(no output)\n[killed by SIGKILL]"
    failed = python("x = 1\nraise ValueError('bad input')")
    assert failed.startswith("Traceback") and 'File "<code>", line 2' in failed
    assert failed.endswith("ValueError: bad input\n\n[exit status 1]")
    assert python("import json, math, re, socket, ctypes, sqlite3, decimal; print(math.pi)").startswith("3.14159")


@needs_sandbox
def test_python_runs_in_a_fresh_folder_each_call(monkeypatch):
    monkeypatch.setenv("RLHF_TEST_SECRET", "token")
    temp = set(os.listdir(tempfile.gettempdir()))
    code = (
        "import os\nprint(os.getcwd(), os.listdir(), os.environ.get('RLHF_TEST_SECRET'), sorted(os.environ))\n"
        "open('left.txt', 'w').write('x')"
    )
    first, second = python(code), python(code)
    assert first == second == "/tmp [] None ['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']\n"
    assert {name for name in set(os.listdir(tempfile.gettempdir())) - temp if "python" in name} == set()


@needs_sandbox
def test_python_cannot_reach_tcp_or_signal_the_trainer():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        output = python(f"""
import os, socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=2)
except OSError as exc:
    print("connect", type(exc).__name__)
try:
    os.kill({os.getpid()}, 0)
except OSError as exc:
    print("signal", type(exc).__name__)
""")
    assert output == "connect ConnectionRefusedError\nsignal ProcessLookupError\n"


@needs_sandbox
def test_python_output_is_cut_and_the_program_stopped():
    started = time.monotonic()
    run = run_python("while True:\n    print('x' * 100)", timeout=20, limit=500)
    assert time.monotonic() - started < 5 and run.cut and run.status is None and not run.timed_out
    assert len(run.output) == 500 and run.output.endswith("[output cut at 500 characters; the program was stopped]")


@needs_sandbox
def test_python_memory_bomb_is_stopped():
    output = python("x = bytearray(10 ** 10)")
    assert output.endswith("MemoryError\n\n[exit status 1]")
    grow = run_python("chunks = []\nwhile True:\n    chunks.append(b' ' * 10 ** 7)", memory=256 << 20)
    assert "MemoryError" in grow.output and grow.status == 1


def marked_processes(marker: str) -> list[int]:
    """The host's processes whose command line holds `marker` (a sandboxed process's own pid is its namespace's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def escaping_child(marker: str) -> str:
    """Code that starts a process in a session of its own (setsid), named by `marker`, sleeping for 100 s."""
    return (
        "import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
        f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(100)', {marker!r}])\n"
        "time.sleep(0.5)\nprint('started', flush=True)\n"
    )


@pytest.mark.slow
@needs_sandbox
@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(100)"])
def test_python_cannot_outlive_its_timeout(code):
    """Through the Toolbox: the error text, within 2x the timeout; and a process that left the process group
    (setsid) is killed too."""
    timeout, marker = 1.5, f"rlhf-sandbox-test-{os.getpid()}-{time.monotonic_ns()}"
    with Toolbox(load_tools(["python"]), timeout=timeout) as box:
        started = time.monotonic()
        turn = box.respond(call("python", code=escaping_child(marker) + code))
        elapsed = time.monotonic() - started
        content = turn.messages[0]["content"]
        assert turn.errors == 1 and elapsed < 2 * timeout, elapsed
        assert content == (
            f"error: tool 'python' ran past the time limit of {timeout:g} s (stopped); its output before: started\n"
        )
        deadline = time.monotonic() + 2  # the kernel ends the PID namespace's processes as bwrap goes
        while marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marked_processes(marker) == []
        assert box.respond(call("python", code="print('next')")).messages == [
            {"role": "tool", "name": "python", "content": "next\n"}
        ]


def test_calls_past_the_cap_are_not_run_and_counted(user_tools):
    """Thousands of calls in one message: the first max_calls run, the rest are not (the last tool message says how
    many), and they count as calls that failed."""
    with Toolbox(user_tools, timeout=30, max_calls=3) as box:
        turn = box.respond(" ".join(call("add", a=i, b=1) for i in range(2000)))
        assert (turn.calls, turn.errors, turn.dropped) == (2000, 1997, 1997)
        assert [m["content"] for m in turn.messages] == [
            "1",
            "2",
            "3\nerror: 1997 more tool calls in this message not run (at most 3 per message)",
        ]
        assert (
            box.respond(call("add", a=1, b=1) * 4)
            .messages[-1]["content"]
            .endswith("1 more tool call in this message not run (at most 3 per message)")
        )
        assert box.respond(call("add", a=1, b=1) * 3) == type(turn)(
            [{"role": "tool", "name": "add", "content": "2"}] * 3, 3, 0, 0
        )
    with Toolbox(user_tools, timeout=30, limit=200, max_calls=1) as box:  # the note survives the result's cut
        content = box.respond(call("table", n=50) * 2).messages[0]["content"]
        assert len(content) <= 200 and "[result cut at" in content and content.endswith("(at most 1 per message)")
    with pytest.raises(ValueError, match=">= 1"):
        Toolbox(user_tools, timeout=30, max_calls=0)
