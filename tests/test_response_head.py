"""The LM head over the trained positions only (utils.models.forward: transformers' `logits_to_keep`): the same
log-probs, loss and gradients as the head over the whole sequence, with the head fed only the kept positions."""

import pytest
import torch

from utils.math.losses import IGNORE_INDEX, sft_nll
from utils.math.rows import Row, pack
from utils.models.forward import causal_lm_logits, lm_nll, token_logprobs
from utils.models.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="module")
def model(tiny_llama):
    torch.manual_seed(0)
    return load_causal_lm(tiny_llama, load_tokenizer(tiny_llama)).float().eval()


def rollout_batch():
    rows = [
        Row(prompt_ids=torch.tensor([5, 6, 7, 8, 9]), response_ids=torch.tensor([10, 11, 2]), ended_with_eos=True),
        Row(prompt_ids=torch.tensor([12, 13]), response_ids=torch.tensor([14, 15, 16, 17, 18]), ended_with_eos=False),
    ]
    return pack(rows, pad_token_id=0)


@pytest.fixture
def head_inputs():
    """head_inputs(model) -> the list of the sequence lengths the model's LM head is fed from then on (a forward
    hook, removed after the test)."""
    handles = []

    def watch(model):
        seen = []
        handles.append(model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1])))
        return seen

    yield watch
    for handle in handles:
        handle.remove()


def test_token_logprobs_run_the_head_on_the_response_and_give_the_whole_heads_values(model, head_inputs):
    batch = rollout_batch()  # prompt_len 5, length 10
    whole = token_logprobs(
        model,
        {k: v for k, v in batch.items() if k != "prompt_len"},
        temperature=0.7,
        return_entropy=True,
        chunk_tokens=0,
    )
    seen = head_inputs(model)
    kept = token_logprobs(model, batch, temperature=0.7, return_entropy=True, chunk_tokens=0)
    assert seen == [10 - 5 + 1]  # positions 4..9: the last prompt token predicts the first response token
    p = batch["prompt_len"]
    for w, k in zip(whole, kept):
        assert k.shape == w.shape == (2, 9)
        torch.testing.assert_close(k[:, p - 1 :], w[:, p - 1 :], rtol=0, atol=1e-6)
        assert torch.all(k[:, : p - 1] == 0)
    mask = batch["action_mask"]
    assert torch.all((kept[0] != 0)[mask.bool()])  # every action position got its log-prob


def test_lm_nll_runs_the_head_from_the_first_trained_label_with_the_same_loss_and_gradients(model, head_inputs):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 2], [12, 13, 14, 15, 16, 17, 0, 0]])
    mask = (ids != 0).long()
    labels = ids.clone()
    labels[0, :5] = IGNORE_INDEX  # row 0 trains from position 5, row 1 from position 3
    labels[1, :3] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        nll, count = fn()
        (nll / count).backward()
        return nll.detach(), count, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    nll_w, count_w, grads_w = loss_and_grads(lambda: sft_nll(causal_lm_logits(model, ids, mask), labels))
    seen = head_inputs(model)
    nll_k, count_k, grads_k = loss_and_grads(lambda: lm_nll(model, batch, 0))
    assert seen == [8 - 2]  # position 2 predicts the first trained label (row 1's position 3)
    assert count_k == count_w == 6
    torch.testing.assert_close(nll_k, nll_w, rtol=1e-6, atol=1e-6)
    for gk, gw in zip(grads_k, grads_w):
        torch.testing.assert_close(gk, gw, rtol=1e-5, atol=1e-7)


def test_no_trained_label_runs_the_whole_head(model, head_inputs):
    ids = torch.tensor([[5, 6, 7]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, IGNORE_INDEX)}
    seen = head_inputs(model)
    nll, count = lm_nll(model, batch, 0)
    assert seen == [3] and count == 0 and nll == 0


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gpt2"])
def test_shared_prompts_give_the_one_pass_log_probs_with_each_prompt_run_once(arch, request):
    """The reference's scoring of a GRPO rollout (token_logprobs' share_prompts): rows repeating a prompt with
    answers of different lengths (EOS, padding after it, a left-padded shorter prompt); each distinct prompt's
    first P - 1 tokens go through the model once, and the log-probs are the one-pass forward's."""
    path = request.getfixturevalue(arch)
    torch.manual_seed(0)
    lm = load_causal_lm(path, load_tokenizer(path)).float().eval()
    prompts, answers = ([5, 6, 7, 8, 9], [12, 13]), ([10, 11, 2], [14, 15, 16, 17, 18], [19, 2], [20, 21, 22, 23])
    rows = [
        Row(prompt_ids=torch.tensor(prompts[i // 2]), response_ids=torch.tensor(a), ended_with_eos=a[-1] == 2)
        for i, a in enumerate(answers)
    ]
    batch = pack(rows, pad_token_id=0)
    one_pass = token_logprobs(lm, batch, temperature=0.7)
    fed = []
    handle = lm.get_input_embeddings().register_forward_hook(lambda module, args, out: fed.append(tuple(args[0].shape)))
    try:
        shared = token_logprobs(lm, batch, temperature=0.7, share_prompts=True)
    finally:
        handle.remove()
    p, length = batch["prompt_len"], batch["input_ids"].shape[1]
    assert fed == [(2, p - 1), (4, length - p + 1)]  # 2 distinct prompts once, then every row's rest
    mask = batch["action_mask"].bool()
    assert shared.shape == one_pass.shape
    torch.testing.assert_close(shared[mask], one_pass[mask], rtol=0, atol=1e-5)
