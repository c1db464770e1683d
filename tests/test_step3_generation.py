"""Generation sees the same positions as scoring and training: a prompt generated alone and the same
prompt left-padded in a batch give the same greedy tokens, also for gpt2's absolute positions."""
import torch
from transformers import AutoModelForCausalLM

from utils.model import load_tokenizer


def test_left_padding_does_not_change_greedy_tokens(tiny_gpt2):
    tokenizer = load_tokenizer(tiny_gpt2, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_gpt2, dtype=torch.float32).eval()
    prompts = ["Human: a\n\nAssistant:", "Human: a much longer prompt with many more words in it\n\nAssistant:"]
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id)
    alone = [model.generate(**tokenizer(p, return_tensors="pt"), **kwargs)[0, -6:] for p in prompts]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert batch["attention_mask"][0].eq(0).sum() > 5  # the short prompt is heavily left-padded
    together = model.generate(**batch, **kwargs)[:, -6:]
    for i in range(len(prompts)):
        assert together[i].tolist() == alone[i].tolist()
