"""`--reward_url` (step3_ppo/rewards/remote.py) and the reward server (step3_ppo/rewards/server.py), OpenRLHF's remote
reward-model convention: POST {query, prompts, labels} -> {rewards}. The project's server on a free port serving real
rewards (math_verify, a file function, a reward-model directory) scores what calling them directly scores; a stub
server answers wrongly on purpose (a wrong count, a non-number, a 500, a hang, refused connections): each one line
naming the URL, or with skip_bad NaN rows counted; one step-3 iteration at lr 0 scored by the URL alone."""

import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from step3_ppo.main import parse_args, setup
from step3_ppo.rewards import server as reward_server
from step3_ppo.rewards.functions import load_reward_function
from step3_ppo.rewards.remote import RemoteReward, RemoteRewardError
from tests.test_step3_grpo import grpo_args, write_rows
from tests.test_step3_lr0 import prompt_batches
from utils.errors import UsageError
from utils.evaluation.scoring import reward_scores
from utils.math.rows import Row
from utils.runtime.ports import free_port

REWARDS = """
def chars(prompts, completions, answer, **kwargs):
    return [float(len(c)) + (0.5 if a is not None else 0.0) for c, a in zip(completions, answer)]


def nan_on_seven(completions, **kwargs):
    return [float("nan") if "7" in c else 1.0 for c in completions]


def raises(completions, **kwargs):
    raise KeyError("no such column")
"""


class WordTokenizer:
    """Words as ids (0 and 1 are the special <s> and </s>): decoding is joining, so the texts are known exactly."""

    def __init__(self):
        self.vocab = ["<s>", "</s>"]

    def ids(self, text: str) -> torch.Tensor:
        out = []
        for word in text.split(" "):
            if word not in self.vocab:
                self.vocab.append(word)
            out.append(self.vocab.index(word))
        return torch.tensor(out)

    def batch_decode(self, sequences, skip_special_tokens=False):
        return [" ".join(self.vocab[i] for i in s.tolist() if not (skip_special_tokens and i < 2)) for s in sequences]


CASES = [  # (prompt, completion, the row's answer)
    ("<s> Half of one?", "so \\boxed{\\frac{1}{2}} </s>", "0.5"),
    ("<s> Root of four?", "it is \\boxed{\\sqrt{4}} </s>", 2),
    ("<s> Three plus four?", "7 </s>", 8),
    ("<s> No answer field", "maybe 3", None),
]


def make_rows(tokenizer, cases=CASES):
    rows = []
    for prompt, completion, answer in cases:
        extra = {"id": len(rows)} if answer is None else {"answer": answer, "id": len(rows)}
        rows.append(
            Row(tokenizer.ids(prompt), tokenizer.ids(completion), True, prompt={"prompt": prompt, "extra": extra})
        )
    return rows


def decoded_completions(tokenizer, rows):
    return tokenizer.batch_decode([r.response_ids for r in rows], skip_special_tokens=True)


def labels(rows):
    return [r.prompt["extra"].get("answer") for r in rows]


# ---------------------------------------------------------------- the project's server


class Served:
    """The project's reward server on a free port, serving in a thread."""

    def __init__(self, argv, rewards=None):
        self.server = reward_server.make_server(reward_server.parse_args([*argv, "--port", "0"]), rewards)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/get_reward"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.server.rewards.close()


@pytest.fixture(scope="module")
def rewards_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("remote") / "rewards.py"
    path.write_text(REWARDS)
    return path


@pytest.fixture(scope="module")
def served(rewards_file):
    served = Served(["--reward", "math_verify", f"{rewards_file}:chars", "--reward_weights", "1", "0.5"])
    yield served
    served.close()


def post(url, payload, raw: bytes | None = None, method="POST"):
    data = raw if raw is not None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data if method == "POST" else None, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_component_scores_what_the_functions_score_directly(served, rewards_file):
    tokenizer = WordTokenizer()
    rows = make_rows(tokenizer)
    completions, answers = decoded_completions(tokenizer, rows), labels(rows)
    verified = load_reward_function("math_verify").fn(completions=completions, answer=answers)
    chars = load_reward_function(f"{rewards_file}:chars").fn(prompts=None, completions=completions, answer=answers)
    assert verified == [1.0, 1.0, 0.0, 0.0]
    component = RemoteReward(served.url, tokenizer, timeout=30, retries=0)
    scores = component(rows)
    assert scores.dtype == torch.float32 and component.name == "remote" and component.engine is None
    expected = torch.tensor([v + 0.5 * c for v, c in zip(verified, chars)], dtype=torch.float32)
    assert torch.equal(scores, expected)
    assert component.posts == 1 and component.retried == 0 and component.skipped == 0  # one POST for the batch
    payload = component.payload(rows)
    assert payload["prompts"][0] == "<s> Half of one?" and payload["labels"] == ["0.5", 2, 8, None]
    assert payload["query"][0] == "<s> Half of one?so \\boxed{\\frac{1}{2}}"  # the completion without </s>
    status, answer = post(served.url, payload)
    assert status == 200 and answer["components"] == {"math_verify": verified, "chars": chars}


def test_the_server_reads_only_json_and_answers_400(served):
    assert post(served.url, None, raw=b"__import__('os').system('echo hi')")[0] == 400
    for payload, words in [
        ([1, 2], "expected an object"),
        ({"query": "x"}, "'query' must be a list of strings"),
        ({"query": ["a", "b"], "prompts": ["a"]}, "one per row"),
        ({"query": ["a"], "prompts": [3]}, "'prompts' must be a list of strings"),
        ({"query": ["a"], "labels": "x"}, "'labels' must be a list"),
    ]:
        status, answer = post(served.url, payload)
        assert status == 400 and words in answer["error"] and "\n" not in answer["error"], answer
    assert post(served.url, None, method="GET")[0] == 405
    # OpenRLHF's serve_rm clients send only the queries: then no prompt and no label
    status, answer = post(served.url, {"query": ["so \\boxed{2}"]})
    assert status == 200 and answer["components"] == {"math_verify": [0.0], "chars": [12.0]}
    assert post(served.url, {"query": []}) == (200, {"rewards": [], "components": {"math_verify": [], "chars": []}})


def test_a_failing_function_is_a_500_and_a_bad_row_is_null(rewards_file):
    served = Served(["--reward", f"{rewards_file}:raises"])
    try:
        status, answer = post(served.url, {"query": ["a"], "prompts": [""], "labels": [None]})
        assert status == 500 and "raised KeyError" in answer["error"] and "raises" in answer["error"]
    finally:
        served.close()
    served = Served(["--reward", f"{rewards_file}:nan_on_seven"])
    try:
        status, answer = post(served.url, {"query": ["p 7", "p 8"], "prompts": ["p", "p"], "labels": [1, 2]})
        assert status == 200 and answer == {"rewards": [None, 1.0]}
        tokenizer = WordTokenizer()  # through the component: the null is a non-number, the run stops or skips it
        with pytest.raises(RemoteRewardError, match=r"reward 2 of 4 is null, not a finite number"):
            RemoteReward(served.url, tokenizer, retries=0)(make_rows(tokenizer))
        component = RemoteReward(served.url, tokenizer, retries=0, skip_bad=True)
        scores = component(make_rows(tokenizer))
        assert torch.isnan(scores).tolist() == [False, False, True, False] and component.skipped == 1
    finally:
        served.close()


def test_server_flags_fail_in_one_line(rewards_file):
    with pytest.raises(UsageError, match="--reward_weights has 1 values for 2 rewards"):
        reward_server.parse_args(["--reward", "math_verify", "format", "--reward_weights", "1"])
    with pytest.raises(UsageError, match=r"--reward .no_such_builtin. is none of: a built-in \(math_exact, "):
        reward_server.build_rewards(reward_server.parse_args(["--reward", "no_such_builtin"]))
    with pytest.raises(UsageError, match="--port must be in"):
        reward_server.parse_args(["--reward", "math_verify", "--port", "70000"])


def test_a_reward_model_directory_is_served(tiny_llama_reward):
    scorer = reward_server.ModelScorer(tiny_llama_reward)
    tokenizer = scorer.tokenizer
    prompts, completions = ["Human: good movie?\n\nAssistant:", "Human: bad plot\n\nAssistant:"], [" yes", " no way"]
    rows = [
        Row(
            torch.tensor(tokenizer(p, add_special_tokens=False)["input_ids"]),
            torch.tensor(tokenizer(c, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]),
            True,
        )
        for p, c in zip(prompts, completions)
    ]
    expected = reward_scores(scorer.model, tokenizer, rows)  # step 2's layout: prompt, reply, EOS
    served = Served(["--reward", tiny_llama_reward], reward_server.Rewards([scorer]))
    try:
        status, answer = post(served.url, {"query": [p + c for p, c in zip(prompts, completions)], "prompts": prompts})
        assert status == 200 and answer["rewards"] == pytest.approx(expected, abs=1e-5)
    finally:
        served.close()


# ---------------------------------------------------------------- a stub server that answers wrongly


class Stub:
    """Answers every POST by `mode`; counts the requests; `release` ends the hanging ones."""

    def __init__(self):
        stub = self
        self.mode, self.requests, self.release = "ok", [], threading.Event()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(payload)
                n = len(payload["query"])
                status, answer = 200, {"rewards": [float(i) for i in range(n)]}
                if stub.mode == "short":
                    answer = {"rewards": [1.0] * (n - 1)}
                elif stub.mode == "string":
                    answer["rewards"][1] = "good"
                elif stub.mode == "nan":  # Python's json reads NaN (not standard JSON)
                    return self.send(200, json.dumps(answer).replace("1.0", "NaN").encode())
                elif stub.mode == "no_rewards":
                    answer = {"scores": [1.0] * n}
                elif stub.mode == "not_json":
                    return self.send(200, b"<html>oops</html>")
                elif stub.mode == "500":
                    status, answer = 500, {"error": "the judge crashed"}
                elif stub.mode == "400":
                    status, answer = 400, {"error": "no such route"}
                elif stub.mode == "hang":
                    stub.release.wait(10)
                self.send(status, json.dumps(answer).encode())

            def send(self, status, data):
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a hanging answer's client gave up

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/get_reward"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def stub():
    stub = Stub()
    yield stub
    stub.close()


def component(url, **kwargs):
    tokenizer = WordTokenizer()
    kwargs = {"timeout": 5, "retries": 0, "backoff_s": 0.01, **kwargs}
    return RemoteReward(url, tokenizer, **kwargs), make_rows(tokenizer)


def assert_one_line(exc, *parts):
    text = str(exc)
    assert "\n" not in text and text.startswith("--reward_url http://127.0.0.1:"), text
    for part in parts:
        assert part in text, (part, text)


def test_one_post_per_batch_and_the_scores_as_returned(stub):
    reward, rows = component(stub.url)
    assert reward(rows).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert reward(rows[:2]).tolist() == [0.0, 1.0]
    assert len(stub.requests) == 2 and [len(r["query"]) for r in stub.requests] == [4, 2]
    assert set(stub.requests[0]) == {"query", "prompts", "labels"}


@pytest.mark.parametrize(
    "mode, words, bad_rows",
    [
        ("short", "answered 3 rewards for 4 queries", [0, 1, 2, 3]),
        ("string", 'reward 1 of 4 is "good", not a finite number', [1]),
        ("nan", "reward 1 of 4 is nan, not a finite number", [1]),
        ("no_rewards", 'the answer has no "rewards" list: {"scores"', [0, 1, 2, 3]),
        ("not_json", "the answer is not JSON: '<html>oops</html>'", [0, 1, 2, 3]),
        ("400", 'HTTP 400 Bad Request: {"error": "no such route"}', [0, 1, 2, 3]),
    ],
)
def test_a_wrong_answer_stops_the_run_or_skips_its_rows(stub, mode, words, bad_rows):
    stub.mode = mode
    reward, rows = component(stub.url, retries=2)
    with pytest.raises(RemoteRewardError) as info:
        reward(rows)
    assert_one_line(info.value, stub.url, words)
    assert len(stub.requests) == 1  # an answer, even a wrong one, is not asked again
    skipping, rows = component(stub.url, retries=2, skip_bad=True)
    scores = skipping(rows)
    assert torch.isnan(scores).nonzero().flatten().tolist() == bad_rows and skipping.skipped == len(bad_rows)
    assert all(s == i for i, s in enumerate(scores.tolist()) if i not in bad_rows)  # the good rows as returned


def test_an_http_error_is_retried_with_backoff_then_stops_or_skips(stub):
    stub.mode = "500"
    reward, rows = component(stub.url, retries=3, backoff_s=0.05)
    started = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        reward(rows)
    waited = time.monotonic() - started
    assert_one_line(
        info.value, "HTTP 500 Internal Server Error", "the judge crashed", "4 tries: --reward_url_retries 3"
    )
    assert len(stub.requests) == 4 and reward.posts == 4 and reward.retried == 3
    assert 0.05 + 0.1 + 0.2 <= waited < 3  # 1, 2, 4 x the base
    skipping, rows = component(stub.url, retries=1, skip_bad=True)
    assert torch.isnan(skipping(rows)).all() and skipping.skipped == 4 and skipping.posts == 2
    assert torch.isnan(skipping(rows)).all() and skipping.skipped == 8  # counted again on each batch


def test_a_server_that_hangs_past_the_timeout(stub):
    stub.mode = "hang"
    reward, rows = component(stub.url, timeout=0.3, retries=1)
    started = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        reward(rows)
    assert_one_line(info.value, "no answer within --reward_url_timeout 0.3 s", "2 tries")
    assert reward.posts == 2 and time.monotonic() - started < 3
    skipping, rows = component(stub.url, timeout=0.3, retries=0, skip_bad=True)
    assert torch.isnan(skipping(rows)).all() and skipping.skipped == 4


def test_connection_refused():
    url = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
    reward, rows = component(url, retries=2)
    with pytest.raises(RemoteRewardError) as info:
        reward(rows)
    assert_one_line(info.value, url, "cannot connect", "Connection refused", "3 tries")
    assert reward.posts == 3
    skipping, rows = component(url, retries=0, skip_bad=True)
    assert torch.isnan(skipping(rows)).all() and skipping.skipped == 4


# ---------------------------------------------------------------- step 3


def remote_args(model, tmp, url, *extra):
    argv = grpo_args(model, tmp, *extra)
    at = argv.index("--reward_funcs")
    return argv[:at] + ["--reward_url", url] + argv[at + 2 :]


def test_the_flags_and_their_checks(tiny_llama, tmp_path):
    write_rows(tmp_path)
    args = parse_args(remote_args(tiny_llama, tmp_path, "http://127.0.0.1:1/get_reward"))
    assert args.reward_specs == [] and args.reward_model_paths == []  # the URL alone is a reward
    assert args.reward_url_timeout == 60.0 and args.reward_url_retries == 3
    with pytest.raises(UsageError, match="--reward_url must be an http:// or https:// URL, got 'file:///etc/passwd'"):
        parse_args(remote_args(tiny_llama, tmp_path, "file:///etc/passwd"))
    with pytest.raises(UsageError, match=r"--reward_weights has 1 values for 2 rewards \(math_exact remote\)"):
        parse_args(
            remote_args(tiny_llama, tmp_path, "http://x/", "--reward_funcs", "math_exact", "--reward_weights", 1)
        )
    with pytest.raises(UsageError, match="--reward_url_timeout must be > 0"):
        parse_args(remote_args(tiny_llama, tmp_path, "http://x/", "--reward_url_timeout", 0))
    with pytest.raises(UsageError, match="--reward_url_retries does nothing without --reward_url"):
        parse_args([*grpo_args(tiny_llama, tmp_path), "--reward_url_retries", "5"])


def test_one_step3_iteration_scored_by_the_url_alone(tiny_llama, tmp_path, rewards_file):
    write_rows(tmp_path)
    served = Served(["--reward", f"{rewards_file}:chars"])
    try:
        args = parse_args(
            remote_args(
                tiny_llama, tmp_path, served.url, "--actor_zero_stage", 0, "--actor_learning_rate", 0, "--kl_ctl", 0
            )
        )
        run = setup(args)
        assert [c.name for c in run.trainer.rewards] == ["remote"]
        metrics, rows = run.trainer.step(prompt_batches(run, 2, n_rows=4), step=0)
    finally:
        served.close()
    completions = run.tokenizer.batch_decode([r.response_ids for r in rows], skip_special_tokens=True)
    assert [r.score for r in rows] == [float(len(c)) + 0.5 for c in completions]  # every row has an answer
    assert [r.score_parts["remote"] for r in rows] == [r.score for r in rows]
    assert metrics["reward/remote_mean"] == pytest.approx(sum(r.score for r in rows) / len(rows))
    assert metrics["ppo/log_ratio_max_abs"] <= 1e-4
    assert run.trainer.rewards[0].posts == 2  # one per rollout batch (2 batches of 2 prompts x 2 samples)
