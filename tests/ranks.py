"""A one-node launcher for tests: `python tests/ranks.py N PORT MODULE ARGS...` starts N ranks of
`python -u -m MODULE --local_rank=R ARGS...` with the environment deepspeed's launcher gives them, lets
them write to this process's stdout and stderr, and ends them all as soon as one fails (exit status:
the failed rank's).

That is what `deepspeed --num_gpus N --module MODULE` does on one node (deepspeed.launcher.launch),
without the two Python + torch + DeepSpeed start-ups of its runner and its launch module (3-7 s per
launch on 2 cores) and its one-second polling. The `deepspeed` command itself stays under test where
users meet it: the multi-node tests, the arithmetic quick demo and the rank-failure case run it (the
quick main and tools demos run their scripts' `deepspeed` through the fork server: tests.launch).
Imports nothing heavy on purpose. `python tests/ranks.py --zygote SOCKET N PORT MODULE ARGS...` has the
tests' fork server (tests/zygote.py) fork the ranks (N = 0: one plain `python -m MODULE`) instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PIDS_FILE_VAR = "RLHF_TESTS_RANK_PIDS"  # where a front of the fork server writes its ranks' pids (tests.launch)


def rank_env(rank: int, num_ranks: int, port: str, base: dict | None = None) -> dict:
    """The variables deepspeed.launcher.launch sets for one rank of a one-node job, over `base` (this
    process's environment when None)."""
    return {
        **(os.environ if base is None else base),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(num_ranks),
        "LOCAL_SIZE": str(num_ranks),
        "CROSS_RANK": "0",
        "CROSS_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "CUDA_VISIBLE_DEVICES": ",".join(str(r) for r in range(num_ranks)),
    }


def stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """SIGTERM every live rank, SIGKILL those still alive after `grace_s` (as the launcher's handler)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str]) -> int:
    if argv[0] == "--zygote":  # the ranks forked by the tests' fork server (tests/zygote.py), this process their front
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from zygote import request

        return request(argv[1], int(argv[2]), argv[3], argv[4], argv[5:])
    num_ranks, port, module, args = int(argv[0]), argv[1], argv[2], argv[3:]
    procs = [
        subprocess.Popen(
            [sys.executable, "-u", "-m", module, f"--local_rank={rank}", *args], env=rank_env(rank, num_ranks, port)
        )
        for rank in range(num_ranks)
    ]

    def on_signal(signum, frame):
        stop(procs)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            stop(procs)
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
