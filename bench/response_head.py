"""The LM head over the trained positions only (utils.models.forward's `logits_to_keep`) against the whole sequence,
on the tool-use demo's step-1 traces and step-3 rows, in one process, the two arms alternating.

Step 1 (`lm_nll`) and step 3's log-probs (`token_logprobs`) run the head and its softmax from the first trained
position on; before, they ran it over the prompt too (in the tool demo ~60% of a trace: the tool block, the
system and user turns). Each round times a forward + backward of a batch with each arm (the order
alternating, AB BA ...) and the report gives the medians, their ratio, the spread, and the largest difference
between the arms' losses and log-probs (the head is per position, so none is expected).

    .venv/bin/python bench/response_head.py [--rounds 6] [--batch 8] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import REPO, RUNS, add_model_args, alternate, bench_model, end_report, read_jsonl, start_report, title  # noqa: E402


def tool_traces() -> str:
    """The tool-use demo's step-1 traces (data/make_tool_data.py, its default seed), written once under bench/runs."""
    out = os.path.join(RUNS, "tool_data")
    path = os.path.join(out, "sft", "train.jsonl")
    if not os.path.exists(path):
        subprocess.run(
            [sys.executable, "-m", "data.make_tool_data", "--out", out], cwd=REPO, check=True, stdout=subprocess.DEVNULL
        )
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per arm (each round: one batch of each kind)")
    p.add_argument("--batch", type=int, default=8, help="rows per batch (step 1's micro-batch in the tool demo: 8)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the ranks' OMP_NUM_THREADS: 1)")
    p.add_argument("--save", default=None, help="also write the printed report to this file (path)")
    return p.parse_args(argv)


def batches(tokenizer, batch_size: int):
    """(a step-1 batch of tool-use traces, a step-3 packed batch of the same traces as prompt + response)."""
    from utils.data import SFTCollator, tokenize_sft
    from utils.math.losses import IGNORE_INDEX
    from utils.math.rows import Row, pack

    rows = read_jsonl(tool_traces())[:batch_size]
    examples, _ = tokenize_sft(rows, tokenizer, 224, False)
    sft = SFTCollator(tokenizer.pad_token_id)(examples)
    packed = []
    for ids, labels in zip(sft["input_ids"], sft["labels"]):
        real, trained = ids[ids != tokenizer.pad_token_id], (labels != IGNORE_INDEX).nonzero()
        start = int(trained[0]) if len(trained) else 1
        packed.append(Row(prompt_ids=real[:start], response_ids=real[start:], ended_with_eos=True))
    return sft, pack(packed, tokenizer.pad_token_id)


def main(argv=None):
    args = parse_args(argv)
    import torch

    from utils.math.losses import sft_nll
    from utils.models.forward import causal_lm_logits, lm_nll, token_logprobs
    from utils.models.loading import load_causal_lm, load_tokenizer

    torch.set_num_threads(args.threads)
    path = bench_model(args)
    if args.tiny:  # the traces are conversations: the tiny model's twin with a chat template
        from utils.models.tiny import make_tiny_model

        path = os.path.join(RUNS, "tiny_chat_llama")
        if not os.path.exists(os.path.join(path, "config.json")):
            make_tiny_model("llama", path, chat=True)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, tokenizer).float().train()
    sft, packed = batches(tokenizer, args.batch)
    prompt_share = 1 - float(packed["attention_mask"][:, packed["prompt_len"] :].sum() / packed["attention_mask"].sum())
    header = start_report(
        [
            title("response_head.py"),
            f"model: {path}; torch threads {args.threads}",
            f"step 1 batch {tuple(sft['input_ids'].shape)}, step 3 batch "
            f"{tuple(packed['input_ids'].shape)} (prompt_len {packed['prompt_len']}; "
            f"{100 * prompt_share:.0f}% of the real tokens are prompt)",
            f"{args.rounds} rounds per arm, alternating; forward + backward each",
        ]
    )

    def whole_nll(batch):  # the arm before: the head over every position
        return sft_nll(causal_lm_logits(model, batch["input_ids"], batch["attention_mask"]), batch["labels"])

    def whole_logprobs(batch):
        return token_logprobs(model, {k: v for k, v in batch.items() if k != "prompt_len"})

    def timed(fn, batch, reduce):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = fn(batch)
        reduce(out).backward()
        return time.perf_counter() - start, out

    nll = lambda out: out[0] / out[1]  # noqa: E731
    masked = lambda out: (out * packed["action_mask"]).sum()  # noqa: E731
    timed(lambda b: lm_nll(model, b), sft, nll)  # warm-up
    rows, diffs = [], {}
    for name, whole, ours, batch, reduce in (
        ("step 1 lm_nll", whole_nll, lambda b: lm_nll(model, b), sft, nll),
        ("step 3 token_logprobs", whole_logprobs, lambda b: token_logprobs(model, b), packed, masked),
    ):
        a, b = alternate(args.rounds, lambda: timed(whole, batch, reduce), lambda: timed(ours, batch, reduce))
        ta, tb = [t for t, _ in a], [t for t, _ in b]
        out_a, out_b = a[0][1], b[0][1]
        if isinstance(out_a, tuple):
            diff = abs(float(nll(out_a).detach() - nll(out_b).detach()))
        else:
            diff = float(((out_a - out_b).abs() * packed["action_mask"]).max())
        diffs[name] = diff
        rows.append(
            f"{name:24s} {statistics.median(ta):8.3f} {statistics.median(tb):8.3f} "
            f"{statistics.median(ta) / statistics.median(tb):6.2f}x   "
            f"{min(ta):.3f}-{max(ta):.3f} / {min(tb):.3f}-{max(tb):.3f}   {diff:.1e}"
        )
    body = [f"{'batch':24s} {'whole s':>8s} {'resp. s':>8s}  ratio   spread whole / response-only    max |diff|", *rows]
    end_report(args.save, header, body, data={"diffs": diffs})


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
