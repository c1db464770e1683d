"""The curves a user of a step-3 run looks at first, in one figure: the training reward (per component when there
are several), the KL to the reference, response lengths, the held-out evaluation's accuracy or score, and tool calls
when the policy made any. Evaluations (`eval/...` keys, logged every K steps) are drawn as points, training
figures as lines over the step. Every other metric stays in TensorBoard / wandb / metrics.jsonl.

    python -m step3_ppo.plot OUTPUT_DIR [--out PNG] [--title TEXT]   # OUTPUT_DIR/metrics.jsonl -> curves.png

A series that does not vary is not drawn: its panel's title states its value, and a panel with nothing varying is
left out. It also prints each evaluation metric's first and last value (before -> after training).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass

from utils.cli import FlagParser
from utils.errors import UsageError, run_main

EVAL_PREFIX = "eval/"
NOT_DRAWN = {"eval/prompts"}  # a count, not a curve
_CI_SUFFIXES = ("_ci", "_ci_low", "_ci_high")  # an interval of the key before the suffix
# reward/<name>_mean keys that are not a reward component: the sum of the components, and the total after the
# baseline and the KL penalty (zero by construction under a group baseline; the KL has its own panel)
_NOT_COMPONENTS = {"reward/score_mean", "reward/total_mean", "reward/length_penalty_mean"}


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    points: bool  # an evaluation: markers only (no line joining two evaluations); else a training line
    xs: tuple
    ys: tuple
    band: tuple = ((), (), ())  # (steps, lows, highs) of an evaluation's logged interval
    color: str = "C0"


@dataclass(frozen=True)
class Panel:
    title: str
    ylabel: str
    series: tuple[Series, ...]  # the series that vary, drawn
    constants: tuple[str, ...] = ()  # "label: value" of the series that do not, shown under the title


# ---------------------------------------------------------------------------------------------------- reading
def read_rows(metrics_jsonl_path: str) -> list[dict]:
    """Rows of a metrics.jsonl (blank or malformed lines skipped), sorted by step."""
    rows = []
    with open(metrics_jsonl_path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
    return sorted(rows, key=lambda r: r["step"])


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) where `key` holds a finite number (missing keys and "nan" strings skipped)."""
    pairs = [(row["step"], row[key]) for row in rows if _number(row.get(key))]
    return [x for x, _ in pairs], [y for _, y in pairs]


def eval_keys(rows: list[dict]) -> list[str]:
    """The `eval/...` keys of any row (sorted), except the intervals drawn with their metric:
    `K_ci` ([low, high]) and `K_ci_low` / `K_ci_high` where K itself is logged."""
    keys = sorted({k for row in rows for k in row if k.startswith(EVAL_PREFIX) and k not in NOT_DRAWN})
    present = set(keys)
    return [k for k in keys if not any(k.endswith(sfx) and k[: -len(sfx)] in present for sfx in _CI_SUFFIXES)]


def interval_series(rows: list[dict], key: str) -> tuple[list, list, list]:
    """(steps, lows, highs) of `key`'s interval: `key_ci` as [low, high], or `key_ci_low` + `key_ci_high`."""
    xs, lows, highs = [], [], []
    for row in rows:
        pair = row.get(f"{key}_ci")
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            pair = (row.get(f"{key}_ci_low"), row.get(f"{key}_ci_high"))
        if all(_number(v) for v in pair):
            xs.append(row["step"])
            lows.append(pair[0])
            highs.append(pair[1])
    return xs, lows, highs


# -------------------------------------------------------------------------------------------------- selection
def _same(a, b) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)


def _panel(rows: list[dict], title: str, ylabel: str, candidates) -> Panel | None:
    """The panel of `candidates` ((key, label, points[, color]) each; the color defaults to the candidate's place,
    so a series keeps its color when another is left out): series with no data left out, one repeating an earlier
    series (the same steps and values: a single component is the score) named in its label ("score = math_exact"),
    constant ones in `constants`; None when no series varies."""
    kept = []  # [label, key, points, color, xs, ys]
    for i, (key, label, points, *color) in enumerate(candidates):
        xs, ys = map(tuple, series(rows, key))
        same = [k for k in kept if xs == k[4] and all(map(_same, ys, k[5]))]
        if same:
            same[0][0] += f" = {label}"
        elif xs:
            kept.append([label, key, points, color[0] if color else f"C{i}", xs, ys])
    drawn, constants = [], []
    for label, key, points, color, xs, ys in kept:
        if all(_same(y, ys[0]) for y in ys):
            constants.append(f"{label}: {ys[0]:.4g} ({f'step {xs[0]}' if len(xs) == 1 else 'constant'})")
        else:
            band = tuple(map(tuple, interval_series(rows, key))) if points else ((), (), ())
            drawn.append(Series(key, label, points, xs, ys, band, color))
    return Panel(title, ylabel, tuple(drawn), tuple(constants)) if drawn else None


def _keys(rows: list[dict], prefix: str, suffix: str = "") -> list[str]:
    return sorted({k for row in rows for k in row if k.startswith(prefix) and k.endswith(suffix)})


def select_panels(rows: list[dict]) -> list[Panel]:
    """Which panels and series to draw from metrics.jsonl's rows, in order: reward, KL, response length, held-out
    accuracy (or score, and judge scores), tool calls (when any was made)."""
    components = [k for k in _keys(rows, "reward/", "_mean") if k not in _NOT_COMPONENTS]
    reward = [("reward/score_mean", "sequence reward", False)]
    reward += [(k, k[len("reward/") : -len("_mean")], False) for k in components]
    reward += [("reward/length_penalty_mean", "length penalty", False)]
    measure = "accuracy" if any("eval/accuracy" in row for row in rows) else "score"
    held_out = [("eval/accuracy", "accuracy", True), ("eval/score_mean", "score", True)]
    held_out += [(k, k[len("eval/reward/") : -len("_mean")], True) for k in _keys(rows, "eval/reward/", "_mean")]
    held_out += [(k, k[len(EVAL_PREFIX) :].replace("_", " "), True) for k in _keys(rows, "eval/judge")]
    held_out = [c for c in held_out if not c[0].endswith(_CI_SUFFIXES)]
    tools = [
        ("rollout/tool_calls_mean", "calls, training", False, "C0"),  # a quantity's color in training and held-out
        ("rollout/tool_errors_mean", "failed calls, training", False, "C3"),
        ("eval/tool_calls_mean", "calls, held-out", True, "C0"),
        ("eval/tool_errors_mean", "failed calls, held-out", True, "C3"),
    ]
    called = any(y > 0 for key, *_ in tools[::2] for y in series(rows, key)[1])
    panels = [
        _panel(rows, "Reward (training samples)", "reward", reward),
        _panel(rows, "KL to the reference", "nats per answer", [("kl/ref_mean", "KL", False)]),
        _panel(
            rows,
            "Response length",
            "tokens",
            [("gen/response_len_mean", "training samples", False), ("eval/response_len_mean", "held-out", True)],
        ),
        _panel(rows, f"Held-out {measure}", measure, held_out),
        _panel(rows, "Tool calls per answer", "calls", tools) if called else None,
    ]
    return [p for p in panels if p is not None]


def describe(rows: list[dict], panels: list[Panel]) -> str:
    """A short description of the run from its rows (no directory): its steps, multi-turn or not, the evaluation."""
    steps = max((r["step"] for r in rows), default=0)
    text = f"Step-3 run, {steps:g} steps"
    if any("rollout/tool_calls_mean" in r for r in rows):
        text += ", multi-turn"
    prompts = series(rows, "eval/prompts")[1]
    if any(s.points for p in panels for s in p.series):
        text += (
            f"; points: greedy evaluation on {prompts[-1]:g} held-out prompts" if prompts else "; points: evaluation"
        )
    return text


# ---------------------------------------------------------------------------------------------------- drawing
def draw(panels: list[Panel], title: str):
    """The figure of `panels` (a matplotlib Figure; constrained layout, legends below their panel)."""
    from matplotlib.figure import Figure  # lazy: +0.5 s on every --help (matplotlib)
    from matplotlib.ticker import MaxNLocator  # lazy: with matplotlib.figure

    n = max(len(panels), 1)
    cols = n if n <= 3 else (2 if n == 4 else 3)
    n_rows = math.ceil(n / cols)
    fig = Figure(figsize=(4.6 * cols, 3.7 * n_rows + 0.5), layout="constrained")
    axes = list(fig.subplots(n_rows, cols, squeeze=False).flat)
    for ax in axes[len(panels) :]:
        fig.delaxes(ax)
    if not panels:
        axes[0].text(0.5, 0.5, "no metric varies: nothing to draw", ha="center", va="center", color="gray")
        axes[0].set_axis_off()
    all_steps = [x for p in panels for s in p.series for x in s.xs]
    for ax, panel in zip(axes, panels):
        for s in panel.series:
            if s.points:
                ax.plot(s.xs, s.ys, linestyle="none", marker="o", markersize=6, color=s.color, label=s.label)
                if s.band[0]:
                    ax.vlines(s.band[0], s.band[1], s.band[2], color=s.color, alpha=0.5, label="_interval")
            else:
                ax.plot(s.xs, s.ys, marker="." if len(s.xs) < 50 else None, color=s.color, label=s.label)
        ax.set_title("\n".join((panel.title, *panel.constants)), fontsize="medium")
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.set_xlim(min(all_steps) - 0.5, max(all_steps) + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))
        ax.margins(y=0.1)  # points at the edge of the range stay whole
        ax.grid(True, alpha=0.3)
        if len(panel.series) > 1:
            ax.legend(
                loc="upper center",
                bbox_to_anchor=(0.5, -0.2),
                ncols=2,
                fontsize="small",
                frameon=False,
                handlelength=1.5,
            )
    fig.suptitle(title)
    return fig


def plot_curves(metrics_jsonl_path: str, out_png: str, title: str | None = None) -> str:
    """Write `out_png`: the panels select_panels picks from `metrics_jsonl_path`, under `title` (default: describe's
    description of the run); returns `out_png`."""
    rows = read_rows(metrics_jsonl_path)
    panels = select_panels(rows)
    fig = draw(panels, title or describe(rows, panels))
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def eval_summary(rows: list[dict]) -> list[str]:
    """One line per `eval/...` metric: its first and last value and their steps (before -> after training)."""
    lines = []
    for key in eval_keys(rows):
        xs, ys = series(rows, key)
        if xs:
            lines.append(f"{key}: {ys[0]:.4f} (step {xs[0]}) -> {ys[-1]:.4f} (step {xs[-1]})")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = FlagParser(description=__doc__.splitlines()[0])
    p.add_argument("output_dir", help="a step-3 output directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: OUTPUT_DIR/curves.png)")
    p.add_argument("--title", default=None, help="the figure's title (default: the run's steps and evaluation)")
    return p


def main(argv=None) -> str:
    args = build_parser().parse_args(argv)
    metrics = os.path.join(args.output_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise UsageError(f"{metrics} does not exist (is {args.output_dir!r} a step-3 output directory?)")
    out = plot_curves(metrics, args.out or os.path.join(args.output_dir, "curves.png"), args.title)
    for line in eval_summary(read_rows(metrics)):
        print(line)
    print(out)
    return out


if __name__ == "__main__":
    run_main(main)
