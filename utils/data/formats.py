"""Row formats: one raw record of any accepted layout -> the normalised row of a step.

Accepted layouts (``normalize_row``; keys renamed by ``--prompt_key`` & co. first):

* standard: ``prompt`` / ``chosen`` / ``rejected`` strings; ``response`` and ``completion`` are
  synonyms of ``chosen`` (DeepSpeed-Chat's and TRL's prompt/completion rows);
* conversational SFT: ``messages``, a list of ``{"role", "content"}`` turns, multi-turn;
* conversational preference (TRL): ``prompt`` a message list, ``chosen`` / ``rejected`` lists of
  assistant messages; or no ``prompt`` and two whole conversations sharing a prefix (implicit prompt);
* HH-RLHF transcripts: ``chosen`` / ``rejected`` strings "\\n\\nHuman: ...\\n\\nAssistant: ..." and
  no prompt: the prompt is the shared text up to and including the last "\\n\\nAssistant:";
* prompt-only rows (step 3): a string or a message list, every other field kept in ``extra``
  (``answer``, ``label``, ...) for reward functions;
* unpaired feedback (TRL's KTO form; step 2 when ``RowFormat.unpaired``): ``prompt``, ``completion``
  (strings, or message lists) and a boolean ``label`` (true: desirable; in CSV the text true / false), no
  ``rejected``: the row's ``chosen`` is the completion, ``rejected`` None and ``label`` the bool. Pairs
  are still read. Step 1 trains a row labelled true as an SFT example and refuses one labelled false (a
  thumbs-down completion is no example to imitate). A file holds pairs or unpaired rows, not both
  (``check_shapes``, run on every source read, in every step).

A normalised row holds ``prompt``, ``chosen``, ``rejected`` (each a string, a message list or None),
``messages`` (step 1's whole conversation, or None), ``extra`` and ``origin``.  A row is *chat*
when its texts are message lists: those are rendered with the tokenizer's chat template
(utils/data/chat.py); string rows are concatenated raw unless ``--apply_chat_template`` made
them a user turn and an assistant turn here.

A malformed record raises DataError naming file:line and the field; a record that teaches nothing
(an empty turn, no assistant turn, two sides without a shared prompt) raises SkipRow with the
reason the caller counts.  Pure: no tokenizer, no files.
"""

from __future__ import annotations

from dataclasses import dataclass

from utils.data.sources import DataError

ROLES = ("system", "user", "assistant", "tool")
HH_ASSISTANT = "\n\nAssistant:"
HH_HUMAN = "\n\nHuman:"
CHOSEN_SYNONYMS = ("response", "completion")
FIELDS = ("prompt", "chosen", "rejected", "messages")
# the reasons a row is skipped (counted per source, logged once): see SkipRow
SKIP_REASONS = ("empty", "empty_turn", "no_assistant_turn", "prefix_mismatch", "template_mismatch", "too_long")


class SkipRow(Exception):
    """A well-formed row that teaches nothing; ``reason`` is one of SKIP_REASONS. ``length``: a "too_long" row's
    tokens (what an all-too-long split reports as its longest)."""

    def __init__(self, reason: str, length: int | None = None):
        super().__init__(reason)
        self.reason, self.length = reason, length


@dataclass(frozen=True)
class RowFormat:
    """How raw records map to rows: the key names (OpenRLHF's --input_key style) and the chat options."""

    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    messages_key: str = "messages"
    label_key: str = "label"  # unpaired rows' desirable (true) / undesirable (false) field
    apply_chat_template: bool = False  # string rows become a user turn + an assistant turn
    unpaired: bool = False  # step 2 also reads unpaired rows (KTO)

    @classmethod
    def from_args(cls, args) -> "RowFormat":
        return cls(**{k: getattr(args, k) for k in cls.__dataclass_fields__ if getattr(args, k, None) is not None})

    def key(self, name: str) -> str:
        """The record's field holding ``name`` ("prompt", "chosen", "rejected" or "messages")."""
        return getattr(self, f"{name}_key")

    @property
    def keys(self) -> tuple:
        return tuple(self.key(name) for name in FIELDS)


DEFAULT_FORMAT = RowFormat()


def is_chat(value) -> bool:
    return isinstance(value, list)


def common_prefix_len(a, b) -> int:
    """How many leading items two sequences share (characters, messages, token ids)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prompt_text(prompt) -> str:
    """A prompt for people to read: the string, or a message list's turns as "role: content" lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


# --------------------------------------------------------------------------- messages
def check_messages(value, origin: str, field: str, assistant_only: bool = False) -> list:
    """A validated message list (each ``{"role", "content"}`` with string content); SkipRow on an empty turn."""
    if not isinstance(value, list):
        raise DataError(f"{origin}: field '{field}' must be a list of messages, got {type(value).__name__}")
    if not value:
        raise SkipRow("empty")
    out = []
    for i, m in enumerate(value):
        where = f"{origin}: field '{field}'[{i}]"
        if not isinstance(m, dict):
            raise DataError(f'{where}: expected a message object {{"role", "content"}}, got {type(m).__name__}')
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: 'role' must be one of {'/'.join(ROLES)}, got {role!r}")
        if assistant_only and role != "assistant":
            raise DataError(f"{where}: expected an assistant message, got role {role!r}")
        if not isinstance(content, str):
            raise DataError(f"{where}: 'content' must be a string, got {type(content).__name__}")
        if not content.strip():
            raise SkipRow("empty_turn")
        out.append({"role": role, "content": content})
    return out


def parse_transcript(text: str) -> list | None:
    """An HH-RLHF transcript ("\\n\\nHuman: ..\\n\\nAssistant: ..") as messages, or None if it is not one."""
    if text.startswith(HH_HUMAN.lstrip()):
        text = "\n\n" + text  # DeepSpeed-Chat's "Human: ...\n\nAssistant:" prompts
    if not text.startswith(HH_HUMAN):
        return None
    messages, rest = [], text
    markers = {HH_HUMAN: "user", HH_ASSISTANT: "assistant"}
    while rest:
        marker = next((m for m in markers if rest.startswith(m)), None)
        if marker is None:
            return None
        rest = rest[len(marker) :]
        ends = [i for i in (rest.find(HH_HUMAN), rest.find(HH_ASSISTANT)) if i >= 0]
        cut = min(ends) if ends else len(rest)
        messages.append({"role": markers[marker], "content": rest[:cut].strip()})
        rest = rest[cut:]
    return messages


def split_hh(chosen: str, rejected: str | None) -> tuple[str, str, str | None]:
    """(prompt, chosen response, rejected response) of HH-RLHF transcripts; SkipRow("prefix_mismatch")
    when the two sides do not share the text up to their last "\\n\\nAssistant:"."""
    shared = chosen if rejected is None else chosen[: common_prefix_len(chosen, rejected)]
    cut = shared.rfind(HH_ASSISTANT)
    if cut < 0:
        raise SkipRow("prefix_mismatch")
    prompt = chosen[: cut + len(HH_ASSISTANT)]
    return prompt, chosen[len(prompt) :], None if rejected is None else rejected[len(prompt) :]


def split_shared_prefix(chosen: list, rejected: list) -> tuple[list, list, list]:
    """(prompt, chosen turns, rejected turns) of two whole conversations (TRL's implicit prompt):
    the shared leading messages are the prompt, and both rests must start with an assistant turn."""
    n = common_prefix_len(chosen, rejected)
    prompt, c, r = chosen[:n], chosen[n:], rejected[n:]
    if not prompt or not c or not r or c[0]["role"] != "assistant" or r[0]["role"] != "assistant":
        raise SkipRow("prefix_mismatch")
    return prompt, c, r


# --------------------------------------------------------------------------- rows
def _text(value, origin: str, field: str, assistant_only: bool = False):
    """A string or a validated message list; SkipRow when empty."""
    if isinstance(value, str):
        if not value.strip():
            raise SkipRow("empty")
        return value
    if isinstance(value, list):
        return check_messages(value, origin, field, assistant_only)
    raise DataError(f"{origin}: field '{field}' must be a string or a list of messages, got {type(value).__name__}")


def _label(value, origin: str):
    """An unpaired row's label: a boolean; in a CSV source (whose values are all strings) also the text
    true / false (any case)."""
    if isinstance(value, str) and origin.split(":")[0].lower().endswith(".csv") and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


def _missing(origin: str, name: str, fmt: RowFormat, obj: dict | None = None) -> DataError:
    if name == "rejected" and fmt.unpaired:  # neither a pair nor a labelled row: the label is what KTO rows lack
        return DataError(
            f"{origin}: missing field '{fmt.label_key}' (unpaired feedback for --loss_type kto needs true/false; "
            f"a preference pair needs '{fmt.rejected_key}')"
        )
    hint = " (or 'response' / 'completion')" if name == "chosen" and fmt.chosen_key == "chosen" else ""
    if name == "rejected" and obj is not None and fmt.label_key in obj and not fmt.unpaired:
        hint = f" (a row of unpaired feedback with '{fmt.label_key}': --loss_type kto of the DPO step reads those)"
    extra = "" if name != "prompt" else f" (or '{fmt.messages_key}', or HH-RLHF 'chosen' transcripts)"
    return DataError(f"{origin}: missing field '{fmt.key(name)}'{hint}{extra}")


def row_shape(obj, origin: str, fmt: RowFormat = DEFAULT_FORMAT) -> str | None:
    """The record's kind: "pair" (a chosen side and a rejected one), "unpaired" (a chosen side, no rejected one
    and a true/false label: TRL's KTO row) or None (anything else: an SFT or a prompt row, not an object)."""
    if not isinstance(obj, dict):
        return None
    synonyms = CHOSEN_SYNONYMS if fmt.chosen_key == "chosen" else ()
    if all(obj.get(key) is None for key in (fmt.chosen_key, *synonyms)):
        return None
    if obj.get(fmt.rejected_key) is not None:
        return "pair"
    return "unpaired" if isinstance(_label(obj.get(fmt.label_key), origin), bool) else None


def check_shapes(records, fmt: RowFormat = DEFAULT_FORMAT) -> None:
    """DataError for a file (the records whose origins share a "file:" part) holding both preference pairs and
    unpaired feedback rows, naming the first row of each: a step would read one kind as the other (step 1 a
    thumbs-down completion as an example, the reward model a KTO row as a pair without its rejected side)."""
    first: dict[str, dict[str, str]] = {}
    for obj, origin in records:
        shape = row_shape(obj, origin, fmt)
        if shape is None:
            continue
        file = origin.rsplit(":", 1)[0]
        seen = first.setdefault(file, {})
        seen.setdefault(shape, origin)
        if len(seen) == 2:
            raise DataError(
                f"{file}: mixes preference pairs ('{fmt.chosen_key}' and '{fmt.rejected_key}', first at "
                f"{seen['pair']}) and unpaired feedback rows ('{fmt.label_key}' true/false and no "
                f"'{fmt.rejected_key}', first at {seen['unpaired']}); give each kind a file of its own "
                "(step2_dpo --loss_type kto reads both)"
            )


def _prompt_of_conversation(messages: list) -> list:
    """Step 3's prompt from a whole conversation: every turn before its last assistant turn."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    prompt = messages if last is None else messages[:last]
    if not prompt or prompt[-1]["role"] == "assistant":
        raise SkipRow("no_assistant_turn" if last is None else "prefix_mismatch")
    return prompt


def _turn(role: str, text: str) -> list:
    return [{"role": role, "content": text}]


def normalize_row(obj, origin: str, step: int, fmt: RowFormat = DEFAULT_FORMAT) -> dict:
    """The normalised row of ``step`` (1 SFT, 2 pairs, 3 prompts) from one raw record (see the module doc)."""
    if not isinstance(obj, dict):
        raise DataError(f"{origin}: expected a JSON object, got {type(obj).__name__}")
    raw = {name: obj.get(fmt.key(name)) for name in FIELDS}
    if step == 1 and raw["rejected"] is None and _label(obj.get(fmt.label_key), origin) is False:
        raise DataError(
            f"{origin}: a row labelled undesirable ('{fmt.label_key}': false) is not an SFT example; drop it or "
            "train it with step2_dpo --loss_type kto"
        )
    if raw["chosen"] is None and fmt.chosen_key == "chosen":
        raw["chosen"] = next((obj[k] for k in CHOSEN_SYNONYMS if obj.get(k) is not None), None)
    # step 3 keeps every field but the prompt's for reward functions (an answer, a label, the pair it came from)
    used = (
        {fmt.prompt_key, fmt.messages_key}
        if step == 3
        else set(fmt.keys) | (set(CHOSEN_SYNONYMS) if fmt.chosen_key == "chosen" else set())
    )
    label = None
    if step == 2 and fmt.unpaired and raw["rejected"] is None and fmt.label_key in obj:
        label = _label(obj[fmt.label_key], origin)
        if not isinstance(label, bool):
            raise DataError(
                f"{origin}: field '{fmt.label_key}' must be true (desirable) or false (undesirable), got {label!r}"
            )
        used.add(fmt.label_key)
    row = {
        "prompt": None,
        "chosen": None,
        "rejected": None,
        "messages": None,
        "extra": {k: v for k, v in obj.items() if k not in used},
        "origin": origin,
    }
    if label is not None:
        row["label"] = label

    if raw["messages"] is not None and raw["prompt"] is None:
        if step == 2:
            raise DataError(
                f"{origin}: a '{fmt.messages_key}' row has no rejected side; step 2 needs "
                f"'{fmt.prompt_key}', '{fmt.chosen_key}' and '{fmt.rejected_key}'"
            )
        messages = check_messages(raw["messages"], origin, fmt.messages_key)
        if step == 3:
            row["prompt"] = _prompt_of_conversation(messages)
            return row
        if not any(m["role"] == "assistant" for m in messages):
            raise SkipRow("no_assistant_turn")
        row["messages"] = messages
        return row

    needed = ("chosen",) if label is not None else {1: ("chosen",), 2: ("chosen", "rejected"), 3: ()}[step]
    values = {}
    for name in ("prompt", "chosen", "rejected"):
        if raw[name] is not None and (name == "prompt" or name in needed):
            values[name] = _text(
                raw[name], origin, fmt.key(name), assistant_only=name != "prompt" and raw["prompt"] is not None
            )
    if "prompt" not in values:
        # no prompt: HH-RLHF transcripts or TRL's implicit prompt, taken from the sides
        if raw["chosen"] is None:
            raise _missing(origin, "prompt", fmt)
        if "rejected" in needed and raw["rejected"] is None:
            raise _missing(origin, "rejected", fmt, obj)
        # only step 2 needs the two sides to agree on the prompt; steps 1 and 3 take it from chosen
        c = _text(raw["chosen"], origin, fmt.chosen_key)
        r = None if raw["rejected"] is None or step != 2 else _text(raw["rejected"], origin, fmt.rejected_key)
        if r is not None and is_chat(c) != is_chat(r):
            raise DataError(
                f"{origin}: fields '{fmt.chosen_key}' and '{fmt.rejected_key}' must both be strings "
                "or both message lists"
            )
        if is_chat(c) and r is None:
            prompt = _prompt_of_conversation(c)
            parts = (prompt, c[len(prompt) :], None)
        elif is_chat(c):
            parts = split_shared_prefix(c, r)
        elif HH_ASSISTANT not in c:
            raise _missing(origin, "prompt", fmt)
        else:
            parts = split_hh(c, r)
        values = {n: v for n, v in zip(("prompt", "chosen", "rejected"), parts) if v is not None}
        if any(isinstance(v, str) and not v.strip() for v in values.values()):
            raise SkipRow("empty")
    for name in needed:
        if name not in values:
            raise _missing(origin, name, fmt, obj)
    chat = [is_chat(values[n]) for n in values]
    if any(chat) and not all(chat):
        raise DataError(
            f"{origin}: fields {[fmt.key(n) for n in values]} mix strings and message lists; "
            "give all as strings or all as message lists"
        )
    if not any(chat) and fmt.apply_chat_template:
        values = _templated(values)
    if step == 1 and is_chat(values["prompt"]):
        row["messages"] = values["prompt"] + values["chosen"]
        return row
    row.update({n: values.get(n) for n in ("prompt", "chosen", "rejected")})
    return row


def _templated(values: dict) -> dict:
    """--apply_chat_template on string rows: the prompt a user turn (an HH transcript its own turns),
    each response an assistant turn."""
    prompt = values["prompt"]
    turns = parse_transcript(prompt[: -len(HH_ASSISTANT)]) if prompt.endswith(HH_ASSISTANT) else None
    out = {"prompt": turns if turns and all(m["content"] for m in turns) else _turn("user", prompt)}
    for name in ("chosen", "rejected"):
        if name in values:
            out[name] = _turn("assistant", values[name].strip() if turns else values[name])
    return out
