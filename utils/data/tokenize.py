"""Tokenising rows (SFT examples, reward-model and DPO pairs, PPO prompts) and plain texts (PPO-ptx)."""

from __future__ import annotations

import hashlib
import json
from typing import Sequence

from utils.data.chat import assistant_spans, frame_lens, render, rendering_tools, reply_ids, require_template
from utils.data.formats import SkipRow, is_chat
from utils.data.sources import JSON_EXTS, DataError, _read_data_file, _read_text

IGNORE_INDEX = -100


# --------------------------------------------------------------------------- #
# Tokenisation
# --------------------------------------------------------------------------- #
def encode(tokenizer, text: str) -> list[int]:
    """Token ids without special tokens: the templates decide what is added."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def bos_prefix(tokenizer) -> list[int]:
    """[bos] only when the tokenizer's own config adds one (e.g. Llama)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if bos is not None and getattr(tokenizer, "add_bos_token", False) else []


def _eos(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataError("tokenizer has no eos_token_id")
    return eos


def fit_prompt(
    prefix: list, prompt: list, longest_tail: int, max_len: int, suffix: Sequence[int] = ()
) -> tuple[list, bool]:
    """Left-truncate the prompt body so prefix+prompt+suffix+tail fits (>= 1 prompt token kept).

    Left truncation keeps the end of the prompt ("...Assistant:"), which is
    what the response continues; a chat template's frame (its system header
    as ``prefix``, its generation prompt as ``suffix``) is never cut.
    """
    over = len(prefix) + len(prompt) + len(suffix) + longest_tail - max_len
    drop = max(0, min(over, len(prompt) - 1))
    return prefix + prompt[drop:] + list(suffix), drop > 0


def fit_tail(prompt_ids: list, tail: list, max_len: int) -> tuple[list, bool]:
    """Right-truncate response+eos to what is left after the prompt."""
    keep = max(0, max_len - len(prompt_ids))
    return tail[:keep], keep < len(tail)


def tokenizer_fingerprint(tokenizer) -> dict:
    """What identifies a tokenizer's output for the tokenised-data cache: its vocabulary, special
    tokens, BOS rule and chat template."""
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return {
        "name": getattr(tokenizer, "name_or_path", ""),
        "size": len(tokenizer),
        "vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest(),
        "special": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id],
        "bos_prefix": bos_prefix(tokenizer),
        "chat_template": getattr(tokenizer, "chat_template", None),
    }


def _check_len(max_len: int, tokenizer) -> None:
    if max_len < len(bos_prefix(tokenizer)) + 2:
        raise DataError(f"max sequence length {max_len} is too small (need >= prompt token + response token)")


def _skip(stats: dict, skip: SkipRow) -> None:
    stats["skipped"][skip.reason] = stats["skipped"].get(skip.reason, 0) + 1
    if skip.length is not None:  # a too-long row: the longest is what `check_not_all_too_long` reports
        stats["longest_too_long"] = max(stats.get("longest_too_long", 0), skip.length)


def check_not_all_too_long(examples: list, stats: dict, max_len: int, split: str, flag: str = "--max_seq_len") -> None:
    """DataError when a split (`split`: "training", "held-out") kept no example and rows were skipped as longer
    than `max_len` (`flag`): said as such, with the count and the longest, not as an empty split."""
    too_long = stats.get("skipped", {}).get("too_long", 0)
    if examples or not too_long:
        return
    longest = stats.get("longest_too_long")  # absent from a token cache written before it was counted
    longest = f" (the longest: {longest} tokens)" if longest else ""
    others = {k: v for k, v in stats["skipped"].items() if k != "too_long" and v}
    others.update({k: stats[k] for k in ("skipped_empty", "skipped_bad_pairs") if stats.get(k)})
    if not others:
        head = f"every one of the {too_long} {split} rows was longer than {flag} {max_len}{longest}"
    else:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(others.items()))
        head = (
            f"no {split} row is usable: {too_long} were longer than {flag} {max_len}{longest}, "
            f"the others skipped ({shown})"
        )
    raise DataError(
        f"{head}; a row must fit at least its prompt's frame (a chat template's header and generation prompt) and "
        f"one response token: raise {flag}, or shorten the rows"
    )


def _sft_chat(row: dict, tokenizer, max_seq_len: int, last_turn_only: bool, stats: dict):
    """A conversation's ids (the template's own) and labels on its assistant turns (all, or the last)."""
    ids, spans = assistant_spans(tokenizer, row["messages"])
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans[-1:] if last_turn_only else spans:
        labels[start:end] = ids[start:end]
    if len(ids) > max_seq_len:
        stats["truncated_response"] += 1
        length = len(ids)
        ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        if all(t == IGNORE_INDEX for t in labels):
            raise SkipRow("too_long", length)
    return {"input_ids": ids, "labels": labels}


def tokenize_sft(rows: Sequence[dict], tokenizer, max_seq_len: int, last_turn_only: bool = False) -> tuple[list, dict]:
    """SFT examples, loss only on the responses.

    String rows: ids = prompt + response + eos, the prompt left-truncated. Conversations (chat
    rows): the chat template's ids, every assistant turn trained with its end-of-turn token (only
    the last with ``last_turn_only``), right-truncated (a conversation's header stays)."""
    _check_len(max_seq_len, tokenizer)
    _eos(tokenizer)  # refused before any row
    stats = {"examples": 0, "truncated_prompt": 0, "truncated_response": 0, "skipped_empty": 0, "skipped": {}}
    out = []
    for row in rows:
        if row.get("messages") is not None:
            require_template(tokenizer, row.get("origin", ""))
            try:
                out.append(_sft_chat(row, tokenizer, max_seq_len, last_turn_only, stats))
            except SkipRow as skip:
                _skip(stats, skip)
            continue
        if not (row.get("chosen") or "").strip() or not (row.get("prompt") or "").strip():
            stats["skipped_empty"] += 1
            continue
        p, (tail,) = fit_replies(row, tokenizer, ("chosen",), max_seq_len, stats)
        out.append({"input_ids": p + tail, "labels": [IGNORE_INDEX] * len(p) + tail})
    stats["examples"] = len(out)
    return out, stats


def prompt_parts(row: dict, tokenizer, replies: Sequence[str] = (), room: int | None = None) -> tuple:
    """(head, body, foot, [reply ids]) of a row's prompt, to be joined by ``fit_prompt``.

    Strings: head [bos], body the prompt, no foot, each reply + eos. Chat rows: the template's
    prompt (ending with its generation prompt) and each reply's ids up to its end-of-turn token;
    when the prompt and the longest reply exceed ``room`` the prompt is split into the frame that
    truncation keeps (head, foot: ``frame_lens``) and the body between, else it is all head.
    SkipRow("too_long") when not even the frame and one token fit."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        eos = _eos(tokenizer)
        return (
            bos_prefix(tokenizer),
            encode(tokenizer, prompt),
            [],
            [encode(tokenizer, row[k]) + [eos] for k in replies],
        )
    require_template(tokenizer, row.get("origin", ""))
    tails, prompt_ids = [], None
    for k in replies:
        prompt_ids, tail = reply_ids(tokenizer, prompt, row[k])
        tails.append(tail)
    if prompt_ids is None:
        prompt_ids = render(tokenizer, prompt, add_generation_prompt=True)
    longest = max(map(len, tails), default=0)
    if room is None or len(prompt_ids) + longest <= room:
        return prompt_ids, [], [], tails
    head, foot = frame_lens(tokenizer, prompt, prompt_ids)
    if head + foot + 1 + min(1, longest) > room:
        raise SkipRow("too_long", len(prompt_ids) + longest)
    return prompt_ids[:head], prompt_ids[head : len(prompt_ids) - foot], prompt_ids[len(prompt_ids) - foot :], tails


def fit_replies(row: dict, tokenizer, keys: Sequence[str], max_seq_len: int, stats: dict) -> tuple[list, list]:
    """(prompt ids, [ids of ``row[k]`` for k in keys]) fitted into ``max_seq_len``, sharing one prompt.

    The prompt is truncated once, for the longest reply, so every sequence has the identical
    prompt prefix (the reward model compares them after it); a templated prompt keeps its frame,
    and a chat reply ends at its end-of-turn token, where step 3's generation stops and the score
    is read; replies are then right-truncated. Truncations are counted in ``stats``. SkipRow when
    a reply renders empty or the row does not fit."""
    head, body, foot, tails = prompt_parts(row, tokenizer, keys, max_seq_len)
    if not all(tails):
        raise SkipRow("empty")
    p, cut_p = fit_prompt(head, body, max(map(len, tails)), max_seq_len, foot)
    stats["truncated_prompt"] += cut_p
    fitted = []
    for tail in tails:
        tail, cut_r = fit_tail(p, tail, max_seq_len)
        stats["truncated_response"] += cut_r
        fitted.append(tail)
    return p, fitted


def scored_sequences(row: dict, tokenizer, keys: Sequence[str], max_seq_len: int, stats: dict) -> list:
    """prompt + each of ``row[k] for k in keys`` as a reward model reads them (``fit_replies``)."""
    p, tails = fit_replies(row, tokenizer, keys, max_seq_len, stats)
    return [p + tail for tail in tails]


def tokenize_pairs(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """Reward-model pairs: ``chosen_input_ids`` / ``rejected_input_ids``, each the whole sequence
    (``scored_sequences``). Pairs with an empty side or chosen == rejected teach nothing: skipped."""
    out, stats = _fitted_pairs(rows, tokenizer, max_seq_len)
    return [{"chosen_input_ids": p + c, "rejected_input_ids": p + r} for p, c, r in out], stats


def tokenize_preference_pairs(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """DPO pairs: the shared prompt once (``prompt_input_ids``) and each response apart
    (``chosen_response_ids`` / ``rejected_response_ids``, each ending with its EOS or end-of-turn
    token unless truncated), so a sequence log-prob sums exactly the response tokens. The same rows
    are kept and skipped, with the same truncation, as ``tokenize_pairs``."""
    out, stats = _fitted_pairs(rows, tokenizer, max_seq_len)
    return [{"prompt_input_ids": p, "chosen_response_ids": c, "rejected_response_ids": r} for p, c, r in out], stats


def _fitted_pairs(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """[(prompt ids, chosen ids, rejected ids)] of the usable pairs (``fit_replies``), and the stats."""
    _check_len(max_seq_len, tokenizer)
    stats = {"examples": 0, "truncated_prompt": 0, "truncated_response": 0, "skipped_bad_pairs": 0, "skipped": {}}
    out = []
    for row in rows:
        if isinstance(row.get("prompt"), str):
            c, r = (row.get("chosen") or "").strip(), (row.get("rejected") or "").strip()
            if not c or not r or c == r or not row["prompt"].strip():
                stats["skipped_bad_pairs"] += 1
                continue
        elif row.get("chosen") == row.get("rejected"):
            stats["skipped_bad_pairs"] += 1
            continue
        try:
            p, (chosen, rejected) = fit_replies(row, tokenizer, ("chosen", "rejected"), max_seq_len, stats)
        except SkipRow as skip:
            _skip(stats, skip)
            continue
        out.append((p, chosen, rejected))
    stats["examples"] = len(out)
    return out, stats


def tokenize_unpaired(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """KTO's labelled single examples: ``prompt_input_ids``, ``completion_response_ids`` (ending with its
    EOS or end-of-turn token unless truncated, as a DPO response) and ``desirable`` (bool). An unpaired
    row (``label``) gives one; a pair gives two, its chosen desirable and its rejected undesirable (the
    pair's prompt fitted once, as ``tokenize_preference_pairs`` does, and the same pairs skipped)."""
    pairs = [row for row in rows if "label" not in row]
    fitted, stats = _fitted_pairs(pairs, tokenizer, max_seq_len)
    out = [ex for p, c, r in fitted for ex in (_unpaired(p, c, True), _unpaired(p, r, False))]
    stats["skipped_empty"] = 0
    for row in rows:
        if "label" not in row:
            continue
        if isinstance(row.get("prompt"), str) and not (row["prompt"].strip() and (row.get("chosen") or "").strip()):
            stats["skipped_empty"] += 1
            continue
        try:
            p, (completion,) = fit_replies(row, tokenizer, ("chosen",), max_seq_len, stats)
        except SkipRow as skip:
            _skip(stats, skip)
            continue
        out.append(_unpaired(p, completion, row["label"]))
    stats["examples"] = len(out)
    stats["desirable"] = sum(ex["desirable"] for ex in out)
    stats["undesirable"] = len(out) - stats["desirable"]
    return out, stats


def _unpaired(prompt_ids: list, completion_ids: list, desirable: bool) -> dict:
    return {"prompt_input_ids": prompt_ids, "completion_response_ids": completion_ids, "desirable": bool(desirable)}


def tokenize_prompts(
    rows: Sequence[dict], tokenizer, max_prompt_seq_len: int, tools: list | None = None
) -> tuple[list, dict]:
    """PPO prompts; long prompts keep their last tokens (the part the answer follows) and a template's
    header.  Each example keeps, for reward functions, its row's prompt as given (``prompt``), where it
    came from (``origin``) and its other fields (``extra``). ``tools``: JSON schemas the chat template
    renders into each conversational prompt (its ``tools`` variable)."""
    with rendering_tools(tools):
        return _tokenize_prompts(rows, tokenizer, max_prompt_seq_len)


def _tokenize_prompts(rows: Sequence[dict], tokenizer, max_prompt_seq_len: int) -> tuple[list, dict]:
    prefix = bos_prefix(tokenizer)
    if max_prompt_seq_len < len(prefix) + 1:
        raise DataError(f"max prompt length {max_prompt_seq_len} is too small")
    stats = {"examples": 0, "truncated_prompt": 0, "skipped": {}, "chat": False}
    out = []
    for row in rows:
        stats["chat"] |= is_chat(row["prompt"])  # responses then also end at the template's end-of-turn token
        try:
            head, body, foot, _ = prompt_parts(row, tokenizer, room=max_prompt_seq_len)
        except SkipRow as skip:
            _skip(stats, skip)
            continue
        ids, cut = fit_prompt(head, body, 0, max_prompt_seq_len, foot)
        stats["truncated_prompt"] += cut
        example = {"input_ids": ids, "prompt": row["prompt"], "origin": row.get("origin", "")}
        if row.get("extra"):
            example["extra"] = row["extra"]
        out.append(example)
    stats["examples"] = len(out)
    return out, stats


# --------------------------------------------------------------------------- #
# Plain text (step 3's pretraining mix, PPO-ptx)
# --------------------------------------------------------------------------- #
def read_texts(path: str) -> list[str]:
    """Texts for the language-modelling term: one per non-empty line of a .txt file, or the `text`
    field (else prompt + chosen) of each JSON/JSONL row; errors name the file and line."""
    if not path.endswith(JSON_EXTS):
        return [line for line in _read_text(path).splitlines() if line.strip()]
    texts = []
    for obj, origin in _read_data_file(path)[0]:
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            texts.append(obj["text"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and isinstance(obj.get("chosen"), str):
            texts.append(obj["prompt"] + obj["chosen"])
        else:
            raise DataError(f"{origin}: missing field 'text' (or 'prompt' and 'chosen')")
    if not texts:
        raise DataError(f"{path}: no text rows")
    return texts


def tokenize_texts(texts: Sequence[str], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """Every token trained; a text longer than `max_seq_len` is cut into several examples (nothing dropped)."""
    eos, prefix = _eos(tokenizer), bos_prefix(tokenizer)
    stats = {"examples": 0, "split_texts": 0}
    out = []
    for text in texts:
        ids = prefix + encode(tokenizer, text) + [eos]
        chunks = [ids[i : i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
        stats["split_texts"] += len(chunks) > 1
        out += [{"input_ids": c, "labels": list(c)} for c in chunks if len(c) > 1]
    stats["examples"] = len(out)
    return out, stats
