"""Process-group set-up that works with the `deepspeed` launcher, torchrun, or no launcher at all.

It also keeps what a rank is doing (`phase`: start-up, restore, training, evaluation, checkpoint, export; step 3's
generation / experience / training), written to the process group's store in a job of several ranks beside each
rank's host and pid. When a collective fails because a peer is gone (gloo's "Connection closed by peer") or
hangs (gloo's "Timed out waiting"), `lost_peer_line` turns the error into one line that names the rank whose
process ended (same host: its pid no longer runs) or that did not answer, the phase each was in, and where a
--resume continues from; utils.errors.run_main prints it instead of the traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import datetime
import os
import random
import re
import socket

import numpy as np
import torch

from utils import errors
from utils.runtime import accelerator, extensions
from utils.runtime.accelerator import local_device
from utils.runtime.ports import free_port


def init_distributed(timeout_s: int = 600) -> None:
    """Initialise torch.distributed through DeepSpeed, on the backend the accelerator names (gloo on
    CPU, nccl on CUDA), with this rank bound to its own device first (utils/runtime/accelerator.py).

    Without a launcher the rank variables are missing and DeepSpeed falls back to MPI discovery,
    which fails without mpi4py (shared/notes); a lone process therefore becomes rank 0 of 1.
    `timeout_s` bounds how long a rank waits on a dead peer before raising.
    """
    import deepspeed  # lazy: +0.5 s on every --help (deepspeed)

    if "RANK" not in os.environ:
        os.environ.update(
            {
                "RANK": "0",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()),
            }
        )
    tune_malloc()
    accelerator.set_local_device()
    extensions.load_comm_op()  # per-checkout build, our own lock, no silent wait on a stale one
    deepspeed.init_distributed(
        dist_backend=accelerator.communication_backend(),
        timeout=datetime.timedelta(seconds=timeout_s),
        auto_mpi_discovery=False,
    )
    _share_failures(timeout_s)
    _unlink_shm_buffer()


_output_dir: str | None = None  # the run's --output_dir (start_process), where its checkpoints are
_PHASE_KEY, _PROCESS_KEY = "rlhf/phase/{}", "rlhf/process/{}"  # store keys: each rank's phase, its "host pid"
_phase = "start-up"  # what this rank is doing (`phase`)
_store = None  # the process group's store in a job of several ranks (phases, processes)
_timeout_s: int | None = None  # --dist_timeout
# a collective that failed because a peer is gone or does not answer (gloo; NCCL's, where it raises)
_LOST_PEER = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Timed out waiting|Socket Timeout|timeout", re.I)
_TIMED_OUT = re.compile(r"Timed out|timeout", re.I)


def start_process(args) -> None:
    """What every step does first: process group (--dist_timeout), seeds (--seed), TF32 (--no_tf32)."""
    global _output_dir
    _output_dir = getattr(args, "output_dir", None)
    init_distributed(args.dist_timeout)
    set_seed(args.seed)
    accelerator.configure_tf32(not args.no_tf32)


# glibc mallopt parameters (malloc.h) and the values `tune_malloc` sets (mallopt takes C ints).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
MALLOC_TUNING = {
    "MALLOC_MMAP_MAX_": (_M_MMAP_MAX, 0),
    "MALLOC_TRIM_THRESHOLD_": (_M_TRIM_THRESHOLD, 2**31 - 1),
    "MALLOC_TOP_PAD_": (_M_TOP_PAD, 1 << 30),
}


def malloc_tuning_wanted(env=os.environ) -> bool:
    """False when the user chose: RLHF_MALLOC_TUNING=0, or any of the MALLOC_* variables set."""
    return env.get("RLHF_MALLOC_TUNING", "1") != "0" and not any(name in env for name in MALLOC_TUNING)


def malloc_tuning_env() -> dict:
    """The same settings as MALLOC_* environment variables (for processes that are not ours)."""
    return {name: str(value) for name, (_, value) in MALLOC_TUNING.items()}


def tune_malloc() -> bool:
    """Keep freed memory in the heap for reuse instead of unmapping it (glibc only).

    ZeRO-3 gathers and frees parameter and gradient buffers of tens of MB on every forward and
    backward. glibc serves blocks over 32 MB with a fresh mmap and unmaps them on free, so every
    gather page-faults and zero-fills its memory again (shared/notes/peer-trl.md). Serving all
    blocks from the heap and never trimming it removes those faults once the heap has grown to
    the working set (a bounded plateau, not a leak). Skipped when the user set any of these
    MALLOC_* variables or RLHF_MALLOC_TUNING=0. Returns whether it was applied.
    """
    if not malloc_tuning_wanted():
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    return all(mallopt(param, value) == 1 for param, value in MALLOC_TUNING.values())


def _share_failures(timeout_s: int) -> None:
    """Hand the process group's store to utils.errors: the first rank of a job to fail claims the one
    report there, so N ranks meeting the same bad input print one line, not N. Each rank's host, pid and
    phase go there too, for `lost_peer_line`."""
    global _store, _timeout_s
    if torch.distributed.get_world_size() > 1:
        _store, _timeout_s = torch.distributed.distributed_c10d._get_default_store(), timeout_s
        _store.set(_PROCESS_KEY.format(rank()), f"{socket.gethostname()} {os.getpid()}")
        _store.set(_PHASE_KEY.format(rank()), _phase)
        errors.use_store(_store, lost_peer_line)


def current_phase() -> str:
    return _phase


def set_phase(name: str) -> None:
    """This rank is now in phase `name` (kept on the store in a job of several: one set per change)."""
    global _phase
    if name == _phase:
        return
    _phase = name
    if _store is not None:
        with contextlib.suppress(Exception):  # a store that is gone: the next collective says so
            _store.set(_PHASE_KEY.format(rank()), name)


@contextlib.contextmanager
def phase(name: str):
    """Phase `name` inside the block, the previous one after it; not after an error, so that a rank whose
    collective failed names the phase it failed in."""
    previous = _phase
    set_phase(name)
    yield
    set_phase(previous)


def lost_peer_line(exc: BaseException) -> str | None:
    """One line for a collective that failed because a peer rank is gone or did not answer (gloo's "Connection
    closed by peer", "Timed out waiting"): which rank (its process ended: same host, its pid no longer runs; or
    it did not answer within --dist_timeout), the phase each was in, this rank's phase, where a --resume
    continues from. None for any other error, or when the store does not answer (its host, rank 0, is gone)."""
    text = errors.one_line(exc)
    if not _LOST_PEER.search(text) or not re.search(r"gloo|nccl|c10d", text, re.I) or _store is None:
        return None
    try:
        peers = _peers()
    except Exception:
        return None
    mine = f"this rank was in {_phase}"
    gone = [r for r, (ended, _) in peers.items() if ended]
    if gone:
        what = ", ".join(f"rank {r} (in {peers[r][1]})" for r in gone)
        verb = "is" if len(gone) == 1 else "are"
        line = f"{what} {verb} gone: its process ended (killed? the OOM killer? see the system log); {mine}"
    elif _TIMED_OUT.search(text):
        others = [r for r, (_, p) in peers.items() if p != _phase] or list(peers)
        what = ", ".join(f"rank {r} (in {peers[r][1]})" for r in others)
        line = f"no answer within --dist_timeout {_timeout_s} s from {what}: hung or too slow; {mine}"
    else:
        what = ", ".join(f"rank {r} in {p}" for r, (_, p) in peers.items())
        line = f"lost the connection to a peer rank ({what}; on another host, not checked); {mine}"
    where = errors.resume_point()
    resume = f"--resume continues from {where}" if where else "no checkpoint to --resume from"
    return f"{line}; {resume}"


def _peers() -> dict[int, tuple[bool | None, str]]:
    """Every other rank: (whether its process ended: None when on another host, its last phase), from the store."""
    _store.set_timeout(datetime.timedelta(seconds=5))
    host, out = socket.gethostname(), {}
    for r in range(world_size()):
        if r == rank():
            continue
        peer_host, pid = _store.get(_PROCESS_KEY.format(r)).decode().split()
        ended = _process_ended(int(pid)) if peer_host == host else None
        out[r] = (ended, _store.get(_PHASE_KEY.format(r)).decode())
    return out


def _process_ended(pid: int) -> bool:
    """Whether process `pid` of this host no longer runs (gone, or a zombie its launcher has not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: whether a signal can reach it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False


def _unlink_shm_buffer() -> None:
    """Remove the name of DeepSpeed's shared-memory all-reduce buffer once every rank has mapped it.

    On CPU, DeepSpeed's shm comm op creates a 69 MB `/dev/shm/deepspeed_allreduce_buffer_*` file per
    rank and never removes it: each run leaked 140 MB of RAM (tmpfs) per 2 ranks, even on a clean
    exit, until the machine ran out of memory. The mappings stay valid after the name is unlinked.
    """
    name = (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
        f"{os.environ.get('MASTER_PORT', '')}_{torch.distributed.get_rank()}"
    )
    if not os.path.exists(name):
        return
    torch.distributed.barrier()  # every rank has opened every other rank's buffer
    os.remove(name)


def run_output_dir() -> str | None:
    """The --output_dir of the run this process started (`start_process`), None before."""
    return _output_dir


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def is_rank0() -> bool:
    return rank() == 0


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def from_rank0(value):
    """Rank 0's `value` (any picklable object) on every rank; collective (a plain return without peers)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _reduced(values: list[float], op) -> list[float]:
    """`values` reduced over all ranks, float64 (token counts stay exact), on the rank's own device
    (NCCL reduces only accelerator tensors; gloo takes CPU ones)."""
    if not torch.distributed.is_initialized():
        return [float(v) for v in values]
    tensor = torch.tensor(values, dtype=torch.float64, device=local_device())
    torch.distributed.all_reduce(tensor, op=op)
    return tensor.tolist()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few floats over all ranks."""
    return _reduced(values, torch.distributed.ReduceOp.SUM)


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rank_batches(examples: list, batch_size: int, max_batches: int = 0) -> list[tuple[list, float]]:
    """This rank's share of `examples` in batches, the SAME number of batches on every rank (at most
    `max_batches` when > 0: an evaluation on part of a held-out split).

    ZeRO-3 forwards are collective, so a rank with fewer examples still runs a forward: it gets
    a copy of a real batch with weight 0. Unlike DistributedSampler's padding, no example is
    counted twice, so evaluation figures are exact.
    """
    n_ranks, r = world_size(), rank()
    shard = examples[r::n_ranks]
    per_rank = -(-len(examples) // n_ranks)
    n_batches = -(-per_rank // batch_size)
    batches = [(shard[i * batch_size : (i + 1) * batch_size], 1.0) for i in range(n_batches)]
    filler = examples[:batch_size]
    if max_batches > 0:
        batches = batches[:max_batches]
    return [(b, w) if b else (filler, 0.0) for b, w in batches]


def all_reduce_max(value: float) -> float:
    """The largest of one float over all ranks."""
    return _reduced([value], torch.distributed.ReduceOp.MAX)[0]


def all_reduce_max_list(values: list[float]) -> list[float]:
    """Each float's largest value over all ranks, in one collective."""
    return _reduced(values, torch.distributed.ReduceOp.MAX) if values else []
