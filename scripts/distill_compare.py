"""The distillation demo's comparison (scripts/demo.sh --task distill): the held-out greedy accuracy of the teacher (a
GRPO run), of the student before and after on-policy distillation, and of GRPO given the same training time (the
teacher's own run, which started from the same student), from the two runs' metrics.jsonl; and one plot of accuracy
against training time for both runs.

    python scripts/distill_compare.py --distill OUT/distill --grpo OUT/grpo [--out DIR]

Training time is the sum of each iteration's generation, experience and training seconds (`time/..._s`) up to an
evaluation: the evaluations themselves, start-up and export are left out of both runs alike.
"""

from __future__ import annotations

import json
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # run as a file from anywhere, without the editable install

from utils.cli import FlagParser  # noqa: E402
from utils.errors import UsageError, run_main  # noqa: E402

PHASES = ("time/generation_s", "time/experience_s", "time/train_s")
SHARE = 0.9  # the goal: the student within this share of the teacher's accuracy


def evaluations(output_dir: str) -> list[tuple[int, float, float]]:
    """(iteration, training seconds up to it, held-out accuracy) of each evaluation of a step-3 run, by iteration."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"{path} does not exist (is {output_dir!r} a step-3 output directory?)")
    seconds, accuracy = {}, {}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            step = int(row.get("step", 0))
            if all(k in row for k in PHASES):
                seconds[step] = sum(float(row[k]) for k in PHASES)
            if "eval/accuracy" in row:
                accuracy[step] = float(row["eval/accuracy"])
    if not accuracy:
        raise UsageError(f"{path} has no eval/accuracy: the run needs --eval_interval and an accuracy reward")
    return [(s, sum(t for k, t in seconds.items() if k <= s), accuracy[s]) for s in sorted(accuracy)]


def first_reaching(points, target: float):
    return next(((s, t, a) for s, t, a in points if a >= target), None)


def table(distill, grpo) -> list[str]:
    teacher, before, after = grpo[-1], distill[0], distill[-1]
    same_time = [p for p in grpo if p[1] <= after[1]][-1]
    rows = [
        ("teacher: GRPO of the student", teacher),
        ("student before", before),
        ("after distillation", after),
        ("GRPO at the same training time", same_time),
    ]
    lines = [
        "| model | iterations | training time (s) | held-out accuracy |",
        "|---|---|---|---|",
        *(f"| {name} | {s} | {t:.0f} | {a:.3f} |" for name, (s, t, a) in rows),
    ]
    target = SHARE * teacher[2]
    for name, points in (("distillation", distill), ("GRPO", grpo)):
        hit = first_reaching(points, target)
        lines.append(
            f"{name} reaches {SHARE:.0%} of the teacher's accuracy ({target:.3f}): "
            + (f"after {hit[0]} iterations, {hit[1]:.0f} s of training" if hit else "not in this run")
        )
    return lines


def plot(distill, grpo, path: str) -> None:
    from matplotlib.figure import Figure  # lazy: matplotlib, only for the figure

    fig = Figure(figsize=(6, 4), constrained_layout=True)
    ax = fig.add_subplot()
    for label, points, color in (("distillation from the GRPO policy", distill, "C0"), ("GRPO", grpo, "C1")):
        ax.plot([t for _, t, _ in points], [a for _, _, a in points], "o-", color=color, label=label)
    ax.axhline(SHARE * grpo[-1][2], color="grey", linestyle="--", label=f"{SHARE:.0%} of the teacher's accuracy")
    ax.set_xlabel("training time (s: generation + experience + training)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("SmolLM2-135M-Instruct on arithmetic: distillation vs GRPO")
    ax.legend(loc="lower right")
    fig.savefig(path, dpi=100)


def build_parser():
    p = FlagParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--distill", required=True, help="the distillation run's output directory")
    p.add_argument("--grpo", required=True, help="the teacher's GRPO run's output directory (its eval curve)")
    p.add_argument("--out", default=None, help="where comparison.txt and accuracy_vs_time.png go (default --distill)")
    return p


def main(argv=None) -> list[str]:
    args = build_parser().parse_args(argv)
    distill, grpo = evaluations(args.distill), evaluations(args.grpo)
    lines = table(distill, grpo)
    out = args.out or args.distill
    with open(os.path.join(out, "comparison.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(distill, grpo, os.path.join(out, "accuracy_vs_time.png"))
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    run_main(main)
