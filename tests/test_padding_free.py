"""Padding-free packing (`--padding_free`: a micro-batch's real tokens run as ONE sequence, position ids restarting
per row) and token-budget micro-batches (`--max_tokens_per_micro_batch`): the same log-probs, entropies, SFT loss,
values, scores and gradients as the padded path (fp32, within 1e-5), rows never attending across each other, a
model whose attention ignores the position ids refused, the budget's micro-batches never over it (veRL #7553's
packer was), the step's loss one mean over unequal micro-batches, and the lr=0 invariant with a budget that cuts the
rollout differently from the generation batches."""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, Qwen2Config

from tests.test_step3_lr0 import lr0_setup, prompt_batches
from utils.errors import ProjectError, UsageError
from utils.math.losses import IGNORE_INDEX
from utils.math.ops import packed_predictions, packed_tokens_index, scatter_packed
from utils.math.rows import Row, pack, token_budget_groups
from utils.models.forward import check_padding_free, lm_nll, sequence_scores, token_logprobs, token_values
from utils.models.reward_model import RewardModel
from utils.models.tiny import tiny_config

TOL = 1e-5


# --------------------------------------------------------------------------- pure layout helpers
def test_packed_index_and_positions_by_hand():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0], [0, 0, 1, 0]])
    index, positions = packed_tokens_index(mask)
    assert index.tolist() == [1, 2, 3, 4, 5, 10]
    assert positions.tolist() == [0, 1, 2, 0, 1, 0]


def test_predicting_positions_by_hand():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    predicts, source = packed_predictions(mask)
    # a position predicts when it and the next are real: row 0 columns 1, 2 (tokens 0, 1 of the sequence),
    # row 1 column 0 (token 3); a row's last token predicts nothing
    assert predicts.tolist() == [[False, True, True], [True, False, False]]
    assert source.tolist() == [0, 1, 3]
    keep = torch.tensor([[False, False, True], [True, True, True]])
    predicts, source = packed_predictions(mask, keep)
    assert predicts.tolist() == [[False, False, True], [True, False, False]] and source.tolist() == [1, 3]


def test_scatter_packed_puts_values_back_and_passes_gradients():
    mask = torch.tensor([[False, True, True], [True, False, False]])
    values = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = scatter_packed(values, mask)
    assert out.tolist() == [[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]]
    (out * torch.tensor([[5.0, 6.0, 7.0], [8.0, 9.0, 10.0]])).sum().backward()
    assert values.grad.tolist() == [6.0, 7.0, 8.0]
    hidden = scatter_packed(torch.arange(6.0).view(3, 2), mask)
    assert hidden[0, 2].tolist() == [2.0, 3.0] and hidden[1, 0].tolist() == [4.0, 5.0] and hidden[0, 0].sum() == 0


# --------------------------------------------------------------------------- token budget
def test_budget_groups_by_hand():
    assert token_budget_groups([5, 3, 8, 2, 7], 10) == [[2, 3], [1, 4], [0]]
    # at least 4 micro-batches: the fullest one with two rows is halved
    assert token_budget_groups([5, 3, 8, 2, 7], 10, 4) == [[2], [3], [1, 4], [0]]
    assert token_budget_groups([], 4) == []


@pytest.mark.parametrize("seed", range(20))
def test_budget_groups_never_exceed_the_budget_and_keep_every_row_once(seed):
    """veRL #7553: its packer put more than max_token_len tokens in a micro-batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
    budget = max(lengths) + int(torch.randint(0, 400, (1,), generator=g))
    minimum = len(token_budget_groups(lengths, budget))
    for count in (0, minimum, min(len(lengths), minimum + 3), len(lengths)):
        groups = token_budget_groups(lengths, budget, count)
        assert len(groups) == max(count, minimum)
        assert sorted(i for group in groups for i in group) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in group) <= budget for group in groups)
        assert all(group for group in groups)


def test_budget_refuses_a_row_longer_than_it_and_more_groups_than_rows():
    with pytest.raises(ValueError, match="row 1 has 11 tokens, more than the budget of 10"):
        token_budget_groups([5, 11], 10)
    with pytest.raises(ValueError, match="2 rows cannot fill 3"):
        token_budget_groups([5, 4], 10, 3)


# --------------------------------------------------------------------------- forwards equal the padded path
def packed_rows(vocab: int, seed: int = 0) -> dict:
    """Three rows: a left-padded shorter prompt, answers of different lengths (right padding)."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        Row(torch.randint(3, vocab, (p,), generator=g), torch.randint(3, vocab, (t,), generator=g), False)
        for p, t in ((6, 14), (4, 9), (1, 11))
    ]
    return pack(rows, pad_token_id=0)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def arch(request):
    return request.param


def causal_lm(arch: str, tied: bool = True):
    torch.manual_seed(0)
    config = tiny_config(arch, 256, 1, 2, 0)
    config.tie_word_embeddings = tied
    return AutoModelForCausalLM.from_config(config).float().eval()  # no dropout: both paths see the same model


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_close(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for name in a:
        scale = a[name].abs().max().clamp(min=1e-6)
        assert ((a[name] - b[name]).abs().max() / scale) <= TOL, name


@pytest.mark.parametrize("chunk_tokens", [0, 7])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_entropy_and_gradients_equal_the_padded_path(arch, chunk_tokens, temperature):
    model = causal_lm(arch, tied=chunk_tokens == 0)
    batch = packed_rows(256)
    action = batch["action_mask"].bool()
    results = []
    for padding_free in (False, True):
        model.zero_grad(set_to_none=True)
        logprobs, entropy = token_logprobs(
            model,
            batch,
            temperature,
            return_entropy=True,
            entropy_grad=True,
            chunk_tokens=chunk_tokens,
            padding_free=padding_free,
        )
        (logprobs * action).sum().add((entropy * action).sum() * 0.3).backward()
        results.append((logprobs.detach(), entropy.detach(), grads(model)))
    (lp, ent, g), (lp_free, ent_free, g_free) = results
    assert (lp[action] - lp_free[action]).abs().max() <= TOL
    assert (ent[action] - ent_free[action]).abs().max() <= TOL
    assert_grads_close(g, g_free)


def test_sft_loss_and_gradients_equal_the_padded_path(arch):
    model = causal_lm(arch)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (3, 19), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    labels = ids.clone()
    labels[:, :7] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    out = []
    for padding_free in (False, True):
        model.zero_grad(set_to_none=True)
        nll, count = lm_nll(model, batch, 5, padding_free=padding_free)
        (nll / count).backward()
        out.append((nll.item(), int(count), grads(model)))
    assert out[0][1] == out[1][1] == int((labels[:, 1:] != IGNORE_INDEX).sum())
    assert isinstance(lm_nll(model, batch, 5, padding_free=True)[1], torch.Tensor)  # as the padded path's (ptx divides)
    assert abs(out[0][0] - out[1][0]) <= TOL * abs(out[0][0])
    assert_grads_close(out[0][2], out[1][2])


def test_values_and_scores_equal_the_padded_path(arch):
    torch.manual_seed(0)
    model = RewardModel(AutoModel.from_config(tiny_config(arch, 256, 1, 2, 0))).float().eval()
    batch = packed_rows(256)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    real = mask[:, :-1].bool()
    out = []
    for padding_free in (False, True):
        model.zero_grad(set_to_none=True)
        values = token_values(model, ids, mask, padding_free)
        scores = sequence_scores(model, ids, mask, padding_free)
        ((values * real).sum() + scores.sum()).backward()
        out.append((values.detach(), scores.detach(), grads(model)))
    assert (out[0][0][real] - out[1][0][real]).abs().max() <= TOL
    assert (out[0][1] - out[1][1]).abs().max() <= TOL
    assert_grads_close(out[0][2], out[1][2])


def test_rows_do_not_attend_across_each_other(arch):
    """Changing one row's tokens leaves the other rows' packed log-probs exactly as they were."""
    model = causal_lm(arch).eval()
    batch = packed_rows(256)
    before = token_logprobs(model, batch, padding_free=True)
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    changed["input_ids"][0, batch["attention_mask"][0].bool()] = 7
    after = token_logprobs(model, changed, padding_free=True)
    assert torch.equal(before[1:], after[1:]) and not torch.equal(before[0], after[0])


def test_a_model_whose_mask_ignores_positions_is_refused():
    torch.manual_seed(0)
    opt = AutoModelForCausalLM.from_config(tiny_config("opt", 256, 1, 2, 0))
    with pytest.raises(UsageError, match="--padding_free: OPTForCausalLM builds its attention mask without"):
        check_padding_free(opt)
    check_padding_free(causal_lm("llama"))  # passes
    qwen2 = Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    check_padding_free(AutoModelForCausalLM.from_config(qwen2))  # its mask arguments go through a dict: tried, not read
    check_padding_free(RewardModel(AutoModel.from_config(tiny_config("llama", 256, 1, 2, 0))))


# --------------------------------------------------------------------------- step 3: lr=0 and the step's loss
@pytest.fixture(scope="module")
def llama_ppo(tmp_path_factory, tiny_llama_reward):
    from utils.models.tiny import make_tiny_model_cached

    return lr0_setup(make_tiny_model_cached("llama"), tiny_llama_reward, tmp_path_factory.mktemp("padding_free"))


@pytest.mark.parametrize("budget", [0, 42, pytest.param(90, marks=pytest.mark.slow)])
def test_log_ratio_is_zero_at_lr0_padding_free_with_a_budget(llama_ppo, budget, monkeypatch):
    """The seeds' bug shape: old log-probs from the (padded or packed) forward of each generation batch, training
    on micro-batches a token budget cut differently; at lr 0 the ratio stays 1."""
    trainer = llama_ppo.trainer
    monkeypatch.setattr(trainer.config, "padding_free", True)
    monkeypatch.setattr(trainer.config, "max_tokens_per_micro_batch", budget)
    monkeypatch.setattr(trainer.config, "do_sample", True)
    cuts = []
    recut = trainer.budget_micro_batches
    monkeypatch.setattr(trainer, "budget_micro_batches", lambda window: cuts.append(recut(window)) or cuts[-1])
    torch.manual_seed(11 + budget)
    metrics, rows = trainer.step(prompt_batches(llama_ppo, 2, n_rows=8), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4, metrics["ppo/log_ratio_max_abs"]
    assert metrics["tokens/padding_fraction"] == 0.0
    if budget:
        sizes = [len(mb) for window in cuts for mb in window]
        assert sizes != [4] * len(sizes), sizes  # the budget re-cut the 4-row mini-batches
        assert all(sum(r.prompt_ids.numel() + r.response_ids.numel() for r in mb) <= budget for w in cuts for mb in w)


def test_a_budget_gives_the_whole_steps_gradient(llama_ppo, monkeypatch):
    """One optimizer step of the rollout's rows: the actor's gradient is the same mean over trained tokens whether
    the rows go through in fixed mini-batches (padded) or in unequal token-budget micro-batches (packed)."""
    trainer = llama_ppo.trainer
    torch.manual_seed(5)
    monkeypatch.setattr(trainer.config, "do_sample", True)
    rows = trainer.make_experience(prompt_batches(llama_ppo, 4, n_rows=8))[0]
    trainer.compute_advantages(rows)
    captured = []
    step = trainer.actor.step
    monkeypatch.setattr(trainer.actor, "step", lambda *a, **k: None)  # keep the weights, read the gradient
    monkeypatch.setattr(trainer.actor.optimizer, "zero_grad", lambda *a, **k: None)
    for padding_free, budget in ((False, 0), (True, 45)):
        monkeypatch.setattr(trainer.config, "padding_free", padding_free)
        monkeypatch.setattr(trainer.config, "max_tokens_per_micro_batch", budget)
        monkeypatch.setattr(trainer.config, "ppo_epochs", 1)
        for p in trainer.actor.module.parameters():
            p.grad = None
        trainer.train_epochs(rows, step=0)
        captured.append({n: p.grad.clone() for n, p in trainer.actor.module.named_parameters() if p.grad is not None})
    monkeypatch.setattr(trainer.actor, "step", step)
    assert_grads_close(captured[0], captured[1])


def test_a_row_longer_than_the_budget_stops_with_one_line(llama_ppo, monkeypatch):
    trainer = llama_ppo.trainer
    monkeypatch.setattr(trainer.config, "max_tokens_per_micro_batch", 12)
    row = Row(torch.arange(3, 10), torch.arange(3, 9), True)
    with pytest.raises(ProjectError, match=r"--max_tokens_per_micro_batch 12: a rollout row \(group 0\) has 13 tokens"):
        trainer.budget_micro_batches([[row]])
