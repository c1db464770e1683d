"""Teachers of step 3's on-policy distillation: their flags and checks, which teacher scores which row, and the
distillation terms the trainer adds to its advantages or its loss.

On-policy distillation (GKD, Agarwal et al. 2024; MiniLLM's reverse KL): the student (the actor) samples, each frozen
teacher scores the student's own tokens, and a per-token divergence (step3_ppo.algo.distill.DISTILL_SIGNALS) is the
learning signal: dense, on-policy, with or without a task reward. A teacher is a frozen model beside the reference
(ZeRO-3 inference, `--offload_teacher_model` to CPU memory; step3_ppo.deepspeed_models builds it), scored on the
rollout's token ids as generated (token-in-token-out), with the policy's temperature. Two kinds of signal:

- `reverse_kl_sampled` (the default): log pi_student - log pi_teacher of each sampled token, from the old (rollout-
  time) log-probs and the teacher's; `--distill_coef` x its negative is added to every action's advantage, after
  the estimator's whitening (a dense per-token advantage, as Thinking Machines' and Tinker's on-policy distillation
  do), so it goes through the chosen `--policy_loss` and its clip like the task's advantage;
- `reverse_kl`, `forward_kl`, `jsd`: the divergence over the whole vocabulary at each action, a loss term
  (`--distill_coef` x its aggregate under `--loss_agg`) computed from the LM heads' inputs a chunk of positions at
  a time, so no [B, T, V] tensor exists; the teacher runs again in each training micro-batch (one teacher).

Only the policy's own tokens get a signal: the loss mask leaves out an environment's and a tool's tokens and the rows
the loss drops. With several teachers, the data column `--teacher_key` names each prompt's teacher (a row without it
goes to the first); every teacher scores every row (a forward under ZeRO-3 is a collective every rank must make), and
each row keeps its own teacher's scores. A teacher must share the student's tokenizer: a different vocabulary stops
the run (cross-tokenizer distillation is not supported). A rollout engine that can serve a teacher (its registry entry's
`teacher`, step3_ppo/rollout/engines.py) scores the rows in a worker of its own instead (`--teacher_engine`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import Tensor

from step3_ppo.algo.distill import DISTILL_SIGNALS
from step3_ppo.rollout.engines import ROLLOUT_ENGINES
from utils.cli import Number
from utils.models.loading import check_model_path, load_tokenizer
from utils.train.flags import fail, refuse_unread
from utils.train.metrics_logger import print_rank0

DISTILL_FLAGS = (
    "teacher_key",
    "teacher_engine",
    "distill_signal",
    "distill_coef",
    "distill_jsd_beta",
    "offload_teacher_model",
)


@dataclass(frozen=True)
class Teacher:
    """One `--teacher_model_name_or_path` entry: the name a data row's `--teacher_key` field gives, and its path."""

    name: str
    path: str


def add_teacher_args(parser) -> None:
    g = parser.add_argument_group("distillation (on-policy, from one or several teachers)")
    g.add_argument(
        "--teacher_model_name_or_path",
        nargs="*",
        default=[],
        metavar="[NAME=]PATH",
        help="frozen teacher model(s) that score the student's sampled tokens (same tokenizer as the actor); with "
        "several, NAME=PATH names each for --teacher_key (default names: the folders' names)",
    )
    g.add_argument(
        "--teacher_key",
        default="teacher",
        help="with several teachers, the prompt rows' field naming each row's teacher (absent: the first)",
    )
    g.add_argument(
        "--distill_signal",
        choices=list(DISTILL_SIGNALS),
        default="reverse_kl_sampled",
        help="; ".join(f"{name}: {entry.help}" for name, entry in DISTILL_SIGNALS.items()),
    )
    g.add_argument(
        "--distill_coef",
        type=Number(float, above=0),
        default=1.0,
        help="weight of the distillation signal beside the task's advantage (or alone, with no reward)",
    )
    beta = DISTILL_SIGNALS["jsd"].options["beta"]
    g.add_argument(
        "--distill_jsd_beta",
        type=Number(float, low=beta.minimum, high=beta.maximum),
        default=beta.default,
        help=f"--distill_signal jsd: {beta.help}",
    )
    g.add_argument(
        "--offload_teacher_model",
        action="store_true",
        help="keep the teachers' parameters in CPU memory (ZeRO-3 offload)",
    )
    g.add_argument(
        "--teacher_engine",
        choices=["hf", *[name for name, entry in ROLLOUT_ENGINES.items() if entry.teacher is not None]],
        default="hf",
        help="what scores the student's tokens: hf, each teacher a frozen DeepSpeed engine in the trainer; "
        + "; ".join(f"{name}, {entry.teacher_help}" for name, entry in ROLLOUT_ENGINES.items() if entry.teacher),
    )


def served_by() -> str:
    return ", ".join(name for name, entry in ROLLOUT_ENGINES.items() if entry.teacher is not None)


def parse_teachers(values: list[str]) -> list[Teacher]:
    """`[NAME=]PATH` entries as Teachers; an unnamed one is called by its folder's name ("teacher" when alone)."""
    teachers = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or os.path.exists(value) or not name:
            name, path = "", value
        teachers.append(Teacher(name, path))
    if len(teachers) == 1 and not teachers[0].name:
        return [Teacher("teacher", teachers[0].path)]
    named = [Teacher(t.name or os.path.basename(os.path.normpath(t.path)), t.path) for t in teachers]
    seen = [t.name for t in named]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        fail(f"--teacher_model_name_or_path: two teachers are called {twice[0]!r}; name them NAME=PATH")
    return named


def check_teacher_args(args) -> None:
    """Sets `args.teachers` (a list of Teacher, empty without distillation) after checking what a teacher needs:
    the flags that only a teacher (or one signal) reads, the paths, the tokenizer (the student's), and the
    signals' limits; says so when a teacher is the actor's own starting point."""
    args.teachers = parse_teachers(args.teacher_model_name_or_path)
    if not args.teachers:
        refuse_unread(args, DISTILL_FLAGS, "without --teacher_model_name_or_path")
        return
    signal = DISTILL_SIGNALS[args.distill_signal]
    if args.distill_signal != "jsd":
        refuse_unread(args, ["distill_jsd_beta"], f"with --distill_signal {args.distill_signal} (jsd reads it)")
    if len(args.teachers) == 1:
        refuse_unread(args, ["teacher_key"], "with one teacher (it names a row's teacher among several)")
    elif signal.needs_logits:
        fail(
            f"--distill_signal {args.distill_signal} runs the teacher in every training micro-batch: it takes one "
            f"teacher (reverse_kl_sampled takes several)"
        )
    serving = ROLLOUT_ENGINES[args.teacher_engine]
    if serving.teacher is None and args.teacher_engine != "hf":
        fail(f"--teacher_engine {args.teacher_engine} cannot serve a teacher (engines that can: hf, {served_by()})")
    if serving.check_teacher is not None:
        serving.check_teacher(args)
    if signal.needs_logits and args.padding_free:
        fail(
            f"--distill_signal {args.distill_signal} reads the padded layout's hidden states: leave --padding_free out"
        )
    if signal.needs_logits and args.logprob_chunk_tokens <= 0:
        fail(
            f"--distill_signal {args.distill_signal} reads the vocabulary a chunk at a time: it needs "
            f"--logprob_chunk_tokens > 0"
        )
    for teacher in args.teachers:
        check_model_path(teacher.path, "--teacher_model_name_or_path")
        if os.path.realpath(teacher.path) == os.path.realpath(args.actor_model_name_or_path):
            start = "its LoRA adapters start at 0, so" if args.actor_lora_dim > 0 else "so"
            print_rank0(
                f"[step3] teacher {teacher.name!r} is the actor's own starting model ({teacher.path}): {start} the "
                f"distillation signal starts at 0 and holds the student near it"
            )


def check_same_tokenizer(args, student_tokenizer) -> None:
    """Every teacher's tokenizer is the student's: the same vocabulary (token -> id) and special tokens, else
    the teacher would score other tokens than the ones sampled."""
    student = student_tokenizer.get_vocab()
    for teacher in args.teachers:
        theirs = load_tokenizer(teacher.path, args.trust_remote_code)
        if theirs.get_vocab() != student:
            diff = len(set(theirs.get_vocab().items()) ^ set(student.items()))
            fail(
                f"--teacher_model_name_or_path {teacher.path}: its tokenizer ({len(theirs)} tokens) differs from the "
                f"actor's at {args.actor_model_name_or_path} ({len(student_tokenizer)} tokens, {diff} entries "
                f"differ); a teacher must share the student's tokenizer"
            )


def row_teacher(prompt: dict, key: str, names: list[str]) -> str:
    """The teacher of a prompt row: its `key` field among `names`, or the first teacher when it has none."""
    value = (prompt.get("extra") or {}).get(key)
    if value is None:
        return names[0]
    if value not in names:
        fail(f"a prompt row's --teacher_key field {key!r} is {value!r}, not one of the teachers {', '.join(names)}")
    return value


def check_teacher_column(examples, key: str, names: list[str]) -> None:
    """Every prompt row names a known teacher (or none): checked on the data before any model loads."""
    if len(names) > 1:
        for example in examples:
            row_teacher(example, key, names)


def distill_sums(
    signal: Tensor,
    teacher_logprobs: Tensor,
    loss_mask: Tensor,
    owners: list[str],
    names: list[str],
    agree: Tensor | None = None,
) -> dict:
    """This rank's sums for the distillation metrics (`distill_metrics`), from the sampled tokens' reverse KL
    and the teacher's log-probs [B, T] over the trained actions `loss_mask`: per token, per answer (each row's own
    mean), and the teacher's log-prob of the student's tokens; with `agree` [B, T] (1 where the student's and the
    teacher's most likely tokens are the same) their top-1 agreement; per teacher too when there are several
    (`owners`: each row's teacher)."""
    groups = {"": torch.ones(len(owners), dtype=torch.bool)}
    if len(names) > 1:
        groups.update({f"{name}/": torch.tensor([o == name for o in owners]) for name in names})
    out = {}
    for prefix, rows in groups.items():
        mask = loss_mask[rows].float()
        tokens = mask.sum(-1)
        answered = tokens > 0
        per_row = (signal[rows] * mask).sum(-1)[answered] / tokens[answered]
        out[f"distill/{prefix}signal_sum"] = (signal[rows] * mask).sum().item()
        out[f"distill/{prefix}tokens"] = tokens.sum().item()
        out[f"distill/{prefix}seq_signal_sum"] = per_row.sum().item()
        out[f"distill/{prefix}answers"] = int(answered.sum())
        out[f"distill/{prefix}teacher_logprob_sum"] = (teacher_logprobs[rows] * mask).sum().item()
        if agree is not None:
            out[f"distill/{prefix}top1_agree_sum"] = (agree[rows] * mask).sum().item()
    return out


def distill_metrics(totals: dict, names: list[str], signal: str) -> dict:
    """The distillation metrics of an iteration over all ranks (none without a teacher): the sampled tokens'
    reverse KL to the teacher per token and per answer, and the teacher's mean log-prob of the student's tokens;
    the share of actions where the student's and the teacher's most likely tokens agree (an in-process teacher and
    the old log-probs from a forward); the same per teacher (`distill/<name>/...`) when there are several. The
    full-vocabulary signals log their loss from the training micro-batches (`loss/distill`)."""
    if not names:
        return {}
    out = {}
    for prefix in [""] + ([f"{name}/" for name in names] if len(names) > 1 else []):
        tokens, answers = max(totals[f"distill/{prefix}tokens"], 1), max(totals[f"distill/{prefix}answers"], 1)
        out[f"distill/{prefix}reverse_kl_sampled_token_mean"] = totals[f"distill/{prefix}signal_sum"] / tokens
        out[f"distill/{prefix}reverse_kl_sampled_seq_mean"] = totals[f"distill/{prefix}seq_signal_sum"] / answers
        out[f"distill/{prefix}teacher_logprob_mean"] = totals[f"distill/{prefix}teacher_logprob_sum"] / tokens
        if f"distill/{prefix}top1_agree_sum" in totals:
            out[f"distill/{prefix}top1_agreement"] = totals[f"distill/{prefix}top1_agree_sum"] / tokens
    return out
