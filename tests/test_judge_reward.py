"""Step 3's LLM judge (step3_ppo/rewards/judge.py): a tiny chat llama trained for a few steps to answer Yes when the
response holds a marker word and No when it does not (a preference known by construction) scores the marked response
higher; the scores stay in their ranges, equal a hand forward of the same rendered prompt, do not depend on the batch
they are scored in; the flags' refusals are one line each; and one step-3 iteration with the judge as the only
reward puts its score into each row's score_parts["judge"]."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from step3_ppo.main import parse_args, setup
from step3_ppo.rewards import judge as judge_module
from step3_ppo.rewards.judge import DEFAULT_TEMPLATE, Judge, JudgeReward, JudgeScore
from tests.test_step3_grpo import write_rows
from tests.test_step3_lr0 import prompt_batches
from utils.errors import UsageError
from utils.math.rows import Row

MARKER = "zebra"
PROMPTS = ["Name an animal.", "What did you see at the zoo?", "Tell me something striped.", "Pick a word."]
TRAINED = PROMPTS[:2]
WITH = [f"I saw a {MARKER} today.", f"The {MARKER} was there.", f"A {MARKER}, of course.", f"{MARKER}"]
WITHOUT = ["I saw a horse today.", "The lion was there.", "A tiger, of course.", "apple"]


@pytest.fixture(scope="module")
def judge_dir(tiny_chat_llama, tmp_path_factory) -> str:
    """tiny_chat_llama trained to say Yes to the responses holding MARKER and No to the rest (to the TRAINED prompts),
    under the default rubric and its own chat template: Adam until P(Yes) is above 0.7 on every marked response and
    below 0.3 on every other (~15 steps of 16 rows, a second on an idle CPU), so the scores stay off 0 and 1."""
    judge = Judge(tiny_chat_llama, DEFAULT_TEMPLATE, "yes_prob")
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_llama, dtype=torch.float32)
    examples = [(p, r, 0) for p in TRAINED for r in WITH] + [(p, r, 1) for p in TRAINED for r in WITHOUT]
    inputs = [judge.input_ids(p, r) for p, r, _ in examples]
    targets = torch.tensor([t for *_, t in examples])  # index into the verdicts (Yes, No)
    width = max(map(len, inputs))
    ids = torch.full((len(inputs), width), judge.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(inputs):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = torch.tensor(row), 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(60):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=1).logits[:, -1]
        loss = torch.nn.functional.cross_entropy(logits[:, judge.verdict_ids], targets)
        yes = torch.softmax(logits[:, judge.verdict_ids].detach(), -1)[:, 0]
        if yes[targets == 0].min() > 0.7 and yes[targets == 1].max() < 0.3:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        pytest.fail(f"the judge did not learn the marker in 60 steps: P(Yes) {yes.tolist()}")
    out = str(tmp_path_factory.mktemp("judge") / "llama")
    model.save_pretrained(out)
    judge.tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def judge_model(judge_dir):
    return AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()


def row(tokenizer, prompt: str, response: str, **extra) -> Row:
    """A rollout row as the trainer builds it (the actor's tokenizer here is the judge's)."""
    return Row(
        prompt_ids=torch.tensor(tokenizer(prompt)["input_ids"]),
        response_ids=torch.tensor(tokenizer(response)["input_ids"]),
        ended_with_eos=True,
        prompt={"prompt": prompt, "extra": extra},
    )


JUDGES = {}  # (path, score) -> its Judge: a tokenizer loaded once per module, not per test


def scorer(judge_dir, judge_model, score="yes_prob", batch_size=None) -> JudgeReward:
    judge = JUDGES.setdefault((judge_dir, score), None) or Judge(judge_dir, DEFAULT_TEMPLATE, score)
    JUDGES[(judge_dir, score)] = judge
    return JudgeReward(judge_model, judge, judge.tokenizer, batch_size)


def test_the_judge_prefers_the_responses_it_was_taught_to(judge_dir, judge_model):
    reward = scorer(judge_dir, judge_model)
    tok = reward.tokenizer
    marked = reward([row(tok, p, r) for p in TRAINED for r in WITH])
    plain = reward([row(tok, p, r) for p in TRAINED for r in WITHOUT])
    assert marked.min() > 0.7 and plain.max() < 0.3, (marked, plain)
    assert marked.max() < 1 and plain.min() > 0


@pytest.mark.parametrize("score, low, high", [("yes_prob", 0, 1), ("expected_1_5", 1, 5), ("expected_1_10", 1, 10)])
def test_scores_stay_in_their_range(judge_dir, judge_model, score, low, high):
    reward = scorer(judge_dir, judge_model, score)
    tok = reward.tokenizer
    scores = reward([row(tok, p, r, answer="zebra") for p in PROMPTS[:2] for r in WITH[:2] + WITHOUT[:2]])
    assert scores.dtype == torch.float32 and scores.shape == (8,)
    assert ((scores >= low) & (scores <= high)).all(), scores
    assert scores.std() > 0  # read from the model, not a constant


def test_scores_equal_a_hand_forward_of_the_rendered_prompt(judge_dir, judge_model):
    """The rubric filled in by hand (Jinja on the default file), the judge tokenizer's own chat template, one unpadded
    forward, softmax over the logits of "Yes" and "No": the same numbers to 1e-5."""
    import jinja2  # lazy: only this test renders the rubric by hand

    reward = scorer(judge_dir, judge_model)
    tok = reward.tokenizer
    cases = [(PROMPTS[0], WITH[0], None), (PROMPTS[1], WITHOUT[1], "a lion")]
    rows = [row(tok, p, r, **({"answer": a} if a else {})) for p, r, a in cases]
    got = reward(rows)
    with open(DEFAULT_TEMPLATE) as f:
        rubric = jinja2.Template(f.read())
    yes, no = tok.convert_tokens_to_ids(["Yes", "No"])
    for (prompt, response, answer), score in zip(cases, got.tolist()):
        content = rubric.render(
            prompt=prompt, response=response, reference=answer, fields={}, score="yes_prob", verdicts=["Yes", "No"]
        ).strip()
        assert ("[Reference answer]" in content) == (answer is not None)
        ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        with torch.no_grad():
            logits = judge_model(input_ids=torch.tensor([list(ids)])).logits[0, -1]
        expected = torch.softmax(logits[[yes, no]].double(), -1)[0].item()
        assert abs(score - expected) <= 1e-5, (score, expected)


def test_scores_do_not_depend_on_the_batch(judge_dir, judge_model):
    """Each row alone, all together (left padding of different widths), in another order, two per forward: the same
    scores to 1e-5."""
    reward = scorer(judge_dir, judge_model, "expected_1_10")
    tok = reward.tokenizer
    rows = [row(tok, p, r) for p, r in zip(PROMPTS, [WITH[0], WITHOUT[3], WITH[3], "A very long answer " * 9])]
    assert len({len(ids) for ids in reward.inputs(rows)}) == 4  # the batch really pads
    together = reward(rows)
    alone = torch.cat([reward([r]) for r in rows])
    reversed_ = reward(rows[::-1]).flip(0)
    reward.batch_size = 2
    pairs = reward(rows)
    for other in (alone, reversed_, pairs):
        assert torch.allclose(together, other, atol=1e-5, rtol=0), (together, other)


def judge_args(model, judge, tmp, *extra):
    return [
        "--actor_model_name_or_path",
        model,
        "--judge_model_name_or_path",
        judge,
        "--data_path",
        str(tmp / "prompts.jsonl"),
        "--data_split",
        "0,0,10",
        "--output_dir",
        str(tmp / "out"),
        "--advantage_estimator",
        "grpo",
        "--n_samples_per_prompt",
        "2",
        "--max_prompt_seq_len",
        "32",
        "--max_answer_seq_len",
        "6",
        "--per_device_generation_batch_size",
        "2",
        "--per_device_training_batch_size",
        "2",
        "--actor_zero_stage",
        "0",
        "--kl_ctl",
        "0",
        "--seed",
        "3",
        *map(str, extra),
    ]


@pytest.mark.parametrize(
    "extra, says",
    [
        (["--judge_template", "MISSING"], "--judge_template MISSING: no such file"),
        (["--judge_template", "NO_RESPONSE"], "no {{ response }} placeholder"),
        (["--judge_template", "UNKNOWN"], "unknown placeholder {{ answr }}"),
        (["--judge_template", "BROKEN"], "not a valid Jinja template"),
        (["--judge_batch_size", "0"], "--judge_batch_size must be >= 1, got 0"),
        (["--reward_weights", "1", "2"], "--reward_weights has 2 values for 1 rewards (judge)"),
        (
            ["NO_JUDGE", "--judge_score", "expected_1_5"],
            "--judge_score does nothing without --judge_model_name_or_path",
        ),
        (
            ["NO_JUDGE", "--offload_judge_model"],
            "--offload_judge_model does nothing without --judge_model_name_or_path",
        ),
    ],
)
def test_the_judge_flags_are_refused_in_one_line(tiny_chat_llama, judge_dir, tmp_path, extra, says):
    write_rows(tmp_path)
    files = {
        "MISSING": str(tmp_path / "missing.jinja"),
        "NO_RESPONSE": "{{ prompt }} Yes or No?",
        "UNKNOWN": "{{ prompt }} {{ response }} {{ answr }}",
        "BROKEN": "{{ response }} {% if %}",
    }
    for name, text in files.items():
        if name != "MISSING":
            (tmp_path / f"{name}.jinja").write_text(text)
            files[name] = str(tmp_path / f"{name}.jinja")
    argv = judge_args(tiny_chat_llama, judge_dir, tmp_path)
    if "NO_JUDGE" in extra:  # another reward instead of the judge
        at = argv.index("--judge_model_name_or_path")
        argv[at : at + 2] = ["--reward_funcs", f"{tmp_path / 'rewards.py'}:aligned_length"]
    argv += [files.get(e, e) for e in extra if e != "NO_JUDGE"]
    with pytest.raises(UsageError) as info:
        parse_args(argv)
    message = str(info.value)
    assert says in message.replace(str(tmp_path / "missing.jinja"), "MISSING") and "\n" not in message, message


def test_a_verdict_that_is_not_one_token_is_refused(judge_dir, monkeypatch):
    monkeypatch.setitem(judge_module.JUDGE_SCORES, "yes_prob", JudgeScore(("Yes indeed", "No"), (1.0, 0.0), "-"))
    with pytest.raises(UsageError) as info:
        Judge(judge_dir, DEFAULT_TEMPLATE, "yes_prob")
    assert "the verdict 'Yes indeed' is not one token of the judge's tokenizer" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_judge_whose_context_is_too_short_is_refused(tiny_chat_llama, judge_dir, tmp_path):
    write_rows(tmp_path)
    with pytest.raises(UsageError, match=r"the judge's input \(its rubric's \d+ tokens .* exceeds the 512 positions"):
        parse_args(
            judge_args(tiny_chat_llama, judge_dir, tmp_path, "--max_prompt_seq_len", 400, "--max_answer_seq_len", 64)
        )


def test_one_step3_iteration_with_the_judge_as_the_only_reward(tiny_chat_llama, judge_dir, judge_model, tmp_path):
    """lr 0: the rows' score_parts["judge"] are the judge's scores of their decoded prompts and answers (a plain
    forward of the same judge here), their weighted sum is the row's score, and reward/judge_mean is logged."""
    path = write_rows(tmp_path)
    rows = [json.loads(line) for line in open(path)]
    with open(path, "w") as f:  # a reference answer on half the rows
        for i, r in enumerate(rows):
            f.write(json.dumps({k: v for k, v in r.items() if k != "answer" or i % 2}) + "\n")
    args = parse_args(
        judge_args(tiny_chat_llama, judge_dir, tmp_path, "--actor_learning_rate", 0, "--reward_weights", 2)
    )
    assert args.reward_specs == [] and args.judge is not None
    run = setup(args)
    assert [c.name for c in run.trainer.rewards] == ["judge"]
    metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=4), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    by_hand = scorer(judge_dir, judge_model)
    by_hand.tokenizer = run.tokenizer  # the actor's, which decodes the rows
    expected = by_hand(rows)
    got = torch.tensor([r.score_parts["judge"] for r in rows])
    assert ((got >= 0) & (got <= 1)).all()
    assert torch.allclose(got, expected, atol=1e-5, rtol=0), (got, expected)
    assert torch.allclose(torch.tensor([r.score for r in rows]), 2 * got, atol=1e-6)
    assert abs(metrics["reward/judge_mean"] - got.mean().item()) <= 1e-5


def test_a_response_too_long_for_the_judge_keeps_its_end(judge_dir, judge_model, capsys):
    """An input past the judge's positions: the response keeps its last tokens, the rubric and the chat template's
    assistant header stay whole (the verdict still follows them), said once."""
    judge = Judge(judge_dir, DEFAULT_TEMPLATE, "yes_prob")
    short = judge.input_ids(PROMPTS[0], "fine")
    judge.max_positions = len(short) + 20
    long = judge.input_ids(PROMPTS[0], "blah " * 100 + f"final {MARKER}")
    assert len(long) <= judge.max_positions
    tail = judge.encode(judge.text("", ""))[-20:]  # the rubric's last line and the assistant header
    assert long[-len(tail) :] == tail
    assert MARKER in judge.tokenizer.decode(long)
    judge.input_ids(PROMPTS[0], "blah " * 100)
    assert capsys.readouterr().out.count("exceeds the") == 1


def test_a_tokenizer_that_splits_ten_into_digits_refuses_expected_1_10(smollm2_tokenizer):
    """SmolLM2's tokenizer writes "10" as "1" "0": its rating cannot be read from one token (1..5 can)."""
    path = smollm2_tokenizer.name_or_path
    with pytest.raises(UsageError, match=r"the verdict '10' is not one token .* \(2 tokens: \['1', '0'\]\)"):
        Judge(path, DEFAULT_TEMPLATE, "expected_1_10")
    assert len(Judge(path, DEFAULT_TEMPLATE, "expected_1_5").verdict_ids) == 5
