"""Step 2: train a reward model on (prompt, chosen, rejected) pairs under DeepSpeed.

The model is a causal-LM backbone plus a linear value head (utils.models.reward_model.RewardModel); a
sequence's score is the value at its last real token (the EOS after the response). The loss is
DeepSpeed-Chat's pairwise one, mean(-log sigmoid(chosen - rejected - margin)), over one forward of
the [2B, L] batch (chosen rows first). Held-out pair accuracy, mean chosen/rejected scores and
their margin are measured exactly over all ranks before training, every --eval_interval steps and
at the end. The output directory is reloaded by RewardModel.from_pretrained (backbone as a plain
from_pretrained directory, value_head.safetensors, reward_model.json).
"""

from __future__ import annotations

import time

import torch

from utils.cli import Number
from utils.data import PairCollator, check_not_all_too_long, split_pair_batch, tokenize_pairs
from utils.errors import run_main
from utils.math.losses import pair_metrics, pairwise_loss
from utils.models.forward import check_padding_free, eval_mode, sequence_scores
from utils.models.loading import check_4bit_args, four_bit_loading, load_tokenizer
from utils.models.reward_model import RewardModel, export_reward_model
from utils.runtime.distributed import all_reduce_sum, rank_batches
from utils.train.checkpoint import check_resume_early, data_layout
from utils.train.config_file import write_run_config
from utils.train.flags import add_pair_eval_args, single_model_parser, validate_training_args
from utils.train.loop import (
    build_trained_engine,
    check_pair_splits,
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
    parser = single_model_parser(  # no token log-probs here (a scalar head): no --logprob_chunk_tokens
        __doc__.splitlines()[0], "causal LM directory (step 1 output) or hub name: the backbone", logprobs=False
    )
    g = parser.add_argument_group("reward model")
    g.add_argument(
        "--margin", type=Number(float), default=0.0, help="loss margin: -log sigmoid(chosen - rejected - margin)"
    )
    add_pair_eval_args(parser)
    return parser


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    validate_training_args(args)
    check_4bit_args(args, {"reward model": ""}, {"reward model": args.zero_stage})
    check_resume_early(args)  # a --resume that cannot continue stops before any model loads
    return args


def pair_scores(model, batch: dict, padding_free: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen scores [B], rejected scores [B]) of a PairCollator batch in one forward (`padding_free`: of its
    real tokens only, --padding_free)."""
    return split_pair_batch(sequence_scores(model, batch["input_ids"], batch["attention_mask"], padding_free))


def pair_tokens(pair: dict) -> int:
    """The tokens a pair adds to its micro-batch, its chosen and rejected sequences (`--max_tokens_per_micro_batch`:
    a pair is never split)."""
    return len(pair["chosen_input_ids"]) + len(pair["rejected_input_ids"])


def trained_pairs(batch: dict) -> dict:
    """{"pairs": the pairs of a PairCollator batch}: the unit the loss averages over with a token budget, where
    micro-batches hold unequal numbers of pairs (utils.train.loop.train_micro_batches sums it over the step)."""
    return {"pairs": batch["input_ids"].shape[0] // 2}


@torch.no_grad()
def evaluate_pairs(
    engine, pairs: list, collator, batch_size: int, max_batches: int = 0, padding_free: bool = False
) -> dict:
    """Exact held-out pair metrics over all ranks' shares (filler batches weigh 0)."""
    # Sorted by length, so batches hold similar lengths and little padding; the sums are exact in any order.
    pairs = sorted(pairs, key=lambda p: max(len(p["chosen_input_ids"]), len(p["rejected_input_ids"])))
    batches = rank_batches(pairs, batch_size, max_batches)  # same count on every rank: ZeRO-3 forwards stay matched
    correct = chosen_sum = rejected_sum = count = 0.0
    with eval_mode(engine):
        for batch_pairs, weight in batches:
            chosen, rejected = pair_scores(engine, collator(batch_pairs), padding_free)
            correct += weight * (chosen > rejected).sum().item()
            chosen_sum += weight * chosen.sum().item()
            rejected_sum += weight * rejected.sum().item()
            count += weight * chosen.numel()
    correct, chosen_sum, rejected_sum, count = all_reduce_sum([correct, chosen_sum, rejected_sum, count])
    n = max(count, 1.0)
    return {
        "eval/accuracy": correct / n,
        "eval/chosen_score": chosen_sum / n,
        "eval/rejected_score": rejected_sum / n,
        "eval/margin": (chosen_sum - rejected_sum) / n,
        "eval/pairs": int(count),
    }


def _format_eval(metrics: dict) -> str:
    return (
        f"accuracy {metrics['eval/accuracy']:.4f}, chosen {metrics['eval/chosen_score']:.4f}, "
        f"rejected {metrics['eval/rejected_score']:.4f}, margin {metrics['eval/margin']:.4f} "
        f"({metrics['eval/pairs']} pairs)"
    )


def main(argv=None):
    args = parse_args(argv)
    write_run_config(args, "step2_reward.main")  # OUTPUT_DIR/config.yaml (rank 0): `--config` it to rerun these flags
    tokenizer, train_pairs, train_stats, eval_pairs, eval_stats = start_single_model_run(
        args, 2, lambda rows, tok: tokenize_pairs(rows, tok, args.max_seq_len), {"max_seq_len": args.max_seq_len}
    )
    print_rank0(f"[step2] train pairs {len(train_pairs)} {train_stats}; eval pairs {len(eval_pairs)} {eval_stats}")
    check_not_all_too_long(train_pairs, train_stats, args.max_seq_len, "training")
    check_not_all_too_long(eval_pairs, eval_stats, args.max_seq_len, "held-out")
    check_pair_splits(train_pairs, train_stats, eval_pairs)
    collator = PairCollator(tokenizer.pad_token_id)

    budget = token_budget(args, train_pairs, collator, pair_tokens, "pair")
    sampler, loader, total_steps = micro_batch_schedule(train_pairs, collator, args, budget)
    ds_config = train_ds_config_from_args(args)
    with four_bit_loading(args.load_in_4bit):  # --load_in_4bit: the backbone's Linear layers; the value head trains
        model = RewardModel.from_pretrained(
            args.model_name_or_path,
            tokenizer,
            ds_config,
            args.dropout,
            args.trust_remote_code,
            args.attn_implementation,
        )
    engine = build_trained_engine(model, ds_config, spec_from_args(args), total_steps)
    if args.padding_free:
        check_padding_free(engine)

    def run_eval(step: int) -> dict:
        eval_start = time.time()
        metrics = evaluate_pairs(
            engine, eval_pairs, collator, args.per_device_eval_batch_size, args.eval_iters, args.padding_free
        )
        metrics["time/eval_s"] = time.time() - eval_start
        print_rank0(f"[step2] eval at step {step}: {_format_eval(metrics)} in {metrics['time/eval_s']:.1f} s")
        return metrics

    run = Run(
        args,
        "step2",
        "step2 reward",
        {"model": engine},
        data_layout(args, len(train_pairs)),
        total_steps,
        evaluate=run_eval,
    )

    def evaluate_before():
        metrics = run_eval(0)
        return {"before": metrics}, metrics

    before = run.restore(evaluate_before)["before"]

    def micro_step(batch):
        chosen, rejected = pair_scores(engine, batch, args.padding_free)
        m = pair_metrics(chosen, rejected)
        loss = pairwise_loss(chosen, rejected, args.margin)
        # with a token budget the micro-batches hold unequal numbers of pairs: the loss a mean over the step's pairs
        return {"pairs": loss} if budget else loss, (m["accuracy"], m["margin_mean"])

    def step_metrics(means):
        mean_loss, mean_acc, mean_margin = means
        return (
            {"train/loss": mean_loss, "train/accuracy": mean_acc, "train/margin": mean_margin},
            {"loss": f"{mean_loss:.4f}", "acc": f"{mean_acc:.2f}"},
            f"loss {mean_loss:.4f} accuracy {mean_acc:.3f}",
        )

    train_micro_batches(
        run,
        engine,
        loader,
        sampler,
        micro_step,
        step_metrics,
        counts=trained_pairs if budget else None,
        budget=budget,
        padding_free=args.padding_free,
    )

    step = run.loop.step
    after = run.evaluate_now()
    print_rank0(
        f"[step2] eval accuracy after {step} steps: {after['eval/accuracy']:.4f} "
        f"(before {before['eval/accuracy']:.4f}); training took {run.train_s:.1f} s"
    )
    run.log(step, {"time/train_s": run.train_s})
    run.finish(
        lambda: export_reward_model(engine, tokenizer, args.output_dir),
        args.output_dir,
        "the reward model",
        ReloadCheck(
            "score",
            "scores",
            engine,
            lambda: RewardModel.from_pretrained(
                args.output_dir,
                load_tokenizer(args.output_dir, args.trust_remote_code),
                trust_remote_code=args.trust_remote_code,
            ),
            lambda model, batch: sequence_scores(model, batch["input_ids"], batch["attention_mask"]),
            collator(eval_pairs[:4] or train_pairs[:4]),
        ),
    )


def cli() -> None:
    """`python -m step2_reward.main` and the `rlhf-rm` command: main() ended by run_main (the project's errors as one
    `error:` line)."""
    run_main(main)


if __name__ == "__main__":
    cli()
