"""Log-probs of the distribution actually sampled (utils/math/sampling.py): softmax(logits / T) after top-k then top-p,
renormalised over the kept tokens. By hand on a 5-token vocabulary; against transformers' warpers and vLLM's
apply_top_k_top_p on random logits; through token_logprobs' `return_processed` (chunked, whole, padding-free) and
the hf engine's generate (whose log-probs stay the tempered softmax's: the policy trained); and in step 3 at lr 0
with --top_k and an engine of processed log-probs (vLLM's kind), where the trainer's processed log-probs meet the
generator's (rollout/logprob_diff_max) although its plain tempered ones do not. The vLLM worker's own are checked in
tests/test_rollout_vllm.py."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from step3_ppo.main import parse_args, setup
from tests.test_agents import agent_setup
from tests.test_step3_grpo import grpo_args, write_rows
from tests.test_step3_lr0 import prompt_batches
from utils.math.rows import Row, pack
from utils.math.sampling import kept_tokens, processed_logprobs, processed_token_logprobs, truncates
from utils.models import forward
from utils.models.forward import causal_lm_logits, sampled_logprobs, token_logprobs

NEG = float("-inf")
# probabilities 0.5, 0.2, 0.15, 0.1, 0.05 as logits (T = 1)
PROBS = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).log()


def close(actual: torch.Tensor, expected: list) -> bool:
    expected = torch.tensor(expected, dtype=torch.float32)
    same_mask = torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    return same_mask and torch.allclose(actual[finite], expected[finite], atol=1e-6)


def test_truncates():
    assert not truncates(0, 1.0)
    assert truncates(5, 1.0) and truncates(0, 0.9) and truncates(1, 0.5)


def test_top_k_by_hand_keeps_ties_at_the_kth_value():
    """logits 3, 1, 1, 0, -2 with top_k 2: the 2nd largest is 1, held by two tokens, and both stay (>= the k-th
    value, as transformers and vLLM): log-probs 3 - log(e^3 + 2e) = -0.23954, 1 - log(e^3 + 2e) = -2.23954."""
    logits = torch.tensor([3.0, 1.0, 1.0, 0.0, -2.0])
    assert close(processed_logprobs(logits, 1.0, top_k=2), [-0.2395447662, -2.2395447662, -2.2395447662, NEG, NEG])
    # top_k >= V keeps everything: the plain log-softmax
    assert torch.allclose(processed_logprobs(logits, 1.0, top_k=5), logits.log_softmax(-1), atol=1e-7)
    assert torch.allclose(processed_logprobs(logits, 1.0, top_k=9), logits.log_softmax(-1), atol=1e-7)


def test_top_p_by_hand():
    """p = 0.5, 0.2, 0.15, 0.1, 0.05; ascending cumulative 0.05, 0.15, 0.30, 0.50, 1. top_p 0.8 drops those <= 0.2
    (0.05, 0.1): kept mass 0.85, log(0.5 / 0.85) = -0.53063, log(0.2 / 0.85) = -1.44692, log(0.15 / 0.85) = -1.73460.
    top_p 0.4 drops everything <= 0.6 but the most likely token, which is always kept: log-prob 0."""
    assert close(processed_logprobs(PROBS, top_p=0.8), [-0.5306282511, -1.4469189829, -1.7346010554, NEG, NEG])
    assert close(processed_logprobs(PROBS, top_p=0.4), [0.0, NEG, NEG, NEG, NEG])
    assert close(processed_logprobs(PROBS, top_p=0.01), [0.0, NEG, NEG, NEG, NEG])


def test_temperature_comes_before_top_p_by_hand():
    """T = 0.5 squares the probabilities: 0.25, 0.04, 0.0225, 0.01, 0.0025 (/ 0.325); ascending cumulative 0.0077,
    0.0385, 0.1077, 0.2308, 1. top_p 0.8 keeps the two largest (at T = 1 it keeps three): log(0.25 / 0.29) = -0.14842,
    log(0.04 / 0.29) = -1.98100."""
    assert close(processed_logprobs(PROBS, 0.5, top_p=0.8), [-0.1484200051, -1.9810014689, NEG, NEG, NEG])
    # top-k is the same at any temperature; only the renormalised values change
    assert torch.equal(kept_tokens(PROBS / 0.5, top_k=2), kept_tokens(PROBS, top_k=2))


def test_top_p_reads_the_distribution_renormalised_by_top_k_by_hand():
    """top_k 4 drops 0.05 first; renormalised 0.526, 0.211, 0.158, 0.105, ascending cumulative 0.105, 0.263, ...:
    top_p 0.87 then drops the 0.105 (<= 0.13), leaving 0.5, 0.2, 0.15 of mass 0.85 (the values of top_p 0.8 above).
    top_p 0.87 alone would keep four tokens (cumulative 0.05, 0.15 > 0.13)."""
    assert close(
        processed_logprobs(PROBS, top_k=4, top_p=0.87), [-0.5306282511, -1.4469189829, -1.7346010554, NEG, NEG]
    )
    assert kept_tokens(PROBS, top_p=0.87).tolist() == [True, True, True, True, False]


def test_token_gather_and_any_leading_dims():
    logits = torch.randn(2, 3, 50)
    tokens = torch.randint(0, 50, (2, 3))
    full = processed_logprobs(logits, 0.7, 10, 0.9)
    assert full.shape == (2, 3, 50) and full.dtype == torch.float32
    assert torch.equal(
        processed_token_logprobs(logits, tokens, 0.7, 10, 0.9), full.gather(-1, tokens[..., None])[..., 0]
    )
    assert torch.allclose(full.exp().sum(-1), torch.ones(2, 3), atol=1e-6)  # a distribution over the kept tokens
    # bf16 logits are read in fp32
    assert processed_logprobs(logits.bfloat16(), 0.7, 10, 0.9).dtype == torch.float32


SETTINGS = [(1.0, 5, 1.0), (0.7, 50, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.5), (0.6, 20, 0.8), (1.3, 3, 0.95), (0.7, 1, 1.0)]


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS)
def test_the_same_as_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = 3 * torch.randn(16, 1000)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    ours = processed_logprobs(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(scores))
    assert torch.isfinite(ours).sum(-1).min() >= 1 and (top_k == 0 or torch.isfinite(ours).sum(-1).max() <= top_k)
    kept = torch.isfinite(ours)
    assert (ours[kept] - scores.log_softmax(-1)[kept]).abs().max() <= 1e-6


@pytest.mark.parametrize("temperature,top_k,top_p", SETTINGS + [(1.0, 0, 1.0)])
@pytest.mark.parametrize("cpu_sync", [False, True])
def test_the_same_as_vllms_apply_top_k_top_p(temperature, top_k, top_p, cpu_sync):
    """vLLM's processed log-probs are log_softmax(apply_top_k_top_p(logits / T, k, p)) (forward_native / forward_cpu);
    its PyTorch implementation, with and without the sort-free top-k-only path (cpu_sync)."""
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # lazy: vLLM is an optional extra

    torch.manual_seed(1)
    logits = 3 * torch.randn(16, 1000)
    logits[0, :4] = logits[0].max() + 1  # a tie at the top
    k = torch.full((16,), top_k, dtype=torch.long) if top_k else None
    p = torch.full((16,), top_p) if top_p < 1 else None
    theirs = apply_top_k_top_p_pytorch(logits.clone() / temperature, k, p, allow_cpu_sync=cpu_sync)
    theirs = theirs.log_softmax(-1, dtype=torch.float32)
    ours = processed_logprobs(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs))
    kept = torch.isfinite(ours)
    assert (ours[kept] - theirs[kept]).abs().max() <= 1e-6


# --------------------------------------------------------------------------- token_logprobs(return_processed)
@pytest.fixture(scope="module")
def model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama).eval()


@pytest.fixture(scope="module")
def batch(model) -> dict:
    """Three rows: left-padded prompts of different lengths; answers of different lengths (right padding), each 8
    tokens sampled at T 0.7 with top_k 5 (inside every truncation tested) then 1 to 3 random tokens (mostly outside)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for p, extra in ((6, 3), (4, 1), (6, 2)):
        prompt = torch.randint(3, 50000, (p,), generator=g)
        torch.manual_seed(p + extra)
        out = model.generate(
            prompt[None], max_new_tokens=8, min_new_tokens=8, do_sample=True, temperature=0.7, top_k=5, pad_token_id=0
        )
        rows.append(Row(prompt, torch.cat([out[0, p:], torch.randint(3, 50000, (extra,), generator=g)]), False))
    return pack(rows, pad_token_id=0)


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("chunk_tokens", [0, 8, 4096])
@pytest.mark.parametrize("sampling", [(5, 1.0), (0, 0.9), (40, 0.95)])
def test_token_logprobs_returns_the_processed_logprobs_of_the_same_logits(
    model, batch, padding_free, chunk_tokens, sampling
):
    """Each action's processed log-prob equals processed_logprobs on the whole [B, L, V] logits, beside the plain
    log-probs and the top-1 (the order: log-probs, top-1, processed), for the whole, chunked and padding-free paths."""
    temperature = 0.7
    with torch.no_grad():
        plain, top1, processed = token_logprobs(
            model,
            batch,
            temperature,
            chunk_tokens=chunk_tokens,
            padding_free=padding_free,
            return_top1=True,
            return_processed=sampling,
        )
        logits = causal_lm_logits(model, batch["input_ids"], batch["attention_mask"])[:, :-1]
        expected = processed_token_logprobs(logits, batch["input_ids"][:, 1:], temperature, *sampling)
        alone = token_logprobs(model, batch, temperature, chunk_tokens=chunk_tokens, padding_free=padding_free)
    actions = batch["action_mask"] != 0
    kept = torch.isfinite(expected) & actions
    assert 24 <= kept.sum() < actions.sum() or sampling[0] == 0  # the sampled tokens in, random ones out
    assert torch.equal(torch.isfinite(processed) & actions, kept)
    assert (processed[kept] - expected[kept]).abs().max() <= 1e-5
    assert torch.equal(plain, alone) and top1.shape == plain.shape
    assert (processed[kept] > plain[kept]).all()  # renormalised over fewer tokens


@pytest.mark.parametrize("padding_free", [False, True])
@pytest.mark.parametrize("chunk_tokens", [0, 8])
def test_without_truncation_the_processed_logprobs_are_the_plain_ones(model, batch, padding_free, chunk_tokens):
    with torch.no_grad():
        plain, processed = token_logprobs(
            model, batch, 0.7, chunk_tokens=chunk_tokens, padding_free=padding_free, return_processed=(0, 1.0)
        )
    actions = batch["action_mask"] != 0
    assert (plain[actions] - processed[actions]).abs().max() <= 1e-6


def test_processed_logprobs_are_refused_with_a_gradient(model, batch):
    with pytest.raises(ValueError, match="no-grad"):
        token_logprobs(model, batch, 0.7, return_processed=(5, 1.0))


# --------------------------------------------------------------------------- the hf engine's generate
def test_generate_gives_the_log_probs_of_the_tempered_softmax_whatever_top_k(model):
    """transformers' generate with top_k 5 at T 0.7: its log-probs are the trainer's plain tempered ones of the same
    tokens (the policy trained: `--old_logprobs rollout` stands for the trainer's forward), far from the processed."""
    torch.manual_seed(0)
    prompts = torch.randint(3, 50000, (3, 5))
    mask = torch.ones_like(prompts)
    mask[0, :2] = 0
    kwargs = forward.generation_kwargs(
        forward.GenerationSettings(max_new_tokens=6, temperature=0.7, top_k=5), model.generation_config.eos_token_id, 0
    )
    sequences, generated = forward.generate(model, prompts, mask, logprob_temperature=0.7, **kwargs)
    assert not (sequences[:, 5:] == model.generation_config.eos_token_id).any()  # 6 answer tokens each
    rows = [Row(prompts[b][mask[b] != 0], sequences[b, 5:], False) for b in range(3)]
    batch = pack(rows, pad_token_id=0)
    with torch.no_grad():
        plain, processed = token_logprobs(model, batch, 0.7, return_processed=(5, 1.0))
    actions = batch["action_mask"] != 0
    assert (generated.reshape(-1) - plain[actions]).abs().max() <= 1e-5
    assert (generated.reshape(-1) - processed[actions]).abs().min() > 1.0  # top-5 of 50258 tokens: far apart
    # sampled_logprobs without truncation is the plain tempered log-softmax
    step = [torch.randn(2, 30) for _ in range(3)]
    tokens = torch.randint(0, 30, (2, 3))
    expected = torch.stack(
        [(s / 0.7).log_softmax(-1).gather(-1, tokens[:, t : t + 1])[:, 0] for t, s in enumerate(step)], 1
    )
    assert torch.allclose(sampled_logprobs(step, tokens, 0.7), expected, atol=1e-6)


# --------------------------------------------------------------------------- step 3 at lr 0 with the hf engine
def processed_engine(monkeypatch, trainer, top_k=5, top_p=1.0):
    """The hf engine made to return log-probs of the truncated distribution, as the vLLM worker does (its entry's
    processed_logprobs): the trainer's side of the comparison, without a worker."""

    def processed(step_logits, tokens, temperature=1.0):
        columns = [
            processed_token_logprobs(logits, tokens[:, t], temperature, top_k, top_p)
            for t, logits in enumerate(step_logits)
        ]
        return torch.stack(columns, dim=1)

    monkeypatch.setattr(forward, "sampled_logprobs", processed)
    monkeypatch.setattr(trainer, "rollout_processed", True)


@pytest.fixture(scope="module")
def top_k_run(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("processed_logprobs")
    write_rows(tmp)
    extra = ["--actor_zero_stage", 0, "--actor_learning_rate", 0, "--kl_ctl", 0.1, "--rollout_engine", "hf"]
    extra += ["--temperature", 0.7, "--top_k", 5, "--rollout_correction", "tis"]
    return setup(parse_args(grpo_args(tiny_llama, tmp, *extra)))


def test_the_hf_engine_is_compared_with_the_plain_log_probs(top_k_run):
    trainer = top_k_run.trainer
    torch.manual_seed(0)
    metrics, rows = trainer.step(prompt_batches(top_k_run, 2, n_rows=2), step=0)
    assert metrics["rollout/logprob_diff_max"] <= 1e-4 and metrics["ppo/log_ratio_max_abs"] <= 1e-4
    assert all("old_processed_logprobs" not in r.per_action for r in rows)


def test_lr0_generator_and_trainer_agree_on_the_truncated_distribution(top_k_run, monkeypatch):
    """At --temperature 0.7 --top_k 5 and lr 0 the generator's log-probs (the truncated distribution's) meet the
    trainer's processed ones (rollout/logprob_diff_max <= 1e-4, TIS weights 1), while the trainer's plain tempered
    old log-probs, which the PPO ratio keeps using (log-ratio ~0), differ from them by log(kept mass)."""
    trainer = top_k_run.trainer
    assert trainer.processed_sampling() is None  # the hf engine's log-probs are of the tempered softmax
    processed_engine(monkeypatch, trainer)
    assert trainer.processed_sampling() == (5, 1.0)
    torch.manual_seed(0)
    metrics, rows = trainer.step(prompt_batches(top_k_run, 2, n_rows=2), step=0)
    assert metrics["rollout/logprob_diff_max"] <= 1e-4, metrics["rollout/logprob_diff_max"]
    assert metrics["rollout/correction_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    for row in rows:
        old, processed = row.per_action["old_logprobs"], row.per_action["old_processed_logprobs"]
        assert old.shape == processed.shape == row.per_action["rollout_logprobs"].shape
        assert (processed - old).min() > 1.0  # the kept mass of 5 of 50258 near-uniform tokens is small
        assert (processed - row.per_action["rollout_logprobs"]).abs().max() <= 1e-4
    assert all(math.isfinite(metrics[k]) for k in ("rollout/logprob_diff_mean", "loss/actor"))


def test_without_truncation_nothing_more_is_stored(top_k_run, monkeypatch):
    trainer = top_k_run.trainer
    processed_engine(monkeypatch, trainer, top_k=0)
    saved = trainer.config.top_k
    trainer.config.top_k = 0
    try:
        assert trainer.processed_sampling() is None
        rows = trainer.generate_rows(prompt_batches(top_k_run, 2, n_rows=2)[0], logprobs=True)
        trainer.store_logprobs(rows, trainer.actor, "old_logprobs")
    finally:
        trainer.config.top_k = saved
    assert all("old_processed_logprobs" not in r.per_action for r in rows)
    assert max((r.per_action["rollout_logprobs"] - r.per_action["old_logprobs"]).abs().max() for r in rows) <= 1e-4


def test_multi_turn_rows_get_processed_logprobs_on_their_actions(
    tiny_chat_llama, tiny_chat_llama_reward, tmp_path, monkeypatch
):
    """Trajectories with the environment's replies between the policy's turns: the trainer's processed log-probs sit
    on the same action positions as the generator's (each turn's own), so the distance over the actions is rounding."""
    from utils.data import PromptCollator

    run = agent_setup(
        tiny_chat_llama,
        tiny_chat_llama_reward,
        tmp_path,
        "--advantage_estimator",
        "grpo",
        "--n_samples_per_prompt",
        "2",
        "--temperature",
        "0.7",
        "--top_k",
        "5",
    )
    trainer = run.trainer
    processed_engine(monkeypatch, trainer)
    collate = PromptCollator(run.tokenizer.pad_token_id)
    torch.manual_seed(0)
    rows, _, _ = trainer.make_experience([collate(list(run.loader.dataset)[:3])])
    assert any(r.agent["turns"] > 1 for r in rows)
    for row in rows:
        actions = row.response_action_mask.bool()
        assert not actions.all()  # environment tokens between the turns
        rollout, processed = row.per_action["rollout_logprobs"], row.per_action["old_processed_logprobs"]
        assert (rollout[actions] - processed[actions]).abs().max() <= 1e-4
        assert (processed[actions] - row.per_action["old_logprobs"][actions]).min() > 1.0
    assert trainer.compute_advantages(rows)["logprob_diff_max"] <= 1e-4
