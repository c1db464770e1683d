"""bench/sft_throughput.py's arithmetic: the figures of a run from its metrics rows (warm-up dropped, seconds
weighted), the FLOPs 6N leaves out, and the profile's operator groups."""

import pytest

from bench.common import BenchError
from bench.sft_throughput import cpu_mfu, extra_flops_per_token, group_profile, summarise


def step(n: int, real: float, processed: float, tokens_per_s: float, mfu: float) -> dict:
    return {
        "step": n,
        "train/loss": 1.0,
        "tokens/real": real,
        "tokens/processed": processed,
        "perf/training_tokens_per_s": tokens_per_s,
        "perf/training_mfu": mfu,
    }


def test_summarise_drops_the_warmup_and_weighs_each_step_by_its_seconds():
    rows = [
        {"step": 0, "eval/perplexity": 10.0},
        {**step(1, 100, 100, 1.0, 0.01), "perf/peak_flops": 1e9},  # warm-up: 100 s, dropped
        step(2, 100, 125, 100.0, 0.3),  # 1 s
        step(3, 300, 375, 100.0, 0.5),  # 3 s
        {"step": 3, "time/train_s": 104.0},
    ]
    s = summarise(rows, warmup=1, ranks=2, extra_per_token=0.0)
    assert s["steps_timed"] == 2
    assert s["real_tokens_per_s"] == pytest.approx(400 / 4)
    assert s["processed_tokens_per_s"] == pytest.approx(500 / 4)
    assert s["padding_fraction"] == pytest.approx(0.2)
    assert s["mfu"] == pytest.approx((0.3 * 1 + 0.5 * 3) / 4)
    assert s["peak_flops"] == pytest.approx(2e9)  # the probe's per-rank peak x ranks
    assert s["achieved_flops"] == pytest.approx(s["mfu"] * 2e9)
    # FLOPs per token derived back: achieved x seconds / real tokens
    assert s["model_flops_per_token"] == pytest.approx(0.45 * 2e9 * 4 / 400)
    assert s["mfu_with_head_attention"] == pytest.approx(s["mfu"])
    more = summarise(rows, 1, 2, extra_per_token=s["model_flops_per_token"])  # twice the FLOPs per token
    assert more["mfu_with_head_attention"] == pytest.approx(2 * s["mfu"])
    profiled = summarise(rows, 1, 2, drop_last=1)  # the last step was profiled: only step 2 counts
    assert profiled["steps_timed"] == 1 and profiled["mfu"] == pytest.approx(0.3)


def test_summarise_without_timed_steps_is_an_error():
    rows = [{**step(1, 100, 100, 1.0, 0.01), "perf/peak_flops": 1e9}]
    with pytest.raises(BenchError, match="no timed steps"):
        summarise(rows, warmup=1, ranks=1)


def test_extra_flops_a_tied_head_and_causal_attention():
    # SmolLM2-135M's shape at 512 tokens per row: the head 6 V d, attention 3 x 2 x 2 d x T/2 per layer
    head, attention = 6 * 49152 * 576, 12 * 576 * 256 * 30
    assert extra_flops_per_token(576, 49152, 30, 512, tied=True) == head + attention
    assert extra_flops_per_token(576, 49152, 30, 512, tied=False) == attention  # an untied head is in 6N


def test_group_profile_sorts_operators_into_groups_and_skips_the_scopes():
    rows = [
        {"name": "aten::mm", "self_s": 2.0},
        {"name": "aten::_log_softmax_backward_data", "self_s": 0.5},
        {"name": "aten::where", "self_s": 0.25},
        {"name": "aten::_scaled_dot_product_flash_attention_for_cpu", "self_s": 0.1},
        {"name": "aten::_fused_adamw_", "self_s": 0.2},
        {"name": "aten::mul", "self_s": 0.3},
        {"name": "sft:backward", "self_s": 9.0},
        {"name": "ProfilerStep*", "self_s": 9.0},
    ]
    groups = group_profile(rows)
    assert groups["matmul (linear layers, LM head)"] == 2.0
    assert groups["softmax / loss / masking (LM head)"] == 0.75
    assert groups["attention (SDPA)"] == 0.1
    assert groups["optimizer (Adam)"] == 0.2
    assert groups["other (elementwise, norms, copies, ...)"] == 0.3
    assert sum(groups.values()) == pytest.approx(3.35)


def test_cpu_mfu_counts_only_the_cpu_seconds_given():
    # 1e12 model FLOPs in 20 CPU seconds on a 100 GFLOP/s core: 50%, whatever the wall clock said
    assert cpu_mfu(1e12, 20.0, 100e9) == pytest.approx(0.5)
    assert cpu_mfu(1e12, 0.0, 100e9) == 0.0
