"""What a run needs in memory per rank, from the models' config.json and the step's flags: pure arithmetic, no
model loaded, no step imported (`plan.py` turns a step's flags into the `ModelSpec`s and settings used here).

Model states follow DeepSpeed's own bytes-per-parameter accounting (`estimate_zero2_model_states_mem_needs`,
`estimate_zero3_model_states_mem_needs`, without their 1.5x CPU buffer factor), split into parts:

| part | bytes per parameter | divided by the ranks at |
|---|---|---|
| parameters | the dtype's (4 fp32, 2 bf16/fp16); NF4 ~0.52 for 4-bit base weights | ZeRO-3 |
| gradients | the dtype's; + 4 for the fp32 copy the optimizer steps on (mixed precision) | ZeRO-2 (fp32: ZeRO-1) |
| optimizer states | AdamW's fp32 moments (8) + the fp32 master copy (4: mixed precision or ZeRO >= 1) | ZeRO-1 |

so mixed precision, ZeRO-2, N ranks gives 2 + 18/N bytes per trained parameter: DeepSpeed's
`estimate_zero2_model_states_mem_needs(cpu_offload=False)` to the byte (checked on a 7B config, 8 ranks). ZeRO-3
gives 20/N where `estimate_zero3_model_states_mem_needs` says 18/N (this counts the fp32 gradient partition the
optimizer step makes), plus the gathered layers in the dtype (DeepSpeed: the largest layer at 4 bytes). Only
trained parameters (the LoRA adapters with a frozen base) have gradients and optimizer states. `--offload` moves
the optimizer states and fp32 gradients (and under ZeRO-3 the parameters) to CPU memory; an offloaded frozen
model's parameters are in CPU memory.

Beside the states: activations per token (the shapes of one decoder layer; with gradient checkpointing only each
layer's input plus one layer recomputed), the logits per token (vocabulary x 4 bytes, fp32, for every token of
the micro-batch or `--logprob_chunk_tokens` at a time), step 3's KV cache of generation and the hybrid engine's
gathered copy of the actor. The total is the largest phase (training, evaluation; generation and experience in
step 3), the parts that phase holds summed. On CPU the heap also keeps what loading and the other phases freed
(`Plan.add_cpu_heap`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

from utils.errors import ProjectError
from utils.train.ds_config import REDUCE_BUCKET_ELEMENTS  # the reduce bucket the engines get under ZeRO >= 1

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# bitsandbytes NF4 with double quantisation: 4 bits per weight, an 8-bit absmax per block of 64 weights, and an
# fp32 scale per 256 of those absmaxes
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
ADAM_MOMENTS_BYTES = 8  # exp_avg and exp_avg_sq, fp32
FP32_BYTES = 4  # the fp32 master weights and the fp32 gradient copy of mixed precision
ZERO3_MAX_LIVE_PARAMETERS = 30_000_000  # utils/train/ds_config.py's stage3_max_live_parameters
# fp32 [tokens, vocabulary] tensors alive at the peak of the loss' backward: the logits, their log-softmax (kept
# by cross-entropy), its gradient and the logits' gradient
LOGITS_COPIES = 4
PHASES = ("training", "evaluation", "generation", "experience")
GATED_MLP_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "olmo"}


class MemoryPlanError(ProjectError):
    """A model directory or config the plan cannot read (printed as one `error:` line)."""


# --------------------------------------------------------------------------- #
# Shapes
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class Shape:
    """What the arithmetic reads from a config.json (decoder-only transformers)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated_mlp: bool = True  # gate, up and down projections (Llama-like); else fc1 and fc2 (GPT-2, OPT)
    tied: bool = True  # the LM head shares the input embedding
    positions: int = 0  # learned position embeddings (GPT-2, OPT); 0 for rotary
    bias: bool = False  # biases on the Linear layers

    @property
    def attention_linears(self) -> list[tuple[int, int]]:
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return [(self.hidden, q), (self.hidden, kv), (self.hidden, kv), (q, self.hidden)]

    @property
    def mlp_linears(self) -> list[tuple[int, int]]:
        h, i = self.hidden, self.intermediate
        return [(h, i), (h, i), (i, h)] if self.gated_mlp else [(h, i), (i, h)]

    @property
    def layer_linear_params(self) -> int:
        """The weights (and biases) of one decoder layer's Linear layers: what LoRA and 4-bit touch."""
        return sum(a * b + (b if self.bias else 0) for a, b in self.attention_linears + self.mlp_linears)

    @property
    def block_linear_params(self) -> int:
        return self.layers * self.layer_linear_params

    @property
    def embedding_params(self) -> int:
        """Input embedding, learned positions and an untied LM head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.positions * self.hidden

    @property
    def norm_params(self) -> int:
        per_norm = self.hidden * (2 if self.bias else 1)  # LayerNorm has a bias, RMSNorm not
        return (2 * self.layers + 1) * per_norm

    @property
    def params(self) -> int:
        return self.embedding_params + self.block_linear_params + self.norm_params

    @property
    def largest_layer_params(self) -> int:
        """The largest module ZeRO-3 gathers at once: the embedding or one decoder layer."""
        return max(self.vocab * self.hidden, self.layer_linear_params)

    def lora_params(self, rank: int) -> int:
        """LoRA adapters (A: in x r, B: r x out) on every Linear of the decoder layers (never the LM head)."""
        return self.layers * sum(rank * (a + b) for a, b in self.attention_linears + self.mlp_linears)


def backbone(shape: Shape) -> Shape:
    """A value-head model's shape (reward model, critic): the transformer without an LM head (its value head, one
    hidden-size vector, is left out)."""
    return replace(shape, tied=True)


def _first(config: dict, *keys, default=None):
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return default


def shape_from_config(config: dict, where: str = "config.json") -> Shape:
    """The Shape of a transformers config dict (Llama-likes, GPT-2, OPT; `text_config` of a multimodal one)."""
    config = config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    vocab = config.get("vocab_size")
    missing = [
        name
        for name, value in (("hidden size", hidden), ("layers", layers), ("heads", heads), ("vocab_size", vocab))
        if not value
    ]
    if missing:
        raise MemoryPlanError(f"{where}: no {', '.join(missing)} (not a decoder-only transformer config?)")
    model_type = config.get("model_type", "")
    gated = model_type in GATED_MLP_TYPES or config.get("hidden_act") in ("silu", "swiglu", "geglu")
    if model_type in ("gpt2", "opt", "gpt_neox", "gptj", "bloom", "falcon"):
        gated = False
    intermediate = _first(config, "intermediate_size", "n_inner", "ffn_dim", default=None) or 4 * hidden
    head_dim = _first(config, "head_dim", default=None) or hidden // heads
    learned_positions = model_type in ("gpt2", "opt")
    return Shape(
        vocab=int(vocab),
        hidden=int(hidden),
        layers=int(layers),
        heads=int(heads),
        kv_heads=int(_first(config, "num_key_value_heads", default=heads)),
        head_dim=int(head_dim),
        intermediate=int(intermediate),
        gated_mlp=gated,
        tied=bool(config.get("tie_word_embeddings", True)),
        positions=int(_first(config, "n_positions", "max_position_embeddings", default=0)) if learned_positions else 0,
        bias=bool(config.get("attention_bias", config.get("bias", not gated))),
    )


def read_shape(path: str) -> Shape:
    """The Shape of the model at `path`: a model directory (or a directory holding only its config.json), or a
    config.json file."""
    config_path = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise MemoryPlanError(
            f"no config.json at {path!r}: give a model directory, or a directory with its config.json"
        )
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise MemoryPlanError(f"{config_path}: cannot be read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise MemoryPlanError(f"{config_path}: not a JSON object")
    return shape_from_config(config, config_path)


# --------------------------------------------------------------------------- #
# Parts
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class ModelSpec:
    """One model a step holds, as its flags set it."""

    name: str  # actor, reference, critic, reward, ema, policy
    shape: Shape
    trained: bool = False
    lora_dim: int = 0
    only_lora: bool = False  # the base weights are frozen (--only_optimize_lora)
    zero_stage: int = 0
    offload: bool = False  # --offload for a trained model; parameters in CPU memory for a frozen one
    load_in_4bit: bool = False  # the base Linear weights in NF4 (frozen bases only)
    gathered_for: tuple = ()  # phases in which ZeRO-3 gathers the whole model (hybrid engine, experience)


@dataclass(frozen=True)
class Part:
    name: str
    bytes: float
    where: str = "device"  # or "cpu"
    phases: tuple = PHASES  # the phases that hold it
    hint: str = ""  # the settings that lower it

    @property
    def gib(self) -> float:
        return self.bytes / GIB


def trained_params(model: ModelSpec) -> int:
    if not model.trained:
        return 0
    adapters = model.shape.lora_params(model.lora_dim) if model.lora_dim > 0 else 0
    return adapters if model.only_lora and model.lora_dim > 0 else model.shape.params + adapters


def parameter_bytes(model: ModelSpec, dtype: str) -> float:
    """The model's weights whole (before ZeRO-3 divides them): 4-bit bases in NF4, the rest in `dtype`."""
    shape, width = model.shape, DTYPE_BYTES[dtype]
    adapters = shape.lora_params(model.lora_dim) if model.lora_dim > 0 else 0
    if model.load_in_4bit:
        base = shape.block_linear_params * NF4_BYTES_PER_PARAM + (shape.params - shape.block_linear_params) * width
    else:
        base = shape.params * width
    return base + adapters * width


def model_state_parts(model: ModelSpec, dtype: str, ranks: int) -> list[Part]:
    """Parameters, gradients and optimizer states of one model on one rank (DeepSpeed's arithmetic: see the
    module docstring), with its ZeRO-3 gathered copies."""
    stage, width = model.zero_stage, DTYPE_BYTES[dtype]
    mixed = dtype != "fp32"
    parts = []
    trained = trained_params(model)
    param_bytes = parameter_bytes(model, dtype)
    per_rank_params = param_bytes / ranks if stage == 3 else param_bytes
    params_on_cpu = model.offload and (stage == 3 or not model.trained)
    parts.append(
        Part(
            f"{model.name} parameters",
            per_rank_params,
            "cpu" if params_on_cpu else "device",
            hint="ZeRO-3, --offload" if trained_params(model) >= model.shape.params else "--load_in_4bit",
        )
    )
    if trained:
        grads = trained * width / (ranks if stage >= 2 else 1)
        fp32_grads = trained * FP32_BYTES / (ranks if stage >= 1 else 1) if mixed else 0
        bucket = min(trained, REDUCE_BUCKET_ELEMENTS) * width if stage >= 1 else 0
        # the fp32 master weights: a copy under mixed precision or ZeRO 1-2; under ZeRO-3 in fp32 the parameter
        # partition itself (utils.train.loop.share_master_weights), unless the optimizer is offloaded
        master = mixed or stage in (1, 2) or (stage == 3 and model.offload)
        optimizer = trained * (ADAM_MOMENTS_BYTES + (FP32_BYTES if master else 0))
        optimizer /= ranks if stage >= 1 else 1
        opt_where = "cpu" if model.offload else "device"
        parts.append(Part(f"{model.name} gradients", grads + bucket, "device", hint="ZeRO-2, LoRA"))
        if fp32_grads:
            parts.append(Part(f"{model.name} fp32 gradients", fp32_grads, opt_where, hint="--offload, ZeRO-2"))
        parts.append(Part(f"{model.name} optimizer states", optimizer, opt_where, hint="--offload or ZeRO-3, LoRA"))
    if stage == 3 and model.gathered_for:
        parts.append(
            Part(
                f"{model.name} gathered copy",
                param_bytes if params_on_cpu else param_bytes - per_rank_params,
                "device",
                tuple(model.gathered_for),
                hint="--no_gathered_experience" if "generation" not in model.gathered_for else "ZeRO-2, LoRA",
            )
        )
    if stage == 3 and (model.trained or not model.gathered_for):
        # the layers ZeRO-3 gathers at a time for a training forward and backward (a frozen model not gathered
        # whole: its scoring forward), at most stage3_max_live_parameters
        live = min(model.shape.params, max(model.shape.largest_layer_params, ZERO3_MAX_LIVE_PARAMETERS))
        phase = ("training",) if model.trained else ("experience",)
        parts.append(Part(f"{model.name} gathered layers", live * width, "device", phase, hint="ZeRO-2"))
    return parts


def activation_bytes_per_token(shape: Shape, dtype: str, checkpointing: bool, seq_len: int, attn: str | None) -> float:
    """Activations a training forward keeps per token for the backward, all layers: each decoder layer's saved
    tensors (norm inputs and outputs, q/k/v/o, the MLP's hidden and its activation, the residuals); with
    gradient checkpointing only each layer's input, plus one layer recomputed during the backward. Eager
    attention adds the [heads, seq] scores and probabilities per token."""
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    q = shape.heads * shape.head_dim
    # two norms (input, normalised, scaled: 3 h each); q, k, v and q, k after the rotary embedding; k and v
    # repeated to the query heads (grouped-query attention through SDPA); the attention output (before and after
    # its transpose); the MLP: gate, up, act(gate), act(gate) x up (gated) or fc1 and its activation
    mlp = (4 if shape.gated_mlp else 2) * shape.intermediate
    per_layer = 6 * h + 4 * q + 3 * kv + 2 * q + mlp  # elements per token
    if attn == "eager":
        per_layer += 2 * shape.heads * seq_len
    width = DTYPE_BYTES[dtype]
    if checkpointing:
        return (shape.layers * h + per_layer) * width
    return shape.layers * per_layer * width


def logits_bytes(shape: Shape, tokens: int, chunk_tokens: int = 0, copies: int = LOGITS_COPIES) -> float:
    """fp32 logits of `tokens` tokens (the vocabulary x 4 bytes each), or of `chunk_tokens` at a time."""
    alive = min(tokens, chunk_tokens) if chunk_tokens > 0 else tokens
    return float(alive) * shape.vocab * 4 * copies


def kv_cache_bytes(shape: Shape, rows: int, length: int, dtype: str) -> float:
    """Generation's KV cache: rows x (prompt + answer) x layers x 2 (keys, values) x kv heads x head dim x bytes."""
    return float(rows) * length * shape.layers * 2 * shape.kv_heads * shape.head_dim * DTYPE_BYTES[dtype]


# --------------------------------------------------------------------------- #
# The plan
# --------------------------------------------------------------------------- #
@dataclass
class Plan:
    step: str
    ranks: int
    dtype: str
    parts: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    runtime_bytes: float = 0.0  # libraries, allocator and CUDA context: outside the parts
    device: str = "cuda"  # "cpu": the device is CPU memory, so offloaded parts count in its total too
    load_bytes: float = 0.0  # the largest model's whole weights, read before ZeRO partitions or flattens them

    def holds(self, part: Part, where: str) -> bool:
        return part.where == where or (where == "device" and self.device == "cpu")

    def phase_total(self, phase: str, where: str = "device") -> float:
        return sum(p.bytes for p in self.parts if phase in p.phases and self.holds(p, where))

    def add_cpu_heap(self) -> None:
        """On CPU: the blocks that loading the models and the other phases freed, which the heap keeps
        (utils/runtime/distributed.py's tune_malloc never returns memory to the system), held at the peak
        phase's peak."""
        transient = {
            ph: sum(p.bytes for p in self.parts if ph in p.phases and p.phases != PHASES) for ph in self.phases
        }
        peak = max(transient, key=transient.get)
        kept = {"loading": self.load_bytes, **{ph: b for ph, b in transient.items() if ph != peak}}
        kept = {ph: b for ph, b in kept.items() if b}
        if kept:
            self.parts.append(Part(f"CPU heap kept from {', '.join(kept)}", sum(kept.values()), "device", (peak,)))

    @property
    def phases(self) -> list[str]:
        return [ph for ph in PHASES if any(ph in p.phases for p in self.parts if p.phases != PHASES)] or ["training"]

    def peak_phase(self, where: str = "device") -> str:
        return max(self.phases, key=lambda ph: self.phase_total(ph, where))

    def total(self, where: str = "device") -> float:
        """The largest phase's parts, plus the runtime on the device."""
        return self.phase_total(self.peak_phase(where), where) + (self.runtime_bytes if where == "device" else 0)


def training_parts(
    model: ModelSpec,
    dtype: str,
    rows: int,
    seq_len: int,
    checkpointing: bool,
    attn,
    chunk: int,
    lm_head: bool,
    budget: int = 0,
) -> list[Part]:
    """A trained model's forward and backward over one micro-batch: activations and (for an LM) logits. A token
    budget (`--max_tokens_per_micro_batch`) bounds the micro-batch's tokens instead of its rows x length."""
    tokens = budget or rows * seq_len
    act = activation_bytes_per_token(model.shape, dtype, checkpointing, seq_len, attn) * tokens
    parts = []
    if model.trained and trained_params(model) >= model.shape.params:
        # autograd's whole gradient of the embedding (and of the tied LM head, summed into it) before the reduce
        # bucket takes it
        shape = model.shape
        parts.append(
            Part(
                f"{model.name} embedding gradient",
                shape.vocab * shape.hidden * DTYPE_BYTES[dtype] * (2 if lm_head else 1),
                phases=("training",),
                hint="LoRA",
            )
        )
    parts += [
        Part(
            f"{model.name} activations ({tokens} tokens)",
            act,
            phases=("training",),
            hint=("--gradient_checkpointing, " if not checkpointing else "")
            + ("a smaller --max_tokens_per_micro_batch" if budget else "a smaller micro-batch"),
        )
    ]
    if lm_head:
        parts.append(
            Part(
                f"{model.name} logits ({min(tokens, chunk) if chunk > 0 else tokens} of {tokens} tokens)",
                logits_bytes(model.shape, tokens, chunk),
                phases=("training",),
                hint="--logprob_chunk_tokens 1024" if chunk <= 0 or chunk > 1024 else "a smaller chunk",
            )
        )
    return parts


def trained_model(name: str, shape, args, prefix: str = "", gathered_for: tuple = ()) -> "ModelSpec":
    """A model the run trains, from its flags (`--{prefix}lora_dim`, `--{prefix}zero_stage`, `--offload`): its base
    weights are 4-bit (`--load_in_4bit`) only when it trains through LoRA alone."""
    lora_dim = getattr(args, f"{prefix}lora_dim")
    return ModelSpec(
        name,
        shape,
        trained=True,
        lora_dim=lora_dim,
        only_lora=args.only_optimize_lora,
        zero_stage=getattr(args, f"{prefix}zero_stage"),
        offload=args.offload,
        load_in_4bit=bool(getattr(args, "load_in_4bit", False)) and lora_dim > 0 and args.only_optimize_lora,
        gathered_for=gathered_for,
    )


def plan_single(
    step: str,
    args,
    shape: Shape,
    ranks: int,
    rows_per_micro_batch: int,
    reference: str = "none",
    lm_head: bool = True,
) -> Plan:
    """Steps 1, 2 and DPO: one trained model (`args`: the step's flags), its micro-batch of
    `rows_per_micro_batch` sequences of --max_seq_len tokens; DPO's reference as `reference` says
    ("engine": a frozen copy; "adapters", "precomputed", "none": no second model)."""
    four_bit = bool(getattr(args, "load_in_4bit", False))
    shape = shape if lm_head else backbone(shape)
    policy = trained_model("policy" if lm_head else "reward model", shape, args)
    plan = Plan(step, ranks, args.dtype, load_bytes=parameter_bytes(policy, args.dtype))
    plan.parts += model_state_parts(policy, args.dtype, ranks)
    if reference == "engine":
        offload_ref = bool(getattr(args, "offload_reference_model", False))
        ref = ModelSpec(
            "reference",
            shape,
            zero_stage=3 if offload_ref else args.zero_stage,
            offload=offload_ref,
            load_in_4bit=four_bit,
        )
        plan.parts += model_state_parts(ref, args.dtype, ranks)
    if step == "dpo":
        plan.notes.append(f"reference: {reference}")
    chunk = getattr(args, "logprob_chunk_tokens", 0) or 0
    plan.parts += training_parts(
        policy,
        args.dtype,
        rows_per_micro_batch,
        args.max_seq_len,
        args.gradient_checkpointing,
        getattr(args, "attn_implementation", None),
        chunk,
        lm_head,
        getattr(args, "max_tokens_per_micro_batch", 0) or 0,
    )
    if lm_head:  # the held-out evaluation: no-grad forwards, the logits and their logsumexp
        eval_tokens = rows_per_micro_batch // args.per_device_train_batch_size * args.per_device_eval_batch_size
        eval_tokens *= args.max_seq_len
        plan.parts.append(
            Part(
                f"evaluation logits ({min(eval_tokens, chunk) if chunk > 0 else eval_tokens} of {eval_tokens} tokens)",
                logits_bytes(shape, eval_tokens, chunk, copies=2),
                phases=("evaluation",),
                hint="--per_device_eval_batch_size, --logprob_chunk_tokens",
            )
        )
    return plan


def plan_rl(args, shapes: dict, ranks: int, needs_critic: bool, needs_reference: bool, reward_paths: list) -> Plan:
    """Step 3: actor, reference (with a KL term), critic (when the estimator trains one), reward models, EMA;
    the generation phase (KV cache, the hybrid engine's gathered actor), the experience phase (each frozen model
    gathered once for its forward over the rollout) and the training phase (actor, then critic, on a mini-batch).
    `shapes`: {model path: Shape}."""
    dtype = args.dtype
    four_bit = bool(getattr(args, "load_in_4bit", False))
    hybrid = bool(args.enable_hybrid_engine)
    gathered_experience = not getattr(args, "no_gathered_experience", False)
    actor_shape = shapes[args.actor_model_name_or_path]
    actor = trained_model("actor", actor_shape, args, "actor_", gathered_for=("generation",) if hybrid else ())
    models = [actor]
    frozen_stage = 3 if args.actor_zero_stage == 3 else 0
    experience = ("experience",) if gathered_experience else ()
    if needs_reference:
        off = bool(args.offload_reference_model)
        models.append(
            ModelSpec(
                "reference",
                actor_shape,
                zero_stage=3 if off else frozen_stage,
                offload=off,
                load_in_4bit=four_bit,
                gathered_for=experience,
            )
        )
    if needs_critic:
        critic_shape = backbone(shapes[args.critic_model_name_or_path])
        models.append(trained_model("critic", critic_shape, args, "critic_", gathered_for=experience))
    reward_stage = 3 if args.critic_zero_stage == 3 else 0
    for i, path in enumerate(reward_paths):
        off = bool(args.offload_reward_model)
        name = "reward model" if len(reward_paths) == 1 else f"reward model {i + 1}"
        models.append(
            ModelSpec(
                name,
                backbone(shapes[path]),
                zero_stage=3 if off else reward_stage,
                offload=off,
                load_in_4bit=four_bit,
                gathered_for=experience,
            )
        )
    if args.enable_ema:
        off = bool(args.offload_reference_model)
        models.append(
            ModelSpec(
                "ema",
                actor_shape,
                lora_dim=args.actor_lora_dim,
                zero_stage=3 if off else frozen_stage,
                offload=off,
                load_in_4bit=four_bit,
            )
        )
    plan = Plan("rl", ranks, dtype, load_bytes=max(parameter_bytes(m, dtype) for m in models))
    for model in models:
        plan.parts += model_state_parts(model, dtype, ranks)
    # the experience phase gathers one model at a time: only the largest gathered copy is held at once
    scoring = [p for p in plan.parts if p.phases == ("experience",) and p.name.endswith("gathered copy")]
    if scoring:
        largest = max(scoring, key=lambda p: p.bytes)
        plan.parts = [p for p in plan.parts if p not in scoring]
        plan.parts.append(
            Part(
                f"gathered for scoring (one at a time; largest: {largest.name.removesuffix(' gathered copy')})",
                largest.bytes,
                largest.where,
                ("experience",),
                hint="--no_gathered_experience",
            )
        )
    # generation: the rollout's rows, prompt + answer tokens
    rows = args.per_device_generation_batch_size * args.n_samples_per_prompt
    length = args.max_prompt_seq_len + args.max_answer_seq_len
    plan.parts.append(
        Part(
            f"KV cache ({rows} rows x {length} tokens)",
            kv_cache_bytes(actor_shape, rows, length, dtype),
            phases=("generation",),
            hint="--per_device_generation_batch_size, --max_answer_seq_len",
        )
    )
    plan.parts.append(Part("generation logits", logits_bytes(actor_shape, rows, 0, copies=2), phases=("generation",)))
    # experience: no-grad forwards over the rollout (logits of the actor/reference, log-probs gathered)
    batches = getattr(args, "generation_batches", 1)
    chunk = getattr(args, "logprob_chunk_tokens", 0) or 0
    budget = getattr(args, "max_tokens_per_micro_batch", 0) or 0  # bounds a training micro-batch's tokens
    plan.parts.append(
        Part(
            f"experience logits ({rows} rows x {length} tokens)",
            logits_bytes(actor_shape, rows * length, chunk, copies=1),
            phases=("experience",),
            hint="--logprob_chunk_tokens 1024",
        )
    )
    if batches > 1:
        plan.notes.append(f"{batches} generation batches per iteration: their rows are kept between phases")
    # training: actor then critic over one mini-batch; the larger of the two is the peak
    mini = args.per_device_training_batch_size
    actor_parts = training_parts(
        actor,
        dtype,
        mini,
        length,
        args.actor_gradient_checkpointing,
        getattr(args, "attn_implementation", None),
        chunk,
        True,
        budget,
    )
    plan.parts += actor_parts
    if needs_critic:
        critic = next(m for m in models if m.name == "critic")
        critic_parts = training_parts(
            critic,
            dtype,
            mini,
            length,
            args.critic_gradient_checkpointing,
            getattr(args, "attn_implementation", None),
            chunk,
            False,
            budget,
        )
        if critic_parts[0].bytes > sum(p.bytes for p in actor_parts):
            plan.parts = [p for p in plan.parts if p not in actor_parts] + critic_parts
    return plan


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #
def largest_parts(plan: Plan, where: str = "device", count: int = 2) -> list[Part]:
    phase = plan.peak_phase(where)
    held = [p for p in plan.parts if phase in p.phases and plan.holds(p, where)]
    return sorted(held, key=lambda p: p.bytes, reverse=True)[:count]


def verdict(plan: Plan, limit_gib: float, where: str = "device") -> str:
    """ "fits: 18.2 of 24 GiB" or "does not fit: 31.0 of 24 GiB; largest: optimizer states 12.1 (try ...), ..."."""
    total = plan.total(where) / GIB
    if total <= limit_gib:
        return f"fits: {total:.1f} of {limit_gib:.3g} GiB"
    advice = ", ".join(
        f"{p.name} {p.gib:.1f}" + (f" (try {p.hint})" if p.hint else "") for p in largest_parts(plan, where)
    )
    return f"does not fit: {total:.1f} of {limit_gib:.3g} GiB; largest: {advice}"


def format_plan(plan: Plan, limit_gib: float) -> str:
    """The table of parts per rank (GiB), the phase totals and the one-line verdict."""
    device = plan.device
    lines = [f"memory plan: step {plan.step}, {plan.ranks} rank(s), {plan.dtype}, per rank (GiB)"]
    lines += [f"  {note}" for note in plan.notes]
    width = max(len(p.name) for p in plan.parts) if plan.parts else 10
    phases = plan.phases
    lines.append(f"  {'part':<{width}}  {'GiB':>8}  where   phases")
    for part in plan.parts:
        where = device if part.where == "device" else "cpu"
        held = "all" if part.phases == PHASES else ",".join(part.phases)
        lines.append(f"  {part.name:<{width}}  {part.gib:8.3f}  {where:<6}  {held}")
    if plan.runtime_bytes:
        lines.append(
            f"  {'runtime (libraries, allocator)':<{width}}  {plan.runtime_bytes / GIB:8.3f}  {device:<6}  all"
        )
    for phase in phases:
        lines.append(
            f"  {phase} phase: {(plan.phase_total(phase) + plan.runtime_bytes) / GIB:.3f} GiB on {device}"
            + (f", {plan.phase_total(phase, 'cpu') / GIB:.3f} GiB in CPU memory" if device != "cpu" else "")
        )
    lines.append(verdict(plan, limit_gib))
    return "\n".join(lines)
