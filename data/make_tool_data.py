"""Generate the tool-use demo's data offline (issue 28: SFT on calculator traces, then GRPO with --tools calculator).

The task is multi-digit arithmetic that SmolLM2-135M-Instruct gets mostly wrong alone: half the problems are
3-digit x 2-digit products ("What is 347 * 28?"), half 4-term sums of 2-digit terms ("What is 47 + 83 + 12 +
65?"); every answer is a non-negative integer, checked by `math_exact` against the last number of the final
answer. Files written to --out:

* sft.jsonl (step 1, `messages` rows, assistant-only loss): one tool-use trace per problem, [system, user,
  assistant, tool, assistant]. The system turn is exactly step3_ppo.tools.tool_system_prompt of the calculator's
  schema, the block step 3 puts in front of its prompts for a chat template without a `tools` variable
  (step3_ppo/agents.py prompts_with_tools), so SFT and RL see one prompt format; the first assistant turn is a
  Hermes call `<tool_call>\\n{"name": "calculator", "arguments": {"expression": "347 * 28"}}\\n</tool_call>`,
  the tool turn the calculator's own output ("9716"), the last turn "The answer is 9716.".
* train.jsonl, eval.jsonl (step 3 and step3_ppo.eval, prompt rows): {"prompt": [{"role": "user", "content":
  "What is 347 * 28?"}], "answer": "9716"}, without a system turn (step 3 adds the tool block).

Rows are deterministic for a seed; every question is distinct and no question is in two files (eval is drawn
first, then sft, then train, so changing --train or --sft leaves eval as it is).

    python -m data.make_tool_data --out DIR [--sft 400] [--train 2000] [--eval 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import random

from data.make_arithmetic_data import write  # the same JSONL writer: one file per split

QUESTION = "What is {expr}?"
ANSWER = "The answer is {answer}."
TOOL = "calculator"
# name -> (what it is, term ranges, operator); the splits alternate the kinds, so each holds half of each
KINDS = {
    "mul": ("a 3-digit by 2-digit product", [(100, 999), (10, 99)], "*"),
    "sum4": ("a sum of four 2-digit terms", [(10, 99)] * 4, "+"),
}
SPLITS = ("eval", "sft", "train")  # the order they are drawn in: eval never depends on the other counts


def make_problem(rng: random.Random, kind: str) -> tuple[str, str, str]:
    """(question, expression, answer) of one problem of `kind` drawn from `rng`."""
    _, ranges, op = KINDS[kind]
    terms = [rng.randint(lo, hi) for lo, hi in ranges]
    expression = f" {op} ".join(str(t) for t in terms)
    answer = math.prod(terms) if op == "*" else sum(terms)
    return QUESTION.format(expr=expression), expression, str(answer)


def problem_space(kind: str) -> int:
    """How many distinct questions `kind` has."""
    return math.prod(hi - lo + 1 for lo, hi in KINDS[kind][1])


def kind_of(i: int) -> str:
    """The kind of a split's i-th row: the kinds alternate."""
    return list(KINDS)[i % len(KINDS)]


def tool_call(expression: str) -> str:
    """The assistant's Hermes call of the calculator (the form step3_ppo/tools.py parse_hermes reads)."""
    return "<tool_call>\n" + json.dumps({"name": TOOL, "arguments": {"expression": expression}}) + "\n</tool_call>"


def system_prompt() -> str:
    """Step 3's tool block for the calculator (tool_system_prompt of load_tools' schema; imports transformers)."""
    from step3_ppo.tools import load_tools, tool_system_prompt

    return tool_system_prompt([load_tools([TOOL])[0].schema])


def sft_row(question: str, expression: str, answer: str, system: str) -> dict:
    """One tool-use trace; the tool turn is the calculator's own output, which must be the answer."""
    from step3_ppo.tools import calculator

    result = calculator(expression)
    if result != answer:  # the trace would teach a wrong answer
        raise AssertionError(f"calculator({expression!r}) gave {result!r}, expected {answer!r}")
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question},
                         {"role": "assistant", "content": tool_call(expression)},
                         {"role": "tool", "content": result},
                         {"role": "assistant", "content": ANSWER.format(answer=result)}]}


def prompt_row(question: str, answer: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}], "answer": answer}


def draw(seed: int, counts: dict) -> dict:
    """{split: [(question, expression, answer)]}: distinct questions, none in two splits, kinds alternating."""
    for kind in KINDS:
        need = sum(sum(1 for i in range(n) if kind_of(i) == kind) for n in counts.values())
        if need > problem_space(kind) // 2:  # past that, drawing without repeats would crawl
            raise SystemExit(f"{need} {KINDS[kind][0]} problems asked for, more than half of the "
                             f"{problem_space(kind)} there are")
    seen: set = set()
    out: dict = {}
    for split in SPLITS:
        rng = random.Random(f"tools-{split}-{seed}")
        rows = []
        while len(rows) < counts.get(split, 0):
            problem = make_problem(rng, kind_of(len(rows)))
            if problem[0] in seen:
                continue
            seen.add(problem[0])
            rows.append(problem)
        out[split] = rows
    return out


def build(seed: int, n_sft: int, n_train: int, n_eval: int) -> dict:
    """{"sft": messages rows, "train": prompt rows, "eval": prompt rows} for `seed`."""
    problems = draw(seed, {"sft": n_sft, "train": n_train, "eval": n_eval})
    system = system_prompt() if problems["sft"] else ""
    return {"sft": [sft_row(q, e, a, system) for q, e, a in problems["sft"]],
            "train": [prompt_row(q, a) for q, _, a in problems["train"]],
            "eval": [prompt_row(q, a) for q, _, a in problems["eval"]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder (sft.jsonl, train.jsonl, eval.jsonl)")
    ap.add_argument("--sft", type=int, default=400,
                    help="tool-use traces (messages rows) in sft.jsonl, for step 1 (default %(default)s)")
    ap.add_argument("--train", type=int, default=2000,
                    help="prompt rows in train.jsonl, for step 3 with --tools calculator (default %(default)s)")
    ap.add_argument("--eval", type=int, default=200,
                    help="held-out prompt rows in eval.jsonl; no eval question is in sft or train "
                         "(default %(default)s)")
    ap.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same rows")
    args = ap.parse_args(argv)
    counts = write(args.out, build(args.seed, args.sft, args.train, args.eval))
    print(f"tool-use data (seed {args.seed}) in {args.out}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return counts


if __name__ == "__main__":
    main()
