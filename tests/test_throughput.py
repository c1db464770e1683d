"""Token counts, rates and MFU (utils/math/throughput.py), the peak FLOP/s they are measured against
(utils/runtime/accelerator.py), and the `tokens/*` and `perf/*` keys a training step logs (utils/train/run.py,
utils/train/loop.py): hand-computed arithmetic, a fast probe, a stub loop and one real in-process step-1 run."""

import time

import pytest
import torch

from tests.test_step1_run import common_args, sft_data  # noqa: F401 (fixture)
from tests.test_training_loop import Sampler, StubEngine, make_run
from utils.math import throughput as t
from utils.runtime import accelerator
from utils.train.loop import train_micro_batches
from utils.train.metrics_logger import read_metrics
from utils.train.run import throughput_metrics

TOKEN_KEYS = {"tokens/real", "tokens/processed", "tokens/padding_fraction"}
TRAINING_KEYS = TOKEN_KEYS | {"perf/training_tokens_per_s", "perf/training_mfu"}


def test_token_and_rate_arithmetic_by_hand():
    assert t.token_metrics(30, 40) == {"tokens/real": 30, "tokens/processed": 40, "tokens/padding_fraction": 0.25}
    assert t.token_metrics(0, 0) == {}
    # 1000 tokens x 6 x 1e6 params = 6e12 FLOPs in 2 s against 1e13 FLOP/s: 0.3 of the peak
    assert t.mfu(6e12, 2.0, 1e13) == pytest.approx(0.3)
    assert t.mfu(1.0, 0.0, 1e13) == 0.0 and t.mfu(1.0, 1.0, 0.0) == 0.0
    assert t.phase_rate_metrics("training", 1000, 6e12, 2.0, 1e13) == {
        "perf/training_tokens_per_s": 500.0,
        "perf/training_mfu": pytest.approx(0.3),
    }
    assert t.phase_rate_metrics("training", 1000, 6e12, 0.0, 1e13) == {}
    assert t.packed_tokens([3, 5, 2]) == (10, 15)  # padded to 5: 15 positions
    assert t.packed_tokens([]) == (0, 0)
    assert t.mask_tokens(torch.tensor([[0, 1, 1], [1, 1, 1]])) == (5, 6)


def test_non_embedding_params_leave_the_embeddings_out():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    assert t.non_embedding_params(model) == 4 * 3 + 3
    assert t.non_embedding_params(None) == 0


def test_phase_tokens_accumulate_and_clear():
    tokens = t.PhaseTokens()
    tokens.add("training", 10, 6.0, 0.5)
    tokens.add("training", 20, 6.0, 0.25)
    tokens.add_trained(30, 40)
    assert tokens.take() == ({"training": [30.0, 180.0, 0.75]}, (30, 40))
    assert tokens.take() == ({}, (0, 0))


def test_throughput_metrics_of_one_rank(monkeypatch):
    monkeypatch.setattr("utils.train.run.peak_flops", lambda: 1e3)
    tokens = t.PhaseTokens()
    tokens.add("training", 30, 6.0, 0.5)
    tokens.add_trained(30, 40)
    out = throughput_metrics(tokens)
    assert out == {
        "tokens/real": 30,
        "tokens/processed": 40,
        "tokens/padding_fraction": 0.25,
        "perf/training_tokens_per_s": 60.0,
        "perf/training_mfu": pytest.approx(180 / (0.5 * 1e3)),
    }
    assert throughput_metrics(tokens) == {}  # read and cleared: nothing counted since


def test_the_probe_returns_a_positive_figure_fast():
    start = time.time()
    flops = accelerator.probe_flops()
    assert flops > 0 and time.time() - start < 5
    assert accelerator.peak_flops() > 0  # CPU: the probe, once


def test_the_cuda_table_by_device_name():
    assert accelerator.table_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert accelerator.table_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert accelerator.table_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert accelerator.table_peak_flops("NVIDIA A10G") == 70e12
    assert accelerator.table_peak_flops("NVIDIA A10") == 125e12
    assert accelerator.table_peak_flops("NVIDIA L4") == 121e12
    assert accelerator.table_peak_flops("NVIDIA GeForce RTX 4090") == 165e12
    assert accelerator.table_peak_flops("Some Future GPU") is None


def test_the_loop_logs_tokens_and_rates_of_masked_batches(tmp_path):
    engine = StubEngine(gas=2)
    engine.module = torch.nn.Linear(4, 4)  # 20 parameters: 120 FLOPs per token
    engine.get_lr = lambda: [0.1]
    run = make_run(tmp_path, total_steps=2)
    masks = [torch.tensor([[1, 1, 0], [1, 1, 1]]), torch.tensor([[1, 0, 0], [1, 1, 1]])]
    loader = [{"attention_mask": m} for m in masks * 2]
    train_micro_batches(
        run,
        engine,
        loader,
        Sampler(),
        lambda batch: (torch.tensor(1.0), ()),
        lambda m: ({"train/loss": m[0]}, {}, None),
    )
    run.logger.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert TRAINING_KEYS <= set(row)
        assert row["tokens/real"] == 9 and row["tokens/processed"] == 12 and row["tokens/padding_fraction"] == 0.25
        assert row["perf/training_tokens_per_s"] > 0 and row["perf/training_mfu"] > 0
    assert rows[0]["perf/peak_flops"] > 0 and "perf/peak_flops" not in rows[1]  # logged once


def test_a_real_step1_run_logs_tokens_and_rates(tiny_gpt2, sft_data, tmp_path):  # noqa: F811
    from step1_sft.main import main

    out = str(tmp_path / "out")
    main([str(a) for a in common_args(tiny_gpt2, sft_data, out, steps=2) + ["--zero_stage", 0]])
    train = [r for r in read_metrics(out) if "train/loss" in r]
    assert len(train) == 2
    for row in train:
        assert TRAINING_KEYS <= set(row), sorted(row)
        assert 0 < row["tokens/real"] <= row["tokens/processed"] and 0 <= row["tokens/padding_fraction"] < 1
        assert row["perf/training_tokens_per_s"] > 0 and 0 < row["perf/training_mfu"]
    assert train[0]["perf/peak_flops"] > 0
    print(train[-1])


def test_the_probe_leaves_the_global_random_state_alone():
    """A resumed run probes after restoring its RNG state: a draw from the global generator there would change its
    dropout and sampling, and the resumed run would no longer match the uninterrupted one."""
    torch.manual_seed(7)
    before = torch.get_rng_state()
    accelerator.probe_flops(size=64, repeats=1)
    assert torch.equal(torch.get_rng_state(), before)
