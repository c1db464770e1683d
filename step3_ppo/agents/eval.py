"""Held-out evaluation of policies with an environment and tools: the training loop's multi-turn rollout
(step3_ppo/agents/loop.py) on plain models, greedy by default (`python -m step3_ppo.eval ... --env/--tools`);
with only `--reward_funcs`, one plain answer per prompt scored by them (a policy without its tools).
`python -m step3_ppo.agents.eval --without_tools EVAL.json --run STEP3_DIR` prints the tool-use demo's table.

Per policy: the mean of each reward function (`--reward_funcs`, default `math_exact`; the first accuracy-like
one is the accuracy), the environment's reward when it has one, turns, tool calls and tool errors per
trajectory, the environment's tokens, truncated trajectories, and how many trajectories a re-tokenisation
of their rendered conversation would have changed (token in, token out trains the generated ids; a
pipeline that re-tokenises the text would train on those other ids).
"""

from __future__ import annotations

import json
import os

import torch

from step3_ppo.agents.environments import DEFAULT_ENV_TIMEOUT_S
from step3_ppo.agents.loop import AgentLimits, EnvReward, MultiTurn, agent_rates, agent_sums, prompts_with_tools
from step3_ppo.agents.tools import Toolbox
from step3_ppo.plot import read_rows
from step3_ppo.rewards.components import FunctionReward
from utils.cli import FlagParser
from utils.data import PromptCollator, stop_token_ids, tokenize_prompts
from utils.data.chat import render
from utils.errors import UsageError, run_main
from utils.evaluation.loading import load_policy
from utils.models.forward import GenerationSettings, generate, generation_kwargs, model_device


class ModelGenerate:
    """A rollout engine over a plain model (no DeepSpeed): transformers' generate with the KV cache."""

    def __init__(self, model, stop_token_ids, pad_token_id: int):
        self.model, self.stop_token_ids, self.pad_token_id = model, stop_token_ids, pad_token_id

    def generate(self, input_ids, attention_mask, settings):
        device = model_device(self.model)
        return generate(
            self.model,
            input_ids.to(device),
            attention_mask.to(device),
            **generation_kwargs(settings, self.stop_token_ids, self.pad_token_id),
        ).cpu()


def retokenisation_changes(rows, tokenizer) -> int:
    """The trajectories whose prompt + response ids differ from their rendered conversation tokenised
    again as a whole (the template's rendering of prompt + messages, the last turn's closing included)."""
    changed = 0
    for row in rows:
        ids = row.prompt_ids.tolist() + row.response_ids.tolist()
        conversation = list(row.prompt["prompt"]) + row.agent["messages"]
        rendered = render(tokenizer, conversation)
        changed += rendered[: len(ids)] != ids
    return changed


def evaluate_policy(model_dir: str, prompt_rows: list[dict], args, reward_functions: list, device: str) -> dict:
    """One policy's figures (see the module docstring) on `prompt_rows` (read_rows' rows, with their fields)."""
    model, tokenizer = load_policy(model_dir, device)
    rows, schemas = prompts_with_tools(prompt_rows, tokenizer, args.tool_list)
    examples, _ = tokenize_prompts(rows, tokenizer, args.max_prompt_len, tools=schemas)
    stops = stop_token_ids(tokenizer, chat=True)
    engine = ModelGenerate(model, stops, tokenizer.pad_token_id)
    if args.env or args.tools:
        limits = AgentLimits(args.max_turns, args.max_new_tokens, args.max_trajectory_len, args.max_observation_len)
    else:  # the policy's plain answers, scored by the reward functions
        limits = AgentLimits(1, args.max_new_tokens, args.max_new_tokens, 1)
    settings = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    toolbox = (
        Toolbox(args.tool_list, args.tool_timeout, args.tool_parser, max_calls=args.max_tool_calls_per_turn)
        if args.tool_list
        else None
    )
    env_timeout = getattr(args, "env_timeout", None) or DEFAULT_ENV_TIMEOUT_S
    agent = MultiTurn(tokenizer, limits, args.environment, toolbox, env_timeout=env_timeout, skip_hint=False)
    components = [FunctionReward(f, tokenizer) for f in reward_functions]
    if args.environment is not None and args.environment.has_reward:
        components.append(EnvReward())
    collate, out = PromptCollator(tokenizer.pad_token_id), []
    torch.manual_seed(args.seed)
    try:
        with torch.no_grad():
            for i in range(0, len(examples), args.batch_size):
                out += agent.rollout(
                    engine, collate(examples[i : i + args.batch_size]), settings, 1, stops, tokenizer.pad_token_id
                )
    finally:
        agent.close()  # the environments' worker process
        if toolbox is not None:
            toolbox.close()
    n = max(len(out), 1)
    result = {"prompts": len(out)}
    for component in components:
        scores = component(out)
        result[f"reward/{component.name}"] = float(scores.nanmean()) if len(out) else 0.0
        if component.is_accuracy and "accuracy" not in result:
            result["accuracy"] = result[f"reward/{component.name}"]
    sums = agent_sums(out)  # the counters training logs, per trajectory here
    for name in ("turns", "tool_calls", "tool_errors", "env_tokens"):
        result[f"{name}_mean"] = sums[f"agent/{name}_sum"] / n
    result.update(agent_rates(sums, ""))
    result["truncated"] = sums["agent/truncated_sum"]
    result["retokenisation_changes"] = retokenisation_changes(out, tokenizer)
    result["sample"] = out[0].agent["messages"] if out else []
    return result


def format_agent_table(results: dict) -> str:
    """One line per policy."""
    keys = [k for k in next(iter(results.values())) if k != "sample"]
    lines = ["policy  " + "  ".join(keys)]
    for name, figures in results.items():
        lines.append(
            f"{name}  "
            + "  ".join(f"{figures[k]:.3f}" if isinstance(figures[k], float) else str(figures[k]) for k in keys)
        )
    return "\n".join(lines)


# (column, key in step3_ppo.eval's result, key in a step-3 run's eval/... metrics)
DEMO_COLUMNS = (
    ("accuracy", "accuracy", "eval/accuracy"),
    ("tool-call rate", "tool_call_rate", "eval/tool_call_rate"),
    ("tool calls", "tool_calls_mean", "eval/tool_calls_mean"),
    ("failed calls", "tool_error_rate", "eval/tool_error_rate"),
    ("turns", "turns_mean", "eval/turns_mean"),
)


def format_tools_demo_table(without_tools: dict, evaluations: list[dict]) -> str:
    """The tool-use demo's table: the base model without tools (step3_ppo.eval's result of one policy), then
    a run's first and last held-out evaluations (its eval/... metrics rows: after SFT, after RL)."""
    prompts = without_tools["prompts"]
    first, last = evaluations[0], evaluations[-1]
    rows = [
        ("base model, no tools", [without_tools.get(key, 0.0) for _, key, _ in DEMO_COLUMNS]),
        (f"after SFT, calculator (step {first['step']})", [first[key] for *_, key in DEMO_COLUMNS]),
        (f"after GRPO, calculator (step {last['step']})", [last[key] for *_, key in DEMO_COLUMNS]),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"held-out greedy evaluation on {prompts} word problems (math_exact on the final answer; tool calls and "
        f"turns per problem, failed calls per call)",
        f"{'':{width}}  " + "  ".join(f"{title:>14}" for title, *_ in DEMO_COLUMNS),
    ]
    lines += [f"{name:{width}}  " + "  ".join(f"{value:14.3f}" for value in values) for name, values in rows]
    return "\n".join(lines)


def main(argv=None) -> str:
    p = FlagParser(
        description="The tool-use demo's table: a model without tools against a step-3 "
        "run's held-out evaluations with them (first and last)"
    )
    p.add_argument(
        "--without_tools",
        required=True,
        metavar="EVAL_JSON",
        help="step3_ppo.eval --reward_funcs ... --out FILE of the model without its tools (one policy)",
    )
    p.add_argument(
        "--run",
        required=True,
        metavar="STEP3_DIR",
        help="a step-3 output directory (metrics.jsonl) run with --tools and --eval_interval",
    )
    args = p.parse_args(argv)
    with open(args.without_tools) as f:
        without_tools = next(iter(json.load(f).values()))
    metrics = os.path.join(args.run, "metrics.jsonl")
    evaluations = [row for row in read_rows(metrics) if "eval/tool_call_rate" in row]
    if not evaluations:
        raise UsageError(
            f"{metrics} holds no evaluation with tools (was the run made with --tools and --eval_interval?)"
        )
    table = format_tools_demo_table(without_tools, evaluations)
    print(table)
    return table


if __name__ == "__main__":
    run_main(main)
