"""The ONE home of what depends on the accelerator: the device a rank computes on, the communication
backend, synchronisation, memory statistics, cache freeing, RNG state, TF32 and the peak FLOP/s MFU is
measured against.

Everything goes through DeepSpeed's accelerator abstraction (`deepspeed.accelerator.get_accelerator()`),
so CPU, CUDA and the other accelerators DeepSpeed knows take the same code: NCCL on CUDA, gloo on CPU,
as the accelerator names it. The one CPU-specific part is the peak memory: DeepSpeed's CPU
accelerator samples RSS only when asked (a "max" that misses every peak between two calls), so on
CPU the kernel's own high-water mark of the process (VmHWM, reset through /proc/self/clear_refs) is
read instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import re
import resource
import time

import torch


@functools.lru_cache(maxsize=1)
def get():
    """DeepSpeed's accelerator of this process (CUDA when a GPU is visible, else CPU, or DS_ACCELERATOR)."""
    from deepspeed.accelerator import get_accelerator  # lazy: +0.5 s on every --help (deepspeed)

    return get_accelerator()


def name() -> str:
    """'cpu', 'cuda', ... (the accelerator's device type)."""
    return get().device_name()


def is_cpu() -> bool:
    return name() == "cpu"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_device() -> torch.device:
    """The device this rank computes on: cuda:LOCAL_RANK on a GPU node, cpu on CPU."""
    return torch.device("cpu") if is_cpu() else torch.device(get().device_name(local_rank()))


def set_local_device() -> None:
    """Bind this rank to its own device BEFORE any model is built (ZeRO-3 partitions onto the
    current device at construction: without this every rank of a node would build on device 0)."""
    if not is_cpu():
        get().set_device(local_rank())


def communication_backend() -> str:
    """The torch.distributed backend for this accelerator ('nccl' on CUDA, 'gloo' on CPU)."""
    return get().communication_backend_name()


def synchronize() -> None:
    """Wait for the device's queued work (timers around asynchronous kernels need it)."""
    if not is_cpu():
        get().synchronize()


def empty_cache() -> None:
    """Give the allocator's cached, unused blocks back: to the device (its caching allocator), or on CPU glibc's
    free pages to the system (`trim_heap`)."""
    if not is_cpu():
        get().empty_cache()
        return
    trim_heap()


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim, or None (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """glibc's malloc_trim(0): every whole free page of the heap handed back to the system (the free blocks stay
    the allocator's, and their next use faults the pages in again). utils.runtime.distributed.tune_malloc's heap
    never trims by itself, so a phase's freed blocks (gathered weights, KV caches, activations) otherwise stay
    resident up to the largest heap the run ever had. Returns whether memory was released (False off glibc)."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


def configure_tf32(enabled: bool) -> None:
    """TF32 matmuls and convolutions on CUDA (about 8x fp32's matmul rate on Ampere and later, 10
    mantissa bits). Never touched on CPU, whose float32 rounding stays exactly as it was; switched
    off (`--no_tf32`) for the lr=0 log-ratio check, which needs full fp32."""
    if name() != "cuda":
        return
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the legacy allow_tf32 flags must not be mixed in
        matmul.fp32_precision = torch.backends.cudnn.fp32_precision = "tf32" if enabled else "ieee"
    else:
        matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = enabled


def rng_state():
    """The accelerator's RNG state (None on CPU, where torch's own state covers it)."""
    return None if is_cpu() else get().get_rng_state()


def set_rng_state(state) -> None:
    if state is not None and not is_cpu():
        get().set_rng_state(state)


# --------------------------------------------------------------------------- #
# Peak memory
# --------------------------------------------------------------------------- #
def _vm_hwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            match = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def reset_peak_memory() -> None:
    """Start a new peak: the accelerator's peak statistics, or on CPU the process's RSS high-water mark."""
    if not is_cpu():
        get().reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS
    except OSError:
        pass


def peak_memory_bytes() -> int:
    """Peak memory since the last reset: allocated accelerator memory, or on CPU the peak RSS."""
    if not is_cpu():
        return int(get().max_memory_allocated())
    hwm = _vm_hwm_bytes()
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: the lifetime peak (kB on Linux)


def memory_kind() -> str:
    """What peak_memory_bytes measures, for reports."""
    return "peak RSS (VmHWM)" if is_cpu() else f"peak {name()} memory allocated"


class PhaseMemory:
    """Peak memory per phase of a loop (generation, experience, training, ...), in GB.

    `with memory.phase("generation"): ...` resets the peak on entry and records it on exit; a phase
    entered several times in one iteration keeps its largest peak until `metrics()` reads and clears it.
    """

    def __init__(self):
        self.peaks: dict[str, int] = {}

    @contextlib.contextmanager
    def phase(self, phase_name: str):
        reset_peak_memory()
        try:
            yield
        finally:
            self.peaks[phase_name] = max(self.peaks.get(phase_name, 0), peak_memory_bytes())

    def metrics(self) -> dict:
        """{"mem/<phase>_peak_gb": ...} of the phases seen since the last call; clears them."""
        out = {f"mem/{phase}_peak_gb": value / 2**30 for phase, value in self.peaks.items()}
        self.peaks = {}
        return out


# --------------------------------------------------------------------------- #
# Peak FLOP/s (the denominator of perf/<phase>_mfu)
# --------------------------------------------------------------------------- #
# bf16 dense tensor-core peaks (no sparsity), FLOP/s; the first name found in the device's name wins
_BF16_PEAKS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("A10G", 70e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def table_peak_flops(device_name: str) -> float | None:
    """The bf16 dense peak of a CUDA device by its name (`torch.cuda.get_device_name`), None if not listed."""
    for key, peak in _BF16_PEAKS:
        if key.lower() in device_name.lower():
            return peak
    return None


def probe_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 3) -> float:
    """The best of `repeats` timed `size`^3 matmuls on this rank's device and threads, in FLOP/s (about 0.2 s
    on a CPU core in fp32): what this rank can reach, standing in for a datasheet peak. Its matrices come from a
    generator of their own: drawing from the global one would move the run's dropout and sampling, so a resumed run
    (whose probe runs after its restored RNG state) would no longer match an uninterrupted one."""
    device = local_device()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    torch.matmul(a, b)  # warm-up (threads, kernels)
    synchronize()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / max(best, 1e-9)


@functools.lru_cache(maxsize=1)
def peak_flops() -> float:
    """This rank's device's peak FLOP/s, measured once: on CUDA the bf16 dense peak of its name's table entry
    (`_BF16_PEAKS`), else a bf16 matmul probe; on CPU an fp32 matmul probe on the threads this rank uses."""
    if is_cpu():
        return probe_flops(torch.float32)
    if name() == "cuda":
        listed = table_peak_flops(torch.cuda.get_device_name(local_rank()))
        if listed is not None:
            return listed
    return probe_flops(torch.bfloat16)
