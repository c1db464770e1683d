"""Generation for evaluation: `Answer`s of a policy (prompts tokenised like training), re-tokenisation."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import torch

from utils.data import PromptCollator, encode, is_chat, stop_token_ids, tokenize_prompts
from utils.math.rows import Row, split_generation
from utils.models.forward import GenerationSettings, eval_mode, generate, generation_kwargs, model_device

_NO_PROMPT_LIMIT = 1 << 30


@dataclass
class Answer(Row):
    """A generated answer: a `Row` (prompt_ids, response_ids, ended_with_eos; packable with `pack`)
    plus the prompt text and the decoded response text (special tokens skipped)."""

    prompt: str | list = ""  # a string, or a message list rendered with the chat template
    text: str = ""


def generate_answers(
    model,
    tokenizer,
    prompts: Sequence[str],
    settings: GenerationSettings,
    batch_size: int = 8,
    seed: int = 0,
    max_prompt_len: int | None = None,
    logprobs: bool = False,
) -> list[Answer]:
    """One answer per prompt, decoded as `settings` say (greedy, beam search or sampling; one beam
    unless `settings.num_beams` asks for more), generated in left-padded batches of `batch_size`;
    stops at EOS (and for message-list prompts, rendered with the chat template as in training, at
    its end-of-turn token).

    Prompts are tokenised like training (`tokenize_prompts`: no special tokens, BOS only where the
    tokenizer's config adds one; `max_prompt_len` keeps the LAST tokens of a longer prompt, None
    keeps all). Each answer holds the real prompt ids, the response ids up to and including the
    first EOS (all `max_new_tokens` tokens when none came), `ended_with_eos`, the prompt and the
    decoded response text. Sampling draws from a torch RNG seeded with `seed` inside a forked RNG
    state (the caller's global RNG is left untouched). With `logprobs`, each answer's
    `per_action["logprobs"]` holds the generator's log p(token | prefix) of its response tokens under the
    model's raw distribution (temperature 1, before top-k/top-p), the values a forward would give up to
    kernel rounding: `kl_to_reference` reads them instead of running the policy again.
    """
    prompts = list(prompts)
    examples, _ = tokenize_prompts([{"prompt": p} for p in prompts], tokenizer, max_prompt_len or _NO_PROMPT_LIMIT)
    return generate_answers_from_ids(
        model, tokenizer, [ex["input_ids"] for ex in examples], settings, batch_size, seed, prompts, logprobs=logprobs
    )


@torch.no_grad()
def generate_answers_from_ids(
    model,
    tokenizer,
    prompt_ids: Sequence[Sequence[int]],
    settings: GenerationSettings,
    batch_size: int = 8,
    seed: int = 0,
    prompts: Sequence | None = None,
    stop_ids: Sequence[int] | None = None,
    logprobs: bool = False,
) -> list[Answer]:
    """`generate_answers` for prompts already tokenised (lists of ids, used as they are); ``stop_ids``
    default to EOS, plus the template's end-of-turn token when ``prompts`` are message lists."""
    prompt_ids = [list(ids) for ids in prompt_ids]
    if not prompt_ids:
        return []
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    empty = [i for i, ids in enumerate(prompt_ids) if not ids]
    if empty:
        raise ValueError(f"prompts {empty} are empty after tokenisation")
    texts = list(prompts) if prompts is not None else [tokenizer.decode(ids) for ids in prompt_ids]
    if settings.num_beams is None:  # one beam, passed explicitly: a model's generation_config cannot ask for more
        settings = replace(settings, num_beams=1)
    if stop_ids is None:
        stop_ids = stop_token_ids(tokenizer, chat=any(is_chat(p) for p in texts))
    kwargs = generation_kwargs(settings, stop_ids, tokenizer.pad_token_id)
    collate = PromptCollator(tokenizer.pad_token_id)
    device = model_device(model)
    answers: list[Answer] = []
    devices = [] if device.type == "cpu" else [device]  # the accelerator's generator is forked too
    with eval_mode(model), torch.random.fork_rng(devices=devices, device_type=device.type):
        torch.manual_seed(seed)
        for start in range(0, len(prompt_ids), batch_size):
            batch = collate([{"input_ids": ids} for ids in prompt_ids[start : start + batch_size]])
            if logprobs:
                sequences, generated = generate(
                    model, batch["input_ids"], batch["attention_mask"], logprob_temperature=1.0, **kwargs
                )
            else:
                sequences, generated = generate(model, batch["input_ids"], batch["attention_mask"], **kwargs), None
            rows = split_generation(sequences, batch["input_ids"], batch["attention_mask"], stop_ids)
            for i, (prompt, row) in enumerate(zip(texts[start : start + batch_size], rows)):
                text = tokenizer.decode(row.response_ids.tolist(), skip_special_tokens=True)
                per_action = (
                    {}
                    if generated is None
                    else {"logprobs": generated[i, : row.response_ids.numel()].float().cpu().clone()}
                )
                answers.append(
                    Answer(
                        prompt_ids=row.prompt_ids,
                        response_ids=row.response_ids,
                        ended_with_eos=row.ended_with_eos,
                        prompt=prompt,
                        text=text,
                        per_action=per_action,
                    )
                )
    return answers


def retokenize(answers: Sequence[Answer], tokenizer) -> list[Answer]:
    """The same prompt/response TEXTS tokenised for another tokenizer (a reward model of another family)."""
    out = []
    for a in answers:
        end = stop_token_ids(tokenizer, chat=is_chat(a.prompt))[-1]  # EOS, or the template's end-of-turn
        response = encode(tokenizer, a.text) + ([end] if a.ended_with_eos else [])
        if not response:
            response = [end]
        prompt_ids = tokenize_prompts([{"prompt": a.prompt}], tokenizer, _NO_PROMPT_LIMIT)[0][0]["input_ids"]
        out.append(
            Answer(
                prompt_ids=torch.tensor(prompt_ids),
                response_ids=torch.tensor(response),
                ended_with_eos=a.ended_with_eos,
                prompt=a.prompt,
                text=a.text,
            )
        )
    return out
