"""Generate a verifiable arithmetic task offline (GRPO demo: no reward model).

Each row is a chat prompt (an optional system turn and a user question such as "What is 23 + 8? Answer with the number
only.") and the exact answer as a string; the `math_exact` reward compares the last number of a completion
(or the content of its last \\boxed{...}) against `answer`. Rows are deterministic for a seed, and no
eval question appears in the train file.

    python -m data.make_arithmetic_data --out DIR [--train 2000] [--eval 200] [--seed 0] [--difficulty add30]
        [--system TEXT]
"""

from __future__ import annotations

import json
import os
import random

from utils.cli import FlagParser, Number
from utils.errors import UsageError, run_main

# name -> (what it is, term ranges, operators); every answer is a non-negative integer, so "the last
# number of the completion" never has to decide whether a leading "-" belongs to it
DIFFICULTIES = {
    "add1": ("a + b, one-digit terms", [(0, 9), (0, 9)], "+"),
    "add20": ("a + b, terms 1..20", [(1, 20), (1, 20)], "+"),
    "add30": ("a + b, terms 1..30", [(1, 30), (1, 30)], "+"),
    "add99": ("a + b, one- or two-digit terms", [(1, 99), (1, 99)], "+"),
    "add2": ("a + b, two-digit terms", [(10, 99), (10, 99)], "+"),
    "add21": ("a + b, a two-digit and a one-digit term", [(10, 99), (1, 9)], "+"),
    "addsub2": ("a + b or a - b (a >= b), one- or two-digit terms", [(1, 99), (1, 99)], "+-"),
    "mul1": ("a * b, one-digit terms", [(2, 9), (2, 9)], "*"),
    "sum3": ("a + b + c, one- or two-digit terms", [(1, 99), (1, 99), (1, 99)], "+"),
}
DEFAULT_DIFFICULTY = "add30"
# Calibrated on SmolLM2-135M-Instruct (greedy, 48 new tokens, 100 eval problems): on add2, the instruction
# in the user turn under the template's own default system turn (19%) beat no instruction (11%) and every
# system-turn instruction tried ("Answer with the number only." 9%, "End your reply with 'The answer is
# N.'" 17%, "\\boxed{}" 4%); with it, add30 gave 32% greedy accuracy with 18-token answers (add20 37%,
# add21 17%, add99 10%, addsub2 8%, sum3 0%, add1 62%, mul1 62%).
SYSTEM = ""  # no system turn: SmolLM2's chat template then adds its default one; --system "..." sets one
QUESTION = "What is {expr}? Answer with the number only."
SHOW = {"+": "+", "-": "-", "*": "*"}


def make_problem(rng: random.Random, difficulty: str = DEFAULT_DIFFICULTY) -> tuple[str, str]:
    """(question, answer) of one problem drawn from `rng`."""
    _, ranges, ops = DIFFICULTIES[difficulty]
    terms = [rng.randint(lo, hi) for lo, hi in ranges]
    op = rng.choice(ops)
    if op == "-":
        terms.sort(reverse=True)  # a >= b: the answer stays non-negative
    expr = f" {SHOW[op]} ".join(str(t) for t in terms)
    return QUESTION.format(expr=expr), str(evaluate(terms, op))


def evaluate(terms: list, op: str) -> int:
    out = terms[0]
    for t in terms[1:]:
        out = out + t if op == "+" else out - t if op == "-" else out * t
    return out


def problem_space(difficulty: str) -> int:
    """Upper bound on the number of distinct questions of a difficulty."""
    _, ranges, ops = DIFFICULTIES[difficulty]
    n = len(ops)
    for lo, hi in ranges:
        n *= hi - lo + 1
    return n


def row_of(question: str, answer: str, system: str = SYSTEM) -> dict:
    turns = [{"role": "system", "content": system}] if system else []
    return {"prompt": turns + [{"role": "user", "content": question}], "answer": answer}


def build(seed: int, n_train: int, n_eval: int, difficulty: str = DEFAULT_DIFFICULTY, system: str = SYSTEM) -> dict:
    """{"train": rows, "eval": rows}. Eval questions are distinct; train questions are drawn apart from
    them (distinct too while the problem space allows, else repeats, never an eval question)."""
    rng = random.Random(f"arithmetic-{difficulty}-{seed}")
    space = problem_space(difficulty)
    if n_eval > space // 2:
        raise UsageError(f"--eval {n_eval} is more than half of the {space} {difficulty} problems")
    eval_rows: dict = {}
    while len(eval_rows) < n_eval:
        q, a = make_problem(rng, difficulty)
        eval_rows.setdefault(q, a)
    train_rows: list = []
    seen: set = set()
    unique = n_train <= (space - n_eval) // 2  # else sampling without repeats would crawl
    while len(train_rows) < n_train:
        q, a = make_problem(rng, difficulty)
        if q in eval_rows or (unique and q in seen):
            continue
        seen.add(q)
        train_rows.append((q, a))
    return {
        "train": [row_of(q, a, system) for q, a in train_rows],
        "eval": [row_of(q, a, system) for q, a in eval_rows.items()],
    }


def write(out: str, data: dict) -> dict:
    os.makedirs(out, exist_ok=True)
    for split, rows in data.items():
        with open(os.path.join(out, f"{split}.jsonl"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return {split: len(rows) for split, rows in data.items()}


def main(argv=None) -> dict:
    ap = FlagParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (train.jsonl, eval.jsonl)")
    ap.add_argument(
        "--train",
        type=Number(int, low=1),
        default=2000,
        help="rows (problems) in train.jsonl; none is an eval question (default %(default)s)",
    )
    ap.add_argument(
        "--eval",
        type=Number(int, low=1),
        default=200,
        help="rows (distinct problems) in eval.jsonl, at most half the problems of --difficulty (default %(default)s)",
    )
    ap.add_argument(
        "--seed",
        type=Number(int, low=0, high=2**32 - 1),
        default=0,
        help="random seed; the same seed gives the same rows",
    )
    ap.add_argument(
        "--difficulty",
        choices=sorted(DIFFICULTIES),
        default=DEFAULT_DIFFICULTY,
        help="; ".join(f"{k}: {v[0]}" for k, v in DIFFICULTIES.items()),
    )
    ap.add_argument(
        "--system",
        default=SYSTEM,
        help="system turn (default: none, the chat template's default system turn then applies)",
    )
    args = ap.parse_args(argv)
    counts = write(args.out, build(args.seed, args.train, args.eval, args.difficulty, args.system))
    print(
        f"arithmetic data ({args.difficulty}, seed {args.seed}) in {args.out}: "
        + ", ".join(f"{k}={v}" for k, v in counts.items())
    )
    return counts


if __name__ == "__main__":
    run_main(main)
