"""Tokenising rows (SFT examples, reward-model pairs, PPO prompts) and plain texts (PPO-ptx)."""

from __future__ import annotations

from typing import Sequence

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


def fit_prompt(prefix: list, prompt: list, longest_tail: int, max_len: int) -> tuple[list, bool]:
    """Left-truncate the prompt body so prefix+prompt+tail fits (>= 1 prompt token kept).

    Left truncation keeps the end of the prompt ("...Assistant:"), which is
    what the response continues.
    """
    over = len(prefix) + len(prompt) + longest_tail - max_len
    drop = max(0, min(over, len(prompt) - 1))
    return prefix + prompt[drop:], drop > 0


def fit_tail(prompt_ids: list, tail: list, max_len: int) -> tuple[list, bool]:
    """Right-truncate response+eos to what is left after the prompt."""
    keep = max(0, max_len - len(prompt_ids))
    return tail[:keep], keep < len(tail)


def _check_len(max_len: int, tokenizer) -> None:
    if max_len < len(bos_prefix(tokenizer)) + 2:
        raise DataError(f"max sequence length {max_len} is too small (need >= prompt token + response token)")


def tokenize_sft(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """SFT examples: ids = prompt + response + eos; loss only on response + eos."""
    _check_len(max_seq_len, tokenizer)
    eos, prefix = _eos(tokenizer), bos_prefix(tokenizer)
    stats = {"examples": 0, "truncated_prompt": 0, "truncated_response": 0, "skipped_empty": 0}
    out = []
    for row in rows:
        if not (row.get("chosen") or "").strip() or not (row.get("prompt") or "").strip():
            stats["skipped_empty"] += 1
            continue
        tail = encode(tokenizer, row["chosen"]) + [eos]
        p, cut_p = fit_prompt(prefix, encode(tokenizer, row["prompt"]), len(tail), max_seq_len)
        tail, cut_r = fit_tail(p, tail, max_seq_len)
        stats["truncated_prompt"] += cut_p
        stats["truncated_response"] += cut_r
        out.append({"input_ids": p + tail, "labels": [IGNORE_INDEX] * len(p) + tail})
    stats["examples"] = len(out)
    return out, stats


def tokenize_pairs(rows: Sequence[dict], tokenizer, max_seq_len: int) -> tuple[list, dict]:
    """Reward-model pairs: chosen and rejected sequences share one prompt.

    The prompt is truncated once, for the longer side, so both sequences have
    the identical prompt prefix (the reward model compares them after it).
    Pairs with an empty side or chosen == rejected teach nothing: skipped.
    """
    _check_len(max_seq_len, tokenizer)
    eos, prefix = _eos(tokenizer), bos_prefix(tokenizer)
    stats = {"examples": 0, "truncated_prompt": 0, "truncated_response": 0, "skipped_bad_pairs": 0}
    out = []
    for row in rows:
        c, r = (row.get("chosen") or "").strip(), (row.get("rejected") or "").strip()
        if not c or not r or c == r or not (row.get("prompt") or "").strip():
            stats["skipped_bad_pairs"] += 1
            continue
        tails = [encode(tokenizer, row[k]) + [eos] for k in ("chosen", "rejected")]
        p, cut_p = fit_prompt(prefix, encode(tokenizer, row["prompt"]), max(map(len, tails)), max_seq_len)
        stats["truncated_prompt"] += cut_p
        seqs = []
        for tail in tails:
            tail, cut_r = fit_tail(p, tail, max_seq_len)
            stats["truncated_response"] += cut_r
            seqs.append(p + tail)
        out.append({"chosen_input_ids": seqs[0], "rejected_input_ids": seqs[1]})
    stats["examples"] = len(out)
    return out, stats


def tokenize_prompts(rows: Sequence[dict], tokenizer, max_prompt_seq_len: int) -> tuple[list, dict]:
    """PPO prompts; long prompts keep their last tokens (the part the answer follows)."""
    prefix = bos_prefix(tokenizer)
    if max_prompt_seq_len < len(prefix) + 1:
        raise DataError(f"max prompt length {max_prompt_seq_len} is too small")
    stats = {"examples": 0, "truncated_prompt": 0}
    out = []
    for row in rows:
        ids, cut = fit_prompt(prefix, encode(tokenizer, row["prompt"]), 0, max_prompt_seq_len)
        stats["truncated_prompt"] += cut
        out.append({"input_ids": ids})
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
        chunks = [ids[i:i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
        stats["split_texts"] += len(chunks) > 1
        out += [{"input_ids": c, "labels": list(c)} for c in chunks if len(c) > 1]
    stats["examples"] = len(out)
    return out, stats
