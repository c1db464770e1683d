"""The reward model of step 2, also the frozen reward model and the critic of step 3.

`RewardModel` = a causal-LM backbone without its LM head (`AutoModel`, possibly peft-wrapped)
plus `v_head = Linear(hidden, 1, bias=False)`, which maps every token's last hidden state to a
value ([B, L], fp32). A sequence's score is the value at its LAST REAL token (the EOS that ends
the response), read through the attention mask (utils.models.forward.sequence_scores), so it is right
for left and right padding of any amount and for pad == EOS. Every forward passes mask-derived position ids and no KV
cache, so a score does not change with padding even for GPT-2's absolute positions.

Saved layout (a directory that `RewardModel.from_pretrained` reloads with identical scores):
- the backbone as a plain `from_pretrained` directory (config, `model.safetensors`, LoRA merged),
  plus the tokenizer;
- `value_head.safetensors`: {"weight": [1, hidden]};
- `reward_model.json`: how the score is read, for humans and later steps.

A fresh v_head (no `value_head.safetensors`, e.g. on a step-1 output or a base model) is drawn
from N(0, 1/(hidden+1)) with a FIXED generator (seed 0): identical on every rank whatever the
global RNG state, and small enough that initial scores are O(1) but not all tied (a zero init
would tie every pair and make the "before training" accuracy meaningless). Only step 2 wants
that: step 3 and the evaluation load with `require_value_head=True`, which refuses such a
directory, and refuse a reward-model directory as a policy (`check_policy_dir`).
"""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from utils.math.ops import position_ids_from_attention_mask
from utils.models.export import agree_on_export, gather_full_state_dict, plain_copy, write_failure, write_model_dir
from utils.models.forward import sequence_scores
from utils.models.loading import ModelLoadError, load_causal_lm, load_tokenizer
from utils.runtime.distributed import is_rank0

VALUE_HEAD_FILE = "value_head.safetensors"
REWARD_MODEL_FILE = "reward_model.json"
V_HEAD_INIT_SEED = 0
REWARD_MODEL_KIND, CAUSAL_LM_KIND = "reward_model", "causal_lm"


def model_dir_kind(path: str) -> str | None:
    """What a model directory is: "reward_model" (has value_head.safetensors, a step-2 output),
    "causal_lm" (any other directory: step-1 output, base model) or None (not a local directory,
    e.g. a hub name, which is not checked). Looks at file names only, loads nothing."""
    if not os.path.isdir(path):
        return None
    return REWARD_MODEL_KIND if os.path.isfile(os.path.join(path, VALUE_HEAD_FILE)) else CAUSAL_LM_KIND


def check_reward_model_dir(path: str, what: str = "reward model") -> None:
    """Raise ModelLoadError, naming `path`, when it is a local directory without value_head.safetensors."""
    if model_dir_kind(path) == CAUSAL_LM_KIND:
        raise ModelLoadError(
            f"{what} directory {path!r} has no {VALUE_HEAD_FILE}, so it is not a reward model from step 2 "
            f"(it looks like a step-1/SFT or base model directory); pass the output directory of step2_reward "
            f"(it has {VALUE_HEAD_FILE} and {REWARD_MODEL_FILE})"
        )


def check_policy_dir(path: str, what: str = "policy") -> None:
    """Raise ModelLoadError, naming `path`, when a directory given as a policy/actor is a reward model
    (value_head.safetensors or reward_model.json present). A non-directory (hub name) passes."""
    if not os.path.isdir(path):
        return
    found = [name for name in (VALUE_HEAD_FILE, REWARD_MODEL_FILE) if os.path.isfile(os.path.join(path, name))]
    if found:
        raise ModelLoadError(
            f"{what} directory {path!r} has {' and '.join(found)}, so it is a reward model from step 2, not a "
            f"policy; pass a causal LM (the output directory of step1_sft or a base model)"
        )


def backbone_hidden_size(config) -> int:
    """Width of the backbone's last hidden state (OPT may project it to word_embed_proj_dim)."""
    if getattr(config, "model_type", None) == "opt" and getattr(config, "word_embed_proj_dim", None):
        return config.word_embed_proj_dim
    for attr in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, attr, None):
            return getattr(config, attr)
    raise ValueError(f"cannot tell the hidden size of a {type(config).__name__}")


def _plain_backbone(backbone: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (for its config)."""
    from peft import PeftModel  # lazy: +3 s on every --help (peft)

    return backbone.get_base_model() if isinstance(backbone, PeftModel) else backbone


class RewardModel(nn.Module):
    """Backbone (AutoModel, maybe peft-wrapped) + v_head: per-token values (scores: utils.models.forward)."""

    def __init__(self, backbone: nn.Module, v_head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone_hidden_size(self.config)
        if v_head is None:
            v_head = nn.Linear(hidden, 1, bias=False)
            generator = torch.Generator().manual_seed(V_HEAD_INIT_SEED)
            with torch.no_grad():
                v_head.weight.normal_(0.0, 1.0 / math.sqrt(hidden + 1), generator=generator)
        if tuple(v_head.weight.shape) != (1, hidden):
            raise ValueError(f"v_head weight has shape {tuple(v_head.weight.shape)}, expected (1, {hidden})")
        # In the backbone's dtype: a ZeRO-3 backbone is BUILT in bf16/fp16 (zero.Init), and
        # deepspeed.initialize casts only a non-ZeRO-3 module, so an fp32 head would stay fp32 there
        # (mixed-dtype partitions, an fp32 Linear on bf16 hidden states).
        backbone_dtype = next(iter(backbone.parameters()), v_head.weight).dtype
        self.v_head = v_head.to(backbone_dtype)

    @property
    def config(self):
        return _plain_backbone(self.backbone).config

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        tokenizer=None,
        ds_config: dict | None = None,
        dropout: float | None = None,
        trust_remote_code: bool = False,
        attn_implementation: str | None = None,
        require_value_head: bool = False,
    ) -> "RewardModel":
        """Backbone of a causal LM / step-1 / step-2 directory; v_head from `value_head.safetensors` if there.

        Without that file the head is fresh (step 2's input), unless `require_value_head` (step 3's
        critic and reward model, the evaluation): then a local directory without it raises
        ModelLoadError before anything is loaded (check_reward_model_dir; a hub name is not checked).
        Built ZeRO-3 partitioned when `ds_config` is stage 3 (the v_head is then partitioned by
        `deepspeed.initialize`). Without ds_config a plain model is built.
        """
        if require_value_head:
            check_reward_model_dir(path)
        backbone = load_causal_lm(
            path,
            tokenizer,
            ds_config,
            dropout,
            trust_remote_code,
            base_model_only=True,
            attn_implementation=attn_implementation,
        )
        v_head = None
        head_file = os.path.join(path, VALUE_HEAD_FILE)
        if os.path.isfile(head_file):
            try:
                weight = load_file(head_file)["weight"].float()
            except Exception as exc:
                raise ModelLoadError(
                    f"reward model directory {path!r}: {VALUE_HEAD_FILE} cannot be read ({exc}); "
                    f"the file is truncated or corrupt (an interrupted save or copy?)"
                ) from exc
            v_head = nn.Linear(weight.shape[1], 1, bias=False)
            with torch.no_grad():
                v_head.weight.copy_(weight)
        return cls(backbone, v_head)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-token values [B, L] (fp32), with mask-derived position ids and no KV cache. A padding-free batch
        (utils.models.forward.packed_forward) gives no mask and its position ids, restarting per packed row."""
        out = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_attention_mask(attention_mask) if position_ids is None else position_ids,
            use_cache=False,
        )
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.v_head(hidden).squeeze(-1).float()

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] sequence scores (utils.models.forward.sequence_scores: the value at the last real token)."""
        return sequence_scores(self, input_ids, attention_mask)


# --------------------------------------------------------------------------- #
# Saving
# --------------------------------------------------------------------------- #
def _write_reward_dir(backbone: nn.Module, v_head_weight: torch.Tensor, tokenizer, out_dir: str) -> None:
    """The reward-model directory, whole or not at all (utils.models.export.write_model_dir: a failed write raises
    ExportWriteError, `out_dir` as it was)."""
    weight = v_head_weight.detach().to("cpu", torch.float32).contiguous()
    info = {
        "class": "RewardModel",
        "score": "value at the last real token (last 1 of attention_mask)",
        "position_ids": "cumsum(attention_mask) - 1, clipped at 0",
        "hidden_size": int(weight.shape[1]),
        "backbone_model_type": getattr(backbone.config, "model_type", None),
        "value_head": VALUE_HEAD_FILE,
    }

    def write_info(folder: str) -> None:
        with open(os.path.join(folder, REWARD_MODEL_FILE), "w") as f:
            json.dump(info, f, indent=2)

    writes = [("the backbone's weights and config", backbone.save_pretrained)]
    if tokenizer is not None:
        writes.append(("the tokenizer", tokenizer.save_pretrained))
    writes.append(
        ("the value head", lambda folder: save_file({"weight": weight}, os.path.join(folder, VALUE_HEAD_FILE)))
    )
    writes.append((f"the {REWARD_MODEL_FILE} description", write_info))
    write_model_dir(out_dir, writes)


def save_reward_model(model: RewardModel, tokenizer, out_dir: str) -> None:
    """Save an UNPARTITIONED RewardModel (LoRA merged into a copy). For engines use export_reward_model."""
    from peft import PeftModel  # lazy: +3 s on every --help (peft)

    backbone = model.backbone
    if isinstance(backbone, PeftModel):
        state = {k: v.detach().to("cpu", copy=True) for k, v in backbone.state_dict().items()}
        backbone = plain_copy(backbone, state)
    _write_reward_dir(backbone, model.v_head.weight, tokenizer, out_dir)


def export_reward_model(engine, tokenizer, out_dir: str) -> None:
    """Write engine.module (a RewardModel, any ZeRO stage, LoRA or not) to `out_dir`. Call on ALL ranks; a failed
    write raises ExportWriteError on every rank."""
    state_dict = gather_full_state_dict(engine)  # collective under ZeRO-3
    failure = None
    if is_rank0():
        backbone_state = {k[len("backbone.") :]: v for k, v in state_dict.items() if k.startswith("backbone.")}
        head_state = {k[len("v_head.") :]: v for k, v in state_dict.items() if k.startswith("v_head.")}
        other = sorted(k for k in state_dict if not k.startswith(("backbone.", "v_head.")))
        if other or set(head_state) != {"weight"}:
            raise RuntimeError(f"unexpected reward model keys: {other or sorted(head_state)}")
        backbone = plain_copy(engine.module.backbone, backbone_state)
        failure = write_failure(lambda: _write_reward_dir(backbone, head_state["weight"], tokenizer, out_dir))
    agree_on_export(failure)


def make_reward_model_dir(model_dir: str, out_dir: str) -> str:
    """A reward-model directory from a causal LM: its backbone and a fresh (seeded) value head, saved as
    step 2 saves one. For tests and benchmarks that need step 3's critic without training step 2; the
    scores equal those of the fresh head `RewardModel.from_pretrained(model_dir)` builds."""
    tokenizer = load_tokenizer(model_dir)
    save_reward_model(RewardModel.from_pretrained(model_dir, tokenizer), tokenizer, out_dir)
    return out_dir
