"""reasoning-gym as step 3's data and reward: `--data_path reasoning_gym:TASK...` (utils/data/reasoning_gym.py)
generates prompt rows offline, deterministically, with disjoint train and held-out questions; the `reasoning_gym`
built-in scores completions with the task's own `score_answer`; one step-3 iteration at lr 0 runs on them."""

import pytest

from step3_ppo.main import parse_args, setup
from step3_ppo.rewards.functions import BUILTINS, RewardFunctionError, load_reward_function
from tests.test_step3_lr0 import prompt_batches
from utils.data import DataError, load_source, read_rows

FIELDS = ("question", "answer", "metadata", "task", "task_config")
TASKS = "reasoning_gym:basic_arithmetic,leg_counting,chain_sum:size=20,eval_size=10,seed=5"


def fields(records):
    return {k: [row[k] for row, _ in records] for k in FIELDS}


@pytest.fixture(scope="module")
def source():
    return load_source(TASKS)


def test_rows_are_deterministic_and_carry_what_the_scorer_needs(source):
    again = load_source(TASKS)
    assert source.train == again.train and source.eval == again.eval
    assert len(source.train) == 60 and len(source.eval) == 30
    row, origin = source.train[0]
    assert origin == "reasoning_gym:basic_arithmetic#0" and row["task"] == "basic_arithmetic"
    system, user = row["prompt"]  # reasoning-gym's default system prompt asks for <answer> tags
    assert system["role"] == "system" and "<answer>" in system["content"]
    assert user == {"role": "user", "content": row["question"]} and row["metadata"]["source_index"] == 0
    other = load_source(TASKS.replace("seed=5", "seed=6"))
    assert [r["question"] for r, _ in other.train] != [r["question"] for r, _ in source.train]


def test_train_and_held_out_questions_are_disjoint():
    # one-digit sums of two terms: few distinct problems, so held-out entries repeating a training one are skipped
    src = load_source("reasoning_gym:chain_sum:size=40,eval_size=20,max_terms=2,max_digits=1,system=none")
    train = {r["question"] for r, _ in src.train}
    held_out = [r["question"] for r, _ in src.eval]
    assert len(held_out) == len(set(held_out)) == 20 and not train & set(held_out)
    assert max(int(o.rsplit("#", 1)[1]) for _, o in src.eval) > 59  # some were skipped
    assert [m["content"] for m in src.train[0][0]["prompt"]] == [src.train[0][0]["question"]]  # no system turn
    rows, split = read_rows("reasoning_gym:chain_sum:size=4,eval_size=3", 3)
    assert split == "eval" and len(rows) == 3 and set(FIELDS) <= set(rows[0]["extra"])


@pytest.mark.parametrize(
    "spec,message",
    [
        ("reasoning_gym:leg_count", "unknown reasoning-gym task 'leg_count' (close: leg_counting"),
        ("reasoning_gym:leg_counting:size=0", "size must be an integer >= 1, got 0"),
        ("reasoning_gym:leg_counting:size=lots", "size must be an integer >= 1, got 'lots'"),
        ("reasoning_gym:leg_counting:legs=4", "'legs' is neither an option"),
        ("reasoning_gym:leg_counting:chain_sum.max_digits=1", "names task 'chain_sum'"),
        ("reasoning_gym:leg_counting:max_animals=0", "cannot create the task"),
        ("reasoning_gym:leg_counting:size=5,eval_size=100,min_animals=1,max_animals=1,max_instances=1", "gave only"),
    ],
)
def test_a_bad_source_is_one_line(spec, message):
    with pytest.raises(DataError) as e:
        load_source(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_reward_is_the_library_score(source):
    assert BUILTINS["reasoning_gym"].is_accuracy
    fn = load_reward_function("reasoning_gym").fn
    records = source.train[:5] + source.train[20:25] + source.eval[-5:]  # the three tasks
    assert {r["task"] for r, _ in records} == {"basic_arithmetic", "leg_counting", "chain_sum"}
    right = fn([f"Thinking... <answer>{r['answer']}</answer>" for r, _ in records], **fields(records))
    assert right == [1.0] * 15
    wrong = fn([f"<answer>{r['answer']}1</answer>" for r, _ in records], **fields(records))
    untagged = fn([str(r["answer"]) for r, _ in records], **fields(records))  # no <answer> tags: None scored
    assert all(s < 1 for s in wrong + untagged)
    with pytest.raises(RewardFunctionError, match="need 'task' and 'metadata'"):
        fn(["<answer>1</answer>"], answer=["1"])


def test_one_grpo_iteration_at_lr0_on_reasoning_gym_rows(tiny_llama, tmp_path):
    args = [
        "--actor_model_name_or_path",
        tiny_llama,
        "--chat_template",
        "utils/chat_templates/chatml.jinja",
        "--data_path",
        "reasoning_gym:chain_sum:size=8,eval_size=4,system=none,max_terms=2",  # short prompts: a fast test
        "--data_split",
        "0,0,1",
        "--output_dir",
        str(tmp_path / "out"),
        "--advantage_estimator",
        "grpo",
        "--n_samples_per_prompt",
        "2",
        "--reward_funcs",
        "reasoning_gym",
        "--max_prompt_seq_len",
        "64",
        "--max_answer_seq_len",
        "6",
        "--per_device_generation_batch_size",
        "2",
        "--per_device_training_batch_size",
        "2",
        "--actor_zero_stage",
        "0",
        "--actor_learning_rate",
        "0",
        "--kl_ctl",
        "0",
        "--seed",
        "3",
    ]
    run = setup(parse_args(args))  # its reward: the built-in, called in a reward worker process as in a run
    metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=4), step=0)
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    assert len(rows) == 8 and all(r.score == 0.0 for r in rows)  # a random model writes no <answer> tags
    assert "reward/reasoning_gym_mean" in metrics
