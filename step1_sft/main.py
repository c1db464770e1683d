"""Step 1: supervised fine-tuning of a causal LM on prompt -> response pairs, under DeepSpeed.

Only response tokens (and the EOS that ends them) are trained; prompt and padding are masked
(-100), unlike DeepSpeed-Chat, which also trains the prompt. Perplexity on the held-out split is
reported before and after training. The output directory is a plain `from_pretrained` directory.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from utils.checkpoint import BadStepGuard, Checkpointing, export_hf_model
from utils.data import SFTCollator, build_step_rows, tokenize_sft
from utils.distributed import all_reduce_sum, init_distributed, is_rank0, rank_batches, set_seed
from utils.logging import print_rank0, progress_bar
from utils.model import causal_lm_logits, hf_zero3_disabled, load_causal_lm, load_tokenizer
from utils.training import (add_data_args, add_engine_args, add_model_args, build_trained_engine, micro_batch_schedule,
                            run_micro_batches, spec_from_args, train_ds_config_from_args, validate_engine_args)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_data_args(parser)
    add_model_args(parser)
    add_engine_args(parser)
    parser.add_argument("--print_loss", action="store_true", help="print the loss of every step")
    args = parser.parse_args(argv)
    validate_engine_args(args)
    return args


def response_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token NLL over trained labels (!= -100) and their count."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    mask = shift_labels != -100
    nll = F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.clamp(min=0).reshape(-1),
                          reduction="none").view_as(shift_labels)
    return (nll * mask).sum(), mask.sum()


@torch.no_grad()
def evaluate_perplexity(engine, examples: list, collator, batch_size: int) -> float:
    """Token-weighted perplexity over all ranks' shares of the held-out examples."""
    engine.eval()
    total_nll, total_tokens = 0.0, 0.0
    for batch_examples, weight in rank_batches(examples, batch_size):
        batch = collator(batch_examples)
        logits = causal_lm_logits(engine, batch["input_ids"], batch["attention_mask"])
        nll, count = response_nll(logits, batch["labels"])
        total_nll += weight * nll.item()
        total_tokens += weight * count.item()
    total_nll, total_tokens = all_reduce_sum([total_nll, total_tokens])
    engine.train()
    return math.exp(total_nll / max(total_tokens, 1.0))


@torch.no_grad()
def export_logits_max_abs_diff(engine, out_dir: str, batch: dict) -> float:
    """Reload the exported directory on rank 0 and compare its logits with the engine's (LoRA merged)."""
    from transformers import AutoModelForCausalLM

    engine.eval()
    expected = causal_lm_logits(engine, batch["input_ids"], batch["attention_mask"])
    engine.train()
    diff = 0.0
    if is_rank0():
        with hf_zero3_disabled():
            reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        actual = causal_lm_logits(reloaded, batch["input_ids"], batch["attention_mask"])
        diff = (actual - expected.float()).abs().max().item()
    return all_reduce_sum([diff])[0]


def main(argv=None):
    args = parse_args(argv)
    init_distributed(args.dist_timeout)
    set_seed(args.seed)

    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    rows = build_step_rows(args.data_path, args.data_split, step=1, seed=args.seed,
                           sft_only_data_path=args.sft_only_data_path, eval_fraction=args.eval_fraction,
                           log=print_rank0)
    train_examples, train_stats = tokenize_sft(rows.train, tokenizer, args.max_seq_len)
    eval_examples, eval_stats = tokenize_sft(rows.eval, tokenizer, args.max_seq_len)
    print_rank0(f"[step1] train examples {len(train_examples)} {train_stats}; eval examples {len(eval_examples)} {eval_stats}")
    collator = SFTCollator(tokenizer.pad_token_id)

    sampler, loader, total_steps = micro_batch_schedule(train_examples, collator, args)
    ds_config = train_ds_config_from_args(args)
    model = load_causal_lm(args.model_name_or_path, tokenizer, ds_config, args.dropout, args.trust_remote_code)
    engine = build_trained_engine(model, ds_config, spec_from_args(args), total_steps)

    checkpointing = Checkpointing(args, {"model": engine})
    loop, shared, _ = checkpointing.restore()
    logger = checkpointing.metrics_logger(args, loop)
    if checkpointing.last_path:
        ppl_before = shared["ppl_before"]
        print_rank0(f"[step1] resumed from {checkpointing.last_path} at step {loop.step}")
    else:
        ppl_before = evaluate_perplexity(engine, eval_examples, collator, args.per_device_eval_batch_size)
        print_rank0(f"[step1] eval perplexity before training: {ppl_before:.3f}")
        logger.log(0, {"eval/perplexity": ppl_before})

    guard = BadStepGuard(loop, args.max_bad_steps, checkpointing)
    start = time.time()
    progress = progress_bar(total_steps, loop.step, "step1 sft")
    def micro_step(batch):
        logits = causal_lm_logits(engine, batch["input_ids"], batch["attention_mask"])
        nll, count = response_nll(logits, batch["labels"])
        return nll / count.clamp(min=1), ()

    def on_step(means):
        (mean_loss,) = means
        logger.log(loop.step, {"train/loss": mean_loss, "train/lr": engine.get_lr()[0], "epoch": loop.epoch,
                               "train/bad_steps": loop.bad_steps})
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{mean_loss:.4f}")
        if args.print_loss:
            print_rank0(f"[step1] step {loop.step} loss {mean_loss:.4f}")
        checkpointing.maybe_save(loop, {"ppl_before": ppl_before})

    run_micro_batches(engine, loader, sampler, loop, total_steps, args.num_train_epochs, guard, micro_step, on_step,
                      "step1")
    if progress is not None:
        progress.close()

    ppl_after = evaluate_perplexity(engine, eval_examples, collator, args.per_device_eval_batch_size)
    elapsed = time.time() - start
    print_rank0(f"[step1] eval perplexity after {loop.step} steps: {ppl_after:.3f} (before {ppl_before:.3f}); "
                f"training took {elapsed:.1f} s")
    logger.log(loop.step, {"eval/perplexity": ppl_after, "time/train_s": elapsed})
    export_hf_model(engine, tokenizer, args.output_dir)
    diff = export_logits_max_abs_diff(engine, args.output_dir, collator(eval_examples[:4]))
    print_rank0(f"[step1] saved the fine-tuned model to {args.output_dir} "
                f"(reloaded logits differ from the engine's by at most {diff:.2e})")
    logger.log(loop.step, {"export/logits_max_abs_diff": diff})
    logger.close()


if __name__ == "__main__":
    main()
