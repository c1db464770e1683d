"""What every entry point's parser is made of, below every other layer: `FlagParser`, whose refusal of a flag is
one line, and `Number`, the type of every numeric flag: finite, inside the range where the flag means something.

`add_argument("--cliprange", type=Number(float, above=0), ...)`: argparse converts the text with it, so the check runs
for the command line and for a `--config` file alike (utils.train.config_file), before any entry point looks at the
value, and a bad value stops the run with one line (`error: --cliprange must be > 0, got nan`). A
float flag must also be finite in fp32 (|x| <= 3.4e38): its value ends up in fp32 tensors, where 1e39 is inf. The
range is declared where the flag is, so a flag has one home; tests/test_flag_ranges.py walks every numeric flag of
every entry point with NaN, inf, 0, negative and out-of-range values, and fails on a numeric flag without a Number.
"""

from __future__ import annotations

import argparse
import math
import re

from utils.errors import UsageError

FP32_MAX = 3.4028234663852886e38


class Number:
    """An argparse `type`: `kind` (int or float) with bounds; `low`/`high` inclusive, `above`/`below` exclusive;
    `also`: values allowed outside the bounds (-1 meaning "no limit")."""

    def __init__(
        self,
        kind: type = float,
        *,
        low: float | None = None,
        high: float | None = None,
        above: float | None = None,
        below: float | None = None,
        also: tuple = (),
    ):
        if kind not in (int, float):
            raise TypeError(f"Number takes int or float, got {kind}")
        self.kind, self.low, self.high, self.above, self.below, self.also = kind, low, high, above, below, also
        self.__name__ = kind.__name__  # argparse names the type in "invalid int value"

    def describe(self) -> str:
        """The allowed values in words: `> 0`, `in [0, 1)`, `>= 0, or -1` (an int flag refuses 1.5 as argparse does)."""
        shown = self._shown
        lower = (
            f"[{shown(self.low)}"
            if self.low is not None
            else f"({shown(self.above)}"
            if self.above is not None
            else None
        )
        upper = (
            f"{shown(self.high)}]"
            if self.high is not None
            else f"{shown(self.below)})"
            if self.below is not None
            else None
        )
        if lower and upper:
            text = f"in {lower}, {upper}"
        elif lower:
            text = f"{'>=' if self.low is not None else '>'} {lower[1:]}"
        elif upper:
            text = f"{'<=' if self.high is not None else '<'} {upper[:-1]}"
        else:
            text = "finite"
        also = "".join(f", or {shown(value)}" for value in self.also)
        return f"{text}{also}"

    def _shown(self, value: float) -> str:
        return str(int(value)) if self.kind is int else f"{value:g}"

    def problem(self, value: float) -> str | None:
        """Why `value` is refused (None: it is fine)."""
        if value in self.also:
            return None
        if self.kind is float and not (math.isfinite(value) and abs(value) <= FP32_MAX):
            return "not finite" if not math.isfinite(value) else "beyond fp32's range (|x| <= 3.4e38)"
        if (
            (self.low is not None and value < self.low)
            or (self.above is not None and value <= self.above)
            or (self.high is not None and value > self.high)
            or (self.below is not None and value >= self.below)
        ):
            return "out of range"
        return None

    def __call__(self, text: str):
        value = self.kind(text)  # ValueError: argparse's own "invalid float value: 'abc'"
        if self.problem(value) is not None:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {text}")
        return value

    def __repr__(self) -> str:
        return f"Number({self.describe()})"


class FlagParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose refusal of a flag (unknown, missing, a value its type or range refuses) is a
    UsageError: one `error:` line through the entry point's run_main, once per job under the launcher, not
    argparse's usage block of every flag (a hundred lines for step 3) above the reason on every rank."""

    # a flag that was renamed: its old name's refusal names the new one
    RENAMED = {"--async_rollout": "--max_staleness K (optimizer steps; one iteration's steps = the old one-step-off)"}

    def error(self, message: str):
        for old, new in self.RENAMED.items():
            if re.search(rf"{old}\b", message):
                raise UsageError(f"{old} was renamed: use {new}")
        flag, sep, reason = message.removeprefix("argument ").partition(": ")
        if sep and reason.startswith("must be "):  # a Number's refusal says it all: `--cliprange must be > 0, got 0`
            raise UsageError(f"{flag} {reason}")
        raise UsageError(f"{message.removeprefix('argument ')} (--help lists the flags)")
