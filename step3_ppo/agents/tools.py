"""Tools for step 3's multi-turn rollouts (`--tools`): functions the policy calls from its answer.

Why TRL's convention: a tool is a plain Python function with type hints and a Google-style docstring with
an Args section, its JSON schema is transformers' `get_json_schema(fn)`, so tools written for TRL's
GRPOTrainer(tools=[...]) run here unchanged, and the schema is what a chat template's `tools` renders.

A spec is a built-in name (`TOOLS`), `path/to/file.py:function` or `package.module:function`
(step3_ppo/specs.py). Calls are parsed from the assistant message by a `TOOL_CALL_PARSERS` entry ("hermes":
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Hermes and Qwen's form). `Toolbox.respond`
answers each call with a `tool` message; whatever goes wrong with a call (malformed: not JSON, not an object,
no name, nested past MAX_NESTING; an unknown tool; wrong arguments: missing, unknown, or of another JSON type than
the tool's schema says; a raise; the timeout) is error text for the model, counted, never a crash. Every call can be
stopped in C code: a user tool and the calculator run in a worker process of their own (step3_ppo/function_worker.py,
killed at the timeout), the python tool in a bubblewrap sandbox per call (step3_ppo/agents/python_sandbox.py).
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import json
import math
import operator
import os
import re
import select
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from step3_ppo.agents import python_sandbox
from step3_ppo.function_worker import CallFailed, FunctionWorker
from step3_ppo.specs import load_object
from utils.errors import ProjectError, one_line

RESULT_LIMIT = 2000  # characters of a tool's result (or error) sent back to the model
MAX_CALLS_PER_TURN = 8  # tool calls run per assistant message; the rest are not run (the model is told)
_MESSAGE_LIMIT = 300
_DEADLINE_NAME = "the time limit of"  # the worker's timeout message: "ran past the time limit of 2 s (...)"


class ToolError(ProjectError):
    """A tool that cannot be loaded or run here (bad spec, no schema, a duplicate name, no sandbox): one line
    naming the spec. Stops the run: it is the setup that is wrong, not the model's call."""

    def __init__(self, spec: str, problem: str):
        self.spec, self.problem = spec, problem
        super().__init__(one_line(f"tool {spec}: {problem}"))


class ToolFailed(Exception):
    """A call that gives the model an error text instead of a result (str() is that text, without 'error: ')."""


def cut(text: str, limit: int = RESULT_LIMIT, what: str = "result") -> str:
    """`text`, at most `limit` characters, marked where it was cut (the model should know it saw a part)."""
    if len(text) <= limit:
        return text
    marker = f"\n[{what} cut at {limit} characters]"
    return text[: max(limit - len(marker), 0)] + marker


def as_text(result) -> str:
    """A tool's return value as the tool message's content: str as is, JSON for dicts and lists."""
    if isinstance(result, str):
        return result
    if isinstance(result, (dict, list, tuple)):
        return json.dumps(result, ensure_ascii=False, default=str)
    return "" if result is None else str(result)


# ---------------------------------------------------------------- calculator

_MAX_DIGITS = 1000  # of any intermediate or final integer: `9**9**9` would take minutes and gigabytes
_MAX_EXPRESSION = 1000  # characters
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_ALLOWED = "only numbers, + - * / // % ** and parentheses are allowed"


def _checked(value):
    """`value` if it is a real number of bounded size, else ValueError."""
    if isinstance(value, complex):
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is too large" if math.isinf(value) else "the result is not a number")
    if isinstance(value, int) and value.bit_length() > _MAX_DIGITS * 3.33:
        raise ValueError(f"the result is too large (more than {_MAX_DIGITS} digits)")
    return value


def _power(base, exponent):
    """`base ** exponent`, refused before it is computed when the result would exceed _MAX_DIGITS digits."""
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > _MAX_DIGITS:
        raise ValueError(f"the result is too large (more than {_MAX_DIGITS} digits)")
    return base**exponent


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"the name '{node.id}'"
    if isinstance(node, ast.Constant):
        return f"the {type(node.value).__name__} {node.value!r}"
    return {ast.Call: "a function call", ast.Attribute: "an attribute"}.get(type(node), f"'{type(node).__name__}'")


def _evaluate(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _checked(_power(_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _checked(_BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"{_ALLOWED}, not {_describe(node)}")


def _number_text(value) -> str:
    """Integers exactly; floats to 15 significant digits, so 0.1 + 0.2 reads 0.3 and 6 / 3 reads 2."""
    return str(value) if isinstance(value, int) else f"{value:.15g}"


def calculator(expression: str) -> str:
    """Evaluates arithmetic: numbers, + - * / // % ** and parentheses.

    Args:
        expression: The expression, e.g. "(12 + 3) * 4".
    """
    expression = str(expression)
    if len(expression) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression ({exc.msg})") from None
    except (ValueError, RecursionError, MemoryError) as exc:  # a too long literal, too deep nesting
        raise ValueError(f"not an arithmetic expression ({one_line(exc, _MESSAGE_LIMIT)})") from None
    try:
        return _number_text(_evaluate(tree.body))
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    except OverflowError:
        raise ValueError("the result is too large") from None
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None


# ---------------------------------------------------------------- python (a sandbox per call)

PYTHON_TIMEOUT_S = 10.0  # a direct call's timeout; the Toolbox passes its own
PYTHON_MEMORY = 1 << 30  # bytes of address space
PYTHON_FILE_SIZE = 1 << 20  # bytes, the largest file it may write in its folder
PYTHON_TOTAL_WRITE = 16 << 20  # bytes, all it may write (the size of its tmpfs folder)
_STATUS_ROOM = 40  # characters kept free after the output for the exit status line


@dataclass(frozen=True)
class SandboxRun:
    """What one run of the python tool gave: its output (stdout and stderr, cut at the limit), its exit status
    (None when it was stopped from here), and whether it ran past the timeout or printed past the limit."""

    output: str
    status: int | None
    timed_out: bool = False
    cut: bool = False


def sandbox_missing() -> str | None:
    """Why the python tool cannot run on this machine (no usable bubblewrap: one line naming the package), or None."""
    return python_sandbox.missing()


def _kill_group(process: subprocess.Popen) -> None:
    """SIGKILL bwrap (its own process group): its PID namespace, and every process the code started, ends."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_output(process: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bool, bool]:
    """The sandbox's output until it closes (or `deadline`, or `cap` bytes); (output, past deadline, over cap)."""
    chunks, size, fd = [], 0, process.stdout.fileno()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), True, False
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks), False, False
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            return b"".join(chunks)[:cap], False, True


def run_python(
    code: str,
    timeout: float = PYTHON_TIMEOUT_S,
    limit: int = RESULT_LIMIT,
    *,
    memory: int = PYTHON_MEMORY,
    file_size: int = PYTHON_FILE_SIZE,
    total_write: int = PYTHON_TOTAL_WRITE,
) -> SandboxRun:
    """Run `code` under bubblewrap (step3_ppo/agents/python_sandbox.py: its own namespaces, a read-only root with only
    the interpreter, a fresh `total_write`-byte tmpfs as its working folder, CPU, memory and file-size limits, no
    network), killed with all it started past `timeout` or `limit`. Raises ToolError where there is no usable
    bubblewrap: the code is never run without it."""
    missing = sandbox_missing()
    if missing:
        raise ToolError("python", missing)
    status_read, status_write = os.pipe()
    try:
        started = time.monotonic()
        try:  # with an empty environment: bwrap's own is readable in the sandbox (/proc/1/environ)
            process = python_sandbox.spawn(timeout, memory, file_size, total_write, status_fd=status_write)
        except OSError as exc:
            raise ToolError("python", f"the sandbox did not start: {one_line(exc, _MESSAGE_LIMIT)}") from None
        os.close(status_write)
        status_write = -1
        try:
            with contextlib.suppress(BrokenPipeError):  # it ended before reading: its status says why
                process.stdin.write(code.encode("utf-8", errors="replace"))
            with contextlib.suppress(BrokenPipeError):
                process.stdin.close()
            output, late, over = _read_output(process, started + timeout, 4 * limit + 4)
            if not (late or over):
                try:  # its output closed: the code ended, or closed stdout and stderr and runs on
                    process.wait(timeout=max(started + timeout - time.monotonic(), 0))
                except subprocess.TimeoutExpired:
                    late = True
            if late or over:
                _kill_group(process)
            status = process.wait()
        finally:
            _kill_group(process)  # anything left in its process group
            process.stdout.close()
        reports = _drain(status_read)
    finally:
        os.close(status_read)
        if status_write >= 0:
            os.close(status_write)
    text = output.decode("utf-8", errors="replace")
    if status != 0 and not (late or over) and '"exit-code"' not in reports:  # bwrap failed before the code ran
        raise ToolError("python", f"the sandbox did not start: {one_line(text, _MESSAGE_LIMIT)}")
    if over:
        return SandboxRun(_over(text, limit), None, cut=True)
    return SandboxRun(cut(text, limit, "output"), None if late else status, timed_out=late, cut=len(text) > limit)


def _drain(fd: int) -> str:
    """What bwrap wrote to its status pipe (JSON documents: the child's pid, then its exit code once it ended)."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _over(text: str, limit: int) -> str:
    """The output of a run stopped for printing too much, marked so."""
    marker = f"\n[output cut at {limit} characters; the program was stopped]"
    return text[: max(limit - len(marker), 0)] + marker


def _run_text(run: SandboxRun) -> str:
    """A finished run as the model reads it: its output, and its exit status when that is not 0."""
    output = run.output if run.output else "(no output)"
    if run.status is None or run.status == 0:
        return output
    if run.status > 128 and run.status - 128 in signal.valid_signals():
        return f"{output}\n[killed by {signal.Signals(run.status - 128).name}]"
    return f"{output}\n[exit status {run.status}]"


def python(code: str) -> str:
    """Runs a Python program in a sandbox and returns what it printed (stdout and stderr).

    Args:
        code: The complete program; print() the values you want to see.
    """
    run = run_python(code)
    text = _run_text(run)
    return f"{text}\n[stopped: ran past the {PYTHON_TIMEOUT_S:g} s time limit]" if run.timed_out else text


def _call_python(arguments: dict, timeout: float, limit: int) -> str:
    """The Toolbox's python call: the run's text, or ToolFailed past the timeout (an error for the model)."""
    run = run_python(**arguments, timeout=timeout, limit=max(limit - _STATUS_ROOM, 0))
    if run.timed_out:
        shown = f"; its output before: {run.output}" if run.output else ""
        raise ToolFailed(f"tool 'python' ran past the time limit of {timeout:g} s (stopped){shown}")
    return _run_text(run)


# ---------------------------------------------------------------- registry and loading


@dataclass(frozen=True)
class BuiltinTool:
    """A built-in tool, named in `--tools` by its key in TOOLS. `fn` is the tool as TRL sees it (its signature
    and docstring give the schema). `call(arguments, timeout, limit) -> str`: for a tool that isolates each
    call itself (python); None runs it in a worker process. `missing() -> str | None`: why it cannot run on
    this machine, checked when it is loaded. `help`: one line for the flag's help."""

    fn: Callable
    help: str
    call: Callable[[dict, float, int], str] | None = None
    missing: Callable[[], str | None] | None = None


# The one place a built-in is registered: its key is its spec and its name in calls.
TOOLS: dict[str, BuiltinTool] = {
    "calculator": BuiltinTool(calculator, "arithmetic on numbers with + - * / // % ** and parentheses (no eval)"),
    "python": BuiltinTool(
        python,
        "runs the model's code in a bubblewrap sandbox (no network, no host files, limits); off unless named",
        call=_call_python,
        missing=sandbox_missing,
    ),
}


@dataclass(frozen=True)
class Tool:
    """A loaded tool: `name` (what calls name), `schema` (TRL's, from `get_json_schema`), `spec` (what the user
    gave, how a worker process loads it again), `fn`, and a built-in's own `call` (see BuiltinTool)."""

    name: str
    schema: dict
    spec: str
    fn: Callable = field(repr=False, compare=False)
    call: Callable[[dict, float, int], str] | None = field(default=None, repr=False, compare=False)


def _forms() -> str:
    return "a built-in (" + ", ".join(TOOLS) + "), path/to/file.py:function or package.module:function"


def tool_function(spec: str) -> Callable:
    """The function `spec` names (the worker process's loader, step3_ppo/function_worker.py)."""
    builtin = TOOLS.get(spec)
    if builtin is not None:
        return builtin.fn
    return load_object(spec, ToolError, what="tool", forms=_forms())


def tool_schema(spec: str, fn: Callable) -> dict:
    """`fn`'s JSON schema as TRL makes it; one line naming `spec` and what is missing where there is none."""
    from transformers.utils import get_json_schema  # lazy: +0.75 s on each tool worker's start

    try:
        return get_json_schema(fn)
    except Exception as exc:
        raise ToolError(
            spec,
            f"needs type hints and a Google-style docstring with an Args section (TRL's convention): "
            f"{one_line(exc, _MESSAGE_LIMIT)}",
        ) from None


def load_tool(spec: str) -> Tool:
    builtin = TOOLS.get(spec)
    missing = builtin.missing() if builtin is not None and builtin.missing is not None else None
    if missing:
        raise ToolError(spec, missing)
    fn = tool_function(spec)
    schema = tool_schema(spec, fn)
    return Tool(schema["function"]["name"], schema, spec, fn, builtin.call if builtin is not None else None)


def load_tools(specs: list[str]) -> list[Tool]:
    """The tools `specs` name (`--tools`), in order; two of the same name are refused (a call could not choose)."""
    tools: list[Tool] = []
    for spec in specs:
        tool = load_tool(spec)
        same = next((t for t in tools if t.name == tool.name), None)
        if same is not None:
            raise ToolError(
                spec, f"its name '{tool.name}' is also the name of tool {same.spec}; tool names must differ"
            )
        tools.append(tool)
    return tools


# ---------------------------------------------------------------- calls


@dataclass(frozen=True)
class ToolCall:
    """One call parsed from an assistant message: `name` and `arguments`, or `error` (why it is malformed;
    `name` kept when it was readable)."""

    name: str | None
    arguments: dict | None
    error: str | None = None


_JSON_TYPES = {
    dict: "an object",
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
# Levels of [ and { a call may nest: json.loads raises RecursionError about 1000 levels down, and pickling the
# arguments for a tool's worker process fails from about 500; no tool's arguments need more than a few.
MAX_NESTING = 64


class _Unreadable(Exception):
    """Model-written JSON that cannot be read; str() says why, for the model."""


def _nesting(value) -> int:
    """How many levels of arrays and objects `value` nests (0 for a scalar), counted without recursion and
    stopping once past MAX_NESTING."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_NESTING:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _read_json(text: str):
    """`text` parsed as JSON, or _Unreadable: not JSON, nested past MAX_NESTING (json.loads's RecursionError
    included), or a number past Python's digit limit (json.loads's ValueError)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _Unreadable(f"not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise _Unreadable(f"nested too deeply (more than {MAX_NESTING} levels of [ and {{)") from None
    except ValueError as exc:  # an integer literal longer than sys.get_int_max_str_digits()
        raise _Unreadable(f"not readable JSON ({one_line(exc, _MESSAGE_LIMIT)})") from None
    if _nesting(value) > MAX_NESTING:
        raise _Unreadable(f"nested too deeply (more than {MAX_NESTING} levels of [ and {{)")
    return value


def _hermes_call(body: str) -> ToolCall:
    try:
        data = _read_json(body)
    except _Unreadable as exc:
        return ToolCall(None, None, f"the <tool_call> block is {exc}")
    if not isinstance(data, dict):
        return ToolCall(
            None,
            None,
            f'expected a JSON object {{"name": ..., "arguments": {{...}}}}, got '
            f"{_JSON_TYPES.get(type(data), 'a value')}",
        )
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, None, 'the call has no "name" (a string)')
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):  # some models send the arguments as a JSON string
        try:
            arguments = _read_json(arguments)
        except _Unreadable as exc:
            return ToolCall(name, None, f'"arguments" is a string that is not a JSON object: it is {exc}')
    if not isinstance(arguments, dict):
        got = _JSON_TYPES.get(type(arguments), "a value")
        return ToolCall(name, None, f'"arguments" must be a JSON object, got {got}')
    return ToolCall(name, arguments)


def parse_hermes(message: str) -> list[ToolCall]:
    """Every `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block of `message`, in order; a block
    left open at the end (the turn was cut) is a malformed call."""
    calls, start = [], message.find(_HERMES_OPEN)
    while start != -1:
        body = start + len(_HERMES_OPEN)
        end = message.find(_HERMES_CLOSE, body)
        if end == -1:
            calls.append(ToolCall(None, None, "the <tool_call> block is not closed (</tool_call> is missing)"))
            break
        calls.append(_hermes_call(message[body:end]))
        start = message.find(_HERMES_OPEN, end + len(_HERMES_CLOSE))
    return calls


@dataclass(frozen=True)
class ToolCallParser:
    """`parse(message) -> list[ToolCall]` (empty: no call, the turn answers); `help`: the form, in one line."""

    parse: Callable[[str], list[ToolCall]]
    help: str


# Another model family's call format is one entry here (and its test).
TOOL_CALL_PARSERS: dict[str, ToolCallParser] = {
    "hermes": ToolCallParser(parse_hermes, '<tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes, Qwen)'),
}


def tool_system_prompt(schemas: list[dict]) -> str:
    """The tools as a system block, for a chat template that has no `tools` variable: each tool's function
    schema as one line of compact JSON (its return type left out), then the Hermes call form parse_hermes reads. Kept
    short (106 SmolLM2 tokens for the calculator, against 216 in Qwen 2.5's wording): the block is in every prompt of
    every rollout, and the models that need it were never trained on a tool format anyway."""
    functions = [{k: v for k, v in schema.get("function", schema).items() if k != "return"} for schema in schemas]
    listed = "\n".join(json.dumps(function, ensure_ascii=False, separators=(",", ":")) for function in functions)
    return (
        f"Tools you can call (JSON schemas):\n{listed}\n"
        'Call one with <tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    )


def template_supports_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a `tools` variable (else tool_system_prompt is used)."""
    template = getattr(tokenizer, "chat_template", None)
    texts = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(text, str) and re.search(r"\btools\b", text) is not None for text in texts)


# ---------------------------------------------------------------- running


@dataclass(frozen=True)
class ToolTurn:
    """The environment's answer to one assistant message: a `tool` message per call run (none: no call), how many
    calls there were, how many of them gave an error text, and how many past the cap were not run (`dropped`, also
    counted in `calls` and `errors`: the model made them and got an error text)."""

    messages: list[dict]
    calls: int
    errors: int
    dropped: int = 0


# A JSON schema type (as get_json_schema writes a parameter's) and the Python values that are one. bool is an int
# in Python but not a number in JSON; a float is not an integer (the function would get 5.0).
_SCHEMA_TYPES = {
    "string": ("a string", lambda v: isinstance(v, str)),
    "integer": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "boolean": ("true or false", lambda v: isinstance(v, bool)),
    "array": ("an array", lambda v: isinstance(v, list)),
    "object": ("an object", lambda v: isinstance(v, dict)),
    "null": ("null", lambda v: v is None),
}


def _value_text(value) -> str:
    """A model's argument as an error text names it: a scalar as JSON, a string, array or object by its kind."""
    if isinstance(value, (str, list, dict)):
        return _JSON_TYPES[type(value)]
    text = json.dumps(value)
    return text if len(text) <= 40 else f"a number of {len(text)} digits"


def _wrong_types(schema: dict, arguments: dict) -> str | None:
    """The first argument whose JSON type is not its parameter's in the tool's schema (TRL's, from the type
    hints: `str` is "string", `int | None` is "integer" and nullable, a Literal an enum); None when all fit.
    A parameter without a type (`Any`) takes anything; nested items are the tool's to check."""
    properties = schema.get("function", schema).get("parameters", {}).get("properties", {})
    for name, value in arguments.items():
        spec = properties.get(name, {})
        kinds = spec.get("type")
        kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
        if spec.get("nullable"):
            kinds.append("null")
        known = [kind for kind in kinds if kind in _SCHEMA_TYPES]
        if known and not any(_SCHEMA_TYPES[kind][1](value) for kind in known):
            wanted = " or ".join(_SCHEMA_TYPES[kind][0] for kind in known)
            return f"'{name}' must be {wanted}, got {_value_text(value)}"
        if "enum" in spec and value not in spec["enum"]:
            listed = ", ".join(json.dumps(option) for option in spec["enum"])
            return f"'{name}' must be one of {listed}, got {_value_text(value)}"
    return None


def _wrong_arguments(tool: Tool, arguments: dict) -> str | None:
    """Why the model's `arguments` do not fit the tool (a missing or unknown name, a value of the wrong JSON
    type), or None."""
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as exc:
        return one_line(exc, _MESSAGE_LIMIT)
    except ValueError:  # no signature to check (a builtin): the call itself will say
        pass
    return _wrong_types(tool.schema, arguments)


def _encodable(text: str) -> str:
    """`text` with what UTF-8 cannot encode (a lone surrogate, from a JSON escape like "\\ud800" in a call)
    as "?": the tokenizer refuses such a string, and a call's name and arguments reach the tool message."""
    return text.encode("utf-8", errors="replace").decode("utf-8")


class Toolbox:
    """Runs the calls of assistant messages with `tools`, each under `timeout` seconds, the first `max_calls` of a
    message (a model can write thousands in one: the rest are not run, and the last tool message says how many);
    results and error texts are cut at `limit` characters. A user tool and the calculator keep one worker process
    each, started at their first call (again after a kill); `close()` stops them."""

    def __init__(
        self,
        tools: list[Tool],
        timeout: float,
        parser: str = "hermes",
        limit: int = RESULT_LIMIT,
        max_calls: int = MAX_CALLS_PER_TURN,
    ):
        if not timeout or timeout <= 0:
            raise ValueError(f"a tool timeout must be a positive number of seconds, not {timeout!r}")
        if max_calls < 1:
            raise ValueError(f"the tool calls run per message must be >= 1, not {max_calls!r}")
        self.max_calls = max_calls
        if parser not in TOOL_CALL_PARSERS:
            raise ToolError(parser, f"unknown tool-call parser; expected one of {', '.join(TOOL_CALL_PARSERS)}")
        self.tools = {tool.name: tool for tool in tools}
        self.timeout, self.limit, self.parse = timeout, limit, TOOL_CALL_PARSERS[parser].parse
        self.workers: dict[str, FunctionWorker] = {}

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools.values()]

    def respond(self, message: str) -> ToolTurn:
        calls = self.parse(message)
        run, dropped = calls[: self.max_calls], max(len(calls) - self.max_calls, 0)
        answers = [self.answer(call) for call in run]
        if dropped:  # told in the last message, cut to the limit with it
            text, ok = answers[-1]
            note = f"error: {dropped} more tool call{'s' if dropped > 1 else ''} in this message not run (at most "
            note += f"{self.max_calls} per message)"
            answers[-1] = (cut(text, max(self.limit - len(note) - 1, 0)) + "\n" + note, ok)
        messages = [
            {"role": "tool", "name": _encodable(call.name or ""), "content": _encodable(text)}
            for call, (text, _) in zip(run, answers)
        ]
        return ToolTurn(messages, len(calls), sum(not ok for _, ok in answers) + dropped, dropped)

    def answer(self, call: ToolCall) -> tuple[str, bool]:
        """The call's result as text, or its error text; and whether it succeeded."""
        try:
            return cut(as_text(self.run(call)), self.limit), True
        except ToolFailed as exc:
            return cut(f"error: {exc}", self.limit), False

    def run(self, call: ToolCall):
        if call.error is not None:
            raise ToolFailed(f"malformed tool call: {call.error}")
        tool = self.tools.get(call.name)
        if tool is None:
            raise ToolFailed(f"unknown tool '{call.name}'; available: {', '.join(self.tools) or 'none'}")
        wrong = _wrong_arguments(tool, call.arguments)
        if wrong is not None:
            raise ToolFailed(f"tool '{tool.name}' got wrong arguments: {wrong}")
        if tool.call is not None:
            return tool.call(call.arguments, self.timeout, self.limit)
        try:
            return self.worker(tool).call(call.arguments, self.timeout)
        except CallFailed as exc:
            raise ToolFailed(f"tool '{tool.name}' {exc}") from None

    def worker(self, tool: Tool) -> FunctionWorker:
        if tool.name not in self.workers:
            self.workers[tool.name] = FunctionWorker(
                tool.spec, f"{__name__}:tool_function", deadline_name=_DEADLINE_NAME
            )
        return self.workers[tool.name]

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        self.workers.clear()

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
