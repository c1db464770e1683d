"""Generation sees the same positions as scoring and training: a prompt generated alone and the same
prompt left-padded in a batch give the same greedy tokens, also for gpt2's absolute positions; a prompt's
repeats share its prefill without changing a token or a log-prob."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from utils.models.forward import generate, sampled_logprobs, shared_prompt_cache
from utils.models.loading import load_tokenizer


def test_left_padding_does_not_change_greedy_tokens(tiny_gpt2):
    tokenizer = load_tokenizer(tiny_gpt2, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    prompts = ["Human: a\n\nAssistant:", "Human: a much longer prompt with many more words in it\n\nAssistant:"]
    kwargs = dict(
        max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id
    )
    alone = [model.generate(**tokenizer(p, return_tensors="pt"), **kwargs)[0, -6:] for p in prompts]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0].eq(0).sum() > 5  # the short prompt is heavily left-padded
    together = model.generate(**batch, **kwargs)[:, -6:]
    for i in range(len(prompts)):
        assert together[i].tolist() == alone[i].tolist()


@pytest.mark.parametrize("model_fixture", ["tiny_gpt2", "tiny_llama", "tiny_opt"])
def test_a_repeated_prompts_cache_is_shared_and_changes_no_token_or_logprob(model_fixture, request):
    """A group's n samples of one prompt: utils.models.forward.generate runs each distinct prompt's prefill once
    (shared_prompt_cache) and gives the tokens and generator log-probs of the unshared prefill (to float
    rounding: the last prompt token now runs as a decoding step)."""
    path = request.getfixturevalue(model_fixture)
    tokenizer = load_tokenizer(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = tokenizer(
        ["Human: a\n\nAssistant:", "Human: a much longer prompt with words\n\nAssistant:"],
        return_tensors="pt",
        padding=True,
    )
    ids, mask = batch["input_ids"].repeat_interleave(3, 0), batch["attention_mask"].repeat_interleave(3, 0)
    cache = shared_prompt_cache(model, ids, mask)
    assert cache is not None and cache.layers[0].keys.shape[0] == 6 and cache.get_seq_length() == ids.shape[1] - 1
    assert shared_prompt_cache(model, batch["input_ids"], batch["attention_mask"]) is None  # nothing repeats
    kwargs = dict(
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=True,
        temperature=0.9,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        use_cache=True,
    )
    torch.manual_seed(3)
    shared, shared_logprobs = generate(model, ids, mask, logprob_temperature=0.9, **kwargs)
    torch.manual_seed(3)
    with torch.no_grad():
        plain = model.generate(
            input_ids=ids, attention_mask=mask, output_logits=True, return_dict_in_generate=True, **kwargs
        )
    assert torch.equal(shared, plain.sequences)
    reference = sampled_logprobs(plain.logits, plain.sequences[:, ids.shape[1] :], 0.9)
    assert (shared_logprobs - reference).abs().max() <= 1e-5  # measured: 0 (llama), 9.5e-7 (gpt2, OPT)
