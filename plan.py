"""The memory a training run needs per rank, estimated before it is launched (the step's flags: `rlhf-sft --help`, ...).

Parameters, gradients and optimizer states of every model the step holds, activations, logits, the KV cache and the
hybrid engine's gathered copy, from the models' config.json (no weights needed) and the step's own flags.

    python plan.py STEP [the step's flags | --config FILE] [--ranks N] [--device_memory_gib G] [--device cpu|cuda]

STEP: sft (step1_sft.main), rm (step2_reward.main), dpo (step2_dpo.main) or rl (step3_ppo.main). The flags are
read by that step's own parser, so a run's --config file and command line plan as they would train; the output
directory and the data are not needed. Prints the parts per rank, the largest phase's total and a one-line
verdict ("fits: 18.2 of 24 GiB", or "does not fit: ..." naming the largest parts and what lowers them).
The arithmetic: utils/train/memory_plan.py; what each part means: docs/guides/memory.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from utils.cli import FlagParser, Number
from utils.errors import UsageError, run_main
from utils.train.memory_plan import GIB, format_plan, plan_rl, plan_single, read_shape, verdict

STEPS = {
    "sft": "step1_sft.main",
    "rm": "step2_reward.main",
    "dpo": "step2_dpo.main",
    "rl": "step3_ppo.main",
}
# what a rank of each kind holds besides the parts: libraries, the tokenizer and the data (the RSS of an idle CPU
# rank with torch, DeepSpeed and transformers imported, measured 0.38 GiB), or the CUDA context (outside
# torch's allocated memory, about 0.5 GiB)
RUNTIME_GIB = {"cpu": 0.4, "cuda": 0.5}


def build_parser() -> argparse.ArgumentParser:
    """plan.py's own flags; everything else goes to the step's parser."""
    p = FlagParser(
        prog="plan.py",
        description=__doc__.splitlines()[0],
        usage="python plan.py STEP [the step's flags | --config FILE] [--ranks N] [--device_memory_gib G]",
    )
    p.add_argument("step", metavar="STEP", help=f"the step to plan: {', '.join(STEPS)}")
    p.add_argument(
        "--ranks", type=Number(int, low=1), default=1, help="number of ranks (GPUs, or CPU processes) the run uses"
    )
    p.add_argument(
        "--device_memory_gib",
        type=Number(float, above=0),
        default=None,
        help="memory per device in GiB (default: the GPU's on CUDA; on CPU this machine's, shared by the ranks)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="what the ranks run on (default auto: cuda when a GPU is visible, else cpu)",
    )
    return p


def step_args(step: str, argv: list[str]):
    """The step's flags as its own parser reads them (without the checks that touch the output directory or
    the data); its required flags other than the model paths may be left out."""
    module = importlib.import_module(STEPS[step])
    parser = module.build_parser()
    for action in parser._actions:
        if action.required and not action.dest.endswith("model_name_or_path"):
            action.required = False
    return module, parser.parse_args(argv)


def device_kind(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch  # lazy: +4 s on plan.py --help (the step parsers import it anyway)

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_memory_gib(device: str) -> float:
    if device == "cuda":
        import torch  # lazy: as in device_kind

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no GPU is visible here; give --device_memory_gib G")
        return torch.cuda.get_device_properties(0).total_memory / GIB
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def make_plan(step: str, module, args, ranks: int):
    if step in ("sft", "rm", "dpo"):
        shape = read_shape(args.model_name_or_path)
        rows = args.per_device_train_batch_size * (2 if step in ("rm", "dpo") else 1)
        reference = module.reference_kind(args) if step == "dpo" else "none"
        return plan_single(step, args, shape, ranks, rows, reference=reference, lm_head=step != "rm")
    from step3_ppo.algo.advantages import get_estimator  # lazy: step 3's modules only when planning step 3
    from step3_ppo.deepspeed_models import needs_reference  # lazy: as above
    from step3_ppo.rewards.functions import is_function_spec  # lazy: as above

    given = args.reward_funcs or ([args.reward_model_name_or_path] if args.reward_model_name_or_path else [])
    specs = given or ([args.critic_model_name_or_path] if args.critic_model_name_or_path else [])
    reward_paths = [spec for spec in specs if not is_function_spec(spec)]
    needs_critic = get_estimator(args.advantage_estimator).needs_critic
    if needs_critic and not args.critic_model_name_or_path:
        raise UsageError(
            f"--advantage_estimator {args.advantage_estimator} trains a critic: give --critic_model_name_or_path"
        )
    paths = {args.actor_model_name_or_path, *reward_paths}
    if needs_critic:
        paths.add(args.critic_model_name_or_path)
    shapes = {path: read_shape(path) for path in paths}
    return plan_rl(args, shapes, ranks, needs_critic, needs_reference(args), reward_paths)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, rest = build_parser().parse_known_args(argv)
    if own.step not in STEPS:
        raise UsageError(f"unknown STEP {own.step!r}: choose one of {', '.join(STEPS)}")
    if own.ranks < 1:
        raise UsageError(f"--ranks must be >= 1, got {own.ranks}")
    module, args = step_args(own.step, rest)
    device = device_kind(own.device)
    plan = make_plan(own.step, module, args, own.ranks)
    plan.device = device
    if device == "cpu":
        plan.add_cpu_heap()
    plan.runtime_bytes = RUNTIME_GIB[device] * GIB
    limit = own.device_memory_gib
    if limit is None:
        limit = device_memory_gib(device)
        if device == "cpu":
            plan.notes.append(f"this machine's {limit:.1f} GiB shared by {own.ranks} rank(s)")
            limit /= own.ranks
    print(format_plan(plan, limit))
    return 0 if verdict(plan, limit).startswith("fits") else 1


def cli() -> int:
    """`python plan.py` and the `rlhf-plan` command: main() with errors as one `error:` line."""
    return run_main(main)


if __name__ == "__main__":
    sys.exit(cli())
