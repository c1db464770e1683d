"""Loading for evaluation: the policy and reward models (eval mode, fp32), tokenizer checks, prompts."""

from __future__ import annotations

import json
import os
import random

import torch

from utils.data import DEFAULT_FORMAT, RowFormat, read_rows
from utils.models.loading import load_causal_lm, load_tokenizer
from utils.models.reward_model import RewardModel, check_policy_dir
from utils.runtime.accelerator import local_device
from utils.runtime.cache_dir import REPO_ROOT

DEFAULT_PROMPTS = os.path.join("data", "demo", "pairs", "eval.jsonl")


def default_device() -> torch.device:
    """The accelerator DeepSpeed finds (utils/runtime/accelerator.py), else the CPU."""
    return local_device()


def load_policy(path: str, device: str | torch.device | None = None, trust_remote_code: bool = False):
    """(causal LM in eval mode, fp32, on `device`; its tokenizer with padding_side="left").

    The tokenizer gets a pad token distinct from EOS (utils.models.loading.load_tokenizer) and the model's
    embeddings are resized to it if needed, exactly as in training. A reward-model directory (step 2's
    output: value_head.safetensors / reward_model.json) raises utils.models.loading.ModelLoadError naming it.
    """
    check_policy_dir(path)
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, padding_side="left")
    model = load_causal_lm(path, tokenizer, trust_remote_code=trust_remote_code)
    model.to(device=device or default_device(), dtype=torch.float32).eval()
    return model, tokenizer


def load_reward_model(path: str, device: str | torch.device | None = None, trust_remote_code: bool = False):
    """(RewardModel in eval mode, fp32, on `device`; its tokenizer). A directory without
    `value_head.safetensors` (a step-1/SFT or base model) raises utils.models.loading.ModelLoadError naming it,
    rather than scoring with a fresh random head (utils.models.reward_model.check_reward_model_dir)."""
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    model = RewardModel.from_pretrained(path, tokenizer, trust_remote_code=trust_remote_code, require_value_head=True)
    model.to(device=device or default_device(), dtype=torch.float32).eval()
    return model, tokenizer


def same_vocabulary(a, b) -> bool:
    """True when two tokenizers map every token (and EOS/pad) to the same ids."""
    return (
        a.eos_token_id == b.eos_token_id
        and a.pad_token_id == b.pad_token_id
        and len(a) == len(b)
        and a.get_vocab() == b.get_vocab()
    )


def load_prompts(
    path_or_source: str = DEFAULT_PROMPTS, n: int | None = 64, seed: int = 0, fmt: RowFormat = DEFAULT_FORMAT
) -> list:
    """Prompts of a JSON/JSONL file or folder (or a `datasets` source), read by `utils.data.read_rows`.

    A source with an eval split (a folder with train/eval files, a .json object with an "eval"
    list, a datasets dict with eval/test/validation) gives its eval prompts, otherwise all its
    rows are used. Duplicates are dropped (first kept), the rest is shuffled with `seed` and the
    first `n` are returned (all when `n` is None). The default is the demo pairs' eval split,
    resolved against the repository root when the working directory does not have it.
    """
    source = path_or_source
    if (
        not os.path.exists(os.path.expanduser(source))
        and not os.path.isabs(source)
        and os.path.exists(os.path.join(REPO_ROOT, source))
    ):
        source = os.path.join(REPO_ROOT, source)
    if source.endswith(DEFAULT_PROMPTS) and not os.path.exists(source):
        raise FileNotFoundError(
            f"{source} is missing: build the demo data with `python -m data.make_demo_data --out data/demo`"
        )
    rows, _ = read_rows(source, 3, fmt)
    prompts, seen = [], set()
    for row in rows:
        key = json.dumps(row["prompt"], sort_keys=True)  # a string or a message list (chat template)
        if key not in seen:
            seen.add(key)
            prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{path_or_source}: no non-empty prompts")
    random.Random(seed).shuffle(prompts)
    return prompts if n is None else prompts[:n]
