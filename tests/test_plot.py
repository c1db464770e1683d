"""step3_ppo.plot: the panels a step-3 run's curves.png holds (reward per component, KL, lengths, held-out accuracy,
tool calls), evaluations as points, series that do not vary named instead of drawn, and no path in any text."""

import json

import pytest

from step3_ppo.plot import describe, draw, main, plot_curves, read_rows, select_panels


def tool_run_rows() -> list[dict]:
    """A GRPO run with a calculator: 4 steps, two reward components, evaluations before (step 0) and after."""
    rows = [
        {
            "step": s,
            "reward/score_mean": 0.2 * s,
            "reward/math_exact_mean": 0.2 * s,
            "reward/format_mean": 0.1 * (s % 2),
            "reward/total_mean": 0.0,  # zero by construction under a group baseline
            "reward/zero_variance_group_fraction": 0.5,
            "kl/ref_mean": 0.1 * s,
            "kl/coef": 0.05,
            "gen/response_len_mean": 60 + s,
            "loss/actor": 0.01 * s,
            "rollout/turns_mean": 2.0,  # a constant: left to TensorBoard
            "rollout/tool_calls_mean": 1.0 + 0.1 * s,
            "rollout/tool_errors_mean": 0.1,  # constant in the data: named in the title
        }
        for s in range(1, 5)
    ]
    for step, accuracy in ((0, 0.5), (4, 0.75)):
        rows.append(
            {
                "step": step,
                "eval/accuracy": accuracy,
                "eval/score_mean": accuracy,  # the same series: drawn once
                "eval/reward/math_exact_mean": accuracy,
                "eval/reward/format_mean": 0.0,
                "eval/response_len_mean": 50 + step,
                "eval/tool_calls_mean": 1.25,
                "eval/tool_errors_mean": 0.1 * step,
                "eval/turns_mean": 2.0,
                "eval/prompts": 128,
            }
        )
    return rows


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def drawn(panel):
    return [(s.key, s.points) for s in panel.series]


def test_panels_of_a_tool_run(tmp_path):
    rows = read_rows(str(write(tmp_path / "metrics.jsonl", tool_run_rows())))
    panels = {p.title: p for p in select_panels(rows)}
    assert list(panels) == [
        "Reward (training samples)",
        "KL to the reference",
        "Response length",
        "Held-out accuracy",
        "Tool calls per answer",
    ]
    # the score and its varying component (math_exact repeats the score: drawn once); no group-baselined total
    assert drawn(panels["Reward (training samples)"]) == [("reward/score_mean", False), ("reward/format_mean", False)]
    assert panels["Reward (training samples)"].series[0].label == "sequence reward = math_exact"
    assert drawn(panels["Response length"]) == [("gen/response_len_mean", False), ("eval/response_len_mean", True)]
    held_out = panels["Held-out accuracy"]
    assert drawn(held_out) == [("eval/accuracy", True)]  # score and math_exact repeat it
    assert held_out.series[0].xs == (0, 4) and held_out.series[0].ys == (0.5, 0.75)
    assert held_out.series[0].label == "accuracy = score = math_exact"
    assert held_out.constants == ("format: 0 (constant)",)
    tools = panels["Tool calls per answer"]
    assert drawn(tools) == [("rollout/tool_calls_mean", False), ("eval/tool_errors_mean", True)]
    assert tools.constants == ("failed calls, training: 0.1 (constant)", "calls, held-out: 1.25 (constant)")


def test_constant_panels_and_runs_without_tools_or_evaluation(tmp_path):
    rows = [{"step": s, "reward/score_mean": 0.1 * s, "kl/ref_mean": 0.0, "gen/response_len_mean": 24} for s in (1, 2)]
    assert [p.title for p in select_panels(rows)] == ["Reward (training samples)"]  # KL and length do not vary
    no_calls = [{**r, "rollout/tool_calls_mean": 0.0, "rollout/tool_errors_mean": 0.0} for r in rows]
    assert [p.title for p in select_panels(no_calls)] == ["Reward (training samples)"]  # no tool panel without a call
    one_eval = rows + [{"step": 0, "eval/accuracy": 0.25}]
    assert [p.title for p in select_panels(one_eval)] == ["Reward (training samples)"]  # one evaluation: no trend
    assert select_panels([{"step": 1, "kl/ref_mean": 0.1}]) == []
    path = write(tmp_path / "flat.jsonl", [{"step": 1, "kl/ref_mean": 0.1}])
    assert plot_curves(str(path), str(tmp_path / "flat.png")) and (tmp_path / "flat.png").stat().st_size > 1000


def test_intervals_and_judge_scores_join_the_evaluation_panel():
    rows = [{"step": s, "reward/score_mean": 0.1 * s} for s in range(1, 9)]
    rows += [
        {"step": s, "eval/judge_mean": 0.1 * s, "eval/judge_mean_ci": [0.0, 0.2 * s], "eval/score_mean": s}
        for s in (4, 8)
    ]
    (reward, held_out) = select_panels(rows)
    assert held_out.title == "Held-out score"
    assert drawn(held_out) == [("eval/score_mean", True), ("eval/judge_mean", True)]
    assert held_out.series[1].band == ((4, 8), (0.0, 0.0), (pytest.approx(0.8), pytest.approx(1.6)))


def test_the_figure_draws_evaluations_as_points_and_names_no_path(tmp_path):
    run = tmp_path / "runs" / "grpo"
    run.mkdir(parents=True)
    write(run / "metrics.jsonl", tool_run_rows())
    rows = read_rows(str(run / "metrics.jsonl"))
    panels = select_panels(rows)
    title = describe(rows, panels)
    assert title == "Step-3 run, 4 steps, multi-turn; points: greedy evaluation on 128 held-out prompts"
    fig = draw(panels, title)
    axes = fig.get_axes()
    assert len(axes) == len(panels) == 5
    for ax, panel in zip(axes, panels):
        lines = {line.get_label(): line for line in ax.get_lines()}
        for s in panel.series:
            assert (lines[s.label].get_linestyle() == "None") == s.points and lines[s.label].get_marker() != "None"
    texts = [t.get_text() for t in fig.findobj(lambda a: hasattr(a, "get_text")) if t.get_text()]
    assert not [t for t in texts if "/" in t or str(tmp_path) in t], texts
    out = main([str(run)])
    assert out == str(run / "curves.png")
    data = (run / "curves.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
