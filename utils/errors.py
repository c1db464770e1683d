"""How an entry point ends on an error the program raised itself: ONE `error: ...` line, printed once
(by rank 0), and a non-zero exit; tracebacks are kept for bugs.

Known errors are the project's own: bad data (utils.data.DataError), a model path or directory that
is not what a flag expects (utils.model.ModelLoadError), a bad checkpoint
(utils.checkpoint.CheckpointError), and the `SystemExit("error: ...")` of the flag checks. Under the
`deepspeed` launcher every rank usually meets the same bad input; without this each printed a
20-line `[rankN]: Traceback` whose last line was the only useful one.
"""
from __future__ import annotations

import os
import sys


def known_errors() -> tuple:
    from utils.checkpoint import CheckpointError
    from utils.data import DataError
    from utils.model import ModelLoadError

    return (CheckpointError, DataError, ModelLoadError)


def one_line(text, limit: int | None = None) -> str:
    """`text` (an exception, a message) with its whitespace collapsed to single spaces, cut at `limit`."""
    line = " ".join(str(text).split())
    return line if limit is None else line[:limit]


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def report(message: str) -> None:
    """Print `message` as one error line, on rank 0 only."""
    if _is_rank0():
        text = one_line(message)
        print(text if text.startswith("error:") else f"error: {text}", file=sys.stderr, flush=True)


def run_main(main, argv=None):
    """`main(argv)`, with the project's own errors turned into one readable line and exit status 1."""
    try:
        return main(argv)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # SystemExit("error: ..."): a flag or input check
            report(exc.code)
            raise SystemExit(1) from None
        raise
    except known_errors() as exc:
        report(str(exc))
        raise SystemExit(1) from None
