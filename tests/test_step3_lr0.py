"""Promise 1: with learning rate 0 the PPO log-ratio between new and old policy is ~0 (fp32, <= 1e-4)
for every generation batch size, mini-batch size and padding layout, on gpt2 (absolute positions)
and llama (rotary). Runs the real engines and trainer in this process (ZeRO-0, one rank); the
2-rank ZeRO-3 case through the launcher is in test_step3_run.py.
"""

import json

import pytest
import torch

from step3_ppo.main import parse_args, setup
from utils.data import PromptCollator

PROMPT_WORDS = ["movie", "good", "plot", "film", "bad", "scene", "actor", "music", "story", "great"]


def write_prompts(path, n=24, chat=False):
    """Prompts of 1 to 12 words, so rollout batches and mini-batches need different left padding
    (with `chat`, as message lists rendered by the chat template)."""
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(PROMPT_WORDS[(i + j) % len(PROMPT_WORDS)] for j in range(1 + (i * 5) % 12))
            row = (
                {"prompt": [{"role": "user", "content": words}]}
                if chat
                else {"prompt": f"Human: {words}\n\nAssistant:"}
            )
            f.write(json.dumps(row) + "\n")


def lr0_setup(model, critic, tmp, chat=False):
    write_prompts(tmp / "prompts.jsonl", chat=chat)
    args = parse_args(
        [
            "--actor_model_name_or_path",
            model,
            "--critic_model_name_or_path",
            critic,
            "--data_path",
            str(tmp / "prompts.jsonl"),
            "--data_split",
            "0,0,10",
            "--output_dir",
            str(tmp / "out"),
            "--actor_zero_stage",
            "0",
            "--critic_zero_stage",
            "0",
            "--actor_learning_rate",
            "0",
            "--critic_learning_rate",
            "0",
            "--max_prompt_seq_len",
            "48" if chat else "32",
            "--max_answer_seq_len",
            "10",
            "--per_device_generation_batch_size",
            "4",
            "--per_device_training_batch_size",
            "4",
            "--seed",
            "3",
            "--actor_dropout",
            "0.0",
            "--critic_dropout",
            "0.0",
        ]
    )
    return setup(args)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def ppo_setup(request, tmp_path_factory):
    from utils.models.tiny import make_tiny_model_cached

    critic = request.getfixturevalue(f"tiny_{request.param}_reward")  # a step-2-like reward-model directory
    return request.param, lr0_setup(
        make_tiny_model_cached(request.param), critic, tmp_path_factory.mktemp(f"lr0_{request.param}")
    )


def prompt_batches(run, generation_batch_size: int, n_rows: int = 4, offset: int = 0):
    examples = list(run.loader.dataset)[offset : offset + n_rows]
    collate = PromptCollator(run.tokenizer.pad_token_id)
    return [collate(examples[i : i + generation_batch_size]) for i in range(0, n_rows, generation_batch_size)]


@pytest.mark.parametrize("generation_batch_size", [2, 4])
@pytest.mark.parametrize("training_batch_size", [1, 2, 4])
def test_log_ratio_is_zero_at_lr0_sampling(ppo_setup, generation_batch_size, training_batch_size):
    arch, run = ppo_setup
    run.trainer.config.do_sample = True
    run.trainer.config.per_device_training_batch_size = training_batch_size
    torch.manual_seed(generation_batch_size * 10 + training_batch_size)
    metrics, rows = run.trainer.step(prompt_batches(run, generation_batch_size, offset=training_batch_size), step=0)
    assert len({r.prompt_ids.numel() for r in rows}) > 1  # padding really differs
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4, (arch, metrics["ppo/log_ratio_max_abs"])


@pytest.mark.parametrize("generation_batch_size,training_batch_size", [(2, 1), (4, 4)])
def test_old_logprobs_from_the_generator_keep_the_log_ratio_at_zero(
    ppo_setup, generation_batch_size, training_batch_size, monkeypatch
):
    """--old_logprobs rollout: the generator's own log-probs (KV-cached decoding of a left-padded batch) are the
    old policy's, with no forward of the actor after generation; training's forward (other padding, no cache)
    gives the same values at lr 0."""
    arch, run = ppo_setup
    trainer, config = run.trainer, run.trainer.config
    forwards = []
    store = trainer.store_logprobs
    monkeypatch.setattr(
        trainer,
        "store_logprobs",
        lambda rows, engine, name, *share: (forwards.append(name), store(rows, engine, name, *share)),
    )
    monkeypatch.setattr(config, "old_logprobs", "rollout")
    monkeypatch.setattr(config, "per_device_training_batch_size", training_batch_size)
    config.do_sample = True
    torch.manual_seed(7)
    metrics, rows = trainer.step(prompt_batches(run, generation_batch_size, offset=16), step=0)
    assert "old_logprobs" not in forwards and "ref_logprobs" in forwards, forwards
    assert all(r.per_action["old_logprobs"] is r.per_action["rollout_logprobs"] for r in rows)
    assert "rollout/logprob_diff_max" not in metrics  # nothing to compare: they are the old log-probs
    assert 0 < metrics["ppo/log_ratio_max_abs"] <= 1e-4, (arch, metrics["ppo/log_ratio_max_abs"])


def test_log_ratio_is_zero_with_early_eos(ppo_setup):
    """An EOS that some rows emit early: rows of different response lengths, padding after EOS in the
    rollout batch, none in mini-batches of one. Sampling is replayed with the same seed, so the
    probe and the real rollout draw the same tokens up to the chosen EOS."""
    arch, run = ppo_setup
    config = run.trainer.config
    saved = (config.do_sample, config.stop_token_ids, config.per_device_training_batch_size)
    try:
        config.do_sample = True
        batches = prompt_batches(run, 4, n_rows=4, offset=8)
        torch.manual_seed(123)
        probe = [r.response_ids.tolist() for r in run.trainer.generate_rows(batches[0])]
        # a token that some row emits for the first time at position k >= 1 becomes EOS: that row
        # (whose earlier draws do not change) then ends with k + 1 tokens
        row, k = next((i, k) for i, ids in enumerate(probe) for k in range(1, len(ids)) if ids[k] not in ids[:k])
        eos = probe[row][k]
        config.stop_token_ids = (eos,)
        config.per_device_training_batch_size = 1
        torch.manual_seed(123)
        metrics, rows = run.trainer.step(batches, step=0)
    finally:
        config.do_sample, config.stop_token_ids, config.per_device_training_batch_size = saved
    lengths = [r.response_ids.numel() for r in rows]
    assert rows[row].ended_with_eos and lengths[row] == k + 1 and len(set(lengths)) > 1, lengths
    for r in rows:  # the action mask runs up to and including EOS: EOS is the last action, never earlier
        ids = r.response_ids.tolist()
        assert (eos in ids) == r.ended_with_eos and (not r.ended_with_eos or ids.index(eos) == len(ids) - 1)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4, (arch, metrics["ppo/log_ratio_max_abs"])


def test_positions_from_arange_would_break_the_invariant(ppo_setup, monkeypatch):
    """Negative control: with positions 0..L-1 regardless of padding (the trlx bug), gpt2's log-ratio
    between the padded rollout batch and unpadded mini-batches of one is far from 0."""
    arch, run = ppo_setup
    if arch != "gpt2":
        pytest.skip("rotary positions are relative: a uniform shift does not change llama's logits")
    import utils.models.forward

    monkeypatch.setattr(
        utils.models.forward,
        "position_ids_from_attention_mask",
        lambda mask: torch.arange(mask.shape[1]).expand_as(mask),
    )
    run.trainer.config.per_device_training_batch_size = 1
    metrics, _ = run.trainer.step(prompt_batches(run, 4, offset=12), step=0)
    run.trainer.config.per_device_training_batch_size = 4
    assert metrics["ppo/log_ratio_max_abs"] > 1e-3


def test_log_ratio_is_zero_on_templated_prompts_ending_at_end_of_turn(
    tiny_chat_llama, tiny_chat_llama_reward, tmp_path
):
    """Message-list prompts through a ChatML template whose end-of-turn token is not EOS: prompts end
    with the generation prompt, a response ends at the first of EOS / end-of-turn (here a token the
    random model does emit stands in for end-of-turn), and the log-ratio stays ~0."""
    run = lr0_setup(tiny_chat_llama, tiny_chat_llama_reward, tmp_path, chat=True)
    tok, config = run.tokenizer, run.trainer.config
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    assert config.stop_token_ids == (tok.eos_token_id, eot)
    generation_prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert all(ex["input_ids"][-len(generation_prompt) :] == generation_prompt for ex in run.loader.dataset)
    config.do_sample, config.per_device_training_batch_size = True, 1
    batches = prompt_batches(run, 4, n_rows=4, offset=4)
    torch.manual_seed(5)
    probe = [r.response_ids.tolist() for r in run.trainer.generate_rows(batches[0])]
    row, k = next((i, k) for i, ids in enumerate(probe) for k in range(1, len(ids)) if ids[k] not in ids[:k])
    config.stop_token_ids = (tok.eos_token_id, probe[row][k])
    torch.manual_seed(5)
    metrics, rows = run.trainer.step(batches, step=0)
    assert rows[row].ended_with_eos and rows[row].response_ids.numel() == k + 1
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4, metrics["ppo/log_ratio_max_abs"]


ESTIMATOR_NAMES = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
# (n samples per prompt, prompts per generation batch, generation batches, mini-batch rows)
GROUP_LAYOUTS = [(2, 2, 2, 8), (4, 2, 1, 2)]


@pytest.mark.slow
def test_log_ratio_is_zero_at_lr0_for_every_estimator(ppo_setup):
    """Every advantage estimator, n samples per prompt in groups, generation batch != mini-batch, the
    estimator's own loss aggregation: the log-ratio stays ~0 and each group's rows answer one prompt.
    All estimators on llama; on gpt2 (whose absolute positions are what padding could break, the same
    for every estimator) gae and grpo."""
    from step3_ppo.algo.advantages import get_estimator

    arch, run = ppo_setup
    trainer, config = run.trainer, run.trainer.config
    saved = (
        trainer.estimator,
        trainer.loss_agg,
        trainer.critic,
        config.n_samples_per_prompt,
        config.per_device_training_batch_size,
    )
    maxima = {}
    try:
        for estimator in ESTIMATOR_NAMES if arch == "llama" else ["gae", "grpo"]:
            for n, prompts_per_batch, batches, minibatch in GROUP_LAYOUTS:
                trainer.estimator = get_estimator(estimator)
                trainer.loss_agg = trainer.estimator.loss_agg
                trainer.critic = run.engines.critic if trainer.estimator.needs_critic else None
                config.n_samples_per_prompt, config.per_device_training_batch_size = n, minibatch
                config.do_sample = True
                torch.manual_seed(n)
                metrics, rows = trainer.step(
                    prompt_batches(run, prompts_per_batch, n_rows=prompts_per_batch * batches, offset=4), step=0
                )
                assert len(rows) == n * prompts_per_batch * batches
                groups = [r.group for r in rows]
                assert groups == [i // n for i in range(len(rows))]  # unique per prompt across generation batches
                for g in set(groups):
                    assert len({tuple(r.prompt_ids.tolist()) for r in rows if r.group == g}) == 1
                assert ("loss/critic" in metrics) == (estimator == "gae")
                maxima[estimator, n] = metrics["ppo/log_ratio_max_abs"]
    finally:
        (
            trainer.estimator,
            trainer.loss_agg,
            trainer.critic,
            config.n_samples_per_prompt,
            config.per_device_training_batch_size,
        ) = saved
    print(f"{arch} lr=0 max |log_ratio| per (estimator, n): {maxima}")
    assert max(maxima.values()) <= 1e-4, (arch, maxima)
