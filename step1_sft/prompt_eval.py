"""Baseline vs fine-tuned answers to the same prompts (DeepSpeed-Chat's step-1 prompt_eval.py).

    python -m step1_sft.prompt_eval --model_name_or_path_baseline DIR --model_name_or_path_finetune DIR \
        [--prompts "Human: ...\\n\\nAssistant:" ... | --prompts FILE.jsonl] [--max_new_tokens 64] \
        [--num_beams N] [--do_sample | --greedy] [--temperature T] [--top_k K] [--top_p P]

Decoding modes: greedy always; beam search when --num_beams N > 1 is given; sampling when
--do_sample is given. With none of --num_beams, --do_sample and --greedy, all three run (beam
search with 4 beams). Prompts are used
verbatim and tokenised exactly as in training (no special tokens; BOS only where the tokenizer's
config adds one); each model uses its own tokenizer.
"""

from __future__ import annotations

import os
import sys

from utils.cli import FlagParser, Number
from utils.data import RowFormat, normalize_row, prompt_text
from utils.train.flags import add_device_arg, add_format_args, add_generation_args, resolve_generation_args

DEFAULT_PROMPTS = (
    "Human: Continue this movie review: The acting in this film\n\nAssistant:",
    "Human: Continue this movie review: I went in expecting\n\nAssistant:",
    "Human: Continue this movie review: A quiet, patient story\n\nAssistant:",
    "Human: Continue this movie review: The director's latest effort\n\nAssistant:",
)
DEFAULT_NUM_BEAMS = 4


def parse_args(argv=None):
    p = FlagParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_name_or_path_baseline", required=True, help="e.g. the base model")
    p.add_argument("--model_name_or_path_finetune", required=True, help="e.g. the step 1 output")
    p.add_argument(
        "--prompts",
        nargs="+",
        default=None,
        help="prompt strings, or one JSON/JSONL file/folder with a 'prompt' field (default: demo-style prompts)",
    )
    p.add_argument("--num_prompts", type=Number(int, low=1), default=8, help="prompts taken from a --prompts file")
    p.add_argument(
        "--max_new_tokens", type=Number(int, low=1), default=64, help="max new tokens per answer (default %(default)s)"
    )
    p.add_argument(
        "--max_prompt_len",
        type=Number(int, low=1),
        default=256,
        help="max prompt length in tokens; a longer prompt keeps its last tokens (default %(default)s)",
    )
    p.add_argument(
        "--num_beams",
        type=Number(int, low=1),
        default=None,
        help=f"beam search width (default {DEFAULT_NUM_BEAMS} when no mode is chosen)",
    )
    add_generation_args(p, do_sample=None)  # None: greedy, beam search and sampling unless one is chosen
    add_format_args(p.add_argument_group("prompt format (as in training)"), template_file=False)
    p.add_argument(
        "--seed",
        type=Number(int, low=0, high=2**32 - 1),
        default=0,
        help="random seed of the sampling and of the prompts picked from a --prompts file",
    )
    p.add_argument(
        "--batch_size", type=Number(int, low=1), default=8, help="prompts per generation batch (default %(default)s)"
    )
    add_device_arg(p)
    args = p.parse_args(argv)
    if args.num_beams is not None and args.num_beams < 1:
        p.error(f"--num_beams must be >= 1, got {args.num_beams}")
    resolve_generation_args(args)
    if args.max_new_tokens < 1:
        p.error(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    return args


def decoding_modes(args) -> list[tuple[str, dict]]:
    """[(title, GenerationSettings keywords besides max_new_tokens)]: greedy, then beam search and/or sampling
    as requested."""
    beams = args.num_beams
    if beams is None and args.do_sample is None:
        beams, sample = DEFAULT_NUM_BEAMS, True
    else:
        sample = bool(args.do_sample)
    modes = [("Greedy", {"do_sample": False})]
    if beams is not None and beams > 1:
        modes.append((f"Beam search ({beams} beams)", {"do_sample": False, "num_beams": beams}))
    if sample:
        modes.append(
            (
                f"Sampling (temperature {args.temperature}, top_k {args.top_k}, top_p {args.top_p})",
                {"do_sample": True, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p},
            )
        )
    return modes


def resolve_prompts(args) -> list:
    """Strings, or message lists (rendered with the model's chat template): from a file as its rows say
    (and --apply_chat_template), from the command line as user turns with --apply_chat_template."""
    fmt = RowFormat.from_args(args)
    if args.prompts and len(args.prompts) == 1 and os.path.exists(os.path.expanduser(args.prompts[0])):
        from utils.evaluation import load_prompts  # lazy: +0.16 s on --help

        return load_prompts(args.prompts[0], args.num_prompts, args.seed, fmt)
    texts = [p.replace("\\n", "\n") for p in args.prompts] if args.prompts else list(DEFAULT_PROMPTS)
    if fmt.apply_chat_template:
        return [normalize_row({"prompt": t}, "--prompts", 3, fmt)["prompt"] for t in texts]
    return texts


def main(argv=None) -> dict:
    args = parse_args(argv)
    from utils.evaluation import generate_answers, load_policy  # lazy: +0.16 s on --help
    from utils.models.forward import GenerationSettings  # lazy: +0.16 s on --help
    from utils.models.loading import ModelLoadError  # lazy: +0.16 s on --help

    prompts = resolve_prompts(args)
    models = {}
    for name, path in (("Baseline", args.model_name_or_path_baseline), ("Finetune", args.model_name_or_path_finetune)):
        try:
            models[name] = load_policy(path, args.device)
        except ModelLoadError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
    answers = {}  # (mode, model name) -> list[Answer]
    modes = decoding_modes(args)
    for title, kwargs in modes:
        for name, (model, tokenizer) in models.items():
            answers[title, name] = generate_answers(
                model,
                tokenizer,
                prompts,
                GenerationSettings(args.max_new_tokens, **kwargs),
                batch_size=args.batch_size,
                seed=args.seed,
                max_prompt_len=args.max_prompt_len,
            )
    for i, prompt in enumerate(prompts):
        print(f"\n==================== prompt {i + 1}/{len(prompts)} ====================")
        print(prompt_text(prompt))
        for title, _ in modes:
            for name in models:
                a = answers[title, name][i]
                status = "EOS" if a.ended_with_eos else "length limit"
                print(f"========== {name}: {title} [{a.response_ids.numel()} tokens, {status}] ==========")
                print(a.text)
        print("=" * 60, flush=True)
    return {
        "prompts": prompts,
        "modes": [t for t, _ in modes],
        "answers": {f"{name}/{title}": [a.text for a in rows] for (title, name), rows in answers.items()},
    }


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
