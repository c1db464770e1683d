"""Serve rewards over HTTP in OpenRLHF's remote reward-model convention: what step 3's `--reward_url` (and
OpenRLHF's `--remote_rm_url`) call.

    python -m step3_ppo.rewards.server --reward math_verify --port 5000
    python -m step3_ppo.rewards.server --reward math_verify format --reward_weights 1 0.1 --port 5000
    python -m step3_ppo.rewards.server --reward out/step2 --port 5000       # a reward-model directory

A reward is what `--reward_funcs` takes: a built-in (step3_ppo/rewards/functions.py BUILTINS), a
`path/to/file.py:function` or `package.module:function`, or a step-2 reward-model directory. A POST (any path;
OpenRLHF's clients use /get_reward) of {"query": [...], "prompts": [...], "labels": [...]} answers
{"rewards": [...]}: the weighted sum of the rewards (each one's scores also under "components" when there are
several), null for a row a function gave no finite score. A function gets what step 3 gives it: `prompts`,
`completions` (each query less its prompt, when it starts with it; else the whole query), `answer` (the labels),
`completion_ids` None (the server has no tokenizer); it runs in its own worker process, killed past `--timeout`.
A reward model scores prompt + completion + EOS at its last token. Only JSON is read from a request; a bad
one is answered 400 with {"error": "..."}, a failed reward 500. One line is logged per batch.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from step3_ppo.rewards.functions import (
    BUILTINS,
    RewardFunctionError,
    is_function_spec,
    load_reward_function,
    score_batch,
)
from step3_ppo.rewards.reward_worker import RewardWorker
from utils.cli import FlagParser, Number
from utils.data.tokenize import encode
from utils.errors import ProjectError, UsageError, one_line, run_main
from utils.evaluation.loading import load_reward_model
from utils.evaluation.scoring import reward_scores
from utils.math.rows import Row

DEFAULT_PORT = 5000  # OpenRLHF's serve_rm default
DEFAULT_TIMEOUT_S = 120.0
MAX_BODY_BYTES = 64 * 2**20
RM_BATCH_SIZE = 8
_MESSAGE_LIMIT = 300


class BadRequest(ProjectError):
    """A request the server cannot read: answered 400 with its one line."""


class RewardFailed(ProjectError):
    """A reward that could not score a batch: answered 500 with its one line."""


class FunctionScorer:
    """A reward function by its spec, called in its own worker process (as step 3 calls it)."""

    def __init__(self, spec: str, timeout: float, options: dict):
        try:
            self.func = load_reward_function(spec, **options)
        except RewardFunctionError as exc:
            raise UsageError(f"--reward: {exc}") from None
        self.name, self.timeout = self.func.name, timeout
        self.worker = RewardWorker(self.func, "--timeout")

    def __call__(self, prompts: list, completions: list, labels: list) -> list:
        """The scores (NaN: a row whose score was not a finite number); raises RewardFailed when the call failed
        (raised, ran past --timeout, gave the wrong count, its worker died) or no row got a score."""
        n, failures = len(completions), []

        def on_skip(error: str) -> None:
            failures.append(error)
            print(f"[reward-server] {error}", file=sys.stderr, flush=True)

        try:
            scores, skipped = score_batch(
                self.func,
                prompts=prompts,
                completions=completions,
                completion_ids=[None] * n,
                extra={"answer": labels},
                origins=[f"query {i}" for i in range(n)],
                timeout=self.timeout,
                deadline="--timeout",
                skip_bad=True,  # a row without a finite score is null in the answer
                on_skip=on_skip,
                call=self.worker.call,
            )
        except RewardFunctionError as exc:  # the setup is wrong (math_exact without labels)
            raise RewardFailed(str(exc)) from None
        if failures and n and len(skipped) == n:
            raise RewardFailed(failures[0])
        return scores.tolist()

    def close(self) -> None:
        self.worker.stop()


class ModelScorer:
    """A step-2 reward-model directory: its value at the last token of prompt + completion + EOS."""

    def __init__(self, path: str):
        self.model, self.tokenizer = load_reward_model(path)
        self.name = os.path.basename(os.path.normpath(path)) or "reward_model"

    def __call__(self, prompts: list, completions: list, labels: list) -> list:
        eos, rows = self.tokenizer.eos_token_id, []
        for prompt, completion in zip(prompts, completions):
            ids = encode(self.tokenizer, completion)
            if ids and ids[-1] == eos:
                ids = ids[:-1]
            rows.append(
                Row(torch.tensor(encode(self.tokenizer, prompt), dtype=torch.long), torch.tensor(ids + [eos]), True)
            )
        return reward_scores(self.model, self.tokenizer, rows, RM_BATCH_SIZE) if rows else []

    def close(self) -> None:
        pass


class Rewards:
    """The served rewards and their weights; `score(batch)` -> the answer. Every batch is scored on ONE long-lived
    thread, one at a time: the worker processes and the model take one call each, and a worker process dies with
    the thread that started it (PR_SET_PDEATHSIG), which must not be a request's short-lived one."""

    def __init__(self, scorers: list, weights: list[float] | None = None):
        self.scorers, self.weights = scorers, weights or [1.0] * len(scorers)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-scoring")

    def score(self, batch: dict) -> dict:
        return self.thread.submit(self.score_here, batch).result()

    def score_here(self, batch: dict) -> dict:
        queries, prompts, labels = batch["query"], batch["prompts"], batch["labels"]
        completions = [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)]
        parts = {s.name: s(prompts, completions, labels) for s in self.scorers}
        total = [sum(w * part[i] for w, part in zip(self.weights, parts.values())) for i in range(len(queries))]
        answer = {"rewards": [_json_number(v) for v in total]}
        if len(parts) > 1:
            answer["components"] = {name: [_json_number(v) for v in values] for name, values in parts.items()}
        return answer

    def close(self) -> None:
        self.thread.submit(lambda: [scorer.close() for scorer in self.scorers]).result()
        self.thread.shutdown()


def _json_number(value: float) -> float | None:
    return value if math.isfinite(value) else None


def read_batch(body: bytes) -> dict:
    """The request's JSON as {"query", "prompts", "labels"} lists of one length; raises BadRequest. `prompts` and
    `labels` may be left out (OpenRLHF's serve_rm reads only `query`): then "" and null."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not JSON: {one_line(exc, _MESSAGE_LIMIT)}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body is a JSON {type(data).__name__}, expected an object with a 'query' list")
    queries = data.get("query")
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest("'query' must be a list of strings (prompt + completion, one per row)")
    n = len(queries)
    prompts = data.get("prompts", [""] * n)
    labels = data.get("labels", [None] * n)
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("'prompts' must be a list of strings")
    if not isinstance(labels, list):
        raise BadRequest("'labels' must be a list (one per query)")
    if len(prompts) != n or len(labels) != n:
        raise BadRequest(f"'query' has {n} entries, 'prompts' {len(prompts)}, 'labels' {len(labels)}: one per row")
    return {"query": queries, "prompts": prompts, "labels": labels}


class Handler(BaseHTTPRequestHandler):
    """POST: score a batch; any other method is 405. The answer is always JSON."""

    server_version = "rlhf-reward-server"
    rewards: Rewards  # set on the subclass `make_server` builds

    def do_POST(self):
        started = time.monotonic()
        try:
            length = int(self.headers.get("Content-Length") or -1)
        except ValueError:
            length = -1
        if length < 0:
            return self.answer(411, {"error": "a Content-Length header is needed"})
        if length > MAX_BODY_BYTES:
            return self.answer(413, {"error": f"the body is {length} bytes, more than {MAX_BODY_BYTES}"})
        body = self.rfile.read(length)
        try:
            batch = read_batch(body)
        except BadRequest as exc:
            self.log_line(f"400 {exc}")
            return self.answer(400, {"error": str(exc)})
        try:
            answer = self.rewards.score(batch)
        except RewardFailed as exc:
            self.log_line(f"500 {exc}")
            return self.answer(500, {"error": str(exc)})
        scores = [v for v in answer["rewards"] if v is not None]
        mean = f"{sum(scores) / len(scores):.4f}" if scores else "-"
        nulls = len(answer["rewards"]) - len(scores)
        self.log_line(
            f"{len(batch['query'])} rows, mean reward {mean}"
            + (f", {nulls} null" if nulls else "")
            + f", {time.monotonic() - started:.2f} s"
        )
        self.answer(200, answer)

    def do_GET(self):
        self.answer(405, {"error": 'POST a JSON batch: {"query": [...], "prompts": [...], "labels": [...]}'})

    do_PUT = do_DELETE = do_PATCH = do_GET

    def answer(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # a client past its timeout: it asks again or gives up
            self.log_line(f"the client left before the answer ({status})")

    def log_line(self, text: str) -> None:
        print(f"[reward-server] {self.client_address[0]} {self.command} {self.path}: {text}", flush=True)

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        pass  # one line per batch (log_line), not http.server's access log besides it


def build_rewards(args) -> Rewards:
    options = {"format_pattern": args.format_pattern}
    for spec in args.reward:
        if not is_function_spec(spec) and not os.path.isdir(os.path.expanduser(spec)) and "/" not in spec:
            raise UsageError(
                f"--reward {spec!r} is none of: a built-in ({', '.join(BUILTINS)}), path/to/file.py:function, "
                f"package.module:function, a reward-model directory"
            )
    scorers = [
        FunctionScorer(spec, args.timeout, options) if is_function_spec(spec) else ModelScorer(spec)
        for spec in args.reward
    ]
    names = [s.name for s in scorers]
    for i, name in enumerate(names):  # as step 3 logs them: name, name_2, ...
        if names[:i].count(name):
            scorers[i].name = f"{name}_{names[:i].count(name) + 1}"
    return Rewards(scorers, args.reward_weights)


def make_server(args, rewards: Rewards | None = None) -> ThreadingHTTPServer:
    """The HTTP server of `args` (not yet serving: call serve_forever); port 0 picks a free one."""
    rewards = rewards or build_rewards(args)
    handler = type("RewardHandler", (Handler,), {"rewards": rewards})
    try:
        server = ThreadingHTTPServer((args.host, args.port), handler)
    except OSError as exc:
        rewards.close()
        raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there: {exc.strerror or exc}") from None
    server.daemon_threads = True
    server.rewards = rewards
    return server


def build_parser() -> FlagParser:
    p = FlagParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--reward",
        nargs="+",
        action="extend",
        required=True,
        metavar="SPEC",
        help="rewards to serve, as --reward_funcs takes them: a built-in, path/to/file.py:function, "
        "package.module:function or a reward-model directory (repeatable)",
    )
    p.add_argument(
        "--reward_weights", nargs="+", type=Number(float), default=None, help="one per --reward (default: all 1)"
    )
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument(
        "--port",
        type=Number(int, low=0, high=65535),
        default=DEFAULT_PORT,
        help="the port to listen on (0: a free one, printed) (default %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=Number(float, above=0),
        default=DEFAULT_TIMEOUT_S,
        help="seconds a reward function's call may take; then its worker process is killed and the batch "
        "answered 500 (default %(default)s)",
    )
    p.add_argument("--format_pattern", default=None, help="the regex of the 'format' built-in")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.reward_weights is not None and len(args.reward_weights) != len(args.reward):
        raise UsageError(
            f"--reward_weights has {len(args.reward_weights)} values for {len(args.reward)} rewards "
            f"({' '.join(args.reward)})"
        )
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    server = make_server(args)
    host, port = server.server_address[:2]
    names = ", ".join(s.name for s in server.rewards.scorers)
    print(f"[reward-server] serving {names} on http://{host}:{port}/get_reward (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("[reward-server] stopped", flush=True)
    finally:
        server.server_close()
        server.rewards.close()
    return 0


def cli() -> None:
    """`python -m step3_ppo.rewards.server` (and an `rlhf-reward-server` command): main() ended by run_main (the
    project's errors as one `error:` line)."""
    run_main(main)


if __name__ == "__main__":
    cli()
