"""Step 1: supervised fine-tuning of a causal LM on prompt -> response pairs, under DeepSpeed.

Only response tokens (and the EOS that ends them) are trained; prompt and padding are masked
(-100), unlike DeepSpeed-Chat, which also trains the prompt. Perplexity on the held-out split is
reported before and after training. The output directory is a plain `from_pretrained` directory.
"""

from __future__ import annotations

import math

import torch

from utils.cli import Number
from utils.data import SFTCollator, check_not_all_too_long, tokenize_sft
from utils.errors import UsageError, run_main
from utils.math.losses import IGNORE_INDEX
from utils.models.export import export_hf_model
from utils.models.forward import LOGPROB_CHUNK_TOKENS, causal_lm_logits, check_padding_free, eval_mode, lm_nll
from utils.models.loading import check_4bit_args, load_causal_lm
from utils.runtime.distributed import all_reduce_sum, rank_batches
from utils.train.checkpoint import check_resume_early, data_layout
from utils.train.config_file import write_run_config
from utils.train.flags import single_model_parser, validate_training_args
from utils.train.loop import (
    build_trained_engine,
    micro_batch_schedule,
    spec_from_args,
    start_single_model_run,
    token_budget,
    train_ds_config_from_args,
    train_micro_batches,
)
from utils.train.metrics_logger import print_rank0
from utils.train.run import ReloadCheck, Run


def build_parser():
    """The argument parser of this entry point (the reference pages of docs/ are generated from it)."""
    parser = single_model_parser(__doc__.splitlines()[0], "local from_pretrained directory or hub name")
    parser.add_argument(
        "--train_on_last_turn_only",
        action="store_true",
        help="train only a conversation's last assistant turn (default: every assistant turn)",
    )
    parser.add_argument(
        "--eval_iters",
        type=Number(int, low=0),
        default=0,
        help="perplexity on at most this many held-out batches per rank (0: all held-out rows)",
    )
    return parser


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    validate_training_args(args)
    check_4bit_args(args, {"model": ""}, {"model": args.zero_stage})
    check_resume_early(args)  # a --resume that cannot continue stops before any model loads
    return args


@torch.no_grad()
def evaluate_perplexity(
    engine,
    examples: list,
    collator,
    batch_size: int,
    max_batches: int = 0,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    padding_free: bool = False,
) -> float:
    """Token-weighted perplexity over all ranks' shares of the held-out examples (the first `max_batches`
    batches of each share when > 0); the LM head `chunk_tokens` tokens at a time (--logprob_chunk_tokens),
    `padding_free` forwards (--padding_free)."""
    total_nll, total_tokens = 0.0, 0.0
    with eval_mode(engine):
        for batch_examples, weight in rank_batches(examples, batch_size, max_batches):
            nll, count = lm_nll(engine, collator(batch_examples), chunk_tokens, padding_free)
            total_nll += weight * nll.item()
            total_tokens += weight * float(count)
    total_nll, total_tokens = all_reduce_sum([total_nll, total_tokens])
    return math.exp(total_nll / max(total_tokens, 1.0))


def sft_loss_terms(
    engine, batch: dict, chunk_tokens: int = LOGPROB_CHUNK_TOKENS, padding_free: bool = False
) -> tuple[dict, tuple]:
    """A micro-batch's loss as utils.train.loop.train_micro_batches takes it: {"tokens": its NLL per trained
    token} (no extra stats); the LM head `chunk_tokens` tokens at a time (--logprob_chunk_tokens),
    `padding_free` forwards (--padding_free)."""
    nll, count = lm_nll(engine, batch, chunk_tokens, padding_free)
    return {"tokens": nll / count.clamp(min=1)}, ()


def example_tokens(example: dict) -> int:
    """The tokens an SFT example adds to its micro-batch (`--max_tokens_per_micro_batch`)."""
    return len(example["input_ids"])


def trained_tokens(batch: dict) -> dict:
    """{"tokens": the labels a micro-batch trains on} (sft_nll's count, without a forward): the unit its
    loss is averaged over, summed over the optimizer step by utils.train.loop.train_micro_batches."""
    return {"tokens": int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())}


def logits_of(model, batch: dict) -> torch.Tensor:
    return causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])


def main(argv=None):
    args = parse_args(argv)
    write_run_config(args, "step1_sft.main")  # OUTPUT_DIR/config.yaml (rank 0): `--config` it to rerun these flags
    tokenizer, train_examples, train_stats, eval_examples, eval_stats = start_single_model_run(
        args,
        1,
        lambda rows, tok: tokenize_sft(rows, tok, args.max_seq_len, args.train_on_last_turn_only),
        {"max_seq_len": args.max_seq_len, "train_on_last_turn_only": args.train_on_last_turn_only},
    )
    print_rank0(
        f"[step1] train examples {len(train_examples)} {train_stats}; eval examples {len(eval_examples)} {eval_stats}"
    )
    if args.eval_iters:
        print_rank0(
            f"[step1] perplexity on at most {args.eval_iters} batches of {args.per_device_eval_batch_size} "
            f"held-out rows per rank (--eval_iters)"
        )
    collator = SFTCollator(tokenizer.pad_token_id)
    check_not_all_too_long(train_examples, train_stats, args.max_seq_len, "training")
    check_not_all_too_long(eval_examples, eval_stats, args.max_seq_len, "held-out")
    if not eval_examples:
        raise UsageError(
            "no held-out examples to evaluate (the eval split is empty: --eval_fraction 0, or "
            "too few rows); give --eval_fraction > 0 or a source with an eval/test file"
        )

    budget = token_budget(args, train_examples, collator, example_tokens, "example")
    sampler, loader, total_steps = micro_batch_schedule(train_examples, collator, args, budget)
    ds_config = train_ds_config_from_args(args)
    model = load_causal_lm(
        args.model_name_or_path,
        tokenizer,
        ds_config,
        args.dropout,
        args.trust_remote_code,
        attn_implementation=args.attn_implementation,
        load_in_4bit=args.load_in_4bit,
    )
    engine = build_trained_engine(model, ds_config, spec_from_args(args), total_steps)
    if args.padding_free:
        check_padding_free(engine)

    run = Run(args, "step1", "step1 sft", {"model": engine}, data_layout(args, len(train_examples)), total_steps)

    def perplexity() -> float:  # before and after training, the same held-out batches
        return evaluate_perplexity(
            engine,
            eval_examples,
            collator,
            args.per_device_eval_batch_size,
            args.eval_iters,
            args.logprob_chunk_tokens,
            args.padding_free,
        )

    def evaluate_before():
        ppl = perplexity()
        print_rank0(f"[step1] eval perplexity before training: {ppl:.3f}")
        return {"ppl_before": ppl}, {"eval/perplexity": ppl}

    ppl_before = run.restore(evaluate_before)["ppl_before"]

    def step_metrics(means):
        (mean_loss,) = means
        return {"train/loss": mean_loss}, {"loss": f"{mean_loss:.4f}"}, f"loss {mean_loss:.4f}"

    # the loss is the NLL per trained token of the whole optimizer step (all micro-batches, all ranks)
    train_micro_batches(
        run,
        engine,
        loader,
        sampler,
        lambda batch: sft_loss_terms(engine, batch, args.logprob_chunk_tokens, args.padding_free),
        step_metrics,
        counts=trained_tokens,
        budget=budget,
        padding_free=args.padding_free,
    )

    ppl_after = perplexity()
    print_rank0(
        f"[step1] eval perplexity after {run.loop.step} steps: {ppl_after:.3f} (before {ppl_before:.3f}); "
        f"training took {run.train_s:.1f} s"
    )
    run.log(run.loop.step, {"eval/perplexity": ppl_after, "time/train_s": run.train_s})
    run.finish(
        lambda: export_hf_model(engine, tokenizer, args.output_dir),
        args.output_dir,
        "the fine-tuned model",
        ReloadCheck(
            "logits",
            "logits",
            engine,
            lambda: load_causal_lm(args.output_dir, trust_remote_code=args.trust_remote_code),
            logits_of,
            collator(eval_examples[:4]),
        ),
    )


def cli() -> None:
    """`python -m step1_sft.main` and the `rlhf-sft` command: main() ended by run_main (the project's errors as one
    `error:` line)."""
    run_main(main)


if __name__ == "__main__":
    cli()
