"""Generate the tool-use demo's data offline (SFT on calculator traces, then GRPO with --tools calculator).

The task is multi-digit arithmetic that SmolLM2-135M-Instruct gets wrong alone: half the problems are 3-digit
x 2-digit products, half sums of four 2-digit terms; every answer is a non-negative integer, checked by
`math_exact` against the last number of the final answer. The RL and held-out problems are word problems ("A
box holds 28 pencils. How many pencils are in 347 boxes?", four wordings per kind); the SFT traces ask half
"What is 347 * 28?", half in two other wordings per kind, so after SFT the model calls the calculator but has
still to learn to do it from the RL wordings' stories. Files written to --out:

* sft/train.jsonl (step 1, `messages` rows, assistant-only loss): one tool-use trace per problem, [system,
  user, assistant, tool, assistant]. The system turn is exactly step3_ppo.agents.tools.tool_system_prompt of the
  calculator's schema, the block step 3 puts in front of its prompts for a chat template without a `tools`
  variable (step3_ppo/agents/loop.py prompts_with_tools), so SFT and RL see one prompt format; the first assistant
  turn is a Hermes call `<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 28"}}\n
  </tool_call>`, the tool turn the calculator's own output ("9716"), the last turn "The answer is 9716.".
* rl/train.jsonl, rl/eval.jsonl (step 3 and step3_ppo.eval, prompt rows): {"prompt": [{"role": "user",
  "content": "A box holds 28 pencils. How many pencils are in 347 boxes?"}], "answer": "9716"}, without a
  system turn (step 3 adds the tool block).

Rows are deterministic for a seed; every problem is distinct and no problem (its numbers, whatever the
wording) is in two files (eval is drawn first, then sft, then train, so changing --train or --sft leaves eval
as it is).

    python -m data.make_tool_data --out DIR [--sft 400] [--train 2000] [--eval 200] [--seed 0]
"""

from __future__ import annotations

import json
import math
import os
import random

from data.make_arithmetic_data import write  # the same JSONL writer: one file per split
from step3_ppo.agents.tools import calculator, load_tools, tool_system_prompt
from utils.cli import FlagParser, Number
from utils.errors import UsageError, run_main

QUESTION = "What is {expr}?"
ANSWER = "The answer is {answer}."
TOOL = "calculator"
# name -> (what it is, term ranges, operator); the splits alternate the kinds, so each holds half of each
KINDS = {
    "mul": ("a 3-digit by 2-digit product", [(100, 999), (10, 99)], "*"),
    "sum4": ("a sum of four 2-digit terms", [(10, 99)] * 4, "+"),
}
# Word problems (terms a, b, ... in the kind's order). The RL and held-out problems are worded in the RL
# wordings; half the SFT traces ask "What is 347 * 28?", half are in other wordings (SFT_WORDED): SFT teaches
# the call, RL to call it from stories it has not seen.
SFT_WORDED = {
    "mul": (
        "There are {a} rows of {b} chairs in a hall. How many chairs are there?",
        "A printer prints {b} pages a minute. How many pages does it print in {a} minutes?",
    ),
    "sum4": (
        "Four trucks carry {a}, {b}, {c} and {d} boxes. How many boxes do they carry in all?",
        "Ann read {a}, {b}, {c} and {d} pages on four days. How many pages did she read?",
    ),
}
WORDED = {
    "mul": (
        "A box holds {b} pencils. How many pencils are in {a} boxes?",
        "Each of the {a} pages of a book has {b} lines. How many lines does the book have?",
        "A farm packs {a} crates with {b} eggs in each. How many eggs is that?",
        "A bus ticket costs {b} cents. How many cents do {a} tickets cost?",
    ),
    "sum4": (
        "Four classes have {a}, {b}, {c} and {d} students. How many students are there in all?",
        "A shop sold {a} cups on Monday, {b} on Tuesday, {c} on Wednesday and {d} on Thursday. "
        "How many cups did it sell?",
        "Tom scored {a}, {b}, {c} and {d} points in four games. How many points did he score?",
        "A bus picked up {a}, {b}, {c} and {d} people at four stops. How many people got on?",
    ),
}
SPLITS = ("eval", "sft", "train")  # the order they are drawn in: eval never depends on the other counts


def make_problem(rng: random.Random, kind: str, wordings: dict | None = None) -> tuple[str, str, str]:
    """(question, expression, answer) of one problem of `kind` drawn from `rng`: "What is 347 * 28?", or one of
    the kind's `wordings` (SFT_WORDED or WORDED)."""
    _, ranges, op = KINDS[kind]
    terms = [rng.randint(lo, hi) for lo, hi in ranges]
    expression = f" {op} ".join(str(t) for t in terms)
    answer = math.prod(terms) if op == "*" else sum(terms)
    if wordings:
        question = rng.choice(wordings[kind]).format(**dict(zip("abcd", terms)))
    else:
        question = QUESTION.format(expr=expression)
    return question, expression, str(answer)


def wordings_of(split: str, i: int) -> dict | None:
    """The wordings of a split's i-th row: RL and eval rows all WORDED; SFT rows in pairs (one per kind),
    alternately plain and SFT_WORDED."""
    if split != "sft":
        return WORDED
    return SFT_WORDED if (i // len(KINDS)) % 2 else None


def problem_space(kind: str) -> int:
    """How many distinct questions `kind` has."""
    return math.prod(hi - lo + 1 for lo, hi in KINDS[kind][1])


def kind_of(i: int) -> str:
    """The kind of a split's i-th row: the kinds alternate."""
    return list(KINDS)[i % len(KINDS)]


def tool_call(expression: str) -> str:
    """The assistant's Hermes call of the calculator (the form step3_ppo/agents/tools.py parse_hermes reads)."""
    return "<tool_call>\n" + json.dumps({"name": TOOL, "arguments": {"expression": expression}}) + "\n</tool_call>"


def system_prompt() -> str:
    """Step 3's tool block for the calculator (tool_system_prompt of load_tools' schema; imports transformers)."""
    return tool_system_prompt([load_tools([TOOL])[0].schema])


def sft_row(question: str, expression: str, answer: str, system: str) -> dict:
    """One tool-use trace; the tool turn is the calculator's own output, which must be the answer."""
    result = calculator(expression)
    if result != answer:  # the trace would teach a wrong answer
        raise AssertionError(f"calculator({expression!r}) gave {result!r}, expected {answer!r}")
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
            {"role": "assistant", "content": tool_call(expression)},
            {"role": "tool", "content": result},
            {"role": "assistant", "content": ANSWER.format(answer=result)},
        ]
    }


def prompt_row(question: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "answer": answer}


def draw(seed: int, counts: dict) -> dict:
    """{split: [(question, expression, answer)]}: distinct problems (expressions), none in two splits, kinds
    alternating; eval and train worded, sft plain."""
    for kind in KINDS:
        need = sum(sum(1 for i in range(n) if kind_of(i) == kind) for n in counts.values())
        if need > problem_space(kind) // 2:  # past that, drawing without repeats would crawl
            raise UsageError(
                f"{need} {KINDS[kind][0]} problems asked for, more than half of the {problem_space(kind)} there are"
            )
    seen: set = set()
    out: dict = {}
    for split in SPLITS:
        rng = random.Random(f"tools-{split}-{seed}")
        rows = []
        while len(rows) < counts.get(split, 0):
            problem = make_problem(rng, kind_of(len(rows)), wordings_of(split, len(rows)))
            if problem[1] in seen:  # the same numbers in other words are the same problem
                continue
            seen.add(problem[1])
            rows.append(problem)
        out[split] = rows
    return out


def build(seed: int, n_sft: int, n_train: int, n_eval: int) -> dict:
    """{"sft": messages rows, "train": prompt rows, "eval": prompt rows} for `seed`."""
    problems = draw(seed, {"sft": n_sft, "train": n_train, "eval": n_eval})
    system = system_prompt() if problems["sft"] else ""
    return {
        "sft": [sft_row(q, e, a, system) for q, e, a in problems["sft"]],
        "train": [prompt_row(q, a) for q, _, a in problems["train"]],
        "eval": [prompt_row(q, a) for q, _, a in problems["eval"]],
    }


def main(argv=None) -> dict:
    ap = FlagParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (sft/train.jsonl, rl/train.jsonl, rl/eval.jsonl)")
    ap.add_argument(
        "--sft",
        type=Number(int, low=1),
        default=400,
        help="tool-use traces (messages rows) in sft/train.jsonl, for step 1 (default %(default)s)",
    )
    ap.add_argument(
        "--train",
        type=Number(int, low=1),
        default=2000,
        help="prompt rows in rl/train.jsonl, for step 3 with --tools calculator (default %(default)s)",
    )
    ap.add_argument(
        "--eval",
        type=Number(int, low=1),
        default=200,
        help="held-out prompt rows in rl/eval.jsonl; no eval problem is in sft or train (default %(default)s)",
    )
    ap.add_argument(
        "--seed",
        type=Number(int, low=0, high=2**32 - 1),
        default=0,
        help="random seed; the same seed gives the same rows",
    )
    args = ap.parse_args(argv)
    data = build(args.seed, args.sft, args.train, args.eval)
    # one folder per step, in the data layer's naming (train.* / eval.*): step 1 reads sft/, step 3 rl/
    counts = {
        "sft": write(os.path.join(args.out, "sft"), {"train": data["sft"]})["train"],
        **write(os.path.join(args.out, "rl"), {"train": data["train"], "eval": data["eval"]}),
    }
    print(f"tool-use data (seed {args.seed}) in {args.out}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return counts


if __name__ == "__main__":
    run_main(main)
