"""Score (prompt, response) texts, or measure pair accuracy, with a trained reward model.

    python -m step2_reward.eval --model_name_or_path DIR --prompt P --response R1 [--response R2 ...]
                                [--prompt P2 --response R3 ...] [--pairs FILE] [--batch_size 16]

Every --response belongs to the --prompt before it. As a shell cannot easily pass a newline, the
escapes \\n, \\t and \\\\ in --prompt/--response become newline, tab and backslash (--raw_text keeps
them as typed), so "Human: ...\\n\\nAssistant:" is the training template. Texts are tokenized
exactly as in training (prompt ids + response ids + EOS, utils.data). `--pairs` reads JSON/JSONL
rows with prompt, chosen, rejected (or a folder / datasets name, like --data_path; when the source
has an eval split, that split is used) and prints accuracy, mean chosen and rejected scores and the
mean margin. One process, no DeepSpeed engine.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

from utils.cli import FlagParser, Number
from utils.data import (
    DEFAULT_FORMAT,
    DataError,
    PairCollator,
    PromptCollator,
    RowFormat,
    SkipRow,
    normalize_row,
    read_rows,
    scored_sequences,
    split_pair_batch,
    tokenize_pairs,
)
from utils.errors import UsageError
from utils.math.losses import pair_metrics
from utils.models.forward import sequence_scores
from utils.models.loading import hf_zero3_disabled, load_tokenizer
from utils.models.reward_model import RewardModel
from utils.train.flags import add_format_args

_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\"}


def unescape(text: str) -> str:
    """Turn the two-character escapes \\n, \\t, \\\\ into newline, tab, backslash (nothing else)."""
    return re.sub(r"\\([nt\\])", lambda m: _ESCAPES[m.group(1)], text)


class _PromptAction(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        groups = getattr(namespace, "groups", None) or []
        groups.append((value, []))
        namespace.groups = groups


class _ResponseAction(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        groups = getattr(namespace, "groups", None)
        if not groups:
            parser.error("--response must follow a --prompt")
        groups[-1][1].append(value)


def parse_args(argv=None):
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", required=True, help="step-2 output directory")
    parser.add_argument(
        "--prompt",
        action=_PromptAction,
        dest="groups",
        default=None,
        metavar="TEXT",
        help="a prompt; repeatable, each followed by its --response(s)",
    )
    parser.add_argument(
        "--response",
        action=_ResponseAction,
        dest="groups",
        default=None,
        metavar="TEXT",
        help="a response to the preceding --prompt; repeatable",
    )
    parser.add_argument("--pairs", default=None, help="JSON/JSONL file (or folder) of prompt/chosen/rejected rows")
    parser.add_argument(
        "--batch_size",
        type=Number(int, low=1),
        default=16,
        help="rows per scoring forward: responses, or pairs with --pairs (default %(default)s)",
    )
    add_format_args(parser.add_argument_group("row format (as in training)"), template_file=False)
    parser.add_argument(
        "--max_seq_len",
        type=Number(int, low=1),
        default=512,
        help="max tokens per scored sequence (prompt + response), truncated as in training (default %(default)s)",
    )
    parser.add_argument(
        "--raw_text", action="store_true", help="keep \\n, \\t, \\\\ as typed (default: newline, tab, backslash)"
    )
    parser.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped with the model")
    args = parser.parse_args(argv)
    args.groups = args.groups or []
    if not args.raw_text:
        args.groups = [(unescape(p), [unescape(r) for r in rs]) for p, rs in args.groups]
    for prompt, responses in args.groups:
        if not responses:
            parser.error(f"--prompt {prompt!r} has no --response")
    if not args.groups and not args.pairs:
        parser.error("give --prompt/--response texts and/or --pairs FILE")
    if args.batch_size < 1:
        parser.error("--batch_size must be >= 1")
    return args


@torch.no_grad()
def score_texts(
    model, tokenizer, items: list[tuple[str, str]], max_seq_len: int, batch_size: int, fmt=DEFAULT_FORMAT
) -> list[float]:
    """Scores of (prompt, response) texts, tokenised as in training (``scored_sequences``); with
    ``fmt.apply_chat_template`` the prompt is a user turn and the response an assistant turn."""
    stats = {"truncated_prompt": 0, "truncated_response": 0}
    sequences = []
    for p, r in items:
        try:
            row = normalize_row({"prompt": p, "chosen": r}, "--prompt/--response", 1, fmt)
            if row["messages"] is not None:
                row = {"prompt": row["messages"][:-1], "chosen": row["messages"][-1:], "origin": row["origin"]}
            sequences += scored_sequences(row, tokenizer, ("chosen",), max_seq_len, stats)
        except SkipRow:
            raise UsageError("empty prompt or response cannot be scored") from None
    collator = PromptCollator(tokenizer.pad_token_id)  # left padding: the score is read at the last real token
    scores = []
    for i in range(0, len(sequences), batch_size):
        batch = collator([{"input_ids": ids} for ids in sequences[i : i + batch_size]])
        scores += sequence_scores(model, batch["input_ids"], batch["attention_mask"]).tolist()
    return scores


@torch.no_grad()
def evaluate_pair_file(model, tokenizer, source: str, max_seq_len: int, batch_size: int, fmt=DEFAULT_FORMAT) -> dict:
    rows, split = read_rows(source, 2, fmt)
    pairs, stats = tokenize_pairs(rows, tokenizer, max_seq_len)
    if not pairs:
        raise DataError(f"{source}: no usable pairs ({stats})")
    collator = PairCollator(tokenizer.pad_token_id)
    chosen, rejected = [], []
    for i in range(0, len(pairs), batch_size):
        batch = collator(pairs[i : i + batch_size])
        c, r = split_pair_batch(sequence_scores(model, batch["input_ids"], batch["attention_mask"]))
        chosen.append(c)
        rejected.append(r)
    metrics = pair_metrics(torch.cat(chosen), torch.cat(rejected))
    metrics.update(pairs=len(pairs), split=split, skipped_bad_pairs=stats["skipped_bad_pairs"])
    return metrics


def _short(text: str, width: int, keep_end: bool = False) -> str:
    """One line of at most `width` characters (newlines shown as \\n); prompts keep their end."""
    text = repr(text)[1:-1]
    if len(text) <= width:
        return text
    return "..." + text[-(width - 3) :] if keep_end else text[: width - 3] + "..."


def format_table(items: list[tuple[str, str]], scores: list[float]) -> str:
    lines = [f"{'score':>10}  {'prompt':<48}  response", f"{'-' * 10}  {'-' * 48}  {'-' * 40}"]
    for (prompt, response), score in zip(items, scores):
        lines.append(f"{score:>10.4f}  {_short(prompt, 48, keep_end=True):<48}  {_short(response, 60)}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    with hf_zero3_disabled():
        tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
        model = RewardModel.from_pretrained(
            args.model_name_or_path, tokenizer, trust_remote_code=args.trust_remote_code, require_value_head=True
        ).eval()
    result = {}
    if args.groups:
        items = [(prompt, response) for prompt, responses in args.groups for response in responses]
        scores = score_texts(model, tokenizer, items, args.max_seq_len, args.batch_size, RowFormat.from_args(args))
        print(format_table(items, scores))
        result["scores"] = scores
    if args.pairs:
        metrics = evaluate_pair_file(
            model, tokenizer, args.pairs, args.max_seq_len, args.batch_size, RowFormat.from_args(args)
        )
        print(
            f"pairs {metrics['pairs']} ({args.pairs}, split {metrics['split']}; "
            f"skipped_bad_pairs {metrics['skipped_bad_pairs']}): accuracy {metrics['accuracy']:.4f}, "
            f"chosen {metrics['chosen_mean']:.4f}, rejected {metrics['rejected_mean']:.4f}, "
            f"margin {metrics['margin_mean']:.4f}"
        )
        result["pairs"] = metrics
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
