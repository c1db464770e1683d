"""A reward served over HTTP (`--reward_url`): OpenRLHF's remote reward-model convention, so a server written for
OpenRLHF (`openrlhf.cli.serve_rm`, a custom `--remote_rm_url` server) scores step 3's rollouts unchanged, and
`python -m step3_ppo.rewards.server` serves any of this project's rewards that way.

One POST per rollout batch (what the trainer hands a reward component), JSON both ways:
    request  {"query": [prompt + completion, ...], "prompts": [prompt, ...], "labels": [the row's 'answer', ...]}
    answer   {"rewards": [one number per query, ...]}
`prompts` are the rows' prompt tokens decoded as the policy saw them (the chat template's special tokens kept),
`query` each prompt followed by its completion decoded without special tokens (what reward functions get), so
`query[len(prompt):]` is the completion; `labels` the rows' `answer` field (null where a row has none). The
rewards are used as returned (float32), as the component `remote`.

A request that fails (connection refused, an HTTP error of 5xx or 429, no answer within `timeout` seconds) is
tried again up to `retries` times, waiting `backoff_s` x 1, 2, 4, ... seconds (at most BACKOFF_MAX_S) between
tries; a 4xx other than 429 is not retried. Past the retries, an answer that is not JSON, has no `rewards` list or
one of another length, or a reward that is not a finite number stops the run (RemoteRewardError, one line naming
the URL); with `skip_bad` (--skip_bad_rewards) those rows' scores are NaN instead (the whole batch for a failed
request or a wrong answer, the bad rewards' rows for bad values), counted in `skipped` and reward/skipped_rows.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request

import torch

from utils.errors import ProjectError, one_line
from utils.math.rows import Row

DEFAULT_TIMEOUT_S = 60.0  # --reward_url_timeout
DEFAULT_RETRIES = 3  # --reward_url_retries
BACKOFF_S = 1.0  # the first wait before a retry; doubled for each further one
BACKOFF_MAX_S = 30.0
LABEL_FIELD = "answer"
_FLOAT32_MAX = 3.4028234663852886e38
_SHOWN_BODY = 120  # characters of an error answer's body in the message
_RETRIED_STATUSES = (429,)  # besides every 5xx


class RemoteRewardError(ProjectError):
    """A reward URL that cannot be reached or answers wrongly; str() is one line naming the URL."""

    def __init__(self, url: str, problem: str):
        self.url, self.problem = url, problem
        super().__init__(one_line(f"--reward_url {url}: {problem}"))


class _Retry(Exception):
    """A failed try worth another (its `problem` is the message if it was the last)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


def _number(value) -> float | None:
    """A JSON number as a finite float32-sized float, else None (true/false, strings, null, NaN are not numbers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) and abs(number) <= _FLOAT32_MAX else None


def _describe(value) -> str:
    return one_line(json.dumps(value) if not isinstance(value, float) else repr(value), 60)


class RemoteReward:
    """The reward component of `--reward_url` (step3_ppo/rewards/components.py's interface): `component(rows)` is
    one POST, float32 [B] scores (NaN: skipped). `posts` counts the requests sent (retries included), `retried` the
    retries, `skipped` the rows whose score was skipped."""

    engine = None
    is_accuracy = False

    def __init__(
        self,
        url: str,
        tokenizer,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = DEFAULT_RETRIES,
        skip_bad: bool = False,
        backoff_s: float = BACKOFF_S,
        name: str = "remote",
    ):
        self.url, self.tokenizer, self.timeout, self.retries = url, tokenizer, timeout, retries
        self.skip_bad, self.backoff_s, self.name = skip_bad, backoff_s, name
        self.posts = self.retried = self.skipped = 0
        self.told_skip = False

    def payload(self, rows: list[Row]) -> dict:
        prompts = self.tokenizer.batch_decode([r.prompt_ids for r in rows], skip_special_tokens=False)
        completions = self.tokenizer.batch_decode([r.response_ids for r in rows], skip_special_tokens=True)
        labels = [(r.prompt.get("extra") or {}).get(LABEL_FIELD) for r in rows]
        return {"query": [p + c for p, c in zip(prompts, completions)], "prompts": prompts, "labels": labels}

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        n = len(rows)
        try:
            values = self.rewards(self.post(self.payload(rows)), n)
        except RemoteRewardError as error:
            if not self.skip_bad:
                raise
            self.tell_first_skip(str(error))
            self.skipped += n
            return torch.full((n,), float("nan"), dtype=torch.float32)
        scores = [_number(v) for v in values]
        bad = [i for i, s in enumerate(scores) if s is None]
        if bad:
            also = f" ({len(bad) - 1} more bad rewards)" if len(bad) > 1 else ""
            error = RemoteRewardError(
                self.url, f"reward {bad[0]} of {n} is {_describe(values[bad[0]])}, not a finite number{also}"
            )
            if not self.skip_bad:
                raise error
            self.tell_first_skip(str(error))
            self.skipped += len(bad)
        return torch.tensor([float("nan") if s is None else s for s in scores], dtype=torch.float32)

    def post(self, payload: dict):
        """The answer's JSON, after up to `retries` retries; raises RemoteRewardError."""
        data = json.dumps(payload, default=str).encode()  # a label JSON cannot hold (a date) as its text
        tries = self.retries + 1
        for attempt in range(tries):
            if attempt:
                self.retried += 1
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), BACKOFF_MAX_S))
            try:
                body = self.send(data)
            except _Retry as failed:
                if attempt == tries - 1:
                    after = f" ({tries} tries: --reward_url_retries {self.retries})" if self.retries else ""
                    raise RemoteRewardError(self.url, failed.problem + after) from None
                continue
            try:
                return json.loads(body)
            except ValueError:
                raise RemoteRewardError(self.url, f"the answer is not JSON: {one_line(body, _SHOWN_BODY)!r}") from None
        raise AssertionError("unreachable")

    def send(self, data: bytes) -> str:
        """One POST: the answer's body, or _Retry (a failure worth another try), or RemoteRewardError."""
        request = urllib.request.Request(
            self.url, data=data, method="POST", headers={"Content-Type": "application/json"}
        )
        self.posts += 1
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            body = one_line(exc.read().decode("utf-8", errors="replace"), _SHOWN_BODY)
            problem = f"HTTP {exc.code} {exc.reason}" + (f": {body}" if body else "")
            if exc.code >= 500 or exc.code in _RETRIED_STATUSES:
                raise _Retry(problem) from None
            raise RemoteRewardError(self.url, problem) from None
        except TimeoutError:
            raise _Retry(f"no answer within --reward_url_timeout {self.timeout:g} s") from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, TimeoutError):
                raise _Retry(f"no answer within --reward_url_timeout {self.timeout:g} s") from None
            raise _Retry(f"cannot connect: {one_line(reason, _SHOWN_BODY)}") from None
        except (ConnectionError, OSError) as exc:  # reset or closed mid-answer
            raise _Retry(f"the connection failed: {one_line(exc, _SHOWN_BODY)}") from None

    def rewards(self, answer, n: int) -> list:
        if not isinstance(answer, dict) or not isinstance(answer.get("rewards"), list):
            shown = one_line(json.dumps(answer), _SHOWN_BODY)
            raise RemoteRewardError(self.url, f'the answer has no "rewards" list: {shown}')
        values = answer["rewards"]
        if len(values) != n:
            raise RemoteRewardError(self.url, f"answered {len(values)} rewards for {n} queries")
        return values

    def tell_first_skip(self, error: str) -> None:
        if not self.told_skip:
            self.told_skip = True
            print(
                f"[step3] warning: --skip_bad_rewards: {error}; its rows are skipped (only the first error of "
                f"{self.name} is printed, reward/skipped_rows counts them)",
                flush=True,
            )
