"""`python -m bench`: list the benchmarks, run one (and save its result), regenerate the results' index.
The command lines are in bench/runner/cli.py, the benchmarks in bench/runner/registry.py."""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.runner.cli import main  # noqa: E402
from utils.errors import run_main  # noqa: E402

if __name__ == "__main__":
    run_main(main)
