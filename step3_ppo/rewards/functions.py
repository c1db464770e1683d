"""Reward functions for step 3: Python callables that score completions, instead of (or beside) a reward model.

Why: rule rewards (a math answer checked against the row's `answer`, a required output format) need no
trained model, and TRL's GRPOTrainer (`reward_funcs`) and OpenRLHF (reward-function files) take them in
the same shape, so functions written for those run here unchanged.

Contract (TRL's keyword-lists convention): `fn(prompts=..., completions=..., completion_ids=..., **fields)`
is called ONCE per batch; every argument is a list with one value per completion, `fields` are the other
fields of the prompt rows (None where a row lacks one), so a function takes what it needs and `**kwargs`
the rest. It returns one finite number per completion (a list, tuple, 1-D tensor or numpy array).

What stops a run (RewardFunctionError, one line naming the function and the first bad row's origin): a spec that
does not load, a call that raises, runs past the timeout (--reward_timeout; without it
step3_ppo/rewards/components.py's default, 120 s), returns the wrong count, or returns a None / non-number /
non-finite value or one beyond float32 (an int like 10**400 too), or whose worker process exits or crashes (step 3
calls each function in a process of its own, step3_ppo/rewards/reward_worker.py). With `skip_bad` the per-row
problems only make those rows NaN and a raise / wrong count / timeout / dead worker makes the whole batch NaN; the
caller drops and counts them. A function that itself raises RewardFunctionError (math_exact without an 'answer'
field) says the setup is wrong: that always stops the run.

A built-in is one `BUILTINS` entry (its factory, one line of help, whether it is an accuracy) next to its
function; the weighted sum of the rewards is `step3_ppo.rewards.combine.combine`.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from step3_ppo.function_worker import CallFailed  # a worker's failed call (re-exported here, caught in score_batch)
from step3_ppo.rewards import reasoning_gym
from step3_ppo.specs import load_object
from utils.errors import ProjectError, one_line

if TYPE_CHECKING:  # annotations only: the reward worker imports this module without torch (+1.6 s a start)
    import torch

DEFAULT_FORMAT_PATTERN = r"\\boxed\{[^{}]+\}"
_MESSAGE_LIMIT = 200
_SHOWN_ORIGINS = 3
_FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: torch is not imported here (see _is_tensor)


class RewardFunctionError(ProjectError):
    """A reward function that does not load or misbehaves; str() is one line naming it (and the row)."""

    def __init__(self, function: str, problem: str, origin: str | None = None, index: int | None = None):
        self.function, self.problem, self.origin, self.index = function, problem, origin, index
        where = ""
        if origin is not None or index is not None:
            parts = ([f"row {origin}"] if origin else []) + (
                [f"index {index} in the batch"] if index is not None else []
            )
            where = f" ({', '.join(parts)})"
        super().__init__(one_line(f"reward function {function}: {problem}{where}"))


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function: `name` is log-safe (`reward/<name>_mean`), `spec` what the user gave.
    `options`: what `load_reward_function` loaded it with, so a worker process can load it again by its spec;
    None for a function handed over as an object, which can only be called in this process."""

    name: str
    fn: Callable
    is_accuracy: bool = False
    spec: str = ""
    options: dict | None = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return self.spec or self.name


# ---------------------------------------------------------------- answers

_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_BOXED = "\\boxed{"


def _last_boxed(text: str) -> str | None:
    """The content of the last balanced `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind(_BOXED)
    while start != -1:
        depth, i = 1, start + len(_BOXED)
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[start + len(_BOXED) : i - 1].strip()
        start = text.rfind(_BOXED, 0, start)
    return None


def final_answer(text: str) -> str | None:
    """A completion's final answer: the last `\\boxed{...}`'s content, else the last number (thousands
    separators removed, a sentence's trailing period not part of it), else None."""
    if not isinstance(text, str):
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers_found = _NUMBER.findall(text)
    return numbers_found[-1].replace(",", "") if numbers_found else None


def _as_number(value) -> float | None:
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int beyond any float
            return None
        return number if math.isfinite(number) else None
    text = str(value).strip().rstrip(".").strip()
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        text = text.replace(",", "")
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def answers_match(predicted: str | None, answer) -> bool:
    """Numerically equal (relative 1e-6) when both parse as numbers, else equal as stripped strings."""
    if predicted is None or answer is None:
        return False
    a, b = _as_number(predicted), _as_number(answer)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    return str(predicted).strip() == str(answer).strip()


# ---------------------------------------------------------------- built-ins

_MISSING = object()


def completion_text(completion) -> str:
    """The text a built-in judges: the completion itself, or of a conversational one (a multi-turn trajectory's
    messages after the prompt, TRL's shape) its last assistant message: the final answer, after tool calls
    and replies."""
    if isinstance(completion, list):
        said = [m.get("content") for m in completion if isinstance(m, dict) and m.get("role") == "assistant"]
        return said[-1] if said and isinstance(said[-1], str) else ""
    return completion


def math_exact(completions, answer=_MISSING, **kwargs) -> list[float]:
    """1.0 where the completion's `final_answer` equals the row's `answer` (int, float or str), else 0.0."""
    if answer is _MISSING:
        raise RewardFunctionError("math_exact", "the prompt rows need an 'answer' field (none of them has one)")
    return [float(answers_match(final_answer(completion_text(c)), a)) for c, a in zip(completions, answer)]


MATH_VERIFY_TIMEOUT_S = 5  # math-verify's own limit on each parse and comparison (its default; whole seconds)


def _math_verify_timeout() -> int | None:
    """math-verify's limits are SIGALRM timers: they work only in the main thread (elsewhere it raises), and they
    would cancel a timer already running there (an in-process call bounded by `_call_with_signal`, which then bounds
    it). So: its limit in the main thread with no timer set (a reward worker process), else None (no own limit)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        return None
    return None if signal.getitimer(signal.ITIMER_REAL)[0] > 0 else MATH_VERIFY_TIMEOUT_S


def make_math_verify() -> Callable:
    """Hugging Face's math-verify: 1.0 where the completion's answer (the last `\\boxed{}` or LaTeX / plain
    expression it extracts) is mathematically equal to the row's `answer` (sympy: 1/2 = 0.5 = \\frac{1}{2},
    \\sqrt{4} = 2, sets and intervals, units and % dropped), else 0.0 (also where nothing parses)."""
    try:
        from math_verify import parse, verify  # lazy: sympy and latex2sympy, +0.3 s, only for this built-in
    except ImportError as exc:
        raise RewardFunctionError("math_verify", f"needs the math-verify package: {one_line(exc, _MESSAGE_LIMIT)}")

    def gold(answer):
        text = str(answer).strip()
        if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
            return parse(text, parsing_timeout=_math_verify_timeout())
        # a bare answer is read as LaTeX math ("1+x" whole, not its first number); plain text as the fallback
        limit = _math_verify_timeout()
        return parse(f"${text}$", parsing_timeout=limit) or parse(text, parsing_timeout=limit)

    def math_verify(completions, answer=_MISSING, **kwargs) -> list[float]:
        if answer is _MISSING:
            raise RewardFunctionError("math_verify", "the prompt rows need an 'answer' field (none of them has one)")
        scores = []
        for completion, expected in zip(completions, answer):
            text = completion_text(completion)
            if expected is None or isinstance(expected, bool) or not isinstance(text, str) or not text.strip():
                scores.append(0.0)
                continue
            limit = _math_verify_timeout()
            predicted = parse(text, parsing_timeout=limit)
            scores.append(float(bool(predicted) and verify(gold(expected), predicted, timeout_seconds=limit)))
        return scores

    return math_verify


def make_format(format_pattern: str | None = None) -> Callable:
    """A reward of 1.0 where `re.search(format_pattern, completion, re.DOTALL)` matches, else 0.0."""
    pattern = DEFAULT_FORMAT_PATTERN if format_pattern is None else format_pattern
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise RewardFunctionError("format", f"--format_pattern {pattern!r} is not a valid regular expression: {exc}")

    def format(completions, **kwargs) -> list[float]:  # noqa: A001 - the built-in's name
        return [float(compiled.search(completion_text(c) or "") is not None) for c in completions]

    return format


def make_sentiment() -> Callable:
    """A reward of each completion's VADER compound score in [-1, 1] (utils.evaluation's SentimentJudge)."""
    try:
        from utils.evaluation.judge import SentimentJudge  # lazy: +1.7 s (torch) on each reward worker's start

        judge = SentimentJudge()
    except ImportError as exc:
        raise RewardFunctionError("sentiment", f"needs the VADER judge: {one_line(exc, _MESSAGE_LIMIT)}")

    def sentiment(completions, **kwargs) -> list[float]:
        return judge.score([completion_text(c) for c in completions])

    return sentiment


@dataclass(frozen=True)
class Builtin:
    """A built-in reward function, loaded by its name in `--reward_funcs`.

    `make(**options)` returns the reward function (`lambda: fn` for a plain function). It declares, as
    keyword parameters named like the flags, the run's options it needs (`make_format(format_pattern=None)`
    gets `--format_pattern`) and gets only those, so a built-in with a new option changes no loader. A
    factory that raises RewardFunctionError stops the run at load time. `help`: one line, in
    `--reward_funcs`' help and the generated reference (docs/reference/registries.md). `is_accuracy`: its
    mean is also `eval/accuracy`.
    """

    make: Callable[..., Callable]
    help: str
    is_accuracy: bool = False


# The one place a built-in is registered: its name here is its spec and its log name; `--reward_funcs`'
# help, docs/reference/registries.md (tests/test_reward_funcs.py checks it) and `is_function_spec` follow.
BUILTINS: dict[str, Builtin] = {
    "math_exact": Builtin(
        lambda: math_exact, "the last number or \\boxed{} equals the row's 'answer'", is_accuracy=True
    ),
    "format": Builtin(make_format, "--format_pattern matches"),
    "sentiment": Builtin(make_sentiment, "VADER"),
    "math_verify": Builtin(
        make_math_verify, "math-verify: the answer equals the row's 'answer' as math (1/2 = 0.5)", is_accuracy=True
    ),
    "reasoning_gym": Builtin(reasoning_gym.make_reasoning_gym, reasoning_gym.HELP, is_accuracy=True),
}


def builtins_help() -> str:
    """The built-ins as `--reward_funcs`' help lists them: `name (help), ...` in registry order."""
    return ", ".join(f"{name} ({builtin.help})" for name, builtin in BUILTINS.items())


# ---------------------------------------------------------------- loading


def is_function_spec(spec: str) -> bool:
    """True for a built-in name, a `file.py` path, or anything with ':' - unless it is an existing
    directory, which the caller loads as a reward model."""
    if os.path.isdir(spec):
        return False
    return spec in BUILTINS or ":" in spec or spec.endswith(".py")


def _log_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name) or "reward"


def _forms() -> str:
    return "a built-in (" + ", ".join(BUILTINS) + "), path/to/file.py:function or package.module:function"


def _declared(make: Callable, options: dict) -> dict:
    """The options a built-in's factory declares as parameters (all of them if it takes **kwargs)."""
    parameters = inspect.signature(make).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return dict(options)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {name: value for name, value in options.items() if name in names}


def load_reward_function(spec: str, /, **options) -> RewardFunction:
    """The reward function `spec` names: a built-in, `path/to/file.py:function` or `package.module:function`.
    `options` are the run's settings by flag name (step 3 passes `**vars(args)`); a built-in's factory gets
    the ones it declares (`format`: `format_pattern`, default a non-empty `\\boxed{...}`), others are ignored."""
    builtin = BUILTINS.get(spec)
    if builtin is not None:
        declared = _declared(builtin.make, options)
        return RewardFunction(
            spec, builtin.make(**declared), is_accuracy=builtin.is_accuracy, spec=spec, options=declared
        )
    fn = load_object(spec, RewardFunctionError, what="reward function", forms=_forms())
    return RewardFunction(_log_name(spec.rpartition(":")[2].rsplit(".", 1)[-1]), fn, spec=spec, options={})


# ---------------------------------------------------------------- calling


class _Timeout(BaseException):
    """Raised by the SIGALRM handler; a BaseException so a function's `except Exception` keeps out of it."""


def _call_with_signal(call: Callable, timeout: float):
    state = {"active": True}

    def on_alarm(signum, frame):
        if state["active"]:
            raise _Timeout()

    previous_handler = signal.signal(signal.SIGALRM, on_alarm)
    previous_delay, previous_interval = signal.setitimer(signal.ITIMER_REAL, timeout)
    started = time.monotonic()
    try:
        return call()
    finally:
        state["active"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_delay > 0:  # someone else's timer: give back what is left of it (at least a tick)
            left = max(previous_delay - (time.monotonic() - started), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)


def _call_in_thread(call: Callable, timeout: float):
    """Off the main thread (or without SIGALRM): the call runs in a daemon thread. A thread cannot be
    killed: past the timeout it is abandoned (its result dropped) and keeps running until it returns."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="reward-function", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _Timeout()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _call(call: Callable, timeout: float | None):
    if not timeout:
        return call()
    if hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread():
        return _call_with_signal(call, timeout)
    return _call_in_thread(call, timeout)


def _origins(origins: list[str], indices: list[int]) -> str:
    shown = ", ".join(str(origins[i]) for i in indices[:_SHOWN_ORIGINS])
    more = len(indices) - _SHOWN_ORIGINS
    return shown + (f" (+{more} more)" if more > 0 else "")


def _is_tensor(value) -> bool:
    """torch.is_tensor without importing torch, which would add a second to each reward worker's start: a
    value cannot be a tensor unless torch was imported."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_tensor(value)


def _as_list(result, expected: int) -> list | str:
    """The result as a list of `expected` values, or a string saying why it is not one."""
    if _is_tensor(result) or type(result).__module__ == "numpy":
        shape = tuple(result.shape)
        if len(shape) != 1:
            return f"returned an array of shape {shape}, expected {expected} numbers (shape ({expected},))"
        result = result.detach().cpu().tolist() if _is_tensor(result) else result.tolist()
    elif not isinstance(result, (list, tuple)):
        return f"returned a {type(result).__name__}, expected a list of {expected} numbers (one per completion)"
    if len(result) != expected:
        return f"returned {len(result)} values for {expected} completions"
    return list(result)


def _number(value) -> float | None:
    if _is_tensor(value) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):
        try:
            number = float(value)
        except OverflowError:  # an int (or Fraction) beyond any float: 10**400
            return None
        return number if math.isfinite(number) and abs(number) <= _FLOAT32_MAX else None
    return None


def _describe(value) -> str:
    if value is None:
        return "None"
    if isinstance(value, int) and value.bit_length() > 64:  # repr of a huge int is long (or refused past 4300 digits)
        return f"an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits (not a finite float32 number)"
    if _number_like(value):
        return f"{value!r} (not a finite float32 number)"
    return f"a {type(value).__name__} ({one_line(repr(value), 60)}), not a number"


def _number_like(value) -> bool:
    return isinstance(value, numbers.Real) or (_is_tensor(value) and value.numel() == 1)


def _check_lengths(completions, completion_ids, extra, origins) -> None:
    n = len(completions)
    lengths = {
        "completion_ids": len(completion_ids),
        "origins": len(origins),
        **{f"extra[{k!r}]": len(v) for k, v in extra.items()},
    }
    wrong = {k: v for k, v in lengths.items() if v != n}
    if wrong:
        raise ValueError(f"score_batch: {wrong} not aligned with {n} completions")


def score_batch(
    func: RewardFunction,
    *,
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    extra: dict[str, list],
    origins: list[str],
    timeout: float | None = None,
    deadline: str = "--reward_timeout",
    skip_bad: bool = False,
    on_skip: Callable[[str], None] | None = None,
    call: Callable[[dict, float | None], object] | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """`func`'s scores of one batch (float32 [B]) and the indices of the rows it could not score.

    Calls `func.fn(prompts=, completions=, completion_ids=, **extra)` once: through `call(kwargs, timeout)`
    when given (step 3's worker process, RewardWorker.call, which kills a call at its deadline and raises
    CallFailed), else in this process, where `timeout` seconds (None or 0: no limit) stop a call by SIGALRM
    in the main thread (at the next Python bytecode: not inside C code), else by abandoning a daemon thread;
    `deadline` names the limit in the message ("ran past --reward_timeout 2 s").
    Without `skip_bad` every problem raises RewardFunctionError; with it bad rows (all rows, for a raise, a
    wrong count, a timeout or a dead worker) come back NaN and listed, and `on_skip` (if given) gets the
    error's one line.
    """
    import torch  # lazy: +1.6 s on each reward worker's start

    n = len(completions)
    _check_lengths(completions, completion_ids, extra, origins)
    everything = list(range(n))

    def fail_batch(problem: str):
        error = RewardFunctionError(func.label, problem)
        if not skip_bad:
            raise error
        if on_skip is not None:
            on_skip(str(error))
        return torch.full((n,), float("nan"), dtype=torch.float32), everything

    try:
        kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **extra)
        result = call(kwargs, timeout) if call is not None else _call(lambda: func.fn(**kwargs), timeout)
    except RewardFunctionError:
        raise
    except _Timeout:
        return fail_batch(f"ran past {deadline} {timeout:g} s on rows {_origins(origins, everything)}")
    except CallFailed as exc:
        return fail_batch(f"{exc} (batch of {n} rows: {_origins(origins, everything)})")
    except Exception as exc:
        text = one_line(f"{type(exc).__name__}: {exc}", _MESSAGE_LIMIT)
        return fail_batch(f"raised {text} (batch of {n} rows: {_origins(origins, everything)})")
    values = _as_list(result, n)
    if isinstance(values, str):
        return fail_batch(f"{values} (rows {_origins(origins, everything)})")
    scores = [_number(v) for v in values]
    bad = [i for i, s in enumerate(scores) if s is None]
    if bad:
        first = bad[0]
        also = f"; {len(bad) - 1} more bad rows" if len(bad) > 1 else ""
        error = RewardFunctionError(func.label, f"returned {_describe(values[first])}{also}", origins[first], first)
        if not skip_bad:
            raise error
        if on_skip is not None:
            on_skip(str(error))
    tensor = torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float32)
    return tensor, bad
