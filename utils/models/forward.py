"""The ONE way every model of the project is run: forwards, device placement, eval mode, generation.

Every forward of a causal LM or of a value-head model (reward model, critic) goes through here,
whether the model is a DeepSpeed engine (any ZeRO stage) or a plain module:
- position ids come from the attention mask (utils.math.ops.position_ids_from_attention_mask) and the
  KV cache is off, so a token's log-prob or value does not depend on the padding of its batch (a group's
  repeated prompt is the exception: run once and its cache shared, in generation and in the reference's
  no-grad scoring, see shared_prompt_cache);
- inputs are moved to the model's device here (rows, packed batches and data-loader batches stay
  on the CPU until a forward reads them);
- log-prob and loss math is fp32 whatever the model's dtype;
- token log-probs, entropies and the SFT loss go through the LM head `chunk_tokens` tokens at a time
  (`--logprob_chunk_tokens`, causal_lm_hidden + utils.math.ops.chunked_head): no [B, T, V] logits tensor
  exists, forward or backward;
- with `padding_free` (`--padding_free`) the training and scoring forwards run a batch's real tokens as ONE
  sequence [1, N], position ids restarting per row (utils.math.ops.packed_tokens_index): no padding is computed,
  no token attends across rows, and the outputs land on the padded layout's positions, so every loss and mask
  downstream is the padded path's.
Generation settings (greedy or sampling, temperature, top-p, top-k) are built into `generate`
keyword arguments in one place too, for step 3's rollout, its evaluation, prompt_eval and chat.py.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from utils.errors import UsageError
from utils.math.losses import IGNORE_INDEX, sft_nll, token_nll
from utils.math.ops import (
    chunked_head,
    entropy_from_logits,
    logprobs_from_logits,
    masked_sum,
    packed_predictions,
    packed_tokens_index,
    position_ids_from_attention_mask,
    scatter_packed,
    sequence_score,
)
from utils.math.sampling import processed_token_logprobs
from utils.runtime.distributed import all_reduce_max, world_size

# Tokens per LM-head chunk of the log-prob forwards: the default of --logprob_chunk_tokens (utils/train/flags.py;
# tests/test_chunked_logprobs.py holds the two equal). 0 computes the whole [B, T, V] logits at once.
LOGPROB_CHUNK_TOKENS = 512
# Config attributes of models whose logits are transformed after the LM head (Gemma 2/3's soft-capping, Cohere's
# logit_scale, Granite's logits_scaling): the chunked head would miss the transform, so these take the whole path.
POST_HEAD_ATTRIBUTES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


# --------------------------------------------------------------------------- #
# Device placement and mode
# --------------------------------------------------------------------------- #
def model_device(model: nn.Module) -> torch.device:
    """The device a model's (or DeepSpeed engine's) inputs must be on."""
    device = getattr(model, "device", None)
    if isinstance(device, (torch.device, str)):
        return torch.device(device)
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch with every tensor on `device` (other values as they are; no copy when already there)."""
    return {k: v.to(device) if isinstance(v, Tensor) else v for k, v in batch.items()}


@contextlib.contextmanager
def eval_mode(*models):
    """Models (or engines) in eval mode (dropout off) inside; each one's previous mode restored after."""
    states = [getattr(m, "module", m).training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, state in zip(models, states):
            m.train(state)


# --------------------------------------------------------------------------- #
# Forwards
# --------------------------------------------------------------------------- #
def causal_lm_logits(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0, shared_prompt_len: int = 0
) -> Tensor:
    """Logits [B, L, V] of a causal LM: mask-derived position ids, no KV cache, inputs on its device.

    With `logits_to_keep` K (0 < K < L) only the last K positions' logits [B, K, V]: transformers' own
    argument, so the LM head and the softmaxes after it skip the prompt (the head is ~20% of a small
    model's FLOPs; its fp32 [B, L, V] logits, their softmax and gradient ~1 GB of a tool-demo rank's step).
    A model class without the argument computes them all and is sliced.

    With `shared_prompt_len` P (no-grad scoring of rows whose first P tokens are their left-padded prompts,
    K = L - P + 1): each distinct prompt's first P - 1 tokens run once and their KV cache is copied to its
    rows (shared_prompt_cache), then every row's last L - P + 1 tokens run on it. A GRPO group of G answers
    pays its prompt once instead of G times; the logits are the one-pass forward's to float rounding (SmolLM2:
    within 6e-5 of logits up to ~30). Always two forwards, whether or not a prompt repeats."""
    device = model_device(model)
    if shared_prompt_len > 1 and logits_to_keep == input_ids.shape[1] - shared_prompt_len + 1:
        p = shared_prompt_len
        cache = shared_prompt_cache(model, input_ids[:, :p], attention_mask[:, :p], always=True)
        if cache is not None:
            input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
            return model(
                input_ids=input_ids[:, p - 1 :],
                attention_mask=attention_mask,
                position_ids=position_ids_from_attention_mask(attention_mask)[:, p - 1 :],
                cache=cache,
                use_cache=True,
            ).logits
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    keep = logits_to_keep if 0 < logits_to_keep < input_ids.shape[1] else 0
    extra = {"logits_to_keep": keep} if keep and _takes_logits_to_keep(type(_hf_model(model))) else {}
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_attention_mask(attention_mask),
        use_cache=False,
        **extra,
    )
    return out.logits[:, -keep:] if keep and not extra else out.logits


def causal_lm_hidden(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int = 0, shared_prompt_len: int = 0
) -> Tensor:
    """The LM head's input [B, K, H] (the decoder's last hidden states, after its final norm) at the positions
    whose logits causal_lm_logits returns with the same arguments, from the same forward: the model (engine,
    peft wrapper and all) runs as there, and a pre-hook on the output-embedding module records the head's input
    and hands the head only its last position (a [B, 1, V] logits tensor, discarded).

    Why the whole model and a hook rather than calling the decoder directly: every wrapper's forward still runs
    (the DeepSpeed engine's, whose ZeRO-3 root hook starts each step's parameter trace; peft's), and each model
    class keeps its own route from the decoder to the head (OPT's `model.decoder`, GPT-2's `transformer`),
    with no per-architecture table. The head is then applied by the caller (chunked_head), through the same
    module: LoRA on it, tied embeddings and ZeRO-3's parameter hooks work as in the whole forward."""
    hidden = _head_input(
        model, lambda: causal_lm_logits(model, input_ids, attention_mask, logits_to_keep, shared_prompt_len)
    )
    return hidden[:, -logits_to_keep:] if 0 < logits_to_keep < hidden.shape[1] else hidden


def _head_input(model: nn.Module, forward) -> Tensor:
    """The LM head's input in `forward()` (a forward of `model`): a pre-hook on the output embeddings records it and
    hands the head only its last position. The last call's: shared_prompt_cache's prefix forward calls the head
    first."""
    head = _hf_model(model).get_output_embeddings()
    captured = []

    def keep_input(module, args):
        if not args:
            raise RuntimeError(f"{type(module).__name__}: the LM head was called without a positional input")
        captured.append(args[0])
        return (args[0][..., -1:, :], *args[1:])

    handle = head.register_forward_pre_hook(keep_input)
    try:
        forward()
    finally:
        handle.remove()
    return captured[-1]


def check_padding_free(model: nn.Module) -> None:
    """Raise UsageError (one line) when `--padding_free` cannot run `model` (an engine, peft model, RewardModel or
    plain causal LM) exactly: its attention would let packed rows see each other.

    Tried, not guessed from the class: one no-grad packed forward of two rows (3 tokens; on a ZeRO-3 engine a
    collective, so every rank calls this at the same point) while transformers' packed-row detection
    (masking_utils.find_packed_sequence_indices, which builds the block-diagonal mask from the position ids) is
    watched; a model whose mask code never asks it, or flash attention (whose varlen kernels take the row starts
    from the position ids themselves) pass or fail accordingly."""
    inner = getattr(model, "module", model)
    hf = _hf_model(getattr(inner, "backbone", inner))  # a RewardModel's backbone, else the causal LM
    if getattr(getattr(hf, "config", None), "_attn_implementation", None) in ("flash_attention_2", "flash_attention_3"):
        return
    from transformers import masking_utils  # lazy: +1.5 s of import on every --help, for a start-up check

    detected = []
    original = masking_utils.find_packed_sequence_indices

    def watched(position_ids):
        rows = original(position_ids)
        detected.append(rows is not None)
        return rows

    masking_utils.find_packed_sequence_indices = watched
    try:
        with torch.no_grad(), eval_mode(model):
            packed_forward(model, torch.tensor([[0, 1, 1], [0, 0, 1]]), torch.tensor([[0, 1, 1], [0, 0, 1]]))
    finally:
        masking_utils.find_packed_sequence_indices = original
    if not (detected and all(detected)):
        raise UsageError(
            f"--padding_free: {type(hf).__name__} builds its attention mask without the position ids, so rows "
            f"packed into one sequence would attend to each other; run it without --padding_free"
        )


def packed_forward(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
    """(the model's output [N, ...] on a batch's N real tokens run as one padding-free sequence, their index in the
    flattened [B, L] batch): a causal LM's logits or a value-head model's values. No attention mask is passed:
    the position ids restarting per row are the row boundaries (utils.math.ops.packed_tokens_index)."""
    device = model_device(model)
    index, positions = packed_tokens_index(attention_mask)
    ids, positions = input_ids.reshape(-1)[index][None].to(device), positions[None].to(device)
    value_model = getattr(getattr(model, "module", model), "v_head", None) is not None  # a RewardModel: no cache
    extra = {} if value_model else {"use_cache": False}
    out = model(input_ids=ids, attention_mask=None, position_ids=positions, **extra)
    out = out.logits if hasattr(out, "logits") else out
    return out[0], index


def packed_hidden(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """The LM head's input [N, H] at a batch's N real tokens, run as one padding-free sequence (packed_forward),
    captured as causal_lm_hidden does (_head_input)."""
    return _head_input(model, lambda: packed_forward(model, input_ids, attention_mask))[0]


def _packed_token_outputs(model, batch: dict, targets: Tensor, chunk_tokens: int, reduce, keep: Tensor):
    """Per-token outputs of `reduce(logits, targets)` ([B, L-1] each, in the layout of utils/math/ops.py; 0 where
    nothing is predicted or `keep` [B, L-1] is False) from a padding-free forward: only the positions read go
    through the LM head, `chunk_tokens` at a time (0: at once)."""
    mask = batch["attention_mask"]
    predicts, source = packed_predictions(mask, keep)
    wanted = targets[predicts]
    head = chunks_head(model, chunk_tokens)
    if head is not None:
        hidden = packed_hidden(model, batch["input_ids"], mask)[source.to(model_device(model))]
        out = head_chunks(head, hidden[None], chunk_tokens, wanted[None], reduce=reduce)
    else:
        logits = packed_forward(model, batch["input_ids"], mask)[0][source.to(model_device(model))]
        out = reduce(logits, wanted.to(logits.device))
        out = tuple(t[None] for t in (out if isinstance(out, tuple) else (out,)))
    return tuple(scatter_packed(t[0], predicts) for t in out)


def chunks_head(model: nn.Module, chunk_tokens: int) -> nn.Module | None:
    """The output-embedding module the log-prob forwards apply `chunk_tokens` tokens at a time, or None for the
    whole-logits path: `chunk_tokens` 0, a model without output embeddings, or one that transforms its logits
    after the head (POST_HEAD_ATTRIBUTES)."""
    if chunk_tokens <= 0:
        return None
    hf = _hf_model(model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    config = getattr(hf, "config", None)
    if head is None or any(getattr(config, name, None) is not None for name in POST_HEAD_ATTRIBUTES):
        return None
    return head


def head_chunks(head: nn.Module, hidden: Tensor, chunk_tokens: int, *per_token: Tensor, reduce):
    """utils.math.ops.chunked_head of `head` over `hidden` [B, T, H]. A ZeRO-3 head whose weights are partitioned
    gathers them at every call, a collective: every rank then makes as many calls as the rank with the most
    tokens (one small all-reduce of the chunk count; the extra chunks are empty), forward and backward alike."""
    count = head_chunk_count([head], hidden.shape[0] * hidden.shape[1], chunk_tokens)
    return chunked_head(hidden, head, reduce, chunk_tokens, *per_token, min_chunks=count)


def head_chunk_count(heads: list[nn.Module], tokens: int, chunk_tokens: int) -> int:
    """How many chunks of `chunk_tokens` the heads run over `tokens` positions: the most of any rank when a head's
    weights are ZeRO-3 partitioned (each call a collective), else this rank's own."""
    count = -(-tokens // chunk_tokens)
    partitioned = any(
        hasattr(p, "ds_id") and not getattr(p, "ds_persist", False) for h in heads for p in h.parameters()
    )
    if partitioned and world_size() > 1:
        count = int(all_reduce_max(float(count)))
    return count


@dataclass(frozen=True)
class HeadInput:
    """The LM head's input [B, K, H] of a padded batch from the first response prediction on (`skipped` positions
    before it), with the head module: what a divergence over the vocabulary reads a chunk at a time
    (step3_ppo.algo.distill.chunked_signal)."""

    hidden: Tensor
    head: nn.Module
    skipped: int

    def at(self, action_mask: Tensor) -> Tensor:
        """[N, H] at the N positions that predict the actions of `action_mask` [B, L-1] (the layout of
        utils/math/ops.py), in row-major order."""
        return self.hidden[:, :-1][action_mask[:, self.skipped :].to(self.hidden.device).bool()]


def head_input(model: nn.Module, batch: dict, chunk_tokens: int) -> HeadInput:
    """One forward of `model` as token_logprobs runs it (padded layout), keeping the LM head's input (a frozen
    teacher's; the trained student's comes from token_logprobs' `return_head_input`, its own forward)."""
    head = chunks_head(model, chunk_tokens)
    if head is None:
        raise ValueError("a divergence over the vocabulary needs chunked LM-head access (--logprob_chunk_tokens > 0)")
    input_ids = batch["input_ids"]
    skipped = max(int(batch.get("prompt_len", 1)) - 1, 0)
    hidden = causal_lm_hidden(model, input_ids, batch["attention_mask"], input_ids.shape[1] - skipped)
    return HeadInput(hidden, head, skipped)


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a DeepSpeed engine and/or a peft wrapper."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.lru_cache(maxsize=None)
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def token_logprobs(
    model: nn.Module,
    batch: dict,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = False,
    share_prompts: bool = False,
    chunk_tokens: int = LOGPROB_CHUNK_TOKENS,
    padding_free: bool = False,
    return_top1: bool = False,
    return_head_input: bool = False,
    return_processed: tuple[int, float] | None = None,
):
    """log p(token i+1 | prefix) [B, L-1] fp32 of a packed batch (utils.math.rows.pack: input_ids,
    attention_mask, prompt_len, ...), in the layout of utils/math/ops.py; optionally with the per-token entropy,
    detached (a monitor) unless `entropy_grad` (an entropy bonus in the loss).

    Only the response positions (from `prompt_len` - 1 on, the first that predicts a response token) go
    through the LM head; the prompt positions before them hold 0, which every reader masks out.

    `temperature` divides the logits first: sampling draws from softmax(logits / T), so the policy
    whose ratio PPO clips is that one, and the reference is scored the same way so that the KL
    compares like with like.

    `chunk_tokens` N > 0 (`--logprob_chunk_tokens`): the decoder runs once, then the head and the softmaxes
    after it run N tokens at a time (causal_lm_hidden, utils.math.ops.chunked_head), each chunk's logits
    recomputed in the backward instead of kept: no [B, L-1, V] tensor exists, forward or backward, for one
    more head matmul per chunk in a training forward. The same arithmetic per token as N = 0, which computes
    the whole logits at once (and, with `entropy_grad`, keeps their softmax for the backward).

    `share_prompts` (no-grad scoring; every rank the same, it is two forwards): a prompt repeated in the
    batch runs once (causal_lm_logits' `shared_prompt_len`).

    `padding_free` (`--padding_free`; not with `share_prompts`, which keeps its padded prefix cache): the batch's
    real tokens run as one sequence (packed_forward) and only the response positions go through the head; the
    other positions hold 0.

    `return_top1`: also the model's most likely token at each position (its argmax, a float tensor), read
    from the same logits: the distillation metrics compare a student's with its teacher's.

    `return_processed` (top_k, top_p) of the rollout's sampling (no-grad scoring only): also each token's log-prob
    under the distribution sampled, softmax(logits / T) after top-k and top-p (utils.math.sampling.processed_logprobs;
    vLLM's processed log-probs), read from the same logits after the top-1.

    `return_head_input` (the chunked padded path only): also the LM head's input (`HeadInput`, last), so that a
    divergence over the vocabulary in the same loss reuses this forward instead of running the decoder again.
    """
    if return_processed is not None and torch.is_grad_enabled():
        raise ValueError("return_processed is for no-grad scoring (its top-k / top-p masks have no gradient)")
    input_ids = batch["input_ids"]
    skipped = max(int(batch.get("prompt_len", 1)) - 1, 0)  # positions before the first prediction of a response token
    keep, shared = input_ids.shape[1] - skipped, skipped + 1 if share_prompts else 0
    labels = input_ids[:, 1 + skipped :]

    def reduce(logits: Tensor, targets: Tensor):
        raw = logits
        if temperature != 1.0:
            logits = logits / temperature
        out = (logprobs_from_logits(logits, targets),)
        if return_entropy:
            out += (entropy_from_logits(logits if entropy_grad else logits.detach()),)
        if return_top1:
            out += (logits.detach().argmax(dim=-1).float(),)
        if return_processed is not None:  # from the raw logits: fp32 before the temperature, as the samplers
            out += (processed_token_logprobs(raw.detach(), targets, temperature, *return_processed),)
        return out if len(out) > 1 else out[0]

    head = chunks_head(model, chunk_tokens)
    if return_head_input and (head is None or padding_free or share_prompts):
        raise ValueError("return_head_input needs the chunked padded path (chunk_tokens > 0, not padding-free)")
    if padding_free and not share_prompts:
        keep = torch.zeros(labels.shape[0], input_ids.shape[1] - 1, dtype=torch.bool)
        keep[:, skipped:] = True
        out = _packed_token_outputs(model, batch, input_ids[:, 1:], chunk_tokens, reduce, keep)
        return out if len(out) > 1 else out[0]
    if head is not None:
        # every kept position, the last one's (which predicts nothing) dropped after: one chunk then runs the
        # whole path's matmuls on the same rows, so its numbers are the whole path's bit for bit
        hidden = causal_lm_hidden(model, input_ids, batch["attention_mask"], keep, shared)
        out = head_chunks(head, hidden, chunk_tokens, F.pad(labels, (0, 1)), reduce=reduce)
        out = tuple(t[:, :-1] for t in out)
    else:
        out = reduce(causal_lm_logits(model, input_ids, batch["attention_mask"], keep, shared)[:, :-1], labels)
        out = out if isinstance(out, tuple) else (out,)
    out = tuple(_front_pad(t, skipped) for t in out)
    if return_head_input:
        out += (HeadInput(hidden, head, skipped),)
    return out if len(out) > 1 else out[0]


def _front_pad(per_token: Tensor, n: int) -> Tensor:
    """[B, T] -> [B, n + T] with zeros in front (the prompt positions token_logprobs leaves out)."""
    return torch.nn.functional.pad(per_token, (n, 0)) if n else per_token


def sequence_logprobs(
    model: nn.Module, batch: dict, chunk_tokens: int = LOGPROB_CHUNK_TOKENS, padding_free: bool = False
) -> tuple[Tensor, Tensor]:
    """(log p(response | prompt) [B], response tokens [B]) fp32: the token log-probs of ``batch``
    (input_ids, attention_mask, action_mask on the response tokens) summed over ``action_mask``:
    DPO's sequence log-probs. Positions from the mask make them independent of the padding."""
    action_mask = batch["action_mask"]
    logprobs = token_logprobs(model, batch, chunk_tokens=chunk_tokens, padding_free=padding_free)
    return masked_sum(logprobs, action_mask, dim=1), action_mask.to(logprobs.device).sum(dim=1)


def lm_nll(
    model: nn.Module, batch: dict, chunk_tokens: int = LOGPROB_CHUNK_TOKENS, padding_free: bool = False
) -> tuple[Tensor, Tensor]:
    """(sum of next-token NLL over the trained labels of `batch`, their count): step 1, PPO-ptx, perplexity.
    The LM head runs from the batch's first trained prediction on (prompts before it are skipped), `chunk_tokens`
    tokens at a time as in token_logprobs (0: the whole logits, utils.math.losses.sft_nll); each token's NLL is
    utils.math.losses.token_nll, the arithmetic of sft_nll. `padding_free`: one padding-free forward, the head on
    the trained positions only."""
    labels = batch["labels"]
    if padding_free:
        targets = labels[:, 1:]
        (nll,) = _packed_token_outputs(model, batch, targets, chunk_tokens, token_nll, targets != IGNORE_INDEX)
        count = packed_predictions(batch["attention_mask"], targets != IGNORE_INDEX)[1].numel()
        return nll.sum(), torch.tensor(count, device=nll.device)
    trained = (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero()
    start = int(trained[0]) if len(trained) else 0  # the first position whose prediction is trained
    head = chunks_head(model, chunk_tokens)
    if head is None:
        logits = causal_lm_logits(model, batch["input_ids"], batch["attention_mask"], labels.shape[1] - start)
        return sft_nll(logits, labels[:, start:])
    hidden = causal_lm_hidden(model, batch["input_ids"], batch["attention_mask"], labels.shape[1] - start)
    # every kept position, the last one untrained (it predicts nothing), as in token_logprobs
    targets = F.pad(labels[:, start + 1 :], (0, 1), value=IGNORE_INDEX).to(hidden.device)
    (nll,) = head_chunks(head, hidden, chunk_tokens, targets, reduce=token_nll)
    return nll.sum(), (targets != IGNORE_INDEX).sum()


def token_values(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, padding_free: bool = False) -> Tensor:
    """Per-token values [B, L-1] fp32 of a value-head model (the critic), in the layout of utils/math/ops.py.

    Position i is the value of the state in which token i+1 is chosen. The RewardModel's forward
    derives its position ids from the mask itself (utils/models/reward_model.py). `padding_free`: one
    padding-free forward (packed_forward); padding positions hold 0.
    """
    if padding_free:
        return _packed_values(model, input_ids, attention_mask)[:, :-1]
    device = model_device(model)
    return model(input_ids.to(device), attention_mask.to(device))[:, :-1].float()


def sequence_scores(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, padding_free: bool = False) -> Tensor:
    """[B] fp32: a value-head model's value at each row's last real token (the reward model's score)."""
    if padding_free:
        values = _packed_values(model, input_ids, attention_mask)
        return sequence_score(values, attention_mask.to(values.device))
    device = model_device(model)
    attention_mask = attention_mask.to(device)
    return sequence_score(model(input_ids.to(device), attention_mask).float(), attention_mask)


def _packed_values(model: nn.Module, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """[B, L] fp32 values of a value-head model from one padding-free forward, 0 on padding."""
    values, _ = packed_forward(model, input_ids, attention_mask)
    return scatter_packed(values.float(), (attention_mask != 0).to(values.device))


# --------------------------------------------------------------------------- #
# Generation
# --------------------------------------------------------------------------- #
@dataclass
class GenerationSettings:
    """How answers are decoded; utils/train/flags.py add_generation_args defines the flags of the sampling part."""

    max_new_tokens: int
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_new_tokens: int | None = None
    num_beams: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if self.num_beams is not None and self.num_beams < 1:
            raise ValueError(f"num_beams must be >= 1, got {self.num_beams}")

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the answers are drawn from (1 for greedy decoding)."""
        return self.temperature if self.do_sample else 1.0


def generation_kwargs(settings: GenerationSettings, stop_token_ids, pad_token_id: int) -> dict:
    """`generate` keyword arguments; the sampling knobs are passed only when sampling (None otherwise,
    so a model's generation_config cannot switch them on behind our back). ``stop_token_ids``: EOS,
    or a list of the tokens that end a response (EOS and a chat template's end-of-turn token)."""
    stop = [stop_token_ids] if isinstance(stop_token_ids, int) else list(stop_token_ids)
    kwargs = {
        "max_new_tokens": settings.max_new_tokens,
        "do_sample": settings.do_sample,
        "eos_token_id": stop[0] if len(stop) == 1 else stop,
        "pad_token_id": pad_token_id,
        "use_cache": True,
    }
    if settings.min_new_tokens is not None:
        kwargs["min_new_tokens"] = settings.min_new_tokens
    if settings.num_beams is not None:
        kwargs["num_beams"] = settings.num_beams
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    return kwargs


@torch.no_grad()
def generate(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, logprob_temperature: float | None = None, **kwargs
):
    """Sequences [B, P + T] of a plain (unwrapped) causal LM for left-padded prompts [B, P], on its device.

    With `logprob_temperature`: (sequences, the generator's own log-probs [B, T] fp32 of the tokens it
    chose, under softmax(logits / logprob_temperature)), the distribution the trainer scores
    (`token_logprobs`; before min-length, top-k and top-p processing: the policy trained, so that
    `--old_logprobs rollout` can stand for the trainer's forward; the vLLM worker's are after top-k and top-p).
    `generate` is asked for its raw logits (`output_logits`), which it keeps for every step: T x B x V x 4 bytes
    more while generating (16 rows x 64 tokens x 49152 tokens of SmolLM2: 0.2 GB), freed here. Rows that
    repeat a prompt share its prefill (shared_prompt_cache; not with beam search or plain ZeRO-3's
    `synced_gpus`, where every rank must run the same forwards).
    """
    device = model_device(model)
    if not kwargs.get("synced_gpus") and (kwargs.get("num_beams") or 1) == 1:
        cache = shared_prompt_cache(model, input_ids, attention_mask)
        if cache is not None:
            kwargs["cache"] = cache
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    if logprob_temperature is None:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    out = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, output_logits=True, return_dict_in_generate=True, **kwargs
    )
    return out.sequences, sampled_logprobs(out.logits, out.sequences[:, input_ids.shape[1] :], logprob_temperature)


def shared_prompt_cache(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, always: bool = False):
    """The KV cache of left-padded prompts [B, P] whose rows repeat (a group's n samples of one prompt), for
    `generate` to continue from: each distinct prompt's first P - 1 tokens run once (position ids from the
    mask) and its cache rows copied to its repeats; generate then runs the last prompt token of every row and
    samples on. The prefill of a GRPO rollout of G samples per prompt costs 1/G of a full one; the tokens and
    their logits are those of the unshared prefill (SmolLM2 and the tiny llama on CPU: bitwise; gpt2 and OPT:
    log-probs within 1e-6, tests/test_step3_generation.py). None when no row repeats (`always`: the cache
    anyway), the prompt is one token, or the model's cache cannot be copied by rows."""
    if input_ids.shape[1] < 2:
        return None
    unique, inverse = torch.unique(
        torch.cat([input_ids, attention_mask.to(input_ids.dtype)], 1), dim=0, return_inverse=True
    )
    if len(unique) == len(input_ids) and not always:
        return None
    rows = torch.arange(len(input_ids), device=input_ids.device)
    first = torch.full((len(unique),), len(input_ids), device=input_ids.device).scatter_reduce(0, inverse, rows, "amin")
    device = model_device(model)
    mask = attention_mask[first, :-1].to(device)
    extra = {"logits_to_keep": 1} if _takes_logits_to_keep(type(_hf_model(model))) else {}
    out = model(
        input_ids=input_ids[first, :-1].to(device),
        attention_mask=mask,
        position_ids=position_ids_from_attention_mask(mask),
        use_cache=True,
        **extra,
    )
    cache = getattr(out, "past_key_values", None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    cache.batch_select_indices(inverse.to(device))
    return cache


def sampled_logprobs(step_logits, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """[B, T] fp32: log softmax(step_logits[t] / temperature) at tokens[:, t], one step at a time (no
    [B, T, V] stack); `step_logits` is `generate`'s tuple of T raw [B, V] logits."""
    if len(step_logits) != tokens.shape[1]:
        raise ValueError(f"{len(step_logits)} steps of logits for {tokens.shape[1]} generated tokens")
    columns = [
        logprobs_from_logits(logits.float() / temperature, tokens[:, t].to(logits.device))
        for t, logits in enumerate(step_logits)
    ]
    return torch.stack(columns, dim=1) if columns else tokens.new_zeros(tokens.shape, dtype=torch.float32)
