"""What the resume check's data hash costs: sha256 of every file the demo's sources are read from.

    .venv/bin/python -m bench.data_hash [--data DIR]

A resumed run hashes its data files (`utils.data.sources.content_hashes`) and compares them with its
checkpoint's, since an edit in place can keep a file's size and row count. This prints the files,
their size and the time of one pass (best of 5), on the demo data (made into DIR first if missing).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import machine_line  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=os.path.join(REPO, "data", "demo"), help="demo data directory")
    args = parser.parse_args(argv)
    from utils.data.sources import content_hashes  # after --help: it imports torch

    if not os.path.isdir(args.data):
        subprocess.run(
            [sys.executable, "-m", "data.make_demo_data", "--out", args.data],
            cwd=REPO,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    sources = [
        os.path.join(args.data, name)
        for name in sorted(os.listdir(args.data))
        if os.path.isdir(os.path.join(args.data, name))
    ]
    print(machine_line())
    times = []
    for _ in range(5):
        start = time.perf_counter()
        hashes = content_hashes(sources)
        times.append(time.perf_counter() - start)
    size = sum(os.path.getsize(p) for p in hashes)
    print(
        f"sha256 of {len(hashes)} files, {size / 1e6:.1f} MB: best {min(times) * 1e3:.1f} ms, "
        f"worst {max(times) * 1e3:.1f} ms of 5 passes"
    )


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
