"""utils.runtime.distributed.tune_malloc: freed ZeRO-3-sized buffers are reused, not unmapped and faulted in again."""

import subprocess
import sys

import pytest

from tests.launch import ROOT, subprocess_env
from utils.runtime.distributed import MALLOC_TUNING

# torch allocates with posix_memalign: with tuning the heap first grows to a plateau (a bounded
# number of such buffers), after which every allocation reuses resident memory.
PROBE = r"""
import resource, sys, torch
from utils.runtime.distributed import tune_malloc
applied = tune_malloc() if sys.argv[1] == "1" else False
def churn(n):
    for _ in range(n):
        x = torch.empty(64 << 20, dtype=torch.uint8)  # a 64 MB gathered buffer
        x.fill_(1)
        del x
churn(30)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
churn(10)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(tuned: bool, **env) -> tuple[str, int]:
    full_env = subprocess_env()
    for name in ("RLHF_MALLOC_TUNING", *MALLOC_TUNING):
        full_env.pop(name, None)
    full_env.update(env)
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if tuned else "0"],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_tuned_malloc_reuses_large_buffers():
    applied, tuned_faults = _probe(True)
    _, default_faults = _probe(False)
    assert applied == "True"
    # default glibc: each 64 MB block is a fresh mmap, 16k page faults a block
    assert default_faults > 10 * 10_000
    assert tuned_faults < default_faults / 10


@pytest.mark.slow
def test_user_choice_wins():
    assert _probe(True, RLHF_MALLOC_TUNING="0")[0] == "False"
    assert _probe(True, MALLOC_TOP_PAD_="0")[0] == "False"
