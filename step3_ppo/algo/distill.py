"""On-policy distillation signals, chosen by name in ONE place (pure tensors, no models).

On-policy distillation (GKD, Agarwal et al. 2024; MiniLLM, Gu et al. 2024): the student (step 3's actor) samples
its answers, a frozen teacher scores the student's own tokens, and a per-token divergence between the two is the
learning signal. `DISTILL_SIGNALS` maps a name to a `DistillSignal`:

- ``reverse_kl_sampled`` reads only the log-probs of the sampled tokens, ``[B, T]`` in the layout of
  utils/math/ops.py: ``log pi_student(y_t) - log pi_teacher(y_t)``, a one-sample estimate of KL(student ||
  teacher) at each action, whose negative is a dense per-token reward (MiniLLM's and Thinking Machines' on-policy
  distillation);
- ``reverse_kl``, ``forward_kl`` and ``jsd`` read the full vocabulary: student and teacher logits ``[N, V]`` at
  the N sampled positions (the action positions, gathered by the caller) give one value per position ``[N]``,
  differentiable on the student's side (a loss; the teacher's side is always detached).

`chunked_signal` computes a full-vocabulary signal from the LM heads' input hidden states a chunk of positions at
a time (utils.math.ops.chunked_head), so that no ``[N, V]`` logits tensor beyond one chunk exists, forward or
backward. The metrics helpers at the end reduce a signal for logging.

Numerics: logits are divided by the temperature and normalised with ``log_softmax`` in fp32 (fp64 kept). A
log-prob below `LOGPROB_FLOOR` counts as `LOGPROB_FLOOR` (``exp`` of it is 0 even in fp64), so a banned token
(``-inf`` logit) contributes exactly 0 where the distribution that weighs it gives it probability 0, every value
and gradient stays finite, and a token that the teacher bans but the student can sample costs ``-LOGPROB_FLOOR``
times its probability instead of ``inf`` (teacher and student must share one vocabulary: align the teacher's
padded rows with the student's before calling).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Tuple, Union

import torch
from torch import Tensor

from utils.math.ops import aggregate, chunked_head, masked_mean, select

__all__ = [
    "LOGPROB_FLOOR",
    "reverse_kl_sampled",
    "reverse_kl",
    "forward_kl",
    "generalized_jsd",
    "DistillOption",
    "DistillSignal",
    "DISTILL_SIGNALS",
    "get_signal",
    "signal_options",
    "chunked_signal",
    "top1_agreement",
    "signal_means",
    "teacher_logprob_mean",
]

# exp(-1e4) is 0 in fp32 and fp64: the floor changes no probability, only a log-ratio against a banned token
LOGPROB_FLOOR = -1.0e4


def _upcast(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _floor(logprobs: Tensor) -> Tensor:
    """Log-probs with -inf (and anything below the floor) raised to LOGPROB_FLOOR; the gradient there is 0."""
    return logprobs.clamp(min=LOGPROB_FLOOR)


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"the distillation temperature must be > 0, got {temperature}")


def _log_probs(student_logits: Tensor, teacher_logits: Tensor, temperature: float) -> Tuple[Tensor, Tensor]:
    """(student, teacher) log-probs [N, V] of logits divided by the temperature, floored; the teacher detached."""
    _check_temperature(temperature)
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(
            f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ "
            "in shape: the same positions over one shared vocabulary are needed"
        )
    student = torch.log_softmax(_upcast(student_logits) / temperature, dim=-1)
    teacher = torch.log_softmax(_upcast(teacher_logits.detach()) / temperature, dim=-1)
    return _floor(student), _floor(teacher).to(student.dtype)


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """KL(p || q) = sum_v p (log p - log q) per row, of floored log-probs (every term finite; 0 where p is 0)."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


# --------------------------------------------------------------------------- the signals
def reverse_kl_sampled(student_logprobs: Tensor, teacher_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """``log pi_student(y_t) - log pi_teacher(y_t)`` of each sampled token ``[B, T]``, 0 off ``action_mask``.

    The inputs are the two models' log-probs of the tokens the student sampled (utils.math.ops layout, taken at
    the sampling temperature); in expectation over the student's samples this is KL(student || teacher) at each
    position. Used as a dense per-token reward, its negative: a token the teacher finds less likely than the
    student does is penalised. Both inputs are selected on the mask before any arithmetic (padding may hold
    anything) and floored (`LOGPROB_FLOOR`); the teacher's side is detached.
    """
    mask = action_mask.to(student_logprobs.device) != 0
    student = _floor(select(_upcast(student_logprobs), mask))
    teacher = _floor(select(_upcast(teacher_logprobs.detach()).to(student.device), mask)).to(student.dtype)
    return select(student - teacher, mask)


def reverse_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(student || teacher) = ``sum_v p_s (log p_s - log p_t)`` at each position ``[N]`` of logits ``[N, V]``
    (both divided by ``temperature`` first). Mode-seeking: the student is pushed off tokens the teacher finds
    unlikely (MiniLLM's divergence; GKD's and TRL's ``beta = 1``)."""
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(student, teacher)


def forward_kl(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """KL(teacher || student) = ``sum_v p_t (log p_t - log p_s)`` at each position ``[N]`` of logits ``[N, V]``
    (both divided by ``temperature`` first). Mode-covering: the student is pushed to cover every token the teacher
    gives mass to (supervised KD's divergence; GKD's and TRL's ``beta = 0``)."""
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    return _kl(teacher, student)


def generalized_jsd(
    student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0, beta: float = 0.5
) -> Tensor:
    """The generalized Jensen-Shannon divergence at each position ``[N]`` of logits ``[N, V]`` (both divided by
    ``temperature`` first), in TRL's convention (``GKDTrainer.generalized_jsd_loss``):

        M = beta * p_teacher + (1 - beta) * p_student
        JSD(beta) = beta * KL(teacher || M) + (1 - beta) * KL(student || M)

    and, as TRL does, exactly ``forward_kl`` at ``beta = 0`` and exactly ``reverse_kl`` at ``beta = 1`` (the
    formula itself vanishes at both ends; TRL documents beta 0 as forward KL and beta 1 as reverse KL). ``beta``
    in [0, 1]; 0.5 gives the symmetric JSD. The mixture's log-probs are computed as ``hi + log1p(w_lo *
    expm1(lo - hi))`` of the larger and smaller of the two log-probs, so that equal student and teacher give
    exactly 0.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"the JSD's beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, temperature)
    student, teacher = _log_probs(student_logits, teacher_logits, temperature)
    teacher_higher = teacher > student
    hi = torch.where(teacher_higher, teacher, student)
    lo = torch.where(teacher_higher, student, teacher)
    w_lo = torch.where(teacher_higher, hi.new_tensor(1.0 - beta), hi.new_tensor(beta))  # the lower one's weight in M
    mixture = hi + torch.log1p(w_lo * torch.expm1(lo - hi))
    return beta * _kl(teacher, mixture) + (1.0 - beta) * _kl(student, mixture)


# --------------------------------------------------------------------------- the registry
@dataclass(frozen=True)
class DistillOption:
    """A setting of one signal (the JSD's beta): its default, one-line help and inclusive bounds."""

    default: float
    help: str
    minimum: float | None = None
    maximum: float | None = None


@dataclass(frozen=True)
class DistillSignal:
    """A distillation signal.

    ``needs_logits`` True: ``fn(student_logits [N, V], teacher_logits [N, V], temperature, **options) -> [N]``,
    the full vocabulary at the N action positions (`chunked_signal` computes it from hidden states); False:
    ``fn(student_logprobs [B, T], teacher_logprobs [B, T], action_mask) -> [B, T]``, only the log-probs of the
    sampled tokens (no teacher logits kept, no LM head run beyond the usual log-probs). ``options``: the
    signal's own settings (`signal_options` fills their defaults).
    """

    fn: Callable[..., Tensor]
    needs_logits: bool
    help: str
    options: Dict[str, DistillOption] = field(default_factory=dict)


DISTILL_SIGNALS: Dict[str, DistillSignal] = {
    "reverse_kl_sampled": DistillSignal(
        reverse_kl_sampled,
        needs_logits=False,
        help="log p_student - log p_teacher of each sampled token, its negative a dense reward (MiniLLM)",
    ),
    "reverse_kl": DistillSignal(
        reverse_kl,
        needs_logits=True,
        help="KL(student || teacher) over the full vocabulary at each sampled position (mode-seeking)",
    ),
    "forward_kl": DistillSignal(
        forward_kl,
        needs_logits=True,
        help="KL(teacher || student) over the full vocabulary at each sampled position (mode-covering)",
    ),
    "jsd": DistillSignal(
        generalized_jsd,
        needs_logits=True,
        help="GKD's generalized Jensen-Shannon divergence (TRL's convention: beta 0 = forward KL, 1 = reverse KL)",
        options={
            "beta": DistillOption(
                0.5, "the teacher's weight in the JSD's mixture, in [0, 1] (0: forward KL, 1: reverse KL)", 0.0, 1.0
            )
        },
    ),
}
# A new signal is one entry here and its pure function above (with a hand-computed test).


def get_signal(name: str) -> DistillSignal:
    """The registry's entry `name`; a ValueError naming the choices otherwise."""
    if name not in DISTILL_SIGNALS:
        raise ValueError(f"unknown distillation signal {name!r}; choose from {', '.join(DISTILL_SIGNALS)}")
    return DISTILL_SIGNALS[name]


def signal_options(signal: DistillSignal, options: Dict[str, float]) -> Dict[str, float]:
    """``options`` completed with the signal's defaults; a ValueError for an unknown name or a value out of
    bounds."""
    unknown = sorted(set(options) - set(signal.options))
    if unknown:
        known = ", ".join(signal.options) or "none"
        raise ValueError(f"unknown distillation option(s) {', '.join(unknown)}; this signal takes: {known}")
    out = {}
    for name, option in signal.options.items():
        value = float(options.get(name, option.default))
        if (option.minimum is not None and value < option.minimum) or (
            option.maximum is not None and value > option.maximum
        ):
            raise ValueError(f"{name} must be in [{option.minimum}, {option.maximum}], got {value}")
        out[name] = value
    return out


# --------------------------------------------------------------------------- chunk by chunk from hidden states
TeacherLogits = Callable[[Tensor], Tensor]


def chunked_signal(
    name: str,
    student_hidden: Tensor,
    student_head: Callable[[Tensor], Tensor],
    teacher: Union[TeacherLogits, Tuple[Tensor, Callable[[Tensor], Tensor]]],
    chunk_tokens: int,
    temperature: float = 1.0,
    agreement: bool = False,
    min_chunks: int = 0,
    **options: float,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """The full-vocabulary signal `name` at N positions ``[N]``, ``chunk_tokens`` positions at a time.

    ``student_hidden`` ``[N, H]``: the student's LM-head inputs at the action positions (gathered by the
    caller), ``student_head`` maps ``[n, H]`` to ``[n, V]`` logits. ``teacher``: either ``(teacher_hidden [N,
    H'], teacher_head)``, or a callable that maps the indices ``[n]`` of a contiguous run of positions (a long
    tensor on the student's device, ascending) to the teacher's logits ``[n, V]`` there. The teacher runs under
    ``torch.no_grad`` and must be deterministic (eval mode): with gradients on, each chunk runs inside
    ``torch.utils.checkpoint`` (utils.math.ops.chunked_head) and its backward calls both heads again, so at most
    one chunk's ``[n, V]`` logits of each model live at a time, forward or backward. The gradient reaches the
    student's hidden states and head only.

    ``agreement`` True: also the top-1 agreement of the chunk's logits ``[N]`` (`top1_agreement`), from the same
    head calls. ``min_chunks``: at least this many calls of each head (a ZeRO-3 head, utils.models.forward's
    head_chunks). ``options``: the signal's own (``beta`` of ``jsd``). Run it under ``torch.no_grad`` for values
    only (a reward, a metric): the chunks then run one after the other, no recomputation.
    """
    signal = get_signal(name)
    if not signal.needs_logits:
        raise ValueError(f"{name} reads the sampled tokens' log-probs, not logits: call its function directly")
    settings = signal_options(signal, options)
    _check_temperature(temperature)
    if student_hidden.dim() != 2:
        raise ValueError(f"student hidden states must be [N, H], got {tuple(student_hidden.shape)}")
    count = student_hidden.shape[0]
    if isinstance(teacher, tuple):
        teacher_hidden, teacher_head = teacher
        if teacher_hidden.dim() != 2 or teacher_hidden.shape[0] != count:
            raise ValueError(
                f"teacher hidden states must be [N, H'] with the student's N = {count}, "
                f"got {tuple(teacher_hidden.shape)}"
            )

        def teacher_logits(positions: Tensor) -> Tensor:
            return teacher_head(teacher_hidden.index_select(0, positions.to(teacher_hidden.device)))

    else:
        teacher_logits = teacher

    def reduce(student_logits: Tensor, positions: Tensor) -> Union[Tensor, Tuple[Tensor, Tensor]]:
        with torch.no_grad():
            teacher_chunk = teacher_logits(positions).to(student_logits.device)
        values = signal.fn(student_logits, teacher_chunk, temperature, **settings)
        if agreement:
            return values, top1_agreement(student_logits, teacher_chunk)
        return values

    positions = torch.arange(count, device=student_hidden.device)
    out = chunked_head(student_hidden, student_head, reduce, chunk_tokens, positions, min_chunks=min_chunks)
    return out if agreement else out[0]


# --------------------------------------------------------------------------- metrics
def top1_agreement(student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """1.0 where the student's most likely token is the teacher's, else 0.0, per position ``[N]`` of logits
    ``[N, V]`` (no gradient; a temperature does not move an argmax; ties go to the lowest token id)."""
    with torch.no_grad():
        same = student_logits.argmax(dim=-1) == teacher_logits.to(student_logits.device).argmax(dim=-1)
        return same.float()


def signal_means(values: Tensor, action_mask: Tensor) -> Dict[str, Tensor]:
    """A per-token signal ``[B, T]`` reduced for logging (detached): ``token_mean``, every action weighing the
    same, and ``seq_mean``, each row's own token mean then the mean over the rows that have actions (a long
    answer weighs as much as a short one). 0 for an empty mask."""
    values = values.detach()
    return {
        "token_mean": masked_mean(values, action_mask),
        "seq_mean": aggregate(values, action_mask, "seq_mean"),
    }


def teacher_logprob_mean(teacher_logprobs: Tensor, action_mask: Tensor) -> Tensor:
    """The teacher's mean log-prob of the student's sampled tokens over the actions (detached; 0 for an empty
    mask): how plausible the teacher finds the student's answers, rising as the student learns."""
    return masked_mean(teacher_logprobs.detach(), action_mask)
