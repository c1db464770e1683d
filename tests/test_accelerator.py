"""What depends on the accelerator, checked on CPU: the device and backend DeepSpeed names, TF32 only on
CUDA (CPU float32 rounding untouched), frozen-model offload whatever the trained model's ZeRO stage, and
the CUDA-only flags refused with one readable line where they cannot work."""

import subprocess
import sys

import pytest
import torch

from tests.launch import ROOT, subprocess_env
from utils.errors import UsageError
from utils.runtime import accelerator
from utils.runtime.distributed import MALLOC_TUNING
from utils.train.ds_config import eval_ds_config


def test_cpu_accelerator_names_cpu_device_and_gloo():
    assert accelerator.name() == "cpu"
    assert accelerator.local_device() == torch.device("cpu")
    assert accelerator.communication_backend() == "gloo"
    assert accelerator.rng_state() is None
    accelerator.synchronize()
    accelerator.empty_cache()  # on CPU: glibc's free pages back to the system (test below)


# Under tune_malloc the heap keeps every freed block resident; empty_cache on CPU hands the free pages back.
TRIM_PROBE = r"""
import sys, torch
from utils.runtime import accelerator
from utils.runtime.distributed import tune_malloc
def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20
assert tune_malloc()
keep = torch.ones(1 << 20)  # allocated after the buffers below: they are freed below a live block, not at the top
blocks = [torch.ones(16 << 20) for _ in range(8)]  # 8 x 64 MB, touched
keep2 = torch.ones(1 << 20)
del blocks
held = rss_mb()
released = accelerator.trim_heap()
print(released, held - rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_empty_cache_on_cpu_gives_the_heaps_free_pages_back():
    env = subprocess_env()
    for name in ("RLHF_MALLOC_TUNING", *MALLOC_TUNING):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", TRIM_PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout.split()
    assert out[0] == "True"
    assert float(out[1]) > 400  # of the 512 MB freed (tune_malloc alone keeps them all resident)


def test_tf32_is_never_touched_on_cpu():
    before = torch.backends.cuda.matmul.fp32_precision
    accelerator.configure_tf32(True)
    assert torch.backends.cuda.matmul.fp32_precision == before


def test_tf32_on_cuda_on_by_default_and_off_for_the_exact_check(monkeypatch):
    monkeypatch.setattr(accelerator, "name", lambda: "cuda")
    before = torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision
    try:
        accelerator.configure_tf32(True)
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        accelerator.configure_tf32(False)
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision = before


@pytest.mark.parametrize("trained_stage", [0, 1, 2, 3])
def test_an_offloaded_frozen_model_is_offloaded_whatever_the_trained_stage(trained_stage):
    config = eval_ds_config(trained_stage, world_size=1, offload=True)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    plain = eval_ds_config(trained_stage, world_size=1, offload=False)
    assert plain["zero_optimization"]["stage"] == (3 if trained_stage == 3 else 0)
    assert plain["zero_optimization"]["offload_param"]["device"] == "none"


def step1_args(out, *extra):
    return ["--model_name_or_path", "m", "--data_path", "d", "--output_dir", str(out), *extra]


def test_flash_attention_without_the_package_is_refused_before_loading(monkeypatch, tmp_path):
    import importlib.util

    from step1_sft.main import parse_args

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a)
    )
    with pytest.raises(UsageError, match="flash_attn package"):
        parse_args(step1_args(tmp_path, "--attn_implementation", "flash_attention_2", "--dtype", "bf16"))


def test_attention_and_tf32_flags_parse(tmp_path):
    from step1_sft.main import parse_args

    args = parse_args(step1_args(tmp_path, "--attn_implementation", "sdpa", "--no_tf32"))
    assert args.attn_implementation == "sdpa" and args.no_tf32
    assert parse_args(step1_args(tmp_path)).attn_implementation is None
