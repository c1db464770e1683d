"""Loading tokenizers and causal LMs the same way in every step.

The rule that lives here so no step can get it wrong: the pad token is distinct from EOS (else
masks built from `input_ids != pad` would hide EOS, the action that carries the reward in step 3).
How models are run (position ids from the attention mask in every forward) is utils/models/forward.py.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import re

import torch
from safetensors import safe_open
from torch import nn

from utils.data.chat import use_chat_template_file
from utils.errors import ProjectError, one_line

PAD_TOKEN = "<pad>"

_DROPOUT_ATTRS = (
    "dropout",
    "attention_dropout",
    "hidden_dropout",
    "activation_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "summary_first_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
)


class ModelLoadError(ProjectError, ValueError):
    """A model or tokenizer path that cannot be loaded; the message names the path."""


class ModelFlagError(ProjectError, ValueError):
    """A model flag that does not fit the model or the device (--lora_module_name, --dtype); names the flag."""


SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # what from_pretrained(use_safetensors=True) reads
# Why pickled weights are refused, and the one-liner that converts them (torch.load(weights_only=True) underneath)
CONVERT_HINT = (
    "pickled weights can run code when loaded, so only safetensors are read; convert the directory once "
    'with: python -c "from transformers import AutoModelForCausalLM as M; '
    "M.from_pretrained('{src}', use_safetensors=False, weights_only=True)"
    ".save_pretrained('{dst}', safe_serialization=True)\""
)


# A Hugging Face hub model id: `name` or `org/name` (huggingface_hub's rules: letters, digits, '-', '_', '.')
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(path: str) -> bool:
    """True for a string that could name a hub model (`gpt2`, `org/name`) and not only a local path."""
    return bool(_HUB_ID.fullmatch(path)) and ".." not in path and "--" not in path and len(path) <= 96


def hub_offline() -> bool:
    """Downloads from the hub are off: HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE (as huggingface_hub reads them)."""
    from huggingface_hub import is_offline_mode  # lazy: only for a hub name (transformers imports it anyway)

    flags = (os.environ.get(name, "").upper() for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return is_offline_mode() or any(flag in ("1", "ON", "YES", "TRUE") for flag in flags)


def in_hub_cache(repo_id: str) -> bool:
    """The local Hugging Face cache holds `repo_id`'s config.json (so from_pretrained can load it offline)."""
    from huggingface_hub import try_to_load_from_cache  # lazy: only for a hub name

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an id huggingface_hub refuses: not cached
        return False


def not_on_disk(path: str, what: str, why: str) -> ModelLoadError:
    """The one line for a model that is neither a local directory nor in the hub cache, `why` it was not downloaded."""
    return ModelLoadError(
        f"{what} {path!r} is neither a local directory nor in the local Hugging Face cache, and {why}; "
        f"give the path of a from_pretrained directory, or download it once with network access "
        f"(hf download {path})"
    )


def check_model_path(path: str, what: str = "model") -> None:
    """Fail early, naming the path, when a local model path does not exist, or a hub name is not cached while
    downloads are off (HF_HUB_OFFLINE=1).

    A string that is not an existing directory is still accepted when it looks like a hub name (`gpt2`,
    `org/name`) and is cached or may be downloaded; a failed download is `hub_load_error`'s line.
    """
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelLoadError(f"{what} directory {path!r} has no config.json (not a from_pretrained directory)")
        return
    if not is_hub_id(path) or os.path.exists(path):
        raise ModelLoadError(f"{what} path {path!r} does not exist or is not a directory")
    if hub_offline() and not in_hub_cache(path):
        raise not_on_disk(path, what, "downloads are off (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1)")


def hub_load_error(path: str, what: str, exc: Exception) -> ModelLoadError | None:
    """The one line for from_pretrained's failure to fetch hub model `path` (no network, an unknown id, a
    gated repository); None for a local directory, or another error."""
    if os.path.isdir(path) or not isinstance(exc, OSError):  # transformers raises OSError for what it cannot fetch
        return None
    why = "downloads are off" if hub_offline() else "downloading it failed"
    first = one_line(str(exc).strip().split("\n")[0].split(". ")[0], 160)  # transformers' advice follows it
    return not_on_disk(path, what, f"{why} ({first})")


@contextlib.contextmanager
def hub_errors(path: str, what: str):
    """A from_pretrained inside that fails to fetch hub model `path` raises `hub_load_error`'s one line instead."""
    try:
        yield
    except OSError as exc:
        error = hub_load_error(path, what, exc)
        if error is None:
            raise
        raise error from exc


def check_weight_files(path: str, what: str = "model") -> None:
    """Refuse a local directory without safetensors weights: pickled ones (*.bin, a one-line conversion
    given) or none at all (a config.json alone). A hub name is left to from_pretrained."""
    if not os.path.isdir(path):
        return
    names = os.listdir(path)
    if any(name in names for name in SAFE_WEIGHTS):
        return
    pickled = sorted(
        name
        for name in names  # what from_pretrained(use_safetensors=False) would unpickle
        if name.startswith("pytorch_model") and name.endswith((".bin", ".bin.index.json"))
    )
    if pickled:
        raise ModelLoadError(
            f"{what} directory {path!r} has only pickled weights ({', '.join(pickled[:3])}"
            f"{', ...' if len(pickled) > 3 else ''}); " + CONVERT_HINT.format(src=path, dst=path)
        )
    raise ModelLoadError(
        f"{what} directory {path!r} has no weights ({' or '.join(SAFE_WEIGHTS)}): an interrupted "
        f"save or copy, or a directory that holds only a config or tokenizer?"
    )


TRUST_HINT = "read it, and pass --trust_remote_code if you trust it"


def check_remote_code(path: str, trust_remote_code: bool, what: str = "model", hint: str = TRUST_HINT) -> None:
    """Refuse a local directory whose config.json or tokenizer_config.json names its own Python code
    (auto_map), which loading would import and run, unless --trust_remote_code; `hint`: what to do (a tool
    without the flag says so)."""
    if trust_remote_code or not os.path.isdir(path):
        return
    for name in ("config.json", "tokenizer_config.json"):
        auto_map = _json_field(os.path.join(path, name), "auto_map")
        if auto_map:
            code = sorted({str(ref).split("--")[-1].split(".")[0] + ".py" for ref in _flat(auto_map) if ref})
            raise ModelLoadError(
                f"{what} directory {path!r} ships its own Python code ('auto_map' in {name}: "
                f"{', '.join(code) or '?'}), which loading would run; {hint}"
            )


def _json_field(file: str, key: str):
    """``key`` of a JSON object file, None when the file is missing or not such an object."""
    try:
        with open(file, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj.get(key) if isinstance(obj, dict) else None


def _flat(value) -> list:
    """The strings of an auto_map value (a class reference, or a list/dict of them)."""
    if isinstance(value, dict):
        return [v for item in value.values() for v in _flat(item)]
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in _flat(item)]
    return [value]


def check_precision_supported(ds_config: dict | None) -> None:
    """Refuse --dtype fp16/bf16 on an accelerator that has no such kernels (DeepSpeed's CPU one has no fp16),
    before a model is loaded for an engine that deepspeed.initialize would then refuse."""
    if not ds_config:
        return
    from deepspeed.accelerator import get_accelerator  # lazy: +0.5 s on every --help (deepspeed)

    accelerator = get_accelerator()
    supported = {"fp16": bool(accelerator.is_fp16_supported()), "bf16": bool(accelerator.is_bf16_supported())}
    for dtype, ok in supported.items():
        if ds_config.get(dtype, {}).get("enabled") and not ok:
            others = [d for d, other_ok in supported.items() if other_ok] + ["fp32"]
            raise ModelFlagError(
                f"--dtype {dtype} is not supported on this device ({accelerator.device_name()}); "
                f"use --dtype {' or '.join(others)}"
            )


def load_tokenizer(
    path: str, trust_remote_code: bool = False, padding_side: str = "right", chat_template: str | None = None
):
    """Load a tokenizer and give it a pad token distinct from EOS (added if needed).

    ``chat_template`` (a Jinja file, ``--chat_template``) replaces the tokenizer's own template; it
    is then saved with every output directory's tokenizer, so later steps and tools render alike."""
    from transformers import AutoTokenizer  # lazy: +0.8 s on every --help (transformers)

    check_model_path(path, "tokenizer")
    check_remote_code(path, trust_remote_code)  # the model's directory, in every step
    with hub_errors(path, "tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if chat_template:
        use_chat_template_file(tokenizer, chat_template)
    if tokenizer.eos_token_id is None:
        raise ModelLoadError(f"tokenizer at {path!r} has no EOS token; generation could never stop")
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
    tokenizer.padding_side = padding_side
    return tokenizer


QLORA_COMPUTE_DTYPE = torch.bfloat16
QLORA_DTYPES = ("bf16", "fp32")  # the --dtype a run with --load_in_4bit takes (the engine's other weights)
QLORA_ZERO_STAGES = (0, 1, 2)  # DeepSpeed stages that run with bitsandbytes' 4-bit parameters


def nf4_config():
    """transformers' BitsAndBytesConfig of --load_in_4bit: NF4, double quantisation, bf16 compute."""
    from transformers import BitsAndBytesConfig  # lazy: +0.8 s on every --help (transformers)

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=QLORA_COMPUTE_DTYPE,
    )


_LOAD_IN_4BIT = contextvars.ContextVar("load_in_4bit", default=False)


@contextlib.contextmanager
def four_bit_loading(enabled: bool = True):
    """`load_causal_lm` calls inside this block that do not say otherwise load 4-bit (for loaders that call it
    for you: RewardModel.from_pretrained's backbone)."""
    token = _LOAD_IN_4BIT.set(enabled)
    try:
        yield
    finally:
        _LOAD_IN_4BIT.reset(token)


def is_4bit_layer(module: nn.Module) -> bool:
    """bitsandbytes' Linear4bit (not peft's LoRA wrapper of it, which has the same class name)."""
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def is_4bit(model: nn.Module) -> bool:
    """Whether `model` (a transformers model, a peft wrapper of one, or a RewardModel) has 4-bit base weights."""
    return any(is_4bit_layer(module) for module in model.modules())


def check_4bit_args(args, trained: dict[str, str], zero_stages: dict[str, int]) -> None:
    """With --load_in_4bit, refuse before any model loads what cannot run on 4-bit base weights, one line each.

    `trained`: {model name: flag prefix} of the models that train ("" for steps 1-2 and DPO; "actor_", "critic_" in
    step 3): their base weights must be frozen (LoRA with --only_optimize_lora). `zero_stages`: {model name: its
    ZeRO stage}, every model that would be 4-bit (frozen ones included)."""
    if not getattr(args, "load_in_4bit", False):
        return
    if args.dtype not in QLORA_DTYPES:
        raise ModelFlagError(
            f"--load_in_4bit needs --dtype {' or '.join(QLORA_DTYPES)} (its 4-bit layers compute in bf16), "
            f"got --dtype {args.dtype}"
        )
    for name, prefix in trained.items():
        if getattr(args, f"{prefix}lora_dim") <= 0 or not args.only_optimize_lora:
            raise ModelFlagError(
                f"--load_in_4bit: the {name}'s base weights would train (full fine-tuning), which 4-bit weights "
                f"cannot; add --{prefix}lora_dim R and --only_optimize_lora (QLoRA), or leave --load_in_4bit out"
            )
    for name, stage in zero_stages.items():
        if stage not in QLORA_ZERO_STAGES:
            raise ModelFlagError(
                f"--load_in_4bit does not work with ZeRO stage {stage} (the {name}'s): DeepSpeed cannot partition "
                f"4-bit weights; use ZeRO stage {', '.join(map(str, QLORA_ZERO_STAGES[:-1]))} or "
                f"{QLORA_ZERO_STAGES[-1]}"
            )


def configure_dropout(config, dropout: float | None) -> None:
    """Set every dropout probability the config knows to `dropout` (None keeps the model's)."""
    if dropout is None:
        return
    for attr in _DROPOUT_ATTRS:
        if hasattr(config, attr):
            setattr(config, attr, dropout)


def zero3_model_context(ds_config: dict | None):
    """Return the object that makes `from_pretrained` build a ZeRO-3 partitioned model.

    Measured (shared/notes): keep the HfDeepSpeedConfig alive while the model exists, and unset
    it before building a non-ZeRO-3 model in the same process, or that one is partitioned too.
    """
    from transformers.integrations import HfDeepSpeedConfig  # lazy: +0.8 s on every --help (transformers)
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config  # lazy: +0.8 s on every --help

    if ds_config is not None and ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        return HfDeepSpeedConfig(ds_config)
    unset_hf_deepspeed_config()
    return None


def load_causal_lm(
    path: str,
    tokenizer=None,
    ds_config: dict | None = None,
    dropout: float | None = None,
    trust_remote_code: bool = False,
    base_model_only: bool = False,
    attn_implementation: str | None = None,
    load_in_4bit: bool | None = None,
) -> nn.Module:
    """Load a causal LM (or only its backbone, for reward/critic models) from a directory.

    `load_in_4bit` (--load_in_4bit, QLoRA; None: as the enclosing `four_bit_loading` block says, else no): the
    backbone's Linear layers in bitsandbytes NF4 with double quantisation and bf16 compute, every other weight
    (embeddings, norms, the LM head) as without it (fp32, cast by the engine's --dtype); only for a model whose
    base weights do not train (check_4bit_args says which).

    Built partitioned when `ds_config` is ZeRO-3. Embeddings are resized when the tokenizer has
    more tokens than the model (an added pad token). `attn_implementation` (None: transformers'
    default) picks the attention kernel (--attn_implementation). Weights are read from safetensors only
    (pickled .bin files can run code); custom model code only with `trust_remote_code`.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # lazy: +0.8 s on every --help (transformers)

    check_model_path(path)
    check_remote_code(path, trust_remote_code)
    check_weight_files(path)
    check_precision_supported(ds_config)
    with hub_errors(path, "model"):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    configure_dropout(config, dropout)
    hf_ds_config = zero3_model_context(ds_config)
    cls = AutoModel if base_model_only else AutoModelForCausalLM
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    if load_in_4bit is None:
        load_in_4bit = _LOAD_IN_4BIT.get()
    if load_in_4bit:
        if hf_ds_config is not None:  # check_4bit_args refuses it first, naming the flag
            raise ModelFlagError("--load_in_4bit does not work with ZeRO stage 3")
        extra["quantization_config"] = nf4_config()
    try:
        model = cls.from_pretrained(
            path, config=config, trust_remote_code=trust_remote_code, dtype=torch.float32, use_safetensors=True, **extra
        )
    except Exception as exc:
        unreadable = unreadable_weight_files(path)
        if unreadable:
            raise ModelLoadError(
                f"model directory {path!r}: {unreadable[0][0]} cannot be read ({unreadable[0][1]}); "
                f"the file is truncated or corrupt (an interrupted save or copy?)"
            ) from exc
        if not os.path.isdir(path) and "use_safetensors" in str(exc):  # a hub model with pickled weights only
            raise ModelLoadError(
                f"model {path!r} has no safetensors weights; "
                + CONVERT_HINT.format(src=path, dst=path.rsplit("/", 1)[-1])
            ) from exc
        error = hub_load_error(path, "model", exc)  # its config cached, its weights not
        if error is not None:
            raise error from exc
        raise
    if load_in_4bit:
        _accept_own_quant_state(model)
        for module in model.modules():
            if is_4bit_layer(module):
                # bitsandbytes repacks a CPU layer's weights in place for its AVX512-BF16 kernel on the first no-grad
                # eval forward (the rollout); every later forward, training's too, then runs that kernel, which has
                # no backward: no gradient would reach the adapters below it. The packing is kept off.
                module.support_avx512bf16_for_cpu = False
    model._hf_ds_config = hf_ds_config  # keep alive: ZeRO-3 hooks refer to it through a weakref
    if tokenizer is not None:
        if embedding_rows(model) < len(tokenizer):
            model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.eos_token_id = tokenizer.eos_token_id
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.use_cache = False
    return model


def _accept_own_quant_state(model: nn.Module) -> None:
    """Let `load_state_dict` read back what `state_dict` of a 4-bit model wrote: its packed weights load, and the
    quantisation constants beside them (`weight.absmax`, `weight.quant_map`, ...), which bitsandbytes' Linear4bit
    writes but does not read, are checked against the layer's own: a DeepSpeed checkpoint (--resume) of frozen
    4-bit weights holds the constants their deterministic quantisation gave, so they match."""

    def hook(module, state_dict, prefix, *args):
        own = {
            prefix + "weight." + name: value for name, value in module.weight.quant_state.as_dict(packed=True).items()
        }
        for key in [k for k in state_dict if k.startswith(prefix + "weight.")]:
            saved = state_dict.pop(key)
            mine = own.get(key)
            if torch.is_tensor(mine) and not torch.equal(saved.to(mine.device), mine):
                raise ModelLoadError(
                    f"{key}: the saved 4-bit quantisation differs from this model's (a checkpoint of another base "
                    f"model?)"
                )

    for module in model.modules():
        if is_4bit_layer(module):
            module._register_load_state_dict_pre_hook(hook, with_module=True)


def unreadable_weight_files(path: str) -> list[tuple[str, str]]:
    """[(file name, reason)] of the .safetensors files of a local directory whose header does not read."""
    if not os.path.isdir(path):
        return []
    bad = []
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            try:
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    f.keys()
            except Exception as exc:  # noqa: BLE001 - any reason it cannot be read is reported
                bad.append((name, one_line(exc)))
    return bad


def embedding_rows(model: nn.Module) -> int:
    """Vocabulary rows of the input embedding, also when ZeRO-3 has partitioned it."""
    weight = model.get_input_embeddings().weight
    return weight.ds_shape[0] if hasattr(weight, "ds_shape") else weight.shape[0]


_NEVER_LORA = ("lm_head", "embed_out", "score")  # output heads


def lora_target_modules(model: nn.Module, module_name_filter: str) -> list[str]:
    """Names of the Linear/Conv1D layers whose name contains `module_name_filter` (never the LM head).

    DeepSpeed-Chat's `--lora_module_name` is a substring; peft wants explicit layer names.
    """
    from transformers.pytorch_utils import Conv1D  # lazy: +0.8 s on every --help (transformers)

    names = [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and module_name_filter in name and not name.endswith(_NEVER_LORA)
    ]
    if not names:
        raise ModelFlagError(
            f"--lora_module_name {module_name_filter!r} matches no Linear layer of the model "
            f"(layer names look like {_linear_names_sample(model)})"
        )
    return names


def _linear_names_sample(model: nn.Module, shown: int = 4) -> str:
    """A few distinct Linear/Conv1D layer names (their last part), to show what --lora_module_name can match."""
    from transformers.pytorch_utils import Conv1D  # lazy: +0.8 s on every --help (transformers)

    names = dict.fromkeys(
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, Conv1D)) and not name.endswith(_NEVER_LORA)
    )
    return ", ".join(list(names)[:shown]) or "none"


def apply_lora(
    model: nn.Module,
    lora_dim: int,
    module_name_filter: str,
    lora_alpha: float | None = None,
    only_optimize_lora: bool = False,
    modules_to_save: list[str] | None = None,
) -> nn.Module:
    """Wrap `model` with peft LoRA adapters; base weights stay trainable unless `only_optimize_lora`."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training  # lazy: +3 s on every --help (peft)
    from transformers.pytorch_utils import Conv1D  # lazy: +0.8 s on every --help (transformers)

    targets = lora_target_modules(model, module_name_filter)
    fan_in_fan_out = isinstance(model.get_submodule(targets[0]), Conv1D)
    config = LoraConfig(
        r=lora_dim,
        lora_alpha=lora_alpha or lora_dim,
        target_modules=targets,
        lora_dropout=0.0,
        fan_in_fan_out=fan_in_fan_out,
        modules_to_save=modules_to_save,
    )
    if is_4bit(model):  # base frozen, non-4-bit weights in fp32 (the engine's --dtype casts them again)
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    peft_model = get_peft_model(model, config)
    if not only_optimize_lora:
        for name, param in peft_model.named_parameters():
            param.requires_grad = True
    return peft_model


class hf_zero3_disabled:
    """Temporarily switch off transformers' global ZeRO-3 flag (to build a plain model on one rank)."""

    def __enter__(self):
        from transformers.integrations import deepspeed as hf_ds  # lazy: +0.8 s on every --help (transformers)

        ref = hf_ds._hf_deepspeed_config_weak_ref
        self.saved = ref() if ref is not None else None
        hf_ds.unset_hf_deepspeed_config()
        return self

    def __exit__(self, *exc):
        from transformers.integrations.deepspeed import set_hf_deepspeed_config  # lazy: +0.8 s on every --help

        if self.saved is not None:
            set_hf_deepspeed_config(self.saved)
        return False
