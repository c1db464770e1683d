"""Every command-line flag, defined ONCE per group and used by all entry points.

Names are DeepSpeed-Chat's where it has them (users know them). A flag that belongs to one
trained model (its path, learning rate, ZeRO stage, LoRA, ...) is declared in `PER_MODEL_FLAGS`
and added once per model prefix: `--learning_rate` in steps 1 and 2, `--actor_learning_rate` and
`--critic_learning_rate` in step 3, from the same definition; utils.train.loop.spec_from_args reads
them back through the same table. Each entry point passes only its defaults.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from typing import Sequence

from utils.cli import Number
from utils.errors import UsageError
from utils.train.config_file import ConfigFileParser
from utils.train.output_dir import is_within, lock_output_dir, remove_entry

SCHEDULER_TYPES = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")

# name -> add_argument keywords; one flag per model prefix ("" in steps 1-2; "actor_", "critic_" in step 3)
PER_MODEL_FLAGS = {
    "learning_rate": dict(type=Number(float, low=0), default=1e-5, help="learning rate of the base weights"),
    "weight_decay": dict(
        type=Number(float, low=0),
        default=0.0,
        help="AdamW weight decay of the base weights (biases, norms and LoRA adapters: none)",
    ),
    "zero_stage": dict(type=Number(int, low=0, high=3), default=0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage"),
    "gradient_checkpointing": dict(action="store_true", help="recompute activations in the backward pass"),
    "dropout": dict(
        type=Number(float, low=0, below=1), default=None, help="override every dropout of the model (None: the model's)"
    ),
    "lora_dim": dict(type=Number(int, low=0), default=0, help="LoRA rank; 0 disables LoRA"),
    "lora_module_name": dict(default="", help="substring of the layer names that get LoRA (default: every Linear)"),
    "lora_learning_rate": dict(type=Number(float, low=0), default=5e-4, help="learning rate of the LoRA adapters"),
}


def add_per_model(group, names: Sequence[str], prefixes: Sequence[str], defaults: dict | None = None) -> None:
    """The PER_MODEL_FLAGS `names`, once per prefix; `defaults` = {name: {prefix: value}} overrides."""
    for name in names:
        own = (defaults or {}).get(name, {})
        for prefix in prefixes:
            spec = {**PER_MODEL_FLAGS[name], **({"default": own[prefix]} if prefix in own else {})}
            group.add_argument(f"--{prefix}{name}", **spec)


def fail(message: str):
    """Stop with one readable line: a UsageError, which the entry points print once (utils/errors.py); the
    message is the whole story, so an exception being handled is not chained to it."""
    raise UsageError(message) from None


# The flags (parsed names) a --resume may change: from then on its value is used, not the checkpoint's.
# They decide how long the run goes, when it evaluates, logs and saves, where it reports, how a process
# waits or finds its files, or only how much memory the same arithmetic takes. Every other flag shapes
# the trained model: a resume that changes one is refused, naming it and both values (utils.train.checkpoint
# Checkpointing, every entry point); a new flag is in that group until it is listed here.
RESUMABLE_FLAGS = frozenset(
    {
        # how long: the learning-rate schedule is recomputed over the new length
        "max_steps",
        "num_train_epochs",
        # evaluation: its figures, never the training
        "eval_interval",
        "eval_iters",
        "per_device_eval_batch_size",
        "eval_num_prompts",
        "eval_do_sample",
        "eval_data_path",
        # logging and reporting
        "print_loss",
        "print_answers",
        "print_answers_interval",
        "enable_tensorboard",
        "tensorboard_path",
        "enable_wandb",
        "wandb_project",
        "wandb_run_name",
        # checkpoints and what stops a run
        "save_interval",
        "keep_checkpoints",
        "max_bad_steps",
        "resume",
        "universal_checkpoint",
        "resume_ignore_data_change",
        "overwrite_output_dir",
        "skip_bad_rewards",
        "reward_timeout",
        # processes and where files are (the data's content is compared on its own)
        "dist_timeout",
        "local_rank",
        "output_dir",
        "data_output_path",
        "trust_remote_code",
        # memory and speed at the same arithmetic
        "gradient_checkpointing",
        "actor_gradient_checkpointing",
        "critic_gradient_checkpointing",
        "release_inference_cache",
        "logprob_chunk_tokens",
        "offload_reference_model",
        "offload_reward_model",
    }
)
# Attributes an entry point derives from its flags after parsing (compared through those flags)
DERIVED_ATTRIBUTES = frozenset({"reward_specs", "reward_model_paths", "environment", "tool_list", "teachers"})


# --------------------------------------------------------------------------- #
# Groups
# --------------------------------------------------------------------------- #
def add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data")
    g.add_argument(
        "--data_path",
        nargs="+",
        required=True,
        help="JSON/JSONL files, folders of them, datasets names, or reasoning_gym:TASK[,TASK...][:KEY=VALUE,...] "
        "(rows generated offline); several are blended",
    )
    g.add_argument(
        "--data_split",
        default="2,4,4",
        help="relative shares of each source for steps 1,2,3, comma-separated (default %(default)s)",
    )
    g.add_argument("--sft_only_data_path", nargs="*", default=[], help="sources used whole by step 1 only")
    g.add_argument(
        "--eval_fraction",
        type=Number(float, low=0, below=1),
        default=0.1,
        help="held-out share of a source that has no eval/test split of its own, a fraction in [0, 1)",
    )
    g.add_argument(
        "--data_output_path",
        default=None,
        help="folder caching the tokenised data, reused by later runs and by every rank (default: none)",
    )
    g.add_argument(
        "--dedupe",
        action="store_true",
        help="drop exact duplicate training rows (all but the first) and the eval rows that are also "
        "training rows; without it they are only counted, in one line at data load",
    )
    add_format_args(g)


def add_format_args(group, template_file: bool = True) -> None:
    """How rows are read and rendered (utils/data/formats.py, chat.py); shared by the steps and the tools
    (which find the template in the model directory's tokenizer, where the steps saved it)."""
    for name in ("prompt", "chosen", "rejected", "messages"):
        group.add_argument(f"--{name}_key", default=name, help=f"field holding the {name} (default '%(default)s')")
    group.add_argument(
        "--apply_chat_template",
        action="store_true",
        help="render string rows with the chat template, as a user turn and an assistant turn "
        "(message-list rows always are)",
    )
    if template_file:
        group.add_argument(
            "--chat_template",
            default=None,
            metavar="FILE",
            help="a Jinja chat template for a tokenizer without one (saved with the output's tokenizer)",
        )


def add_model_args(
    parser: argparse.ArgumentParser,
    models: dict[str, str],
    defaults: dict | None = None,
    optional: Sequence[str] = (),
    logprobs: bool = True,
) -> None:
    """`--{prefix}model_name_or_path` (required unless its prefix is in `optional`, whose caller then
    says when it is needed) and `--{prefix}dropout` per model; `models` = {prefix: help}. `logprobs`: the
    entry point scores token log-probs of a causal LM (--logprob_chunk_tokens; not the reward model's step)."""
    g = parser.add_argument_group("model")
    for prefix, help_text in models.items():
        g.add_argument(f"--{prefix}model_name_or_path", required=prefix not in optional, help=help_text)
    add_per_model(g, ["dropout"], list(models), defaults)
    g.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped with the model")
    g.add_argument(
        "--attn_implementation",
        default=None,
        choices=ATTN_IMPLEMENTATIONS,
        help="transformers' attention kernel (default: its own choice, sdpa where supported); "
        "flash_attention_2 needs the flash_attn package and bf16/fp16 on a GPU",
    )
    if logprobs:
        g.add_argument(
            "--logprob_chunk_tokens",
            type=Number(int, low=0),
            default=LOGPROB_CHUNK_TOKENS,
            help="token log-probs and the SFT loss through the LM head this many tokens at a time, forward and "
            "backward, so that no [batch, length, vocabulary] logits tensor exists (0: the whole logits at once)",
        )
    g.add_argument(
        "--load_in_4bit",
        action="store_true",
        help="QLoRA: every model's base weights in 4 bits (bitsandbytes NF4, double quantisation, bf16 compute): the "
        "frozen ones and those trained through LoRA with --only_optimize_lora; full fine-tuning and ZeRO-3 are refused",
    )


ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
# --logprob_chunk_tokens' default: utils.models.forward.LOGPROB_CHUNK_TOKENS (not imported: this module stays
# torch-free; tests/test_chunked_logprobs.py holds the two equal). Measured in bench/chunked_logprobs.py.
LOGPROB_CHUNK_TOKENS = 512


def add_batch_args(parser: argparse.ArgumentParser) -> None:
    """Steps 1-2: micro-batch sizes and sequence length (step 3 has its own rollout/mini-batch sizes)."""
    g = parser.add_argument_group("batches")
    g.add_argument(
        "--per_device_train_batch_size",
        type=Number(int, low=1),
        default=8,
        help="training micro-batch size, in rows (examples; pairs in step 2) per rank",
    )
    g.add_argument(
        "--per_device_eval_batch_size",
        type=Number(int, low=1),
        default=8,
        help="evaluation batch size, in rows (examples; pairs in step 2) per rank",
    )
    g.add_argument(
        "--max_seq_len",
        type=Number(int, low=1),
        default=512,
        help="max tokens per sequence (prompt + response); longer rows are truncated or skipped",
    )


def add_training_args(
    parser: argparse.ArgumentParser, prefixes: Sequence[str] = ("",), defaults: dict | None = None
) -> None:
    """Schedule, optimizer, DeepSpeed and LoRA flags; the per-model ones once per prefix."""
    g = parser.add_argument_group("optimisation and DeepSpeed")
    g.add_argument(
        "--num_train_epochs",
        type=Number(int, low=1),
        default=1,
        help="passes over the training data (the prompts in step 3), unless --max_steps stops first",
    )
    g.add_argument(
        "--max_steps",
        type=Number(int, low=0, also=(-1,)),
        default=0,
        help="stop after this many optimizer steps (PPO iterations in step 3; 0 or -1: no limit)",
    )
    g.add_argument(
        "--gradient_accumulation_steps",
        type=Number(int, low=1),
        default=1,
        help="micro-batches per rank accumulated into one optimizer step",
    )
    g.add_argument(
        "--lr_scheduler_type",
        default="cosine",
        choices=SCHEDULER_TYPES,
        help="learning-rate schedule after the warmup (transformers' get_scheduler; default %(default)s)",
    )
    g.add_argument(
        "--num_warmup_steps",
        type=Number(int, low=0),
        default=0,
        help="optimizer steps of linear learning-rate warmup from 0",
    )
    g.add_argument(
        "--gradient_clipping",
        type=Number(float, low=0),
        default=1.0,
        help="max global gradient norm before each optimizer step (0: no clipping)",
    )
    g.add_argument(
        "--seed",
        type=Number(int, low=0, high=2**32 - 1),
        default=1234,
        help="random seed of the data split and order, initialisation and sampling",
    )
    g.add_argument(
        "--padding_free",
        action="store_true",
        help="the training forwards run a micro-batch's rows as one sequence of their real tokens, position ids "
        "restarting per row, no padding computed (models whose attention reads row starts from the position ids)",
    )
    g.add_argument(
        "--max_tokens_per_micro_batch",
        type=Number(int, low=0),
        default=0,
        help="cut each optimizer step's rows into micro-batches of at most this many real tokens (as many on every "
        "rank; a longer row stops the run) instead of a fixed number of rows; best with --padding_free (0: off)",
    )
    add_per_model(g, ["learning_rate", "weight_decay", "zero_stage", "gradient_checkpointing"], prefixes, defaults)
    g.add_argument("--offload", action="store_true", help="ZeRO offload of optimizer (and ZeRO-3 params) to CPU")
    g.add_argument(
        "--dtype",
        default="fp32",
        choices=["fp32", "bf16", "fp16"],
        help="precision of the DeepSpeed engines (bf16/fp16: mixed precision; default %(default)s)",
    )
    g.add_argument("--dist_timeout", type=Number(int, low=1), default=600, help="seconds a rank waits on a dead peer")
    g.add_argument(
        "--no_tf32",
        action="store_true",
        help="full fp32 matmuls on CUDA (TF32 is on by default there; never used on CPU)",
    )
    g.add_argument("--local_rank", type=Number(int, low=-1), default=-1, help="set by the deepspeed launcher")
    g = parser.add_argument_group("LoRA")
    add_per_model(g, ["lora_dim", "lora_module_name", "lora_learning_rate"], prefixes, defaults)
    g.add_argument(
        "--lora_alpha", type=Number(float, above=0), default=None, help="LoRA alpha (default: lora_dim, scaling 1)"
    )
    g.add_argument("--only_optimize_lora", action="store_true", help="freeze the base weights")


def add_generation_args(parser: argparse.ArgumentParser, do_sample: bool | None) -> argparse._ArgumentGroup:
    """Greedy or sampling, spelled one way everywhere: `--do_sample` / `--greedy` (`do_sample` default
    per entry point; None lets it decide), and the sampling knobs. `resolve_generation_args` checks them."""
    g = parser.add_argument_group("generation")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument(
        "--do_sample",
        dest="do_sample",
        action="store_true",
        default=do_sample,
        help="sample" + (" (default)" if do_sample else ""),
    )
    mode.add_argument(
        "--greedy",
        dest="do_sample",
        action="store_false",
        help="greedy decoding" + (" (default)" if do_sample is False else ""),
    )
    g.add_argument(
        "--temperature", type=Number(float, above=0), default=None, help="sampling temperature (default 1.0)"
    )
    g.add_argument(
        "--top_p",
        type=Number(float, above=0, high=1),
        default=None,
        help="nucleus sampling: the most likely tokens whose probabilities sum to this, in (0, 1] (default 1.0: off)",
    )
    g.add_argument(
        "--top_k",
        type=Number(int, low=0),
        default=None,
        help="top-k sampling: the k most likely tokens (default 0: off)",
    )
    return g


def resolve_generation_args(args) -> None:
    """Fill the sampling defaults; a sampling knob with --greedy, or a temperature <= 0, stops the run."""
    given = [f"--{name}" for name in ("temperature", "top_p", "top_k") if getattr(args, name) is not None]
    if args.do_sample is False and given:
        fail(f"--greedy cannot be combined with {', '.join(given)}")
    args.temperature = 1.0 if args.temperature is None else args.temperature
    args.top_p = 1.0 if args.top_p is None else args.top_p
    args.top_k = 0 if args.top_k is None else args.top_k
    if args.do_sample and args.temperature <= 0:
        fail(f"--temperature must be > 0 when sampling, got {args.temperature} (use --greedy for greedy decoding)")
    if not 0 < args.top_p <= 1:
        fail(f"--top_p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        fail(f"--top_k must be >= 0 (0: off), got {args.top_k}")


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """`--device` of the stand-alone tools (evaluation, prompt_eval, chat.py); training ranks take theirs
    from the launcher (utils/runtime/accelerator.py)."""
    parser.add_argument(
        "--device", default=None, help="cpu, cuda, cuda:1, ... (default: the accelerator DeepSpeed finds, else cpu)"
    )


def add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpoints and robustness")
    g.add_argument(
        "--save_interval",
        type=Number(int, low=0),
        default=0,
        help="write a resumable checkpoint every N steps under OUTPUT_DIR/checkpoints (0: never)",
    )
    g.add_argument("--keep_checkpoints", type=Number(int, low=1), default=2, help="how many checkpoints to keep")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint in OUTPUT_DIR when there is one (else start fresh)",
    )
    g.add_argument(
        "--universal_checkpoint",
        action="store_true",
        help="with --resume: a checkpoint written by another number of ranks is converted to DeepSpeed's "
        "universal checkpoint format (once, inside the checkpoint) and loaded from it, instead of "
        "being refused",
    )
    g.add_argument(
        "--resume_ignore_data_change",
        action="store_true",
        help="with --resume: continue although the training data's content differs from the checkpoint's "
        "(else refused, naming the changed files); the resumed run reads the new rows",
    )
    g.add_argument(
        "--max_bad_steps",
        type=Number(int, low=1),
        default=5,
        help="stop after this many consecutive updates with a non-finite loss or reward",
    )


def add_output_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Output directory and the metric sinks (metrics.jsonl always; TensorBoard, wandb on request)."""
    g = parser.add_argument_group("output")
    g.add_argument(
        "--output_dir", required=True, help="folder receiving the trained model(s), metrics.jsonl and the checkpoints"
    )
    g.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="start clean in an OUTPUT_DIR a previous run used (its metrics.jsonl and checkpoints are "
        "deleted); without it such a directory is refused unless --resume finds a checkpoint there",
    )
    g.add_argument(
        "--enable_tensorboard",
        action="store_true",
        help="also log the metrics to TensorBoard (needs tensorboard; see --tensorboard_path)",
    )
    g.add_argument("--tensorboard_path", default=None, help="default: OUTPUT_DIR/tensorboard")
    g.add_argument("--enable_wandb", action="store_true", help="also log to Weights & Biases (needs wandb)")
    g.add_argument(
        "--wandb_project", default="rlhf-ds", help="Weights & Biases project, with --enable_wandb (default %(default)s)"
    )
    g.add_argument("--wandb_run_name", default=None, help="default: the output directory's name")
    return g


def add_pair_eval_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Held-out pair evaluation of the step-2 trainers (reward model, DPO): when, and how much."""
    g = parser.add_argument_group("held-out evaluation")
    g.add_argument(
        "--eval_interval",
        type=Number(int, low=0),
        default=0,
        help="evaluate every this many optimizer steps (0: only before and after training)",
    )
    g.add_argument(
        "--eval_iters",
        type=Number(int, low=0),
        default=0,
        help="evaluate on at most this many batches per rank (0: all held-out pairs)",
    )
    return g


def add_offload_reference_arg(group) -> None:
    """Step 3's and DPO's frozen reference model in CPU memory (ZeRO-3 parameter offload)."""
    group.add_argument(
        "--offload_reference_model",
        action="store_true",
        help="keep the frozen reference model's parameters in CPU memory (ZeRO-3 offload)",
    )


def single_model_parser(description: str, model_help: str, logprobs: bool = True) -> argparse.ArgumentParser:
    """Steps 1 and 2 (one trained model): data, model, batch, training, checkpoint and output flags
    (`logprobs`: add_model_args')."""
    parser = ConfigFileParser(description=description)
    add_data_args(parser)
    add_model_args(parser, {"": model_help}, logprobs=logprobs)
    add_batch_args(parser)
    add_training_args(parser)
    add_checkpoint_args(parser)
    add_output_args(parser)
    parser.add_argument("--print_loss", action="store_true", help="print the loss of every step")
    return parser


# --------------------------------------------------------------------------- #
# Checks shared by the training entry points
# --------------------------------------------------------------------------- #
def was_set(args, name: str) -> bool:
    """The flag `name` asks for something: parsed to a value other than its default (a namespace that was not
    parsed by a ConfigFileParser: any value but None)."""
    defaults = getattr(args, "defaults", None)
    if defaults is None or name not in defaults:
        return getattr(args, name, None) is not None
    return args.as_parsed.get(name) != defaults[name]


def refuse_unread(args, names: Sequence[str], why: str) -> None:
    """A flag of `names` that was set does nothing in this run: stop, saying why (`why` completes
    "--NAME does nothing ...")."""
    for name in names:
        if hasattr(args, name) and was_set(args, name):
            fail(f"--{name} does nothing {why}")


# Files a run writes into its output directory; a log the launch script writes first does not count.
RUN_OUTPUTS = (
    "metrics.jsonl",
    "checkpoints",
    "model.safetensors",
    "value_head.safetensors",
    "config.json",
    "actor",
    "critic",
)


# Flags naming what a run reads (a path, or several); none may lie in its output directory.
INPUT_FLAGS = {
    "model_name_or_path": "model",
    "actor_model_name_or_path": "model",
    "critic_model_name_or_path": "model",
    "reward_model_name_or_path": "model",
    "reward_model_paths": "model",
    "data_path": "data",
    "sft_only_data_path": "data",
    "eval_data_path": "data",
    "unsupervised_dataset_name": "data",
    "chat_template": "file",
}


def run_inputs(args, inputs: Sequence = ()) -> list[tuple[str, str, str]]:
    """(flag, path, kind) of every input the run names that exists on disk (a hub name is not a path);
    `inputs`: (flag, path) pairs the caller adds."""
    found = [(flag, path, "model") for flag, path in inputs]
    for name, kind in INPUT_FLAGS.items():
        values = getattr(args, name, None)
        flag = "--reward_funcs" if name == "reward_model_paths" else f"--{name}"  # step 3's reward-model dirs
        found += [(flag, v, kind) for v in ([values] if isinstance(values, str) else values or [])]
    return [(flag, path, kind) for flag, path, kind in dict.fromkeys(found) if path and os.path.exists(path)]


def check_writable_dir(path: str, flag: str) -> None:
    """A folder the run creates or writes into: refused in one line when it, or the nearest folder above it that
    exists, is a file, or when that folder cannot be written."""
    here = os.path.abspath(path)
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    if not os.path.isdir(here):
        fail(f"{flag} {path}: {here} is a file, not a folder")
    if not os.access(here, os.W_OK | os.X_OK):
        fail(f"{flag} {path}: the folder {here} cannot be written")


def check_output_dir(args, inputs: Sequence[str]) -> None:
    """No run overwrites its inputs, shares its output directory with a live run, or silently mixes with a
    previous run's outputs.

    An input (model, data, template) that is the output directory or inside it is refused; then rank 0
    locks the directory (utils/train/output_dir.py: a second run is refused, naming the first); a used one
    (RUN_OUTPUTS) is refused unless --resume finds a checkpoint there or --overwrite_output_dir asks to
    start clean: then the lock holder deletes the old metrics.jsonl, checkpoints and tensorboard, never
    through a symlink (a linked folder is unlinked, its target kept)."""
    check_writable_dir(args.output_dir, "--output_dir")
    if getattr(args, "enable_tensorboard", False) and getattr(args, "tensorboard_path", None):
        check_writable_dir(args.tensorboard_path, "--tensorboard_path")
    out = os.path.realpath(args.output_dir)
    for flag, path, kind in run_inputs(args, inputs):
        if is_within(path, out):
            where = "is" if os.path.realpath(path) == out else f"holds {path},"
            fail(
                f"--output_dir {args.output_dir} {where} the input {kind} of {flag}: the run would overwrite it; "
                f"choose another --output_dir"
            )
    holder = lock_output_dir(args.output_dir)  # before anything in it is deleted or written
    used = [name for name in RUN_OUTPUTS if os.path.lexists(os.path.join(out, name))]
    if not used:
        return
    if getattr(args, "resume", False) and os.path.exists(os.path.join(out, "checkpoints", "latest")):
        return
    if getattr(args, "resume", False) and not getattr(args, "overwrite_output_dir", False):
        fail(
            f"--resume finds no checkpoint in --output_dir {args.output_dir}, which holds a previous run "
            f"({', '.join(used)}) that stopped before its first save: --overwrite_output_dir to start clean, "
            f"or another --output_dir"
        )
    if not getattr(args, "overwrite_output_dir", False):
        fail(
            f"--output_dir {args.output_dir} holds a previous run ({', '.join(used)}): pass --resume to continue "
            f"from its latest checkpoint, --overwrite_output_dir to start clean, or another --output_dir"
        )
    if holder:  # one deleter: the other ranks may still be reading the check above
        for name in ("metrics.jsonl", "checkpoints", "tensorboard"):
            remove_entry(os.path.join(out, name))


def model_max_positions(path: str) -> int | None:
    """The longest sequence a local model directory's config allows (None when unknown or not a directory)."""
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        values = json.load(f)
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if isinstance(values.get(key), int) and values[key] > 0:
            return values[key]
    return None


def check_sequence_fits(path: str, length: int, what: str) -> None:
    """`length` tokens fit the model's position table (else an IndexError mid-run, on absolute positions)."""
    limit = model_max_positions(path)
    if limit is not None and length > limit:
        fail(f"{what} = {length} tokens exceeds the {limit} positions of the model at {path}")


def validate_training_args(args, prefixes: Sequence[str] = ("",)) -> None:
    """Impossible settings stop the run here, before any model is loaded (each flag's own range: its Number)."""
    args.max_steps = max(args.max_steps, 0)  # -1, as the HF Trainer spells "no limit", is 0 here
    if args.only_optimize_lora and all(getattr(args, f"{p}lora_dim") <= 0 for p in prefixes):
        fail(f"--only_optimize_lora needs {' or '.join(f'--{p}lora_dim' for p in prefixes)} > 0")
    if getattr(args, "attn_implementation", None) == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            fail(
                "--attn_implementation flash_attention_2 needs the flash_attn package, which is "
                "not installed (leave the flag out for sdpa)"
            )
        if args.dtype == "fp32":
            fail("--attn_implementation flash_attention_2 needs --dtype bf16 or fp16")
    stage_zero = [f"--{p}zero_stage" for p in prefixes if getattr(args, f"{p}zero_stage") == 0]
    if args.offload and stage_zero:
        fail(f"--offload needs {' and '.join(stage_zero)} 1, 2 or 3")
    inputs = [(f"--{p}model_name_or_path", getattr(args, f"{p}model_name_or_path")) for p in prefixes]
    if hasattr(args, "max_seq_len"):
        check_sequence_fits(inputs[0][1], args.max_seq_len, "--max_seq_len")
    check_output_dir(args, inputs)  # last: with --overwrite_output_dir it deletes the old run's outputs
