"""The LM head a chunk of tokens at a time (`--logprob_chunk_tokens`, utils.models.forward.causal_lm_hidden +
utils.math.ops.chunked_head): the same log-probs, entropies, SFT loss and gradients as the whole [B, T, V] logits
(fp32, within 1e-5), for chunk sizes that do and do not divide the token count, with a temperature, LoRA, tied and
untied embeddings and a ZeRO-3 engine; and the head never gives more than N token rows, forward or backward."""

import sys
import types

import pytest
import torch
from deepspeed.utils import safe_get_full_grad
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM

from step1_sft.main import parse_args as sft_args
from step3_ppo import trainer as trainer_module
from step3_ppo.algo.shaping import FixedKLController
from step3_ppo.trainer import PPOConfig, PPOTrainer
from tests.launch import run_deepspeed, tail
from utils.errors import UsageError
from utils.math.losses import IGNORE_INDEX
from utils.math.rows import Row, pack
from utils.models import forward
from utils.models.forward import lm_nll, sequence_logprobs, token_logprobs
from utils.models.loading import apply_lora, hf_zero3_disabled, load_causal_lm, load_tokenizer
from utils.runtime.distributed import init_distributed
from utils.train import flags
from utils.train.ds_config import train_ds_config
from utils.train.loop import build_optimizer, initialize_engine

TOL = 1e-5


def packed_batch(vocab: int = 50000, seed: int = 0) -> dict:
    """Three rows: a left-padded shorter prompt, answers of different lengths (right padding); 3 x 20 positions."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        Row(torch.randint(3, vocab, (p,), generator=g), torch.randint(3, vocab, (t,), generator=g), False)
        for p, t in ((6, 14), (4, 9), (6, 11))
    ]
    return pack(rows, pad_token_id=0)


def sft_batch(vocab: int = 50000) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 19), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    labels = ids.clone()
    labels[:, :7] = IGNORE_INDEX  # the prompt
    labels[mask == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def outputs_and_grads(model, fn):
    """(fn(model)'s tensors detached, {name: gradient}) of a backward of their sum."""
    model.zero_grad(set_to_none=True)
    out = fn(model)
    out = out if isinstance(out, tuple) else (out,)
    sum(o.float().sum() for o in out if o.requires_grad).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in out], grads


def assert_grads_close(chunked: dict, whole: dict) -> None:
    """Every parameter's gradient within TOL of the whole path's, relative to its norm (a parameter whose gradient
    is zero in exact arithmetic, like a key bias, is held to TOL x 1e-2 of the largest gradient norm instead)."""
    assert chunked.keys() == whole.keys() and whole
    largest = max(float(g.norm()) for g in whole.values())
    for name, g in whole.items():
        err = float((chunked[name] - g).norm())
        assert err <= TOL * float(g.norm()) + 1e-2 * TOL * largest, (name, err, float(g.norm()))


def assert_matches_whole(model, fn, chunks, rtol: float = 0.0) -> None:
    """fn(model, chunk_tokens) for each chunk size against chunk_tokens=0: outputs (within TOL, or `rtol` of a sum)
    and gradients. The packed batch has 45 head positions (3 rows x 15): 5 divides them, 8 does not, 4096 is one
    chunk (and gives the whole path's numbers bit for bit)."""
    whole_out, whole_grads = outputs_and_grads(model, lambda m: fn(m, 0))
    for n in chunks:
        out, grads = outputs_and_grads(model, lambda m: fn(m, n))
        for o, w in zip(out, whole_out):
            torch.testing.assert_close(o, w, rtol=rtol, atol=0 if rtol else TOL)
        assert_grads_close(grads, whole_grads)


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_gpt2", "tiny_opt"])
def model(request):
    """Each tiny architecture (tied input and output embeddings), fp32, dropout off."""
    path = request.getfixturevalue(request.param)
    return load_causal_lm(path, load_tokenizer(path), dropout=0.0).float().eval()


@pytest.mark.parametrize("temperature, chunks", [(1.0, (5, 4096)), (0.7, (8,))])
def test_token_logprobs_and_entropy_equal_the_whole_logits(model, temperature, chunks):
    """Chunk sizes that divide the 45 head positions (5, and 4096: one chunk) and one that does not (8) against
    the whole logits, with and without a temperature; the entropy trained (an entropy bonus)."""
    batch = packed_batch()

    def fn(m, n):
        return token_logprobs(m, batch, temperature, return_entropy=True, entropy_grad=True, chunk_tokens=n)

    assert_matches_whole(model, fn, chunks)


def test_one_chunk_gives_the_whole_paths_numbers_bit_for_bit(model):
    """Every kept position goes through the head (the last one's outputs dropped after), so one chunk runs the
    whole path's matmuls on the same rows: log-probs, entropy and gradients identical, not only close."""
    batch = packed_batch()

    def fn(m, n):
        return token_logprobs(m, batch, 0.7, return_entropy=True, entropy_grad=True, chunk_tokens=n)

    (lp, ent), grads = outputs_and_grads(model, lambda m: fn(m, 4096))
    (lp_w, ent_w), grads_w = outputs_and_grads(model, lambda m: fn(m, 0))
    assert torch.equal(lp, lp_w) and torch.equal(ent, ent_w)
    assert grads.keys() == grads_w.keys() and all(torch.equal(grads[n], grads_w[n]) for n in grads)


def test_the_entropy_monitor_stays_detached(model):
    logprobs, entropy = token_logprobs(model, packed_batch(), 0.7, return_entropy=True, chunk_tokens=5)
    assert logprobs.requires_grad and not entropy.requires_grad


def test_sft_loss_and_dpo_sequence_logprobs_equal_the_whole_logits(model):
    sft = sft_batch()
    assert_matches_whole(model, lambda m, n: lm_nll(m, sft, n)[0], (7,), rtol=TOL)  # a sum over the trained tokens
    assert lm_nll(model, sft, 5)[1] == lm_nll(model, sft, 0)[1] == int((sft["labels"][:, 1:] != IGNORE_INDEX).sum())
    batch = packed_batch()
    assert_matches_whole(model, lambda m, n: sequence_logprobs(m, batch, n)[0], (8,), rtol=TOL)


def test_no_bxtxv_tensor_forward_or_backward(tiny_llama):
    """Every output of the LM head has at most N token rows (the hook sees the backward's recomputation too); the
    whole path's one output has every response position."""
    model = load_causal_lm(tiny_llama, load_tokenizer(tiny_llama), dropout=0.0).float().eval()
    batch = packed_batch()
    rows = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(out.reshape(-1, out.shape[-1]).shape[0])
    )
    try:
        logprobs, entropy = token_logprobs(model, batch, 0.7, return_entropy=True, entropy_grad=True, chunk_tokens=8)
        forward_rows = list(rows)
        (logprobs.sum() + entropy.sum()).backward()
        rows_whole = []
        handle.remove()
        handle = model.get_output_embeddings().register_forward_hook(
            lambda module, args, out: rows_whole.append(out.reshape(-1, out.shape[-1]).shape[0])
        )
        token_logprobs(model, batch, 0.7, return_entropy=True, chunk_tokens=0)
    finally:
        handle.remove()
    kept = 3 * (batch["input_ids"].shape[1] - batch["prompt_len"] + 1)  # every row's positions from prompt_len - 1
    assert max(rows) <= 8
    assert forward_rows[0] == 3  # the model's own head call: one position per row, its logits discarded
    assert sum(forward_rows[1:]) == kept and len(rows) > len(forward_rows)  # the backward recomputed chunks
    assert rows_whole == [kept]  # the whole path: [B, T, V] at once


def test_shared_prompt_scoring_is_chunked_without_gradients(tiny_llama):
    """The reference's no-grad scoring of a group's repeated prompt (share_prompts) gives the one-pass log-probs."""
    model = load_causal_lm(tiny_llama, load_tokenizer(tiny_llama), dropout=0.0).float().eval()
    prompts, answers = ([5, 6, 7, 8, 9], [12, 13]), ([10, 11, 2], [14, 15, 16, 17, 18], [19, 2], [20, 21, 22, 23])
    rows = [
        Row(prompt_ids=torch.tensor(prompts[i // 2]), response_ids=torch.tensor(a), ended_with_eos=a[-1] == 2)
        for i, a in enumerate(answers)
    ]
    batch = pack(rows, pad_token_id=0)
    with torch.no_grad():
        whole = token_logprobs(model, batch, 0.7, chunk_tokens=0)
        shared = token_logprobs(model, batch, 0.7, share_prompts=True, chunk_tokens=3)
    mask = batch["action_mask"].bool()
    torch.testing.assert_close(shared[mask], whole[mask], rtol=0, atol=TOL)


def untied_llama(tiny_llama):
    """tiny_llama's shape with its own output embeddings (a model whose head is not the input embedding)."""
    config = AutoConfig.from_pretrained(tiny_llama)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    with hf_zero3_disabled():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    return model.eval()


def nonzero_adapters(model) -> None:
    torch.manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)


@pytest.mark.parametrize("head_lora", [False, True], ids=["lora_layers", "lora_layers_and_head"])
def test_lora_untied_and_on_the_head(tiny_llama, head_lora):
    """LoRA (peft) on every Linear as --lora_dim puts it, and once on the LM head too (peft wraps the module that
    get_output_embeddings returns); untied embeddings; the adapters' and base weights' gradients."""
    model = untied_llama(tiny_llama)
    if head_lora:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
        assert "lora" in type(forward._hf_model(model).get_output_embeddings()).__module__
    else:
        model = apply_lora(model, 4, "", 8.0)
    nonzero_adapters(model)
    batch = packed_batch()
    assert_matches_whole(
        model, lambda m, n: token_logprobs(m, batch, 0.7, return_entropy=True, entropy_grad=True, chunk_tokens=n), (8,)
    )


def test_a_model_that_transforms_its_logits_after_the_head_takes_the_whole_path():
    """Gemma 2's final soft-capping happens after the head: chunking it would drop it, so such a model is not
    chunked (POST_HEAD_ATTRIBUTES) and its log-probs are its own logits'."""
    config = Gemma2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=2.0,
    )
    torch.manual_seed(0)
    with hf_zero3_disabled():
        model = Gemma2ForCausalLM(config).eval()
    assert forward.chunks_head(model, 8) is None
    batch = packed_batch(vocab=97)
    with torch.no_grad():
        logits = forward.causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])[:, :-1]
        own = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        chunked = token_logprobs(model, batch, chunk_tokens=8)
    mask = batch["action_mask"].bool()
    torch.testing.assert_close(chunked[mask], own[mask], rtol=0, atol=TOL)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_zero3_engine_gives_the_plain_models_logprobs_and_gradients(tiny_llama, lora):
    """A ZeRO-3 engine in this process (every parameter partitioned: persistence threshold 0, so the head's tied
    weight is gathered by its hooks for each chunk and again in the backward's recomputation): chunked log-probs,
    entropy and full gradients (deepspeed.utils.safe_get_full_grad) equal a plain model's whole-logits ones."""
    init_distributed()
    batch = packed_batch()
    tokenizer = load_tokenizer(tiny_llama)

    def build(config):
        model = load_causal_lm(tiny_llama, tokenizer, config, dropout=0.0)
        if lora:
            torch.manual_seed(1)
            model = apply_lora(model, 4, "", 8.0)
        return model

    plain = build(None).float().train()
    if lora:
        nonzero_adapters(plain)
    (lp_w, ent_w), grads_w = outputs_and_grads(
        plain, lambda m: token_logprobs(m, batch, 0.7, return_entropy=True, entropy_grad=True, chunk_tokens=0)
    )
    config = train_ds_config(3, 1, 3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model = build(config)
    if lora:  # the plain model's adapters (same seed, same order), before the engine partitions them
        nonzero_adapters(model)
    params = [p for p in model.parameters() if p.requires_grad]
    engine = initialize_engine(model, config, build_optimizer([{"params": params, "weight_decay": 0.0}], 0.0, False))
    engine.train()
    assert forward.chunks_head(engine, 5) is not None
    logprobs, entropy = token_logprobs(engine, batch, 0.7, return_entropy=True, entropy_grad=True, chunk_tokens=5)
    engine.backward(logprobs.sum() + entropy.sum())
    grads = {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    engine.step()
    torch.testing.assert_close(logprobs.detach(), lp_w, rtol=0, atol=TOL)
    torch.testing.assert_close(entropy.detach(), ent_w, rtol=0, atol=TOL)
    assert_grads_close(grads, {n: g for n, g in grads_w.items() if n in grads})
    assert grads.keys() == grads_w.keys()


def test_the_flag_default_validation_and_threading(monkeypatch):
    """--logprob_chunk_tokens defaults to the forwards' chunk size, refuses a negative value in one line, and the
    step-3 trainer's policy forward gets its value."""
    assert flags.LOGPROB_CHUNK_TOKENS == forward.LOGPROB_CHUNK_TOKENS > 0
    common = ["--data_path", "x.jsonl", "--model_name_or_path", "m", "--output_dir", "/nonexistent/out"]
    parser = flags.single_model_parser("step", "model")
    assert parser.parse_args(common).logprob_chunk_tokens == forward.LOGPROB_CHUNK_TOKENS
    assert "--logprob_chunk_tokens" not in flags.single_model_parser("reward", "model", logprobs=False).format_help()
    with pytest.raises(UsageError, match=r"^--logprob_chunk_tokens must be >= 0, got -1$"):
        sft_args(common + ["--logprob_chunk_tokens", "-1"])
    config = PPOConfig.from_args(
        types.SimpleNamespace(logprob_chunk_tokens=7), stop_token_ids=(2,), pad_token_id=0, max_answer_seq_len=3
    )
    engines = types.SimpleNamespace(actor="the actor", ref=None, critic=None)
    trainer = PPOTrainer(engines, config, FixedKLController(0.0), [])
    calls = []
    monkeypatch.setattr(trainer_module, "token_logprobs", lambda *args, **kw: calls.append((args, kw)))
    trainer.logprobs_fn("the actor", {}, 0.5, return_entropy=True)
    assert calls == [(("the actor", {}, 0.5), {"chunk_tokens": 7, "padding_free": False, "return_entropy": True})]
    other = lambda model, batch, temperature, **kw: token_logprobs(model, batch, temperature, **kw)  # noqa: E731
    assert PPOTrainer(engines, config, FixedKLController(0.0), [], logprobs_fn=other).logprobs_fn is other


def two_rank_probe(model_path: str) -> None:
    """One rank of the two-rank ZeRO-3 test: the ranks score batches of different sizes (45 and 11 head positions),
    so with 5-token chunks one has 9 chunks and the other 3; two training steps and a no-grad scoring must give the
    whole-logits log-probs on both ranks without a collective left waiting."""
    init_distributed()
    rank = torch.distributed.get_rank()
    rows = [Row(torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12, 13, 14, 15, 16, 2]), True)]
    batch = packed_batch() if rank == 0 else pack(rows, pad_token_id=0)
    config = train_ds_config(3, 2, 3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    model = load_causal_lm(model_path, load_tokenizer(model_path), config, dropout=0.0)
    optimizer = build_optimizer([{"params": list(model.parameters()), "weight_decay": 0.0}], 0.0, False)
    engine = initialize_engine(model, config, optimizer)
    engine.train()
    for _ in range(2):
        logprobs, entropy = token_logprobs(engine, batch, 0.7, return_entropy=True, entropy_grad=True, chunk_tokens=5)
        engine.backward(logprobs.sum() + entropy.sum())
        engine.step()
    with torch.no_grad():
        whole = token_logprobs(engine, batch, 0.7, chunk_tokens=0)
        chunked = token_logprobs(engine, batch, 0.7, chunk_tokens=5)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=TOL)
    torch.testing.assert_close(logprobs.detach(), whole, rtol=0, atol=TOL)  # lr 0: the weights did not move
    print(f"rank {rank}: ok", flush=True)


@pytest.mark.slow
def test_two_zero3_ranks_with_different_chunk_counts(tiny_llama, tmp_path):
    """Each chunk's head call gathers the partitioned head: the ranks agree on the chunk count (the most any rank
    needs) so that neither waits in a gather the other never makes."""
    proc = run_deepspeed("tests.test_chunked_logprobs", [tiny_llama], timeout=300, log_path=str(tmp_path / "log"))
    assert proc.returncode == 0, tail(proc)
    assert "rank 0: ok" in proc.stdout and "rank 1: ok" in proc.stdout, tail(proc)


if __name__ == "__main__":
    two_rank_probe(sys.argv[-1])  # after the launcher's --local_rank
