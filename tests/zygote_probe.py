"""A module for tests/test_zygote.py to run as `python -m tests.zygote_probe ACTION...` or as a script (directly or
forked by the tests' fork server): prints what a process was given, exits with a code, or sleeps."""

import os
import sys
import time

if __name__ == "__main__":
    action, rank = sys.argv[-1], os.environ.get("RANK", "-")
    if action == "show":
        print(
            f"argv={sys.argv[1:]} rank={rank} world={os.environ.get('WORLD_SIZE', '-')} "
            f"probe={os.environ.get('PROBE', '-')} cwd={os.getcwd()} stdin={sys.stdin.read().strip()}"
        )
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if action == "fail_rank_1":
        if rank == "1":
            raise ValueError("rank 1 fails")
        time.sleep(60)
    if action == "sleep":
        with open(os.environ["PROBE"] + f".{rank}", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
