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

import json
import os
import weakref

from utils.data.formats import SkipRow, common_prefix_len
from utils.data.sources import DataError

_SENTINEL = "Sentinel reply 7"
# tokenizer -> (the template it was probed with, its end-of-turn id): two renders once, not per row
_END_OF_TURN = weakref.WeakKeyDictionary()


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


def require_template(tokenizer, origin: str = "") -> None:
    if not getattr(tokenizer, "chat_template", None):
        where = f"{origin}: " if origin else ""
        raise DataError(f"{where}conversational rows need a chat template and the tokenizer "
                        f"({getattr(tokenizer, 'name_or_path', '?')}) has none; give one with --chat_template FILE "
                        "(a Jinja file)")


def render(tokenizer, messages: list, add_generation_prompt: bool = False) -> list[int]:
    """Token ids of ``messages`` through the tokenizer's chat template (apply_chat_template's own ids)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        return_dict=True)
    return list(out["input_ids"])


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
    eot = next((t for t in full[len(prompt):] if t in special), None) if full[:len(prompt)] == prompt else None
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
        upto = render(tokenizer, messages[:i + 1])
        if ids[:len(upto)] != upto or start > len(upto):
            raise SkipRow("template_mismatch")
        spans.append((start, _end_of_turn(ids, start, len(upto), stops)))
    return ids, spans


def reply_ids(tokenizer, prompt: list, replies: list) -> tuple[list[int], list[int]]:
    """(prompt ids ending with the generation prompt, the replies' ids up to their last end-of-turn token)."""
    prompt_ids = render(tokenizer, prompt, add_generation_prompt=True)
    full = render(tokenizer, prompt + replies)
    if full[:len(prompt_ids)] != prompt_ids:
        raise SkipRow("template_mismatch")
    stops = stop_token_ids(tokenizer, chat=True)
    tail = full[len(prompt_ids):]
    ends = [i for i, t in enumerate(tail) if t in stops]
    return prompt_ids, tail[:ends[-1] + 1] if ends else tail


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
