"""Chat templates: rendering message lists to token ids exactly as ``tokenizer.apply_chat_template``.

Every templated sequence is the template's own token ids (``render``); the pieces a step needs
are found by rendering the conversation's prefixes, never by searching the text, so turns that
repeat the same content are still told apart:

* an assistant turn spans from the end of ``render(turns before it, add_generation_prompt=True)``
  to its end-of-turn token (the template's text after that token, e.g. ChatML's newline, is not
  part of the turn: generation stops at the token);
* a prompt's header (the template's system block and the opening of the first user turn) is
  the common token prefix of the prompt and the same prompt with other first-user text; left
  truncation keeps it.

A template that renders a prefix differently inside the longer conversation (some templates
rewrite earlier turns) gives SkipRow("template_mismatch") for that row.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import signal
import threading
import weakref

from utils.data.formats import SkipRow, common_prefix_len
from utils.data.sources import DataError
from utils.errors import one_line

_SENTINEL = "Sentinel reply 7"
# tokenizer -> (the template it was probed with, its end-of-turn id): two renders once, not per row
_END_OF_TURN = weakref.WeakKeyDictionary()
# tokenizer -> (template text, the --chat_template file it came from): errors name the file
_TEMPLATE_FILES = weakref.WeakKeyDictionary()
# the tools every render passes to the template (rendering_tools), None: none
_TOOLS: contextvars.ContextVar = contextvars.ContextVar("tools", default=None)
# A render takes well under a millisecond; one still running after this long loops (seconds, 0: no limit)
RENDER_TIME_LIMIT_S = 5.0


class ChatTemplateError(DataError):
    """A chat template that fails on a conversation, is refused by Jinja's sandbox or runs past
    ``RENDER_TIME_LIMIT_S``; the message names the template (the --chat_template file or the tokenizer's)."""


class _RenderTimeout(BaseException):
    """Raised into a render past its time limit; a BaseException so no `except Exception` on the way keeps it."""


def load_chat_template(path: str) -> str:
    """The Jinja text of ``--chat_template FILE`` (a .jinja file, or a tokenizer_config.json's 'chat_template')."""
    if not os.path.isfile(path):
        raise DataError(f"--chat_template {path}: no such file")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            text = json.loads(text).get("chat_template")
        except (ValueError, AttributeError):
            text = None
        if not isinstance(text, str):
            raise DataError(f"--chat_template {path}: no string 'chat_template' in this JSON file")
    if "{%" not in text and "{{" not in text:
        raise DataError(f"--chat_template {path}: not a Jinja template (no '{{%' or '{{{{' in it)")
    return text


def use_chat_template_file(tokenizer, path: str) -> None:
    """Give ``tokenizer`` the template of ``--chat_template FILE``, remembering the file for error messages."""
    tokenizer.chat_template = load_chat_template(path)
    _TEMPLATE_FILES[tokenizer] = (tokenizer.chat_template, path)


def template_name(tokenizer) -> str:
    """How errors name the tokenizer's template: its --chat_template file, else the tokenizer's directory."""
    known = _TEMPLATE_FILES.get(tokenizer)
    if known is not None and known[0] == getattr(tokenizer, "chat_template", None):
        return f"chat template {known[1]} (--chat_template)"
    return f"chat template of the tokenizer {getattr(tokenizer, 'name_or_path', '') or '?'}"


def require_template(tokenizer, origin: str = "") -> None:
    if not getattr(tokenizer, "chat_template", None):
        where = f"{origin}: " if origin else ""
        raise DataError(
            f"{where}conversational rows need a chat template and the tokenizer "
            f"({getattr(tokenizer, 'name_or_path', '?')}) has none; the training steps take one with "
            "--chat_template FILE (a Jinja file) and save it with their output's tokenizer; the evaluation "
            "tools and chat.py read it from the model directory (its tokenizer_config.json "
            "'chat_template', or chat_template.jinja)"
        )


@contextlib.contextmanager
def rendering_tools(tools: list | None):
    """Within it, every ``render`` passes ``tools`` (JSON schemas) to the template, which lists them in its
    system block (step 3's prompts with --tools, when the template has a ``tools`` variable)."""
    token = _TOOLS.set(tools)
    try:
        yield
    finally:
        _TOOLS.reset(token)


def render(tokenizer, messages: list, add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template (apply_chat_template's own ids).

    Templates are code from the model directory or --chat_template: transformers runs them in Jinja's
    ImmutableSandboxedEnvironment, and here under ``RENDER_TIME_LIMIT_S``, every failure (a refusal of
    the sandbox, the template's own raise_exception, deep recursion, a loop stopped) one line naming it."""
    tools = _TOOLS.get()

    def call():
        return tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            add_generation_prompt=add_generation_prompt,
            return_dict=True,
            **({"tools": tools} if tools else {}),
        )

    try:
        out = _within_time_limit(call, RENDER_TIME_LIMIT_S)
    except _RenderTimeout:
        raise ChatTemplateError(
            f"{template_name(tokenizer)}: rendering one conversation ran past "
            f"{RENDER_TIME_LIMIT_S:g} s and was stopped (a loop that does not end?)"
        ) from None
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the template raised is the template's problem
        raise ChatTemplateError(f"{template_name(tokenizer)} failed: {_describe(exc)}") from exc
    return list(out["input_ids"])


def _describe(exc: Exception) -> str:
    """One line for what a template raised: Jinja's kind of error (SecurityError: the sandbox refused) and text."""
    import jinja2  # lazy: +0.15 s on every --help (13 ms of imports and one more full GC pass over torch's objects)

    text = one_line(exc, 300) or "(no message)"
    if isinstance(exc, RecursionError):
        return f"RecursionError: {text} (a macro that calls itself without end?)"
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return f"Jinja's sandbox refused it: {text}"
    if type(exc) is jinja2.exceptions.TemplateError:  # what the template's raise_exception(...) raises
        return f"the template raised an error: {text}"
    return f"{type(exc).__name__}: {text}"


def _within_time_limit(call, seconds: float):
    """``call()``, stopped by _RenderTimeout after ``seconds``: a SIGALRM timer in the main thread (Jinja runs
    as Python bytecode, so the handler fires inside the loop; a few microseconds per call), else a thread."""
    if not seconds:
        return call()
    if (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
        and signal.getsignal(signal.SIGALRM) is not None
    ):  # never disturb someone else's timer or handler
        return _call_with_alarm(call, seconds)
    return _call_in_thread(call, seconds)


def _call_with_alarm(call, seconds: float):
    state = {"active": True}

    def on_alarm(signum, frame):
        if state["active"]:
            raise _RenderTimeout()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        return call()
    finally:
        state["active"] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_in_thread(call, seconds: float):
    """Without signals (off the main thread, or a timer already running): the render runs in a daemon
    thread; one past the limit cannot be killed and is abandoned (the error ends the run)."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            outcome["error"] = exc

    thread = threading.Thread(target=target, name="chat-template-render", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise _RenderTimeout()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _special_ids(tokenizer) -> set:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for i, tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(tok, "special", False):
            ids.add(int(i))
    return ids


def end_of_turn_id(tokenizer) -> int | None:
    """The special token the template puts right after an assistant turn (ChatML's ``<|im_end|>``,
    Llama 3's ``<|eot_id|>``), or None when the tokenizer has no template or none follows the turn."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return None
    cached = _END_OF_TURN.get(tokenizer)
    if cached is not None and cached[0] == template:
        return cached[1]
    user = [{"role": "user", "content": "Hello"}]
    prompt = render(tokenizer, user, add_generation_prompt=True)
    full = render(tokenizer, user + [{"role": "assistant", "content": _SENTINEL}])
    special = _special_ids(tokenizer)
    eot = next((t for t in full[len(prompt) :] if t in special), None) if full[: len(prompt)] == prompt else None
    _END_OF_TURN[tokenizer] = (template, eot)
    return eot


def stop_token_ids(tokenizer, chat: bool) -> list[int]:
    """Tokens that end a response: EOS, and the template's end-of-turn token for chat prompts."""
    ids = [tokenizer.eos_token_id]
    eot = end_of_turn_id(tokenizer) if chat else None
    if eot is not None and eot not in ids:
        ids.append(eot)
    return ids


def _end_of_turn(ids: list, start: int, end: int, stops: list) -> int:
    """End (exclusive) of the assistant turn in ids[start:end]: just after its first end-of-turn/EOS token."""
    for i in range(start, end):
        if ids[i] in stops:
            return i + 1
    return end


def assistant_spans(tokenizer, messages: list) -> tuple[list[int], list[tuple[int, int]]]:
    """(ids of the whole conversation, [(start, end)] of each assistant turn incl. its end-of-turn token)."""
    ids = render(tokenizer, messages)
    stops, spans = stop_token_ids(tokenizer, chat=True), []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(tokenizer, messages[:i], add_generation_prompt=True)) if i else 0
        upto = render(tokenizer, messages[: i + 1])
        if ids[: len(upto)] != upto or start > len(upto):
            raise SkipRow("template_mismatch")
        spans.append((start, _end_of_turn(ids, start, len(upto), stops)))
    return ids, spans


def reply_ids(tokenizer, prompt: list, replies: list) -> tuple[list[int], list[int]]:
    """(prompt ids ending with the generation prompt, the replies' ids up to their last end-of-turn token)."""
    prompt_ids = render(tokenizer, prompt, add_generation_prompt=True)
    full = render(tokenizer, prompt + replies)
    if full[: len(prompt_ids)] != prompt_ids:
        raise SkipRow("template_mismatch")
    stops = stop_token_ids(tokenizer, chat=True)
    tail = full[len(prompt_ids) :]
    ends = [i for i, t in enumerate(tail) if t in stops]
    return prompt_ids, tail[: ends[-1] + 1] if ends else tail


def frame_lens(tokenizer, prompt: list, prompt_ids: list) -> tuple[int, int]:
    """(head, foot): how many leading and trailing tokens of ``prompt_ids`` left truncation must keep.

    The head is the template's system block and the opening of the first user turn, the foot the
    close of the last turn and the generation prompt ("<|im_end|>\n<|im_start|>assistant\n"): the
    common prefix and suffix with the same prompt rendered with other first and last texts."""
    talk = [i for i, m in enumerate(prompt) if m["role"] != "system"]
    if not talk:
        return len(prompt_ids), 0
    other = [dict(m) for m in prompt]
    for i in {talk[0], talk[-1]}:
        other[i]["content"] = "\u2063" + other[i]["content"][::-1] + " ~"
    alt = render(tokenizer, other, add_generation_prompt=True)
    head = common_prefix_len(prompt_ids, alt)
    return head, common_prefix_len(prompt_ids[head:][::-1], alt[head:][::-1])
