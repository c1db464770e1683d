"""How an entry point ends on an error the program raised itself: ONE `error: ...` line, printed once
(by rank 0), and a non-zero exit; tracebacks are kept for bugs.

Known errors are the project's own, every one a `ProjectError`: bad data (utils.data.DataError), a
model path or directory that is not what a flag expects (utils.model.ModelLoadError), a bad checkpoint
(utils.checkpoint.CheckpointError), a reward function that does not load or misbehaves
(step3_ppo.reward_funcs.RewardFunctionError); and the `SystemExit("error: ...")` of the flag checks.
Under the `deepspeed` launcher every rank usually meets the same bad input; without this each printed a
20-line `[rankN]: Traceback` whose last line was the only useful one.

This module imports nothing of the project: the errors subclass `ProjectError` where they are defined,
so `run_main` needs no list of them (and no import of the modules that define them).
"""
from __future__ import annotations

import os
import sys


class ProjectError(Exception):
    """An error the program raises itself about its input (data, a model directory, a checkpoint, a
    reward function): its str() is the one line the user reads, so `run_main` prints it without a
    traceback. Subclasses keep their built-in base where they had one (DataError is also a ValueError)."""


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
    except ProjectError as exc:
        report(str(exc))
        raise SystemExit(1) from None
