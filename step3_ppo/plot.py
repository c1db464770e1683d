"""Training curves of a step-3 run: reward, KL to the SFT reference and response length per PPO step,
plus one panel per periodic evaluation metric (`eval/...` keys, logged every K steps only).

    python -m step3_ppo.plot OUTPUT_DIR [--out PNG]     # reads OUTPUT_DIR/metrics.jsonl -> OUTPUT_DIR/curves.png

With evaluation metrics it also prints each one's first and last value (before -> after training).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

# (panel title, y label, [(metrics key, legend label), ...])
PANELS = (
    (
        "Reward",
        "reward",
        [
            ("reward/score_mean", "sequence reward"),
            ("reward/total_mean", "total (after a group baseline, - KL penalty)"),
        ],
    ),
    ("KL to SFT reference", "KL (nats / sequence)", [("kl/ref_mean", "KL(actor || reference)")]),
    ("Response length", "tokens", [("gen/response_len_mean", "mean response length")]),
)
# drawn for multi-turn runs (--env / --tools) only: per trajectory, every iteration
AGENT_PANEL = (
    "Turns and tool calls",
    "per trajectory",
    [
        ("rollout/turns_mean", "policy turns"),
        ("rollout/tool_calls_mean", "tool calls"),
        ("rollout/tool_errors_mean", "tool calls that failed"),
    ],
)


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


def series(rows: list[dict], key: str) -> tuple[list, list]:
    """(steps, values) where `key` holds a finite number (missing keys and "nan" strings skipped)."""
    xs, ys = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        xs.append(row["step"])
        ys.append(value)
    return xs, ys


EVAL_PREFIX = "eval/"
NOT_DRAWN = {"eval/prompts"}  # a count, not a curve
_CI_SUFFIXES = ("_ci", "_ci_low", "_ci_high")  # an interval of the key before the suffix


def eval_keys(rows: list[dict]) -> list[str]:
    """The `eval/...` keys of any row (sorted), except the intervals drawn as bands in their
    metric's panel: `K_ci` ([low, high]) and `K_ci_low` / `K_ci_high` where K itself is logged."""
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
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in pair):
            xs.append(row["step"])
            lows.append(pair[0])
            highs.append(pair[1])
    return xs, lows, highs


def plot_curves(metrics_jsonl_path: str, out_png: str) -> str:
    """Write a PNG of the 3 training panels (reward, KL, response length over `step`; a multi-turn run's turns
    and tool calls a 4th), then one panel per `eval/...` key (rows without it skipped; its interval shaded when logged);
    returns `out_png`.

    Missing metrics leave their panel with a "no data" note instead of failing.
    """
    import matplotlib  # lazy: +0.5 s on every --help (matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: +0.5 s on every --help (matplotlib)

    rows = read_rows(metrics_jsonl_path)
    agent = [AGENT_PANEL] if any(AGENT_PANEL[2][0][0] in row for row in rows) else []
    panels = list(PANELS) + agent + [(key[len(EVAL_PREFIX) :], key, [(key, "evaluation")]) for key in eval_keys(rows)]
    cols = min(len(panels), len(PANELS))
    n_rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(5 * cols, 4 * n_rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, (title, ylabel, keys) in zip(axes.flat, panels):
        plotted = False
        for key, label in keys:
            xs, ys = series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="." if len(xs) < 50 else None, label=f"{label} ({key})")
                plotted = True
            band = interval_series(rows, key) if key.startswith(EVAL_PREFIX) else ([], [], [])
            if band[0]:
                ax.fill_between(*band, alpha=0.2, label="interval")
        if plotted:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"PPO training curves: {metrics_jsonl_path}", fontsize="small")
    fig.tight_layout()
    out_dir = os.path.dirname(os.path.abspath(out_png))
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def eval_summary(rows: list[dict]) -> list[str]:
    """One line per `eval/...` metric: its first and last value and their steps (before -> after training)."""
    lines = []
    for key in eval_keys(rows):
        xs, ys = series(rows, key)
        if xs:
            lines.append(f"{key}: {ys[0]:.4f} (step {xs[0]}) -> {ys[-1]:.4f} (step {xs[-1]})")
    return lines


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("output_dir", help="a step-3 output directory holding metrics.jsonl")
    p.add_argument("--out", default=None, help="PNG path (default: OUTPUT_DIR/curves.png)")
    args = p.parse_args(argv)
    metrics = os.path.join(args.output_dir, "metrics.jsonl")
    if not os.path.isfile(metrics):
        print(f"error: {metrics} does not exist (is {args.output_dir!r} a step-3 output directory?)", file=sys.stderr)
        sys.exit(2)
    out = plot_curves(metrics, args.out or os.path.join(args.output_dir, "curves.png"))
    for line in eval_summary(read_rows(metrics)):
        print(line)
    print(out)
    return out


if __name__ == "__main__":
    main()
