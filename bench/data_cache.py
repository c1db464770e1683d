"""What --data_output_path saves: tokenising an SFT data set once, then reading it back.

    .venv/bin/python -m bench.data_cache [--rows 100000] [--out DIR]

Writes a JSONL of `--rows` conversational SFT rows (a user turn and an assistant turn of 20-60
words each, seeded random English) and tokenises it for step 1 with the real SmolLM2-135M-Instruct
tokenizer (chat template, max_seq_len 512), through the project's own functions
(`utils.data.build_step_rows` + `utils.data.tokenize_sft`), in three phases of one process:

  (a) no cache: read + normalise + tokenise, what every run and every rank pays without the flag;
  (b) first run with the cache (`utils.data.token_cache.cached_examples`): the same, plus writing the entry;
  (c) second run with the cache: reading the entry back only.

For each: wall time, the process's peak RSS over the phase (VmHWM, reset through
/proc/self/clear_refs before each phase, as utils/runtime/accelerator.py does) and its RSS when the phase
began (the earlier phases' freed memory stays in the heap, so the peak is an upper bound). It also
prints the entry's size on disk and checks that (c) returns exactly (a)'s examples.

With several ranks, rank 0 does (b) once and every other rank only does (c), so on N ranks the
cache turns N x (a) of tokenising into one (b) plus (N-1) x (c) of reading.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.common import machine_line  # noqa: E402

WORDS = """the a of to and in is it you that for on with as this be at by from or have an they which one
we can your all there their what so up out if about who get when make like time just him know take people
into year good some could them see other than then now look only come its over think also back after use
two how our work first well way even new want because any these give day most us model data training
reward policy token tokenizer batch gradient learning rate step loss value function answer question prompt
response chosen rejected example sentence word text file folder memory process rank node machine server
network python code test error result figure table report number line length sequence order random seed
evaluation checkpoint optimizer weight layer attention head hidden state output input label mask pad
please explain why how does would should might must never always often sometimes usually quickly slowly
carefully simple complex small large fast slow early late better worse best worst important different
same similar useful clear short long recipe garden river mountain city village history music painting
science physics chemistry biology weather ocean forest travel journey story poem letter friend family
teacher student school library kitchen coffee bread apple winter summer morning evening market price""".split()


def sentence(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(2, 2030)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice([".", ".", ".", "?", "!"])


def paragraph(rng: random.Random) -> str:
    """20-60 words in sentences of 5-15 words."""
    total, parts = rng.randint(20, 60), []
    while total > 0:
        n = min(total, rng.randint(5, 15))
        parts.append(sentence(rng, n))
        total -= n
    return " ".join(parts)


def write_rows(path: str, n_rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(n_rows):
            row = {
                "messages": [
                    {"role": "user", "content": paragraph(rng)},
                    {"role": "assistant", "content": paragraph(rng)},
                ]
            }
            f.write(json.dumps(row) + "\n")


# --------------------------------------------------------------------------- memory
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+)\s+kB", f.read(), re.MULTILINE).group(1))


def reset_peak() -> None:
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: reset VmHWM to the current RSS
    except OSError:
        pass


class Phase:
    """Wall time, RSS at the start and peak RSS (VmHWM) of one phase."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        reset_peak()
        self.rss0_mb = _status_kb("VmRSS") / 1024
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
        self.peak_mb = _status_kb("VmHWM") / 1024


# --------------------------------------------------------------------------- phases
def tokenise(path: str, tokenizer) -> tuple[list, dict]:
    from utils.data import build_step_rows, tokenize_sft  # transformers: imported here to keep --help fast

    rows = build_step_rows([path], "1,0,0", step=1, seed=0, eval_fraction=0, log=lambda m: None)
    return tokenize_sft(rows.train, tokenizer, 512)


def cache_key(path: str, tokenizer) -> dict:
    st = os.stat(path)
    return {
        "step": 1,
        "sources": [[os.path.abspath(path), st.st_size, st.st_mtime_ns]],
        "data_split": "1,0,0",
        "seed": 0,
        "eval_fraction": 0,
        "max_seq_len": 512,
        "tokenizer": [tokenizer.name_or_path, len(tokenizer), tokenizer.chat_template or ""],
    }


def fingerprint(examples: list) -> str:
    return hashlib.sha256(json.dumps(examples).encode()).hexdigest()


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)) / 2**20


def run(n_rows: int, out: str) -> None:
    from utils.data.token_cache import cached_examples, entry_name  # transformers: imported here to keep --help fast
    from utils.models.default import ensure_default_model
    from utils.models.loading import load_tokenizer

    print(machine_line(), flush=True)
    data, cache_dir = os.path.join(out, "sft.jsonl"), os.path.join(out, "cache")
    start = time.perf_counter()
    write_rows(data, n_rows)
    print(
        f"wrote {n_rows} rows ({os.path.getsize(data) / 2**20:.1f} MiB) in {time.perf_counter() - start:.1f} s: {data}",
        flush=True,
    )
    tokenizer = load_tokenizer(ensure_default_model())
    key = cache_key(data, tokenizer)
    lines: list[str] = []
    build = lambda: tokenise(data, tokenizer)  # noqa: E731

    with Phase("(a) no cache: read + tokenise") as a:
        examples, _ = tokenise(data, tokenizer)
    n_examples, n_tokens, expected = len(examples), sum(len(e["input_ids"]) for e in examples), fingerprint(examples)
    del examples
    with Phase("(b) cache, first run: build + write") as b:
        examples, _ = cached_examples(cache_dir, key, build, log=lines.append)
    del examples
    with Phase("(c) cache, second run: read") as c:
        examples, _ = cached_examples(cache_dir, key, build, log=lines.append)
    assert len(examples) == n_examples and fingerprint(examples) == expected, "(c) differs from (a)"

    print("\n".join(lines))
    print(f"{n_examples} examples, {n_tokens} tokens ({n_tokens / n_examples:.0f} per example); (c) == (a): yes")
    print(f"{'phase':40s} {'wall s':>8s} {'peak RSS MiB':>13s} {'RSS at start':>13s}")
    for p in (a, b, c):
        print(f"{p.name:40s} {p.seconds:8.2f} {p.peak_mb:13.0f} {p.rss0_mb:13.0f}")
    entry = os.path.join(cache_dir, entry_name(key))
    print(f"cache entry on disk: {folder_mb(entry):.1f} MiB ({entry})")
    print(f"speed-up (a)/(c): {a.seconds / c.seconds:.1f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rows", type=int, default=100_000, help="conversational SFT rows to write and tokenise (rows)"
    )
    parser.add_argument("--out", default=None, help="work folder, kept (path; default: a temp folder, removed after)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        run(args.rows, args.out)
        return
    out = tempfile.mkdtemp(prefix="bench-data-cache-")
    try:
        run(args.rows, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    from utils.errors import run_main

    run_main(main)
