"""The `math_verify` built-in (step3_ppo/rewards/functions.py): Hugging Face's math-verify comparing a completion's
answer with the row's 'answer' as mathematics, beside `math_exact`'s number / string match. Hand cases where the two
differ, where both agree, what math-verify does not accept (asserted as it is), and the call the trainer makes:
by its spec, with the trainer's keyword lists, in a reward worker process (where math-verify's SIGALRM limits work)."""

import signal
import threading

import pytest

from step3_ppo.rewards.components import FunctionReward
from step3_ppo.rewards.functions import (
    BUILTINS,
    MATH_VERIFY_TIMEOUT_S,
    RewardFunctionError,
    _math_verify_timeout,
    is_function_spec,
    load_reward_function,
    math_exact,
    score_batch,
)
from step3_ppo.rewards.reward_worker import RewardWorker

# the options step 3 hands every built-in (`load_reward_function(spec, **vars(args))`): a few of them
RUN_OPTIONS = {"format_pattern": None, "max_answer_seq_len": 6, "reward_timeout": None, "skip_bad_rewards": False}


@pytest.fixture(scope="module")
def math_verify():
    return load_reward_function("math_verify", **RUN_OPTIONS).fn


def scores(fn, completions, answers):
    return fn(completions=list(completions), answer=list(answers))


# (completion, the row's answer, math_verify's score, math_exact's score)
DIFFER = [
    ("The answer is $\\frac{1}{2}$", "0.5", 1.0, 0.0),  # LaTeX fraction vs decimal
    ("The answer is $\\frac{1}{2}$", 0.5, 1.0, 0.0),  # a number as the answer
    ("so the result is \\boxed{\\frac{3}{4}}", "0.75", 1.0, 0.0),
    ("so the result is \\boxed{3/4}", "\\frac{3}{4}", 1.0, 0.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0, 0.0),
    ("the side is \\boxed{5\\text{ cm}}", "5", 1.0, 0.0),  # units dropped
    ("that is \\boxed{50\\%}", "0.5", 1.0, 0.0),  # a percentage
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0, 0.0),  # sets, in any order
    ("\\boxed{1, 2}", "\\{1,2\\}", 1.0, 0.0),  # a bare list against a set
    ("\\boxed{(1, 2]}", "(1,2]", 1.0, 0.0),  # intervals
    ("\\boxed{x + 1}", "1+x", 1.0, 0.0),  # expressions, symbolically
    ("\\boxed{x = 2}", "2", 1.0, 0.0),  # an equation's value
    ("\\boxed{2\\pi}", "6.283185", 1.0, 0.0),  # numerically (6 decimals)
    ("\\boxed{10^{3}}", "1000", 1.0, 0.0),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0, 0.0),
    ("the answer is \\boxed{\\text{yes}}", "yes", 1.0, 0.0),  # \text{} around a word
]
BOTH_RIGHT = [
    ("so the answer is 42.", 42, 1.0, 1.0),
    ("the total is 1,234", "1234", 1.0, 1.0),
    ("\\boxed{12} although 99 came up later", "12", 1.0, 1.0),  # the boxed answer, not the last number
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, 1.0),
    ("-5", -5, 1.0, 1.0),
    ("\\boxed{B}", "B", 1.0, 1.0),  # a boxed letter
]
BOTH_WRONG = [
    ("so the answer is 42.", 43, 0.0, 0.0),
    ("\\boxed{(1, 2]}", "[1,2)", 0.0, 0.0),  # other bounds
    ("\\boxed{\\{1,2\\}}", "\\{1,3\\}", 0.0, 0.0),
    ("\\boxed{x + 1}", "x+2", 0.0, 0.0),
    ("no number here", "42", 0.0, 0.0),
    ("", "42", 0.0, 0.0),
    ("12 + 30 = 42, then 7", "42", 0.0, 0.0),  # both take the last number
    ("\\boxed{12} although 99 came up later", "99", 0.0, 0.0),
]
# what math-verify does not accept (its default extraction), asserted as it is
MISSES = [
    ("the answer is B", "B", 0.0, 0.0),  # a multiple-choice letter is not extracted from plain text
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0, 0.0),  # compared at 6 decimals: 0.333 is not 1/3 (0.3333333 is)
    ("\\boxed{0.5}", "one half", 0.0, 0.0),  # an answer in words
    ("\\boxed{1e3}", "1000", 0.0, 1.0),  # E notation is not LaTeX (math_exact reads it as a float)
]


@pytest.mark.parametrize("completion, answer, verified, exact", DIFFER + BOTH_RIGHT + BOTH_WRONG + MISSES)
def test_hand_cases_against_math_exact(math_verify, completion, answer, verified, exact):
    assert scores(math_verify, [completion], [answer]) == [verified]
    assert math_exact(completions=[completion], answer=[answer]) == [exact]


def test_one_batch_scores_each_row_against_its_own_answer(math_verify):
    completions = [c for c, *_ in DIFFER + BOTH_WRONG]
    answers = [a for _, a, *_ in DIFFER + BOTH_WRONG]
    assert scores(math_verify, completions, answers) == [v for *_, v, _ in DIFFER + BOTH_WRONG]


def test_rows_without_an_answer_and_conversational_completions(math_verify):
    assert scores(math_verify, ["\\boxed{2}", "\\boxed{2}", "\\boxed{2}"], [None, 2, True]) == [0.0, 1.0, 0.0]
    trajectory = [
        {"role": "assistant", "content": "let me compute", "tool_calls": []},
        {"role": "tool", "content": "0.5"},
        {"role": "assistant", "content": "so it is $\\frac{1}{2}$"},
    ]
    assert scores(math_verify, [trajectory], ["0.5"]) == [1.0]  # the last assistant message is the answer
    with pytest.raises(RewardFunctionError, match="math_verify: the prompt rows need an 'answer' field"):
        math_verify(completions=["\\boxed{1}"])


def test_registered_as_an_accuracy_built_in():
    assert is_function_spec("math_verify") and BUILTINS["math_verify"].is_accuracy
    func = load_reward_function("math_verify", **RUN_OPTIONS)
    assert func.name == func.spec == "math_verify" and func.options == {}  # it declares no option
    assert FunctionReward(func, tokenizer=None).is_accuracy


def trainer_batch(n_rows):
    """The keyword lists the trainer passes (FunctionReward: prompts, completions, completion_ids, every field)."""
    cases = (DIFFER + BOTH_WRONG)[:n_rows]
    return dict(
        prompts=[f"Question {i}?" for i in range(n_rows)],
        completions=[c for c, *_ in cases],
        completion_ids=[[1, 2, 3]] * n_rows,
        extra={"answer": [a for _, a, *_ in cases], "id": list(range(n_rows))},
        origins=[f"data/math.jsonl:{i + 1}" for i in range(n_rows)],
    ), [v for *_, v, _ in cases]


def test_the_trainer_call_by_spec_in_a_reward_worker_process():
    """As step 3 calls a built-in: loaded by its spec, run in its own worker process (the main thread there, so
    math-verify's own SIGALRM limits are on), with the trainer's keyword lists and other fields."""
    func = load_reward_function("math_verify", **RUN_OPTIONS)
    worker = RewardWorker(func)
    try:
        batch, expected = trainer_batch(10)
        tensor, bad = score_batch(func, **batch, timeout=60, call=worker.call)
        assert tensor.tolist() == expected and bad == []
        again, _ = score_batch(func, **batch, timeout=60, call=worker.call)  # the worker is reused
        assert again.tolist() == expected
    finally:
        worker.stop()


def test_in_process_under_the_callers_alarm_and_in_a_thread():
    """In this process: under score_batch's SIGALRM limit (math-verify's own alarm would cancel it, so it is off)
    and off the main thread (where math-verify's signals would raise)."""
    func = load_reward_function("math_verify")
    batch, expected = trainer_batch(4)
    assert score_batch(func, **batch, timeout=30)[0].tolist() == expected
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(result=score_batch(func, **batch, timeout=30)))
    thread.start()
    thread.join(60)
    assert outcome["result"][0].tolist() == expected


def test_its_own_limit_only_where_sigalrm_is_free():
    assert _math_verify_timeout() == MATH_VERIFY_TIMEOUT_S  # the main thread, no timer running
    signal.setitimer(signal.ITIMER_REAL, 30)
    previous = signal.signal(signal.SIGALRM, lambda *a: None)
    try:
        assert _math_verify_timeout() is None  # a caller's timer runs: math-verify's alarm would cancel it
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(_math_verify_timeout()))
    thread.start()
    thread.join()
    assert seen == [None]
