"""Step 2 alternative: DPO of a causal LM on (prompt, chosen, rejected) pairs under DeepSpeed; its output is a policy.

Direct preference optimisation (Rafailov et al. 2023) needs no reward model and no RL: the loss of a
pair is a function of the policy's and a frozen reference's sequence log-probs of both responses
(utils.math.losses.dpo_loss: sigmoid DPO, conservative DPO with --label_smoothing, IPO; plus
--nll_loss_coef times the chosen responses' NLL, RPO), or of the policy's alone for the reference-free
losses (SimPO, ORPO: --loss_type simpo|orpo; no reference model is built, loaded or precomputed), or
of single labelled examples (KTO, --loss_type kto: unpaired rows {prompt, completion, label} or pairs,
each a desirable and an undesirable example; its reference point from mismatched rows of the batch).
Data: the same pairs as step 2 (its share of --data_split, every format the data layer reads). A
sequence log-prob sums the response tokens only (and the EOS that ends them), positions from the
attention mask, so a pair scores the same under any padding (utils.models.forward.sequence_logprobs).

The reference is the starting policy, in one of three forms:
- --precompute_ref_log_probs: the policy itself scores every pair before its first update (eval
  mode) and the log-probs are kept with the rows and in every checkpoint: no reference model is
  held while training;
- LoRA with --only_optimize_lora: the policy with its adapters disabled (no second copy);
- else a frozen reference engine loaded from --model_name_or_path (ZeRO-3 when the policy is;
  --offload_reference_model keeps it in CPU memory).
Dropout is off by default (--dropout 0.0): with dropout the training forward and the reference
differ at step 0 and the loss does not start at ln 2.

Held-out pairs are measured exactly over all ranks every --eval_interval steps and at the end (before
training the policy is the reference, so its figures are the reference log-probs'): DPO loss,
implicit rewards beta * (logp - ref_logp) of chosen and rejected, the fraction of pairs whose chosen
reward is higher (accuracy; undefined before training, when every implicit reward is 0), their margin,
and the mean sequence log-probs; KTO: each kind's mean implicit reward, their margin and z0, no accuracy.
The output directory is a plain from_pretrained policy (LoRA merged) that step 3 takes as its actor.
"""

from __future__ import annotations

import math
import os
import time

import torch

from utils.cli import Number
from utils.data import (
    PreferenceCollator,
    UnpairedCollator,
    check_not_all_too_long,
    split_pair_batch,
    tokenize_preference_pairs,
    tokenize_unpaired,
)
from utils.errors import one_line, run_main
from utils.math.losses import (
    PAIR_LOSSES,
    PairLogps,
    UnpairedLogps,
    kto_reference_point,
    pair_loss,
    response_nll,
    unpaired_loss,
)
from utils.models.export import export_hf_model
from utils.models.forward import LOGPROB_CHUNK_TOKENS, check_padding_free, eval_mode, sequence_logprobs
from utils.models.loading import check_4bit_args, load_causal_lm
from utils.runtime.distributed import all_reduce_sum, rank_batches, world_size
from utils.train.checkpoint import LATEST_FILE, STATE_FILE, CheckpointError, check_resume_early, data_layout
from utils.train.config_file import write_run_config
from utils.train.ds_config import eval_ds_config
from utils.train.flags import (
    add_offload_reference_arg,
    add_pair_eval_args,
    fail,
    single_model_parser,
    validate_training_args,
)
from utils.train.loop import (
    build_frozen_engine,
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

SIDES = ("chosen", "rejected")


def build_parser():
    """The argument parser of this entry point (the reference pages of docs/ are generated from it)."""
    parser = single_model_parser(
        __doc__.splitlines()[0],
        "causal LM directory (step 1 output) or hub name: the starting policy and the reference",
    )
    parser.set_defaults(dropout=0.0)
    g = parser.add_argument_group("DPO")
    g.add_argument(
        "--beta",
        type=Number(float, above=0),
        default=None,
        help="strength of the implicit KL to the reference: the loss reads beta * log-ratio margins "
        "(SimPO: beta * per-token log-prob margins); default: the loss's (simpo 2.0), else 0.1",
    )
    g.add_argument(
        "--loss_type",
        default="sigmoid",
        choices=list(PAIR_LOSSES),
        help="; ".join(f"{name}: {entry.help}" for name, entry in PAIR_LOSSES.items()),
    )
    for name, (option, owners) in pair_loss_options().items():  # each loss's own settings
        g.add_argument(
            f"--{name}",
            type=Number(float, **{"above" if option.strict else "low": option.minimum}, below=option.below),
            default=option.default,
            help=f"{option.help} (--loss_type {' or '.join(owners)} only)",
        )
    g.add_argument(
        "--nll_loss_coef",
        type=Number(float, low=0),
        default=0.0,
        help="add this times the chosen responses' NLL per token (RPO; 0: off; orpo has its own, weight 1)",
    )
    g.add_argument(
        "--label_key",
        default="label",
        help="field of an unpaired row's label, true (desirable) or false (--loss_type kto; default '%(default)s')",
    )
    g.add_argument(
        "--precompute_ref_log_probs",
        action="store_true",
        help="score every pair with the starting policy once before training and hold no reference model",
    )
    add_offload_reference_arg(g)
    add_pair_eval_args(parser)
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    entry = PAIR_LOSSES[args.loss_type]
    if args.beta is not None and not entry.reads_beta:
        fail(f"--beta: --loss_type {args.loss_type} does not read it; leave the flag out")
    if args.beta is None:
        args.beta = entry.default_beta
    if entry.nll_coef and args.nll_loss_coef:
        fail(
            f"--nll_loss_coef: --loss_type {args.loss_type} has its own NLL term (weight {entry.nll_coef:g}); "
            f"leave the flag out"
        )
    for name, (option, owners) in pair_loss_options().items():
        if getattr(args, name) != option.default and args.loss_type not in owners:
            fail(
                f"--{name} is a setting of --loss_type {' or '.join(owners)}; --loss_type {args.loss_type} does not "
                f"take it"
            )
    args.unpaired = entry.unpaired  # the data layer reads unpaired rows too (utils.data.RowFormat)
    if entry.unpaired:
        if args.nll_loss_coef:
            fail(f"--nll_loss_coef: --loss_type {args.loss_type} reads unpaired examples, there is no chosen side")
        if args.precompute_ref_log_probs:
            fail(
                f"--precompute_ref_log_probs: --loss_type {args.loss_type} scores mismatched (prompt, completion) "
                f"rows drawn per batch with the reference; it keeps a reference model"
            )
        if args.per_device_train_batch_size < 2:
            fail(
                f"--per_device_train_batch_size must be >= 2 with --loss_type {args.loss_type}: its reference "
                f"point pairs each prompt with another example's completion of the same micro-batch"
            )
        if args.max_tokens_per_micro_batch:
            fail(
                f"--max_tokens_per_micro_batch: --loss_type {args.loss_type} pairs each prompt with another "
                f"example's completion of the same micro-batch, and a token budget may leave an example alone in "
                f"one; use --per_device_train_batch_size (--padding_free works)"
            )
    if args.precompute_ref_log_probs and not PAIR_LOSSES[args.loss_type].needs_reference:
        fail(
            f"--precompute_ref_log_probs: --loss_type {args.loss_type} is reference-free, "
            "there is nothing to precompute"
        )
    if args.offload_reference_model and reference_kind(args) != "engine":
        fail(
            f"--offload_reference_model: this run holds no reference model to offload (its reference is "
            f"{REFERENCE_KINDS[reference_kind(args)]})"
        )
    validate_training_args(args)
    stages = {"policy": args.zero_stage}
    if reference_kind(args) == "engine":  # a separate frozen copy (ZeRO-3 offload with --offload_reference_model)
        stages["reference"] = 3 if args.offload_reference_model else args.zero_stage
    check_4bit_args(args, {"policy": ""}, stages)
    check_resume_early(args)  # a --resume that cannot continue stops before any model loads
    return args


def pair_loss_options() -> dict:
    """{option name: (PairOption, [the losses that take it])} over every PAIR_LOSSES entry."""
    options = {}
    for loss_type, entry in PAIR_LOSSES.items():
        for name, option in entry.options.items():
            options.setdefault(name, (option, []))[1].append(loss_type)
    return options


REFERENCE_KINDS = {
    "precomputed": "log-probs precomputed by the starting policy (--precompute_ref_log_probs)",
    "adapters": "the policy with its LoRA adapters disabled (--only_optimize_lora: a frozen base)",
    "engine": "a frozen copy of the starting model",
    "none": "none (the loss is reference-free)",
}


def reference_kind(args) -> str:
    """Where the reference log-probs come from (REFERENCE_KINDS), as the loss and the flags say."""
    if not PAIR_LOSSES[args.loss_type].needs_reference:
        return "none"
    if args.precompute_ref_log_probs:
        return "precomputed"
    if args.lora_dim > 0 and args.only_optimize_lora:
        return "adapters"
    return "engine"


class Reference:
    """The reference log-probs of a PreferenceCollator batch [2B], from the form the run chose; the LM head
    `chunk_tokens` tokens at a time (--logprob_chunk_tokens), `padding_free` forwards (--padding_free), in the
    held-out evaluations too."""

    def __init__(
        self, kind: str, policy, engine=None, chunk_tokens: int = LOGPROB_CHUNK_TOKENS, padding_free: bool = False
    ):
        self.kind, self.policy, self.engine, self.chunk_tokens = kind, policy, engine, chunk_tokens
        self.padding_free = padding_free

    def __call__(self, batch: dict) -> torch.Tensor | None:
        if self.kind == "none":
            return None
        if "ref_logps" in batch:
            return batch["ref_logps"]
        if self.kind == "precomputed":  # the policy has moved: it no longer stands for the reference
            raise RuntimeError("a training batch without its precomputed reference log-probs")
        return self.score(batch)

    @torch.no_grad()
    def score(self, batch: dict) -> torch.Tensor:
        """The reference's own forward (eval mode); for "precomputed", only before the policy's first update."""
        if self.kind == "adapters":
            with eval_mode(self.policy), self.policy.module.disable_adapter():
                return sequence_logprobs(self.policy, batch, self.chunk_tokens, self.padding_free)[0]
        model = self.policy if self.kind == "precomputed" else self.engine
        with eval_mode(model):
            return sequence_logprobs(model, batch, self.chunk_tokens, self.padding_free)[0]


@torch.no_grad()
def all_reference_logps(reference: Reference, pairs: list, collator, batch_size: int) -> list[list[float]]:
    """[[chosen, rejected]] reference log-probs of every pair, each rank scoring its share (the same
    number of forwards on every rank: ZeRO-3 forwards are collective), summed over ranks."""
    order = sorted(range(len(pairs)), key=lambda i: pair_length(pairs[i]))
    logps = torch.zeros((len(pairs), 2), dtype=torch.float64)
    for indices, weight in rank_batches(order, batch_size):
        ref = reference.score(collator([pairs[i] for i in indices])).double().cpu()
        if weight:
            logps[indices] = torch.stack(split_pair_batch(ref), dim=1)
    summed = torch.tensor(all_reduce_sum(logps.flatten().tolist()), dtype=torch.float64)
    return summed.view(-1, 2).tolist()


def reference_logps_problem(logps, expected: int | None) -> str | None:
    """What is wrong with a checkpoint's reference log-probs of one split ([[chosen, rejected]] per pair; `expected`
    pairs, None: any number), None when nothing is."""
    if not isinstance(logps, list):
        return f"a {type(logps).__name__}, not a list"
    for i, item in enumerate(logps):
        numbers = isinstance(item, list) and len(item) == 2
        if not numbers or not all(type(x) in (int, float) and math.isfinite(x) for x in item):
            return f"entry {i} is {one_line(repr(item), 40)}, not two finite numbers"
    if expected is not None and len(logps) != expected:
        return f"{len(logps)} entries for {expected} pairs (cut short?)"
    return None


def restored_reference(state: dict, checkpoint: str, reference: Reference, n_eval: int, n_train: int, rescore) -> None:
    """Check the reference log-probs a resumed checkpoint kept (its state.json's "ref_logps": the held-out pairs',
    and with --precompute_ref_log_probs the training pairs'), which DPO trains and evaluates on. Cut or corrupt:
    a CheckpointError naming the file when they cannot be recomputed (precomputed: the policy has moved since),
    else the held-out ones are scored again with the reference (`rescore()`, collective), saying so."""
    logps = state.get("ref_logps")
    if not isinstance(logps, dict):
        problem = "missing" if logps is None else f"a {type(logps).__name__}, not a mapping"
    else:
        splits = {"eval": None, **({"train": n_train} if reference.kind == "precomputed" else {})}
        problem = next(
            (f"{split}: {why}" for split, n in splits.items() if (why := reference_logps_problem(logps.get(split), n))),
            None,
        )
    if problem is None:
        return
    file = os.path.join(checkpoint, STATE_FILE)
    if reference.kind == "precomputed":
        raise CheckpointError(
            f"{file}: its reference log-probs ('ref_logps', --precompute_ref_log_probs) are cut or corrupt "
            f"({problem}); they cannot be recomputed once the policy has moved: resume from an earlier checkpoint "
            f"(write its folder's name into {os.path.join(os.path.dirname(checkpoint), LATEST_FILE)}), or start "
            f"again with --overwrite_output_dir"
        )
    print_rank0(
        f"[dpo] {file}: its held-out reference log-probs ('ref_logps') are cut or corrupt ({problem}); "
        f"recomputing those of the {n_eval} held-out pairs with the reference"
    )
    state["ref_logps"] = {"eval": rescore()}


def attach_reference(pairs: list, logps: list[list[float]]) -> None:
    for pair, (chosen, rejected) in zip(pairs, logps):
        pair["ref_chosen_logp"], pair["ref_rejected_logp"] = chosen, rejected


class PreferenceLoss:
    """The run's loss of a batch from its policy's (and the reference's) sequence log-probs [2B]: the
    PAIR_LOSSES entry of --loss_type with its own options, plus the optional NLL term, with the
    implicit-reward statistics."""

    def __init__(self, args):
        self.beta, self.loss_type = args.beta, args.loss_type
        self.entry = PAIR_LOSSES[args.loss_type]
        self.nll_loss_coef = self.entry.nll_coef or args.nll_loss_coef  # ORPO's SFT term, or RPO's
        self.options = {name: getattr(args, name) for name in self.entry.options}
        # the per-micro-batch stats the training loop averages (step_metrics reads them in this order)
        self.stat_names = ("accuracy", "margin", "chosen_reward", "rejected_reward") + (
            ("nll",) if self.nll_loss_coef else ()
        )

    def train_terms(
        self, logps: torch.Tensor, counts: torch.Tensor, ref_logps: torch.Tensor | None, batch: dict
    ) -> tuple[dict, dict]:
        return self.terms(logps, counts, ref_logps)

    def step_metrics(self, means: list) -> tuple:
        """train_micro_batches' (metrics, progress postfix, --print_loss line) of [loss, *stat_names means]."""
        mean_loss, accuracy, margin, *_ = means
        return (
            {"train/loss": mean_loss, **{f"train/{name}": v for name, v in zip(self.stat_names, means[1:])}},
            {"loss": f"{mean_loss:.4f}", "acc": f"{accuracy:.2f}"},
            f"loss {mean_loss:.4f} accuracy {accuracy:.3f} margin {margin:.4f}",
        )

    def evaluate(self, engine, pairs: list, collator, batch_size: int, reference: "Reference") -> dict:
        return evaluate_preferences(
            engine, pairs, collator, batch_size, self, reference.chunk_tokens, reference.padding_free
        )

    def __call__(
        self, logps: torch.Tensor, counts: torch.Tensor | None, ref_logps: torch.Tensor | None, with_nll: bool = True
    ) -> tuple:
        terms, stats = self.terms(logps, counts, ref_logps, with_nll)
        return sum(terms.values()), stats

    def terms(
        self, logps: torch.Tensor, counts: torch.Tensor | None, ref_logps: torch.Tensor | None, with_nll: bool = True
    ) -> tuple[dict, dict]:
        """The loss's terms by the unit each is a mean over (`units`): "pairs", the pair loss; with
        --nll_loss_coef, "chosen_tokens", the NLL term per chosen response token; and the stats."""
        chosen, rejected = split_pair_batch(logps)
        ref_chosen, ref_rejected = (
            split_pair_batch(ref_logps.to(logps.device)) if ref_logps is not None else (None, None)
        )
        chosen_tokens, rejected_tokens = split_pair_batch(counts) if self.entry.needs_lengths else (None, None)
        loss, stats = pair_loss(
            PairLogps(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens),
            self.beta,
            self.loss_type,
            **self.options,
        )
        terms = {"pairs": loss}
        stats["chosen_logp"], stats["rejected_logp"] = chosen.detach().mean(), rejected.detach().mean()
        if self.nll_loss_coef and with_nll:
            nll = response_nll(chosen, split_pair_batch(counts)[0])
            stats["nll"] = nll.detach()
            terms["chosen_tokens"] = self.nll_loss_coef * nll
        return terms, stats

    def units(self, batch: dict) -> dict:
        """{unit: count} of a PreferenceCollator batch for the terms above (no forward): its pairs and, with
        the NLL term, its chosen response tokens; train_micro_batches sums them over the optimizer step."""
        pairs = batch["input_ids"].shape[0] // 2
        units = {"pairs": pairs}
        if self.nll_loss_coef:
            units["chosen_tokens"] = int(batch["action_mask"][:pairs].sum())
        return units


class UnpairedLoss:
    """The run's loss of an UnpairedCollator batch [2B] (KTO): the PAIR_LOSSES entry of --loss_type (one
    with `unpaired`) over the B labelled examples, its reference point z0 from the B mismatched rows,
    averaged over the ranks when `terms` gets `reduce` (training: every rank's micro-step is collective,
    as DeepSpeed's are; the held-out figures use each batch's own z0)."""

    stat_names = ("z0", "desirable_reward_sum", "desirable_count", "undesirable_reward_sum", "undesirable_count")

    def __init__(self, args):
        self.beta, self.loss_type = args.beta, args.loss_type
        self.options = {name: getattr(args, name) for name in PAIR_LOSSES[args.loss_type].options}

    def train_terms(
        self, logps: torch.Tensor, counts: torch.Tensor, ref_logps: torch.Tensor, batch: dict
    ) -> tuple[dict, dict]:
        return self.terms(logps, ref_logps, batch["desirable"], reduce=all_reduce_sum)

    def step_metrics(self, means: list) -> tuple:
        """train_micro_batches' (metrics, postfix, line) of [loss, z0, reward sums and counts]: each kind's mean
        reward from the sums (exact over micro-batches and ranks), the margin where both kinds were seen."""
        mean_loss, z0, *sums = means
        rewards = unpaired_means(dict(zip(UNPAIRED_SUMS, sums)))
        return (
            {"train/loss": mean_loss, "train/z0": z0, **{f"train/{k}": v for k, v in rewards.items()}},
            {"loss": f"{mean_loss:.4f}", "z0": f"{z0:.3f}"},
            f"loss {mean_loss:.4f} z0 {z0:.4f} margin {_fmt(rewards.get('margin'))}",
        )

    def evaluate(self, engine, examples: list, collator, batch_size: int, reference: "Reference") -> dict:
        return evaluate_unpaired(engine, examples, collator, batch_size, self, reference)

    def terms(
        self, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, reduce=None
    ) -> tuple[dict, dict]:
        """({"examples": the mean loss over the B examples}, stats) from the [2B] log-probs of the batch."""
        n = desirable.shape[0]
        ref_logps = ref_logps.to(logps.device)
        z0 = kto_reference_point(logps[n:], ref_logps[n:], reduce)
        loss, stats = unpaired_loss(
            UnpairedLogps(logps[:n], ref_logps[:n], desirable.to(logps.device), z0),
            self.beta,
            self.loss_type,
            **self.options,
        )
        stats["logp"] = logps[:n].detach().float().mean()
        return {"examples": loss}, stats

    def units(self, batch: dict) -> dict:
        return {"examples": batch["desirable"].shape[0]}


UNPAIRED_SUMS = UnpairedLoss.stat_names[1:]


def unpaired_means(sums: dict) -> dict:
    """{desirable_reward, undesirable_reward, margin} from summed rewards and counts (a kind absent: its
    reward and the margin are left out)."""
    out = {}
    for kind in ("desirable", "undesirable"):
        if sums[f"{kind}_count"] > 0:
            out[f"{kind}_reward"] = sums[f"{kind}_reward_sum"] / sums[f"{kind}_count"]
    if len(out) == 2:
        out["margin"] = out["desirable_reward"] - out["undesirable_reward"]
    return out


@torch.no_grad()
def evaluate_unpaired(
    engine, examples: list, collator, batch_size: int, loss_of: UnpairedLoss, reference: "Reference"
) -> dict:
    """Exact held-out metrics of KTO over all ranks: the loss, each kind's mean implicit reward
    beta * (logp - ref_logp), their margin, the reference point z0 (each batch's own) and the examples'
    mean log-prob; no accuracy (there are no pairs to rank)."""
    keys = ("loss", "z0", "logp") + UNPAIRED_SUMS
    sums, count = dict.fromkeys(keys, 0.0), 0.0
    with eval_mode(engine):
        for batch_examples, weight in rank_batches(examples, batch_size):
            batch = collator(batch_examples)
            logps, _ = sequence_logprobs(engine, batch, reference.chunk_tokens, reference.padding_free)
            terms, stats = loss_of.terms(logps, reference(batch), batch["desirable"])
            stats["loss"] = terms["examples"]
            n = weight * len(batch_examples)
            for key in keys:
                sums[key] += (weight if key in UNPAIRED_SUMS else n) * stats[key].item()
            count += n
    *totals, count = all_reduce_sum([sums[key] for key in keys] + [count])
    totals = dict(zip(keys, totals))
    n = max(count, 1.0)
    means = {key: totals[key] / n for key in ("loss", "z0", "logp")}
    return {
        **{f"eval/{key}": value for key, value in {**means, **unpaired_means(totals)}.items()},
        "eval/examples": int(count),
    }


EVAL_STATS = ("loss", "accuracy", "chosen_reward", "rejected_reward", "margin", "chosen_logp", "rejected_logp")


def pair_tokens(pair: dict) -> int:
    """The tokens a preference pair adds to its micro-batch, its two rows prompt + response
    (`--max_tokens_per_micro_batch`: a pair is never split)."""
    return 2 * len(pair["prompt_input_ids"]) + len(pair["chosen_response_ids"]) + len(pair["rejected_response_ids"])


def pair_length(pair: dict) -> int:
    """Prompt + longest response of a pair (or of an unpaired example: its completion)."""
    return len(pair["prompt_input_ids"]) + max(len(ids) for key, ids in pair.items() if key.endswith("_response_ids"))


def held_out_pairs(pairs: list, batch_size: int, max_batches: int) -> list:
    """The held-out pairs an evaluation reads, by length (batches of similar lengths, little padding):
    all of them, or with --eval_iters k the shortest k batches per rank (rank_batches gives rank r
    every n-th pair), so reference log-probs are computed for those only."""
    pairs = sorted(pairs, key=pair_length)
    return pairs[: max_batches * batch_size * world_size()] if max_batches else pairs


@torch.no_grad()
def evaluate_preferences(
    engine,
    pairs: list,
    collator,
    batch_size: int,
    loss_of: PreferenceLoss,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    padding_free: bool = False,
) -> dict:
    """Exact metrics over all ranks' shares of `pairs` (held_out_pairs; filler batches weigh 0); the
    pairs carry their reference log-probs. `eval/loss` is the DPO loss alone (without the NLL term)."""
    sums, count = dict.fromkeys(EVAL_STATS, 0.0), 0.0
    with eval_mode(engine):
        for batch_pairs, weight in rank_batches(pairs, batch_size):
            batch = collator(batch_pairs)
            logps, counts = sequence_logprobs(engine, batch, chunk_tokens, padding_free)
            loss, stats = loss_of(logps, counts, batch.get("ref_logps"), with_nll=False)
            stats["loss"] = loss
            n = weight * len(batch_pairs)
            for key in EVAL_STATS:
                sums[key] += n * stats[key].item()
            count += n
    *totals, count = all_reduce_sum([sums[key] for key in EVAL_STATS] + [count])
    n = max(count, 1.0)
    return {**{f"eval/{key}": total / n for key, total in zip(EVAL_STATS, totals)}, "eval/pairs": int(count)}


def reference_metrics(pairs: list, loss_of: PreferenceLoss) -> dict:
    """The held-out metrics before the first update, when the policy IS the reference: its reference
    log-probs against themselves (sigmoid loss ln 2, implicit rewards and margins 0, no accuracy), with no second
    pass over the pairs (on the demo that pass is a quarter of the step's time)."""
    ref = torch.tensor([p[f"ref_{side}_logp"] for side in SIDES for p in pairs], dtype=torch.float32)
    loss, stats = loss_of(ref, None, ref, with_nll=False)
    stats["loss"] = loss
    # every implicit reward is 0: no pair is ranked either way, so the accuracy is undefined (not 0)
    return {**{f"eval/{key}": stats[key].item() for key in EVAL_STATS if key != "accuracy"}, "eval/pairs": len(pairs)}


def unpaired_reference_metrics(examples: list, loss_of: UnpairedLoss) -> dict:
    """KTO's held-out metrics before the first update, when the policy IS the reference: every log-ratio,
    implicit reward, margin and z0 is 0 and each example's loss its weight x (1 - sigmoid(0)), known without
    a pass (which, scoring the examples and their mismatched rows under both, would cost the demo ~5 min)."""
    desirable = torch.tensor([ex["desirable"] for ex in examples], dtype=torch.bool)
    zeros = torch.zeros(2 * len(examples))
    terms, stats = loss_of.terms(zeros, zeros, desirable)
    means = unpaired_means({key: stats[key].item() for key in UNPAIRED_SUMS})
    return {
        "eval/loss": terms["examples"].item(),
        "eval/z0": stats["z0"].item(),
        **{f"eval/{key}": value for key, value in means.items()},
        "eval/examples": len(examples),
    }


def _format_eval(m: dict) -> str:
    if "eval/examples" in m:  # unpaired (KTO)
        rewards = ", ".join(
            f"{kind} reward {m[f'eval/{kind}_reward']:.4f}"
            for kind in ("desirable", "undesirable")
            if f"eval/{kind}_reward" in m
        )
        logp = f"logp {m['eval/logp']:.2f}; " if "eval/logp" in m else ""
        return (
            f"loss {m['eval/loss']:.4f}, margin {_fmt(m.get('eval/margin'))} ({rewards}; z0 {m['eval/z0']:.4f}; "
            f"{logp}{m['eval/examples']} examples)"
        )
    return (
        f"loss {m['eval/loss']:.4f}, accuracy {_fmt(m.get('eval/accuracy'))}, margin {m['eval/margin']:.4f} "
        f"(chosen reward {m['eval/chosen_reward']:.4f}, rejected {m['eval/rejected_reward']:.4f}; "
        f"logp chosen {m['eval/chosen_logp']:.2f}, rejected {m['eval/rejected_logp']:.2f}; "
        f"{m['eval/pairs']} pairs)"
    )


def _fmt(value) -> str:
    """A metric, or "undefined" where it is not (an accuracy while the policy is the reference)."""
    return "undefined" if value is None else f"{value:.4f}"


def build_reference(args, tokenizer, policy) -> Reference:
    kind = reference_kind(args)
    engine = None
    if kind == "engine":
        config = eval_ds_config(
            args.zero_stage, world_size(), args.per_device_train_batch_size, args.dtype, args.offload_reference_model
        )
        model = load_causal_lm(
            args.model_name_or_path,
            tokenizer,
            config,
            0.0,
            args.trust_remote_code,
            attn_implementation=args.attn_implementation,
            load_in_4bit=args.load_in_4bit,
        )
        engine = build_frozen_engine(model, config)
    print_rank0(f"[dpo] reference: {REFERENCE_KINDS[kind]}")
    return Reference(kind, policy, engine, args.logprob_chunk_tokens, args.padding_free)


def main(argv=None):
    args = parse_args(argv)
    write_run_config(args, "step2_dpo.main")  # OUTPUT_DIR/config.yaml (rank 0): `--config` it to rerun these flags
    unpaired = PAIR_LOSSES[args.loss_type].unpaired
    tokenize = tokenize_unpaired if unpaired else tokenize_preference_pairs
    tokenizer, train_pairs, train_stats, eval_pairs, eval_stats = start_single_model_run(
        args,
        2,
        lambda rows, tok: tokenize(rows, tok, args.max_seq_len),
        {"max_seq_len": args.max_seq_len, "pairs": "unpaired" if unpaired else "preference"},
    )
    kind = "examples" if unpaired else "pairs"
    print_rank0(f"[dpo] train {kind} {len(train_pairs)} {train_stats}; eval {kind} {len(eval_pairs)} {eval_stats}")
    check_not_all_too_long(train_pairs, train_stats, args.max_seq_len, "training")
    check_not_all_too_long(eval_pairs, eval_stats, args.max_seq_len, "held-out")
    check_pair_splits(train_pairs, train_stats, eval_pairs)
    if unpaired:
        check_both_labels(args, train_stats)
    eval_pairs = held_out_pairs(eval_pairs, args.per_device_eval_batch_size, args.eval_iters)
    collator = (
        UnpairedCollator(tokenizer.pad_token_id, args.max_seq_len)
        if unpaired
        else PreferenceCollator(tokenizer.pad_token_id)
    )

    budget = None if unpaired else token_budget(args, train_pairs, collator, pair_tokens, "pair")
    sampler, loader, total_steps = micro_batch_schedule(train_pairs, collator, args, budget)
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
        check_padding_free(engine)  # the reference is the same model
    reference = build_reference(args, tokenizer, engine)
    loss_of = UnpairedLoss(args) if unpaired else PreferenceLoss(args)

    def run_eval(step: int) -> dict:
        eval_start = time.time()
        metrics = loss_of.evaluate(engine, eval_pairs, collator, args.per_device_eval_batch_size, reference)
        metrics["time/eval_s"] = time.time() - eval_start
        print_rank0(f"[dpo] eval at step {step}: {_format_eval(metrics)} in {metrics['time/eval_s']:.1f} s")
        return metrics

    run = Run(
        args, "dpo", "step2 dpo", {"model": engine}, data_layout(args, len(train_pairs)), total_steps, evaluate=run_eval
    )

    def attach_all(ref_logps: dict) -> None:
        attach_reference(eval_pairs, ref_logps["eval"])
        if "train" in ref_logps:
            attach_reference(train_pairs, ref_logps["train"])

    def rescore() -> list[list[float]]:  # the held-out pairs' reference log-probs, from the reference itself
        return all_reference_logps(reference, eval_pairs, collator, args.per_device_eval_batch_size)

    def evaluate_before():  # before any update: the policy is still the reference
        if reference.kind == "none":  # a reference-free loss: the policy's own evaluation
            metrics = run_eval(0)
            return {"before": metrics, "ref_logps": {}}, metrics
        if unpaired:  # KTO scores with the reference per batch; before training its figures are known
            metrics = unpaired_reference_metrics(eval_pairs, loss_of)
            print_rank0(f"[dpo] eval before training (the policy is the reference): {_format_eval(metrics)}")
            return {"before": metrics, "ref_logps": {}}, metrics
        ref_start = time.time()
        ref_logps = {"eval": rescore()}
        if reference.kind == "precomputed":
            ref_logps["train"] = all_reference_logps(reference, train_pairs, collator, args.per_device_eval_batch_size)
        ref_time = time.time() - ref_start
        scored = len(eval_pairs) + len(ref_logps.get("train", []))
        print_rank0(f"[dpo] reference log-probs of {scored} pairs in {ref_time:.1f} s")
        run.log(0, {"time/reference_s": ref_time})
        attach_all(ref_logps)
        metrics = reference_metrics(eval_pairs, loss_of)
        print_rank0(f"[dpo] eval before training (the policy is the reference): {_format_eval(metrics)}")
        return {"before": metrics, "ref_logps": ref_logps}, metrics

    state = run.restore(evaluate_before)
    if run.resumed and reference.kind != "none" and not unpaired:
        restored_reference(state, run.restored_from, reference, len(eval_pairs), len(train_pairs), rescore)
        if len(state["ref_logps"]["eval"]) != len(eval_pairs):
            fail(
                f"the checkpoint holds reference log-probs of {len(state['ref_logps']['eval'])} held-out pairs, this "
                f"run evaluates {len(eval_pairs)} (another --eval_iters or --per_device_eval_batch_size): resume "
                f"with the checkpoint's settings"
            )
        attach_all(state["ref_logps"])
    before = state["before"]

    def micro_step(batch):
        logps, counts = sequence_logprobs(engine, batch, args.logprob_chunk_tokens, args.padding_free)
        terms, stats = loss_of.train_terms(logps, counts, reference(batch), batch)
        return terms, tuple(stats[name].item() for name in loss_of.stat_names)

    # the loss is the mean over the optimizer step's pairs (KTO: examples; all micro-batches, all ranks), the
    # NLL term the mean over its chosen response tokens
    train_micro_batches(
        run,
        engine,
        loader,
        sampler,
        micro_step,
        loss_of.step_metrics,
        counts=loss_of.units,
        budget=budget,
        padding_free=args.padding_free,
    )

    step = run.loop.step
    after = run.evaluate_now()
    first = (
        ""
        if unpaired
        else (f"accuracy {_fmt(after.get('eval/accuracy'))} (before {_fmt(before.get('eval/accuracy'))}), ")
    )
    print_rank0(
        f"[dpo] eval after {step} steps: {first}margin {_fmt(after.get('eval/margin'))} (before "
        f"{_fmt(before.get('eval/margin'))}); training took {run.train_s:.1f} s"
    )
    run.log(step, {"time/train_s": run.train_s})
    run.finish(
        lambda: export_hf_model(engine, tokenizer, args.output_dir),
        args.output_dir,
        "the policy",
        ReloadCheck(
            "logp",
            "sequence log-probs",
            engine,
            lambda: load_causal_lm(args.output_dir, trust_remote_code=args.trust_remote_code),
            lambda model, batch: sequence_logprobs(model, batch, args.logprob_chunk_tokens)[0],
            collator(eval_pairs[:4] or train_pairs[:4]),
        ),
    )


def check_both_labels(args, stats: dict) -> None:
    """KTO learns from the contrast of desirable and undesirable examples: training data with one kind only
    stops here, before any model loads."""
    if stats["desirable"] and stats["undesirable"]:
        return
    have, missing = ("true", "false") if stats["desirable"] else ("false", "true")
    fail(
        f"--loss_type {args.loss_type}: every usable training row of {', '.join(args.data_path)} has "
        f"'{args.label_key}' {have} ({stats['examples']} examples); it needs rows labelled {missing} too"
    )


def cli() -> None:
    """`python -m step2_dpo.main` and the `rlhf-dpo` command: main() ended by run_main (the project's errors as one
    `error:` line)."""
    run_main(main)


if __name__ == "__main__":
    cli()
