"""Hand-computed checks of the on-policy distillation signals (step3_ppo.algo.distill): each signal against numbers
worked out in the comments (V = 3 or 4), 0 when teacher == student, TRL's JSD convention at beta 0, 0.5 and 1, the
masked layout of the sampled signal, finite values and gradients with banned (-inf) tokens, and the chunked driver
equal to the whole logits (values and gradients) for several chunk sizes, N = 0 included.

Expected numbers are derived with plain python/math, never obtained by calling the function under test."""

import math

import pytest
import torch

from step3_ppo.algo.distill import (
    DISTILL_SIGNALS,
    LOGPROB_FLOOR,
    chunked_signal,
    forward_kl,
    generalized_jsd,
    get_signal,
    reverse_kl,
    reverse_kl_sampled,
    signal_means,
    signal_options,
    teacher_logprob_mean,
    top1_agreement,
)

INF = float("inf")
NAN = float("nan")
LN2, LN3 = math.log(2), math.log(3)

# The running example, V = 3: the student uniform (logits 0), the teacher (1/2, 1/4, 1/4).
STUDENT = [0.0, 0.0, 0.0]
TEACHER = [math.log(0.5), math.log(0.25), math.log(0.25)]
# KL(S || T) = sum 1/3 * (ln 1/3 - ln p_t) = -ln 3 - (1/3)(ln 1/2 + 2 ln 1/4) = (5/3) ln 2 - ln 3 = 0.0566330
RKL = 5 / 3 * LN2 - LN3
# KL(T || S) = 1/2 ln(1/2 / 1/3) + 2 * 1/4 ln(1/4 / 1/3) = ln 3 - 1.5 ln 2 = 0.0588915
FKL = LN3 - 1.5 * LN2
# beta = 0.5: M = (S + T) / 2 = (5/12, 7/24, 7/24)
#   KL(T || M) = 1/2 ln(6/5) + 1/2 ln(6/7); KL(S || M) = 1/3 ln(4/5) + 2/3 ln(8/7)
JSD_HALF = 0.5 * (0.5 * math.log(6 / 5) + 0.5 * math.log(6 / 7)) + 0.5 * (
    1 / 3 * math.log(4 / 5) + 2 / 3 * math.log(8 / 7)
)
# beta = 0.25 (pins which side beta weighs): M = 0.25 T + 0.75 S = (3/8, 5/16, 5/16)
#   KL(T || M) = 1/2 ln(4/3) + 1/2 ln(4/5); KL(S || M) = 1/3 ln(8/9) + 2/3 ln(16/15)
#   JSD = 0.25 KL(T || M) + 0.75 KL(S || M)
JSD_QUARTER = 0.25 * (0.5 * math.log(4 / 3) + 0.5 * math.log(4 / 5)) + 0.75 * (
    1 / 3 * math.log(8 / 9) + 2 / 3 * math.log(16 / 15)
)


def t(x, dtype=torch.float32, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def close(a, b, tol=1e-6):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=tol, rtol=tol), (a, b)


def full_vocab(name, student, teacher, temperature=1.0, **options):
    signal = get_signal(name)
    return signal.fn(student, teacher, temperature, **signal_options(signal, options))


# ---------------------------------------------------------------- the registry
def test_registry_entries_say_what_they_read():
    assert set(DISTILL_SIGNALS) == {"reverse_kl_sampled", "reverse_kl", "forward_kl", "jsd"}
    assert not DISTILL_SIGNALS["reverse_kl_sampled"].needs_logits
    assert all(DISTILL_SIGNALS[n].needs_logits for n in ("reverse_kl", "forward_kl", "jsd"))
    for signal in DISTILL_SIGNALS.values():
        assert signal.help and "\n" not in signal.help
    assert signal_options(DISTILL_SIGNALS["jsd"], {}) == {"beta": 0.5}
    assert signal_options(DISTILL_SIGNALS["reverse_kl"], {}) == {}
    with pytest.raises(ValueError, match="unknown distillation signal"):
        get_signal("kl")
    with pytest.raises(ValueError, match="unknown distillation option"):
        signal_options(DISTILL_SIGNALS["reverse_kl"], {"beta": 0.5})
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\]"):
        signal_options(DISTILL_SIGNALS["jsd"], {"beta": 1.5})
    with pytest.raises(ValueError, match="temperature must be > 0"):
        reverse_kl(t([STUDENT]), t([TEACHER]), temperature=0.0)
    with pytest.raises(ValueError, match="differ in shape"):
        forward_kl(t([STUDENT]), t([[0.0, 0.0, 0.0, 0.0]]))


# ---------------------------------------------------------------- full-vocabulary signals, hand values
def test_reverse_and_forward_kl_hand_values():
    student, teacher = t([STUDENT, STUDENT]), t([TEACHER, STUDENT])
    close(reverse_kl(student, teacher), [RKL, 0.0])
    close(forward_kl(student, teacher), [FKL, 0.0])
    # V = 4: S = (.1, .2, .3, .4), T = (.4, .3, .2, .1):
    #   KL(S || T) = .1 ln(1/4) + .2 ln(2/3) + .3 ln(3/2) + .4 ln 4 = .3 ln 4 + .1 ln 1.5; KL(T || S) the same
    s4 = t([[math.log(p) for p in (0.1, 0.2, 0.3, 0.4)]])
    t4 = t([[math.log(p) for p in (0.4, 0.3, 0.2, 0.1)]])
    close(reverse_kl(s4, t4), [0.3 * math.log(4) + 0.1 * math.log(1.5)])
    close(forward_kl(s4, t4), [0.3 * math.log(4) + 0.1 * math.log(1.5)])
    # shifting logits by a constant changes no distribution
    close(reverse_kl(student + 3.0, teacher - 7.0), [RKL, 0.0])


def test_kl_equals_a_direct_sum_over_the_vocabulary():
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(5, 7, generator=g) * 2, torch.randn(5, 7, generator=g) * 2
    for temperature in (1.0, 0.6):
        rkl, fkl = [], []
        for s_row, t_row in zip(student.tolist(), teacher.tolist()):
            s_lse = math.log(sum(math.exp(z / temperature) for z in s_row))
            t_lse = math.log(sum(math.exp(z / temperature) for z in t_row))
            ls = [z / temperature - s_lse for z in s_row]
            lt = [z / temperature - t_lse for z in t_row]
            rkl.append(sum(math.exp(a) * (a - b) for a, b in zip(ls, lt)))
            fkl.append(sum(math.exp(b) * (b - a) for a, b in zip(ls, lt)))
        close(reverse_kl(student, teacher, temperature), rkl, tol=1e-5)
        close(forward_kl(student, teacher, temperature), fkl, tol=1e-5)


def test_jsd_follows_trl_at_beta_0_half_quarter_and_1():
    student, teacher = t([STUDENT]), t([TEACHER])
    close(generalized_jsd(student, teacher, beta=0.0), [FKL])  # TRL: beta 0 is the forward KL
    close(generalized_jsd(student, teacher, beta=1.0), [RKL])  # TRL: beta 1 is the reverse KL
    close(generalized_jsd(student, teacher, beta=0.5), [JSD_HALF])
    close(generalized_jsd(student, teacher, beta=0.25), [JSD_QUARTER])
    close(full_vocab("jsd", student, teacher), [JSD_HALF])  # the registry's default beta
    close(full_vocab("jsd", student, teacher, beta=0.25), [JSD_QUARTER])
    # at 0.5 the JSD is symmetric in its two arguments
    close(generalized_jsd(teacher, student, beta=0.5), [JSD_HALF])
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(student, teacher, beta=-0.1)


@pytest.mark.parametrize("name", ["reverse_kl", "forward_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_exactly_zero_when_teacher_is_student(name, temperature):
    logits = torch.randn(6, 11, generator=torch.Generator().manual_seed(1)) * 3
    for options in ({}, {"beta": 0.1}, {"beta": 0.9}) if name == "jsd" else ({},):
        values = full_vocab(name, logits, logits.clone(), temperature, **options)
        assert torch.equal(values, torch.zeros(6)), (name, options, values)


def test_temperature_divides_both_logits_first():
    # logits twice the running example's at temperature 2 are the running example
    student, teacher = t([STUDENT]) * 2, t([TEACHER]) * 2
    close(reverse_kl(student, teacher, 2.0), [RKL])
    close(forward_kl(student, teacher, 2.0), [FKL])
    close(generalized_jsd(student, teacher, 2.0, beta=0.5), [JSD_HALF])


def test_computed_in_fp32_from_bf16_logits():
    student, teacher = t([STUDENT], torch.bfloat16), t([TEACHER])
    values = reverse_kl(student, teacher.bfloat16())
    assert values.dtype == torch.float32
    close(values, [RKL], tol=1e-2)  # the teacher's log(1/2), log(1/4) are exact in bf16 up to rounding


# ---------------------------------------------------------------- banned tokens (-inf logits)
def test_a_token_banned_by_both_gives_finite_values_and_gradients():
    # S = softmax(0, 0, -inf) = (1/2, 1/2, 0); T = (3/4, 1/4, 0)
    #   KL(S || T) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    #   KL(T || S) = 3/4 ln(3/2) + 1/4 ln(1/2)
    #   beta 0.5: M = (5/8, 3/8, 0); KL(T || M) = 3/4 ln(6/5) + 1/4 ln(2/3); KL(S || M) = 1/2 ln(4/5) + 1/2 ln(4/3)
    expected = {
        "reverse_kl": 0.5 * math.log(4 / 3),
        "forward_kl": 0.75 * math.log(1.5) - 0.25 * LN2,
        "jsd": 0.5 * (0.75 * math.log(1.2) + 0.25 * math.log(2 / 3))
        + 0.5 * (0.5 * math.log(0.8) + 0.5 * math.log(4 / 3)),
    }
    for name, value in expected.items():
        student = t([[0.0, 0.0, -INF]], grad=True)
        teacher = t([[math.log(0.75), math.log(0.25), -INF]])
        out = full_vocab(name, student, teacher)
        close(out, [value])
        out.sum().backward()
        assert torch.isfinite(student.grad).all(), (name, student.grad)
        assert student.grad[0, 2] == 0


def test_a_token_only_the_teacher_bans():
    # S uniform, T = (1/2, 1/2, 0) (token 2 banned by the teacher only)
    student = t([STUDENT], grad=True)
    teacher = t([[math.log(0.5), math.log(0.5), -INF]])
    # KL(T || S) sums over the teacher's support: 2 * 1/2 ln(1/2 / 1/3) = ln 1.5
    close(forward_kl(student, teacher), [math.log(1.5)])
    # beta 0.5: M = (5/12, 5/12, 1/6); KL(T || M) = ln(6/5); KL(S || M) = 2/3 ln(4/5) + 1/3 ln 2
    close(generalized_jsd(student, teacher), [0.5 * math.log(1.2) + 0.5 * (2 / 3 * math.log(0.8) + 1 / 3 * LN2)])
    # KL(S || T) is infinite; with the teacher's log-prob floored it is finite:
    #   2/3 (ln 1/3 - ln 1/2) + 1/3 (ln 1/3 - LOGPROB_FLOOR)
    value = reverse_kl(student, teacher)
    close(value, [2 / 3 * math.log(2 / 3) + 1 / 3 * (-LN3 - LOGPROB_FLOOR)], tol=1e-5)
    for name in ("reverse_kl", "forward_kl", "jsd"):
        student.grad = None
        full_vocab(name, student, teacher).sum().backward()
        assert torch.isfinite(student.grad).all(), (name, student.grad)


# ---------------------------------------------------------------- the sampled-token signal
def test_reverse_kl_sampled_is_the_masked_log_ratio():
    student = t([[-9.0, -1.0, -2.0, NAN], [-0.5, -0.25, INF, -3.0]], grad=True)
    teacher = t([[NAN, -1.5, -2.0, -1.0], [-0.75, -INF, 0.0, NAN]])
    mask = t([[0, 1, 1, 0], [1, 1, 0, 0]], torch.long)
    out = reverse_kl_sampled(student, teacher, mask)
    # actions: -1 - (-1.5) = 0.5, -2 - (-2) = 0; -0.5 - (-0.75) = 0.25, -0.25 - LOGPROB_FLOOR (a banned token)
    close(out, [[0.0, 0.5, 0.0, 0.0], [0.25, -0.25 - LOGPROB_FLOOR, 0.0, 0.0]])
    out.sum().backward()
    close(student.grad, [[0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])  # nan/inf in padding reach no gradient
    # teacher == student: exactly 0 (a bool or float mask alike)
    same = reverse_kl_sampled(student.detach(), student.detach().clone(), mask.bool())
    assert torch.equal(same, torch.zeros(2, 4))
    via_registry = DISTILL_SIGNALS["reverse_kl_sampled"].fn(teacher, teacher, mask.float())  # -inf twice: 0 too
    assert torch.equal(via_registry, same) and via_registry.dtype == torch.float32


def test_gradients_reach_the_student_only():
    for name in ("reverse_kl", "forward_kl", "jsd"):
        student, teacher = t([STUDENT], grad=True), t([TEACHER], grad=True)
        full_vocab(name, student, teacher).sum().backward()
        assert student.grad is not None and teacher.grad is None, name
    student, teacher = t([[-1.0, -2.0]], grad=True), t([[-1.5, -2.5]], grad=True)
    reverse_kl_sampled(student, teacher, t([[1, 1]])).sum().backward()
    assert student.grad is not None and teacher.grad is None


# ---------------------------------------------------------------- chunked from hidden states
def heads(vocab=13, hidden=6, teacher_hidden=5, n=9, seed=0):
    torch.manual_seed(seed)
    student_head = torch.nn.Linear(hidden, vocab, bias=False)
    teacher_head = torch.nn.Linear(teacher_hidden, vocab)
    student_h = torch.randn(n, hidden)
    teacher_h = torch.randn(n, teacher_hidden).requires_grad_(True)  # trainable teacher tensors: must get no grad
    return student_head, teacher_head, student_h, teacher_h


def whole(name, student_head, teacher_head, student_h, teacher_h, temperature, **options):
    h = student_h.clone().requires_grad_(True)
    student_head.zero_grad()
    values = full_vocab(name, student_head(h), teacher_head(teacher_h), temperature, **options)
    (values * torch.arange(1.0, len(values) + 1)).sum().backward()  # a weight per position: each gradient counts
    return values.detach(), h.grad, student_head.weight.grad.clone()


def chunked(name, student_head, teacher, student_h, chunk, temperature, **options):
    h = student_h.clone().requires_grad_(True)
    student_head.zero_grad()
    values = chunked_signal(name, h, student_head, teacher, chunk, temperature, **options)
    (values * torch.arange(1.0, len(values) + 1)).sum().backward()
    return values.detach(), h.grad, student_head.weight.grad.clone()


@pytest.mark.parametrize("name,options", [("reverse_kl", {}), ("forward_kl", {}), ("jsd", {"beta": 0.3})])
@pytest.mark.parametrize("chunk", [1, 2, 4, 9, 50])
def test_chunked_equals_whole_logits(name, options, chunk):
    student_head, teacher_head, student_h, teacher_h = heads()
    reference = whole(name, student_head, teacher_head, student_h, teacher_h, 0.8, **options)
    as_pair = chunked(name, student_head, (teacher_h, teacher_head), student_h, chunk, 0.8, **options)

    def by_positions(positions):
        return teacher_head(teacher_h[positions])

    as_callable = chunked(name, student_head, by_positions, student_h, chunk, 0.8, **options)
    for got in (as_pair, as_callable):
        for a, b in zip(got, reference):
            close(a, b)
    assert teacher_head.weight.grad is None and teacher_h.grad is None


def test_chunked_with_no_position():
    student_head, teacher_head, _, _ = heads()
    h = torch.zeros(0, 6, requires_grad=True)
    values, agree = chunked_signal("jsd", h, student_head, (torch.zeros(0, 5), teacher_head), 4, agreement=True)
    assert values.shape == (0,) and agree.shape == (0,)
    values.sum().backward()
    assert h.grad is not None and h.grad.shape == (0, 6)


def test_chunked_keeps_one_chunk_of_logits_and_calls_the_teacher_without_grad():
    student_head, teacher_head, student_h, teacher_h = heads(n=7)
    rows, grad_modes = [], []

    def student(h):
        rows.append(h.shape[0])
        return student_head(h)

    def teacher(positions):
        grad_modes.append(torch.is_grad_enabled())
        return teacher_head(teacher_h[positions])

    h = student_h.clone().requires_grad_(True)
    values = chunked_signal("reverse_kl", h, student, teacher, 3)
    assert rows == [3, 3, 1]
    values.sum().backward()
    assert sorted(rows) == sorted([3, 3, 1] * 2)  # the backward recomputes each chunk once
    assert grad_modes and not any(grad_modes)
    rows.clear()
    with torch.no_grad():
        chunked_signal("reverse_kl", student_h, student, teacher, 3, min_chunks=5)
    assert rows == [3, 3, 1, 0, 0]  # ZeRO-3: as many head calls as the rank with the most chunks


def test_chunked_agreement_and_refusals():
    student_head, teacher_head, student_h, teacher_h = heads()
    with torch.no_grad():
        values, agree = chunked_signal(
            "forward_kl", student_h, student_head, (teacher_h, teacher_head), 4, agreement=True
        )
        student_logits, teacher_logits = student_head(student_h), teacher_head(teacher_h)
    close(values, forward_kl(student_logits, teacher_logits))
    assert torch.equal(agree, (student_logits.argmax(-1) == teacher_logits.argmax(-1)).float())
    with pytest.raises(ValueError, match="log-probs, not logits"):
        chunked_signal("reverse_kl_sampled", student_h, student_head, (teacher_h, teacher_head), 4)
    with pytest.raises(ValueError, match=r"\[N, H'\]"):
        chunked_signal("jsd", student_h, student_head, (teacher_h[:3], teacher_head), 4)
    with pytest.raises(ValueError, match="unknown distillation option"):
        chunked_signal("jsd", student_h, student_head, (teacher_h, teacher_head), 4, gamma=1.0)


# ---------------------------------------------------------------- metrics
def test_top1_agreement_by_hand():
    student = t([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0], [0.0, 0.0, -INF]])
    teacher = t([[0.0, 5.0, 1.0], [0.0, 0.0, 3.0], [1.0, 1.0, 0.0]])
    # argmaxes: 1 vs 1 (agree), 0 vs 2 (differ), 0 vs 0 (a tie goes to the lowest id on both sides: agree)
    close(top1_agreement(student, teacher), [1.0, 0.0, 1.0])


def test_signal_means_and_teacher_logprob_mean_by_hand():
    values = t([[1.0, 2.0, 3.0, NAN], [4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]])
    mask = t([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    means = signal_means(values, mask)
    close(means["token_mean"], 2.5)  # (1 + 2 + 3 + 4) / 4 actions
    close(means["seq_mean"], 3.0)  # rows (1+2+3)/3 = 2 and 4; the row with no action left out: (2 + 4) / 2
    empty = signal_means(values, torch.zeros(3, 4))
    close(empty["token_mean"], 0.0)
    close(empty["seq_mean"], 0.0)
    teacher = t([[-1.0, -2.0, -3.0, NAN], [-4.0, 0.0, 0.0, 0.0], [9.0, 9.0, 9.0, 9.0]], grad=True)
    mean = teacher_logprob_mean(teacher, mask)
    close(mean, -2.5)
    assert not mean.requires_grad


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.8])
def test_jsd_gradient_equals_the_naive_formulas(beta):
    # the naive mixture log((1 - beta) p_s + beta p_t) in fp64; rows 0 and 2 tie (equal log-probs, where the stable
    # form's choice of the larger side flips), row 1 ties nowhere, row 3 is random
    g = torch.Generator().manual_seed(2)
    student = torch.randn(4, 6, generator=g, dtype=torch.float64)
    teacher = torch.randn(4, 6, generator=g, dtype=torch.float64)
    teacher[0] = student[0]  # the whole row tied
    teacher[1, :3] = student[1, :3] + 0.5
    teacher[2] = student[2] + 1.0  # the same distribution, its log-probs equal to rounding
    s1 = student.clone().requires_grad_(True)
    generalized_jsd(s1, teacher, 1.3, beta=beta).sum().backward()
    s2 = student.clone().requires_grad_(True)
    ps, pt = torch.softmax(s2 / 1.3, -1), torch.softmax(teacher / 1.3, -1)
    m = (1 - beta) * ps + beta * pt
    naive = beta * (pt * (pt.log() - m.log())).sum(-1) + (1 - beta) * (ps * (ps.log() - m.log())).sum(-1)
    naive.sum().backward()
    close(generalized_jsd(student, teacher, 1.3, beta=beta), naive.detach(), tol=1e-10)
    close(s1.grad, s2.grad, tol=1e-10)


def test_large_vocabulary_and_large_logits_stay_finite():
    g = torch.Generator().manual_seed(3)
    student = (torch.randn(3, 50000, generator=g) * 40).bfloat16().requires_grad_(True)
    teacher = (torch.randn(3, 50000, generator=g) * 40).bfloat16()
    teacher[:, :100] = -INF
    for name in ("reverse_kl", "forward_kl", "jsd"):
        student.grad = None
        values = full_vocab(name, student, teacher, 0.5)
        values.sum().backward()
        assert values.dtype == torch.float32 and torch.isfinite(values).all() and (values >= 0).all(), name
        assert torch.isfinite(student.grad.float()).all(), name


def test_the_agreement_and_sums_behind_the_metrics():
    """distill_sums / distill_metrics by hand: two rows, one teacher each (two teachers)."""
    from step3_ppo.teachers import distill_metrics, distill_sums

    signal = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 0.0]])
    teacher = torch.tensor([[-1.0, -2.0, 0.0], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    agree = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    sums = distill_sums(signal, teacher, mask, ["a", "b"], ["a", "b"], agree)
    assert sums["distill/signal_sum"] == 3.5 and sums["distill/tokens"] == 3
    assert sums["distill/seq_signal_sum"] == 0.75 + 2.0 and sums["distill/answers"] == 2
    assert sums["distill/a/top1_agree_sum"] == 1.0 and sums["distill/b/top1_agree_sum"] == 1.0
    metrics = distill_metrics(sums, ["a", "b"], "reverse_kl_sampled")
    assert metrics["distill/reverse_kl_sampled_token_mean"] == pytest.approx(3.5 / 3)
    assert metrics["distill/reverse_kl_sampled_seq_mean"] == pytest.approx(2.75 / 2)
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx(-7.0 / 3)
    assert metrics["distill/top1_agreement"] == pytest.approx(2 / 3) and metrics["distill/a/top1_agreement"] == 0.5
    assert distill_metrics(sums, [], "reverse_kl_sampled") == {}
