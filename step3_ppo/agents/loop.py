"""Multi-turn rollouts with environments and tools, token in, token out.

A trajectory is ONE row: its prompt, then the policy's first turn, the environment's (or tools')
reply, the policy's next turn, ... Its response mixes the policy's tokens (actions,
`Row.response_action_mask` 1: each turn up to and including its end-of-turn token) and the
environment's (mask 0), so log-probs, KL, advantages, the loss normaliser and every statistic
count actions only, and the sequence reward lands on the last action (utils/math/rows.py's packing,
step3_ppo/algo/shaping.py). The trained ids are exactly the ids that were generated or appended: a
reply is rendered by the chat template as the suffix between the end of the assistant's turn and
the next generation prompt (`ReplyRenderer`), tokenised once and appended; the conversation is
never rendered and re-tokenised as a whole (which can give other ids than those generated). A reply's
text never becomes a control token: text that spells one (`<|im_end|>\n<|im_start|>assistant`, which would
close the reply's turn and forge an assistant turn) is tokenised as plain text, and only the template's
own markers around it are special.

Each turn, every live trajectory of the batch generates together through the run's rollout engine
(with the hybrid engine the actor stays gathered across all turns: the trainer's rollout phase
holds it). After a turn: a tool call in it is answered by the tools (step3_ppo/agents/tools.py), else the
environment (step3_ppo/agents/environments.py, in a worker process of its own) answers; no tools' answer and
no environment (or the environment's None) ends the episode.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from step3_ppo.agents.environments import DEFAULT_ENV_TIMEOUT_S, EnvFailed, EnvironmentWorker
from step3_ppo.agents.tools import Toolbox, template_supports_tools, tool_system_prompt
from utils.data.chat import end_of_turn_id, render, require_template
from utils.errors import ProjectError
from utils.math.rows import Row
from utils.runtime.distributed import all_reduce_max

# a conversation the reply suffix is measured after: its assistant turn ends where a generated turn does
_PROBE = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
OBSERVATION_CUT_MARK = " [cut]"


class AgentError(ProjectError):
    """A multi-turn setting or template that cannot work, or an environment failure that stops the run."""


@dataclass(frozen=True)
class AgentLimits:
    """`--max_turns`: the policy's turns per trajectory; `max_answer_seq_len`: tokens per turn (a turn cut
    there still goes to the environment, marked truncated); `--max_trajectory_len`: response tokens of the
    whole row, turns and replies (a trajectory reaching it ends, truncated); `--max_observation_len`:
    tokens of one reply's content (cut, marked with OBSERVATION_CUT_MARK)."""

    max_turns: int
    max_answer_seq_len: int
    max_trajectory_len: int
    max_observation_len: int

    def __post_init__(self):
        for name in ("max_turns", "max_answer_seq_len", "max_trajectory_len", "max_observation_len"):
            if getattr(self, name) < 1:
                raise AgentError(f"--{name} must be >= 1, got {getattr(self, name)}")


class ReplyRenderer:
    """Token ids of environment replies as the chat template renders them inside a conversation.

    `suffix(replies)` is what comes after an assistant turn's end-of-turn token: the template's text
    that closes the turn (ChatML's newline), the replies' turns and the next generation prompt. It is
    measured on a probe conversation: render(probe + replies, add_generation_prompt) must start with
    render(probe) up to its end-of-turn token, else the template rewrites earlier turns and token-in-
    token-out cannot hold (one line naming the template).

    A reply whose text spells a special token (`<|im_end|>`) is rendered with a spare special token (the
    `placeholder`, one the template never writes) in place of its content, and the content's own ids
    (tokenised with special tokens split, as plain text) go where the placeholder is: the template's markers
    stay special, the reply's text never becomes one. Other replies are the template's ids as they are."""

    def __init__(self, tokenizer):
        require_template(tokenizer)
        self.tokenizer = tokenizer
        self.end_of_turn = end_of_turn_id(tokenizer)
        special = set(getattr(tokenizer, "all_special_tokens", None) or [])
        for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            if getattr(token, "special", False):
                special.add(str(token))
        self.special_texts = sorted(special - {""}, key=len, reverse=True)  # what split_special_tokens splits
        self._placeholder = "unset"
        stops = [t for t in (self.end_of_turn, tokenizer.eos_token_id) if t is not None]
        base = render(tokenizer, _PROBE)
        ends = [i for i, t in enumerate(base) if t in stops]
        if not ends:
            raise AgentError(
                "the chat template puts no end-of-turn or EOS token after an assistant turn; multi-turn "
                "rollouts need one (generation stops there)"
            )
        self.base = base[: ends[-1] + 1]
        self.turn_end = base[ends[-1]]  # appended (as the environment's) after a turn cut at its length limit

    def suffix(self, replies: list[dict]) -> list[int]:
        if any(self.spells_special(r["content"]) for r in replies):
            return self.placed_suffix(replies)
        return self.rendered_suffix(replies)

    def rendered_suffix(self, replies: list[dict]) -> list[int]:
        full = render(self.tokenizer, _PROBE + replies, add_generation_prompt=True)
        if full[: len(self.base)] != self.base:
            raise AgentError(
                "the chat template renders an assistant turn differently once replies follow it; "
                "multi-turn rollouts append the template's ids after the generated ones and need a "
                "template that keeps earlier turns as they are"
            )
        return full[len(self.base) :]

    def spells_special(self, text: str) -> bool:
        return any(special in text for special in self.special_texts)

    def encode_text(self, text: str) -> list[int]:
        """Ids of a reply's text with special tokens split: `<|im_end|>` in it is plain text, not the token."""
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)

    @property
    def placeholder(self) -> tuple[str, int] | None:
        """(text, id) of a special token that stands in for a reply's content: one that the template does
        not write around a reply and that renders as exactly one id; None if the tokenizer has none."""
        if self._placeholder == "unset":
            self._placeholder = None
            plain = self.rendered_suffix([{"role": "user", "content": "x"}])
            for text in self.special_texts:
                token = self.tokenizer.convert_tokens_to_ids(text)
                if not isinstance(token, int) or token in plain:
                    continue
                if self.rendered_suffix([{"role": "user", "content": text}]).count(token) == 1:
                    self._placeholder = (text, token)
                    break
        return self._placeholder

    def placed_suffix(self, replies: list[dict]) -> list[int]:
        """The suffix with each reply's content tokenised as plain text where the template puts it."""
        if self.placeholder is None:
            raise AgentError(
                "an environment or tool reply spells a special token of the tokenizer, and the tokenizer has "
                "no spare special token to render it safely as plain text (one the chat template never writes)"
            )
        text, token = self.placeholder
        frame = self.rendered_suffix([{**r, "content": text} for r in replies])
        where = [i for i, t in enumerate(frame) if t == token]
        if len(where) != len(replies):
            raise AgentError(
                f"the chat template does not write each reply's content once as it is ({len(where)} places for "
                f"{len(replies)} replies); a reply that spells a special token cannot be placed as plain text"
            )
        out, start = [], 0
        for i, reply in zip(where, replies):
            out += frame[start:i] + self.encode_text(reply["content"])
            start = i + 1
        return out + frame[start:]

    def cut_content(self, content: str, limit: int) -> tuple[str, bool]:
        """A reply's content cut to `limit` tokens (marked), and whether it was cut."""
        ids = self.encode_text(content)
        if len(ids) <= limit:
            return content, False
        return self.tokenizer.decode(ids[:limit]) + OBSERVATION_CUT_MARK, True


@dataclass
class Trajectory:
    """One episode in progress: its ids so far and what the trainer logs of it."""

    prompt_ids: list[int]
    prompt: dict
    env: object | None = None
    response: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # after the prompt: assistant, tool, user turns
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_calls_dropped: int = 0  # calls past --max_tool_calls_per_turn, not run (counted among the errors too)
    turns_cut: int = 0  # turns that reached max_answer_seq_len
    observations_cut: int = 0
    truncated: bool = False  # the trajectory reached --max_trajectory_len
    ended_with_stop: bool = False  # its last turn ended with a stop token
    failed: str | None = None  # the environment raised (one line)
    env_reward: float = float("nan")
    done: bool = False

    def append(self, ids: list[int], is_action: bool, logprobs: list[float] | None = None) -> None:
        self.response += ids
        self.action += [int(is_action)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)

    def counters(self) -> dict:
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_calls_dropped": self.tool_calls_dropped,
        }


class MultiTurn:
    """The multi-turn rollout of a run: `rollout(engine, prompt_batch, settings, n, stop_token_ids, pad, logprobs)`
    -> rows (the n trajectories of each prompt one after the other, as single-turn generation gives them).

    `environment`: a loaded environment (step3_ppo.agents.environments.load_environment) or None; `toolbox`: a
    step3_ppo.agents.tools.Toolbox or None (neither: every trajectory is one turn, as step3_ppo.eval scores a policy's
    plain answers with --reward_funcs); `skip_bad`: an environment that fails drops its trajectory (its score
    NaN, `--skip_bad_rewards`) instead of stopping the run (`skip_hint`: the line that stops it says so, where
    the command has that flag). The environments run in a worker process
    (EnvironmentWorker), each call killed past `env_timeout` seconds (`--env_timeout`); `close()` stops it.
    `env_s` adds up the seconds spent in the environment and the tools (apart from generation)."""

    def __init__(
        self,
        tokenizer,
        limits: AgentLimits,
        environment=None,
        toolbox=None,
        skip_bad: bool = False,
        env_timeout: float = DEFAULT_ENV_TIMEOUT_S,
        skip_hint: bool = True,
    ):
        self.tokenizer, self.limits = tokenizer, limits
        self.environment, self.toolbox, self.skip_bad, self.skip_hint = environment, toolbox, skip_bad, skip_hint
        self.env_worker = EnvironmentWorker(environment, env_timeout) if environment is not None else None
        self.renderer = ReplyRenderer(tokenizer) if environment is not None or toolbox is not None else None
        self.env_s = 0.0
        self.env_failures = 0

    def close(self) -> None:
        """Stop the environments' worker process (it also dies with this process)."""
        if self.env_worker is not None:
            self.env_worker.close()

    # ------------------------------------------------------------------ one rollout
    def rollout(
        self, engine, prompt_batch: dict, settings, n: int, stop_token_ids, pad_token_id: int, logprobs: bool = False
    ) -> list[Row]:
        ids, mask = prompt_batch["input_ids"], prompt_batch["attention_mask"]
        prompt_rows = prompt_batch.get("rows") or [{} for _ in range(ids.shape[0])]
        trajectories = []
        for i in range(ids.shape[0] * n):
            p = i // n
            trajectories.append(Trajectory(prompt_ids=ids[p][mask[p].bool()].tolist(), prompt=prompt_rows[p]))
        for t in trajectories:
            t.env = self._call(t, lambda: self.env_worker.make(t.prompt)) if self.env_worker is not None else None
        stops = set([stop_token_ids] if isinstance(stop_token_ids, int) else stop_token_ids)
        while True:
            live = [t for t in trajectories if not t.done]
            if not all_reduce_max(float(bool(live))):  # every rank runs the same rounds (collective generation)
                break
            self.generate_turn(
                engine, live or trajectories[:1], settings, stops, pad_token_id, logprobs, discard=not live
            )
            for t in live:
                self.answer(t)
        for t in trajectories:
            self.finish(t)
        if self.env_worker is not None:
            self.env_worker.forget(t.env for t in trajectories)
        return [self.to_row(t, logprobs) for t in trajectories]

    def generate_turn(
        self,
        engine,
        live: list[Trajectory],
        settings,
        stops: set,
        pad_token_id: int,
        logprobs: bool,
        discard: bool = False,
    ) -> None:
        """One turn of every live trajectory, generated together (left-padded: positions come from the mask)."""
        room = max(self.limits.max_trajectory_len - len(t.response) for t in live)
        settings = type(settings)(
            **{**settings.__dict__, "max_new_tokens": max(1, min(self.limits.max_answer_seq_len, room))}
        )
        if settings.min_new_tokens and settings.min_new_tokens > settings.max_new_tokens:
            settings = type(settings)(**{**settings.__dict__, "min_new_tokens": settings.max_new_tokens})
        width = max(len(t.prompt_ids) + len(t.response) for t in live)
        input_ids = torch.full((len(live), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(live), width), dtype=torch.long)
        for b, t in enumerate(live):
            row = t.prompt_ids + t.response
            input_ids[b, width - len(row) :] = torch.tensor(row)
            attention_mask[b, width - len(row) :] = 1
        if logprobs:
            sequences, generated_logprobs = engine.generate_with_logprobs(input_ids, attention_mask, settings)
        else:
            sequences, generated_logprobs = engine.generate(input_ids, attention_mask, settings), None
        if discard:
            return
        for b, t in enumerate(live):
            new = sequences[b, width:].tolist()
            end = next((i + 1 for i, tok in enumerate(new) if tok in stops), None)
            turn = new[:end] if end is not None else new
            room = self.limits.max_trajectory_len - len(t.response)
            ended = end is not None and len(turn) <= room
            if len(turn) > room:
                turn, t.truncated = turn[:room], True
            elif end is None:
                t.turns_cut += 1
            if not turn:
                raise AgentError("generation returned no new token for a turn (each turn needs at least one)")
            lp = generated_logprobs[b, : len(turn)].float().tolist() if generated_logprobs is not None else None
            t.append(turn, True, lp)
            t.turns += 1
            t.ended_with_stop = ended
            text = self.tokenizer.decode(turn, skip_special_tokens=True)
            t.messages.append({"role": "assistant", "content": text})
            if t.truncated:
                t.done = True

    def answer(self, t: Trajectory) -> None:
        """The tools' or the environment's reply to the turn just generated, appended as the environment's
        tokens; the episode ends without one, at --max_turns, or when the reply would pass
        --max_trajectory_len (truncated). The environment sees every turn, the last one included, so its
        reward() knows the final answer."""
        if t.done or t.turns >= self.limits.max_turns:  # its last turn: the environment sees it, nobody answers
            self.step_environment(t, t.messages[-1]["content"])
            t.done = True
            return
        replies = self.reply(t)
        if not replies or t.failed:
            t.done = True
            return
        cut_replies = []
        for reply in replies:
            content, cut = self.renderer.cut_content(reply["content"], self.limits.max_observation_len)
            t.observations_cut += cut
            cut_replies.append({**reply, "content": content})
        suffix = self.renderer.suffix(cut_replies)
        if not t.ended_with_stop:  # a turn cut at its length: the environment closes it
            suffix = [self.renderer.turn_end] + suffix
        if len(t.response) + len(suffix) >= self.limits.max_trajectory_len:  # no room for the reply and a turn
            t.truncated = t.done = True
            return
        t.append(suffix, False)
        t.messages += cut_replies

    def reply(self, t: Trajectory) -> list[dict]:
        message = t.messages[-1]["content"]
        if self.toolbox is not None:
            t0 = time.time()
            outcome = self.toolbox.respond(message)
            self.env_s += time.time() - t0
            t.tool_calls += outcome.calls
            t.tool_errors += outcome.errors
            t.tool_calls_dropped += outcome.dropped
            if outcome.messages:
                return outcome.messages
        reply = self.step_environment(t, message)
        return [reply] if reply is not None else []

    def step_environment(self, t: Trajectory, message: str) -> dict | None:
        if t.env is None:
            return None
        return self._call(t, lambda: self.env_worker.step(t.env, message))  # a normalised reply, or None

    def finish(self, t: Trajectory) -> None:
        if t.env is not None and not t.failed and self.environment.has_reward:
            t.env_reward = self._call(t, lambda: self.env_worker.reward(t.env))
        if t.failed:
            t.env_reward = float("nan")

    def _call(self, t: Trajectory, call):
        """An environment call; its failure (EnvFailed: it raised, exited, crashed or ran past --env_timeout)
        ends the trajectory, or without --skip_bad_rewards stops the run."""
        t0 = time.time()
        try:
            return call()
        except EnvFailed as exc:
            if not self.skip_bad:
                hint = " (--skip_bad_rewards drops such trajectories instead)" if self.skip_hint else ""
                raise AgentError(f"{exc}{hint}") from None
            t.failed, t.done = str(exc), True
            self.env_failures += 1
            return None
        finally:
            self.env_s += time.time() - t0

    def to_row(self, t: Trajectory, logprobs: bool) -> Row:
        row = Row(
            prompt_ids=torch.tensor(t.prompt_ids),
            response_ids=torch.tensor(t.response),
            ended_with_eos=t.ended_with_stop and not t.truncated,
            prompt=t.prompt,
            response_action_mask=torch.tensor(t.action, dtype=torch.float32),
        )
        if logprobs:  # the generator's own, 0 on the environment's tokens (never read: not actions)
            row.per_action["rollout_logprobs"] = torch.tensor(t.logprobs, dtype=torch.float32)
        row.agent = {
            "messages": t.messages,
            **t.counters(),
            "env_tokens": len(t.action) - sum(t.action),
            "truncated": t.truncated,
            "turns_cut": t.turns_cut,
            "observations_cut": t.observations_cut,
            "failed": t.failed,
            "env_reward": t.env_reward,
        }
        return row


class EnvReward:
    """The environment's `reward()` at the end of each trajectory, as the reward component `env` (weighted with
    --reward_weights like the others); NaN where the environment failed (dropped with --skip_bad_rewards)."""

    name, engine, is_accuracy = "env", None, False

    def __call__(self, rows: list[Row]) -> torch.Tensor:
        return torch.tensor([(r.agent or {}).get("env_reward", math.nan) for r in rows], dtype=torch.float32)


def agent_sums(rows: list[Row]) -> dict:
    """Per-rank sums of the multi-turn counters (the trainer averages them over all ranks' rows)."""
    agents = [r.agent for r in rows if r.agent is not None]
    return {
        "agent/rows_sum": len(rows),
        "agent/turns_sum": sum(a["turns"] for a in agents),
        "agent/tool_calls_sum": sum(a["tool_calls"] for a in agents),
        "agent/calling_sum": sum(a["tool_calls"] > 0 for a in agents),  # trajectories with a tool call
        "agent/tool_errors_sum": sum(a["tool_errors"] for a in agents),
        "agent/tool_calls_dropped_sum": sum(a.get("tool_calls_dropped", 0) for a in agents),
        "agent/env_tokens_sum": sum(a["env_tokens"] for a in agents),
        "agent/action_tokens_sum": sum(r.action_count for r in rows),
        "agent/truncated_sum": sum(a["truncated"] for a in agents),
        "agent/env_failures_sum": sum(a["failed"] is not None for a in agents),
    }


def agent_rates(sums: dict, prefix: str) -> dict:
    """From agent_sums' totals: the fraction of trajectories that called a tool, and of tool calls that failed
    (an error text went back to the model; 0 with no call)."""
    calls = sums["agent/tool_calls_sum"]
    return {
        f"{prefix}tool_call_rate": sums["agent/calling_sum"] / max(sums["agent/rows_sum"], 1),
        f"{prefix}tool_error_rate": sums["agent/tool_errors_sum"] / calls if calls else 0.0,
    }


# ---------------------------------------------------------------------------- set-up (flags: flags.py)
def limits_of(args) -> AgentLimits:
    return AgentLimits(args.max_turns, args.max_answer_seq_len, args.max_trajectory_len, args.max_observation_len)


def build_agent(args, tokenizer) -> MultiTurn | None:
    """The run's MultiTurn (None without --env / --tools); its tools' workers start at their first call."""
    if args.environment is None and not args.tool_list:
        return None
    toolbox = (
        Toolbox(args.tool_list, args.tool_timeout, args.tool_parser, max_calls=args.max_tool_calls_per_turn)
        if args.tool_list
        else None
    )
    return MultiTurn(
        tokenizer,
        limits_of(args),
        args.environment,
        toolbox,
        getattr(args, "skip_bad_rewards", False),
        getattr(args, "env_timeout", None) or DEFAULT_ENV_TIMEOUT_S,
        skip_hint=hasattr(args, "skip_bad_rewards"),  # step 3's training has the flag, chat.py not
    )


def prompts_with_tools(rows: list[dict], tokenizer, tool_list) -> tuple[list[dict], list | None]:
    """(rows, schemas for the template): with tools, a template that has a `tools` variable renders their
    schemas itself; for one without, each conversational prompt gets the project's tool block as (the start
    of) its system message. Without tools, the rows as they are."""
    if not tool_list:
        return rows, None
    schemas = [tool.schema for tool in tool_list]
    if template_supports_tools(tokenizer):
        return rows, schemas
    block = tool_system_prompt(schemas)
    out = []
    for row in rows:
        prompt = row["prompt"]
        if isinstance(prompt, list):
            if prompt and prompt[0].get("role") == "system":
                prompt = [{**prompt[0], "content": block + "\n\n" + prompt[0]["content"]}] + prompt[1:]
            else:
                prompt = [{"role": "system", "content": block}] + prompt
        out.append({**row, "prompt": prompt})
    return out, None
