"""An LLM judge as a step-3 reward (`--judge_model_name_or_path`): a frozen causal LM reads a rubric filled with the
prompt, the response and (when the row has one) its reference answer, and its next-token distribution at the verdict
is the score. One forward per batch, no generation: the verdict is read from the log-probs of its tokens.

- the rubric: a Jinja template (`--judge_template FILE`, default step3_ppo/rewards/judge_default.jinja) with the
  placeholders `{{ prompt }}` (the prompt as the data gave it; a message list as `role: content` lines),
  `{{ response }}` (the answer decoded without special tokens; a multi-turn trajectory's messages after the prompt),
  `{{ reference }}` (the row's `answer` field, None without one), `{{ fields }}` (every field of the prompt row),
  `{{ score }}` and `{{ verdicts }}` (the --judge_score and its verdict strings, for the instruction); its text is
  the judge's user message, rendered by the judge tokenizer's chat template with the assistant's turn opened (a
  tokenizer without one reads the text as it is);
- the score (`--judge_score`, JUDGE_SCORES): the softmax of the judge's logits restricted to the verdict tokens,
  as the expected verdict value: yes_prob = P(Yes) / (P(Yes) + P(No)) in [0, 1]; expected_1_5 / expected_1_10 the
  expected rating over the tokens "1".."5" / "1".."10". Each verdict must be one token of the judge's tokenizer where
  the judge would write it (after the chat template's assistant header), checked before any model loads;
- the judge is a frozen engine like the reference (the actor's ZeRO stage, `--offload_judge_model` for ZeRO-3 with
  its parameters in CPU memory; step3_ppo.deepspeed_models builds it) and may have another tokenizer than the actor:
  it reads text, not the actor's token ids. Inputs are left-padded, so the last position of every row is its own
  last token, and position ids come from the mask (utils.models.forward): a row's score does not depend on its batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import jinja2
import jinja2.meta
import jinja2.sandbox
import torch

from utils.cli import Number
from utils.data.collate import pad_batch
from utils.errors import one_line
from utils.math.rows import Row
from utils.models.forward import causal_lm_logits, eval_mode
from utils.models.loading import check_model_path, load_tokenizer
from utils.train.flags import check_sequence_fits, fail, model_max_positions, refuse_unread
from utils.train.metrics_logger import print_rank0

DEFAULT_TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "judge_default.jinja")
JUDGE_FLAGS = ("judge_template", "judge_score", "judge_batch_size", "offload_judge_model")
# what a --judge_template may use; `response` it must
PLACEHOLDERS = ("prompt", "response", "reference", "fields", "score", "verdicts")
REFERENCE_FIELD = "answer"  # the prompt row's field `{{ reference }}` holds (math_exact's too)


@dataclass(frozen=True)
class JudgeScore:
    """A way to read the verdict: its token strings and the value of each (the score is their expected value)."""

    verdicts: tuple[str, ...]
    values: tuple[float, ...]
    help: str


JUDGE_SCORES = {
    "yes_prob": JudgeScore(("Yes", "No"), (1.0, 0.0), 'P("Yes") normalised over {Yes, No}, in [0, 1]'),
    "expected_1_5": JudgeScore(
        tuple(str(i) for i in range(1, 6)), tuple(float(i) for i in range(1, 6)), 'the expected rating over "1".."5"'
    ),
    "expected_1_10": JudgeScore(
        tuple(str(i) for i in range(1, 11)),
        tuple(float(i) for i in range(1, 11)),
        'the expected rating over "1".."10" (a tokenizer that splits "10" into digits cannot read it)',
    ),
}


def add_judge_args(g) -> None:
    """The judge's flags, in step 3's rewards group."""
    g.add_argument(
        "--judge_model_name_or_path",
        default=None,
        help="an LLM judge (a causal LM, any tokenizer): its verdict on each prompt + response is the reward "
        "component 'judge' (weighted after the --reward_funcs entries)",
    )
    g.add_argument(
        "--judge_template",
        default=None,
        metavar="FILE",
        help="the judge's rubric, a Jinja file with {{ prompt }}, {{ response }}, {{ reference }} (the row's "
        "'answer'), {{ fields }}, {{ score }}, {{ verdicts }} (default step3_ppo/rewards/judge_default.jinja)",
    )
    g.add_argument(
        "--judge_score",
        choices=list(JUDGE_SCORES),
        default="yes_prob",
        help="how the verdict's log-probs become the score: "
        + "; ".join(f"{name}: {s.help}" for name, s in JUDGE_SCORES.items()).replace("%", "%%"),
    )
    g.add_argument(
        "--judge_batch_size",
        type=Number(int, low=1),
        default=None,
        help="rows per judge forward (default: a whole generation batch, its prompts x --n_samples_per_prompt)",
    )
    g.add_argument(
        "--offload_judge_model",
        action="store_true",
        help="keep the judge's parameters in CPU memory (ZeRO-3 offload)",
    )


class Judge:
    """The judge's rubric, tokenizer and verdict tokens: renders rows to the judge's input ids and reads scores off
    its logits. Built (and so checked) by `check_judge_args` before any model loads."""

    def __init__(self, path: str, template_path: str, score: str, trust_remote_code: bool = False):
        self.path, self.template_path, self.score_name = path, template_path, score
        self.score = JUDGE_SCORES[score]
        self.template = compile_template(template_path)
        self.tokenizer = load_tokenizer(path, trust_remote_code, padding_side="left")
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.max_positions = model_max_positions(path)
        self.verdict_ids = self.verdict_token_ids()
        self.values = torch.tensor(self.score.values, dtype=torch.float32)
        self.told_cut = False

    def text(self, prompt: str, response: str, reference=None, fields: dict | None = None) -> str:
        """The judge's input text: the rubric filled in, as the chat template's user turn with the assistant's
        turn opened (the verdict is the next token)."""
        try:
            content = self.template.render(
                prompt=prompt,
                response=response,
                reference=reference,
                fields=fields or {},
                score=self.score_name,
                verdicts=list(self.score.verdicts),
            ).strip()
        except Exception as exc:  # noqa: BLE001 - whatever the template raised is the template's problem
            fail(f"--judge_template {self.template_path}: rendering failed: {type(exc).__name__}: {one_line(exc)}")
        if not self.chat:
            return content
        messages = [{"role": "user", "content": content}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        # a chat template writes its own special tokens (BOS included) into the text
        return self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"]

    def verdict_prefix(self, text: str) -> str:
        """Without a chat template the verdict follows the rubric's last word after a space ("... Answer: Yes")."""
        return " " if not self.chat and text and not text[-1].isspace() else ""

    def verdict_token_ids(self) -> list[int]:
        """Each verdict's token id where the judge would write it: the tokens `text + verdict` adds to `text`.
        Refused in one line when a verdict is not a single token there."""
        text = self.text("", "")
        ids = self.encode(text)
        out = []
        for verdict in self.score.verdicts:
            more = self.encode(text + self.verdict_prefix(text) + verdict)
            if more[: len(ids)] != ids or len(more) != len(ids) + 1:
                pieces = self.tokenizer.convert_ids_to_tokens(more[len(ids) :] if more[: len(ids)] == ids else more)
                fail(
                    f"--judge_score {self.score_name}: the verdict {verdict!r} is not one token of the judge's "
                    f"tokenizer ({self.path}) after its prompt ({len(more) - len(ids)} tokens: {pieces[-3:]}); "
                    f"choose another of {', '.join(name for name in JUDGE_SCORES if name != self.score_name)}"
                )
            out.append(more[-1])
        if len(set(out)) != len(out):
            fail(f"--judge_score {self.score_name}: two verdicts are the same token of the judge's tokenizer")
        return out

    def frame_tokens(self) -> int:
        """The judge's input tokens of an empty prompt and response: the rubric and chat template's own."""
        return len(self.encode(self.text("", "")))

    def input_ids(self, prompt: str, response: str, reference=None, fields: dict | None = None) -> list[int]:
        """The judge's input ids of one row; a response too long for the judge's positions keeps its end (the final
        answer), said once."""
        ids = self.encode(self.text(prompt, response, reference, fields))
        if self.max_positions is None or len(ids) <= self.max_positions:
            return ids
        response_ids = self.tokenizer(response, add_special_tokens=False)["input_ids"]
        keep = max(len(response_ids) - (len(ids) - self.max_positions) - 8, 0)  # 8: slack for the merges at the cut
        cut = self.tokenizer.decode(response_ids[len(response_ids) - keep :]) if keep else ""
        if not self.told_cut:
            self.told_cut = True
            print_rank0(
                f"[step3] warning: a judge input of {len(ids)} tokens exceeds the {self.max_positions} positions of "
                f"the judge at {self.path}: the response keeps its last {keep} tokens (said once)"
            )
        ids = self.encode(self.text(prompt, "..." + cut, reference, fields))
        return ids[-self.max_positions :]

    @torch.no_grad()
    def scores(self, model, inputs: list[list[int]], batch_size: int | None = None) -> torch.Tensor:
        """[B] fp32: the expected verdict value of each input under `model` (an engine or a plain causal LM), from
        its logits at the last token restricted to the verdict tokens; `batch_size` inputs per forward (None: all).
        Under ZeRO-3 each forward is a collective: every rank makes as many (its batches are as large)."""
        size = batch_size or max(len(inputs), 1)
        out = []
        for start in range(0, len(inputs), size):
            chunk = inputs[start : start + size]  # left-padded: every row's last token is the last position
            ids = pad_batch(chunk, self.tokenizer.pad_token_id, "left")
            mask = pad_batch([[1] * len(row) for row in chunk], 0, "left")
            with eval_mode(model):
                logits = causal_lm_logits(model, ids, mask, logits_to_keep=1)[:, -1].float().cpu()
            out.append(verdict_score(logits, self.verdict_ids, self.values))
        return torch.cat(out) if out else torch.zeros(0)


def verdict_score(logits: torch.Tensor, verdict_ids: list[int], values: torch.Tensor) -> torch.Tensor:
    """[B] the expected value of the verdicts under the softmax of `logits` [B, V] restricted to their tokens
    (yes_prob: P(Yes) / (P(Yes) + P(No)), the same as the full softmax's probabilities renormalised)."""
    return torch.softmax(logits[:, verdict_ids].float(), dim=-1) @ values


def compile_template(path: str):
    """The rubric as a sandboxed Jinja template (as transformers runs chat templates); refused in one line when the
    file is missing, is not valid Jinja, lacks {{ response }} or names a variable the judge does not give."""
    if not os.path.isfile(path):
        fail(f"--judge_template {path}: no such file")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(keep_trailing_newline=True)
    try:
        names = jinja2.meta.find_undeclared_variables(env.parse(source))
        template = env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        fail(f"--judge_template {path}:{exc.lineno}: not a valid Jinja template: {one_line(exc)}")
    if "response" not in names:
        fail(f"--judge_template {path}: the rubric never shows the response (no {{{{ response }}}} placeholder)")
    unknown = sorted(names - set(PLACEHOLDERS))
    if unknown:
        fail(
            f"--judge_template {path}: unknown placeholder {{{{ {unknown[0]} }}}} (the judge fills "
            f"{', '.join(PLACEHOLDERS)}; a row's other fields are fields.NAME)"
        )
    return template


def check_judge_args(args) -> None:
    """Sets `args.judge` (a Judge, or None without --judge_model_name_or_path) after checking what the judge needs:
    the flags only it reads, its path, the template, the verdict tokens, and that its input fits its positions."""
    args.judge = None
    if not args.judge_model_name_or_path:
        refuse_unread(args, JUDGE_FLAGS, "without --judge_model_name_or_path")
        return
    check_model_path(args.judge_model_name_or_path, "--judge_model_name_or_path")
    judge = Judge(
        args.judge_model_name_or_path,
        args.judge_template or DEFAULT_TEMPLATE,
        args.judge_score,
        args.trust_remote_code,
    )
    frame = judge.frame_tokens()
    response = (
        "max_trajectory_len" if getattr(args, "env", None) or getattr(args, "tools", None) else "max_answer_seq_len"
    )
    check_sequence_fits(
        judge.path,
        frame + args.max_prompt_seq_len + getattr(args, response),
        f"the judge's input (its rubric's {frame} tokens + --max_prompt_seq_len + --{response}, in the actor's tokens)",
    )
    args.judge = judge


def prompt_text(row: Row, tokenizer) -> str:
    """The prompt as the data gave it: a string as it is, a message list as `role: content` lines (a lone user
    message: its content); a row without it (built by hand): its prompt ids decoded."""
    prompt = row.prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if len(prompt) == 1:
            return str(prompt[0].get("content") or "")
        return messages_text(prompt)
    return tokenizer.decode(row.prompt_ids, skip_special_tokens=True)


def messages_text(messages: list) -> str:
    """Messages as `role: content` blocks (a tool call's name and arguments when it has no content)."""
    blocks = []
    for m in messages:
        content = m.get("content")
        if not content and m.get("tool_calls"):
            content = " ".join(str(call.get("function", call)) for call in m["tool_calls"])
        blocks.append(f"{m.get('role', '?')}: {content or ''}")
    return "\n\n".join(blocks)


def response_text(row: Row, tokenizer) -> str:
    """The answer as FunctionReward sees it: decoded without special tokens; a trajectory's messages after the
    prompt as `role: content` blocks."""
    if row.agent is not None:
        return messages_text(row.agent["messages"])
    return tokenizer.decode(row.response_ids, skip_special_tokens=True)


class JudgeReward:
    """The reward component "judge": the judge's score of each row (step3_ppo/rewards/components.py's interface)."""

    is_accuracy = False

    def __init__(self, engine, judge: Judge, tokenizer, batch_size: int | None = None, name: str = "judge"):
        self.engine, self.judge, self.tokenizer, self.batch_size, self.name = engine, judge, tokenizer, batch_size, name

    def inputs(self, rows: list[Row]) -> list[list[int]]:
        """Each row's judge input ids."""
        out = []
        for row in rows:
            fields = dict(row.prompt.get("extra") or {})
            out.append(
                self.judge.input_ids(
                    prompt_text(row, self.tokenizer),
                    response_text(row, self.tokenizer),
                    fields.get(REFERENCE_FIELD),
                    fields,
                )
            )
        return out

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        return self.judge.scores(self.engine, self.inputs(rows), self.batch_size)
