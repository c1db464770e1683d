"""Multi-turn terminal chat with a trained model (DeepSpeed-Chat's chat.py).

    python chat.py --model_name_or_path DIR [--max_new_tokens 128] [--system TEXT]
                   [--template {auto,chat,human_assistant}] [--do_sample [--temperature T --top_p P --top_k K]]

Templates:
- `chat`: the tokenizer's own chat template (`apply_chat_template(messages, add_generation_prompt=True)`);
- `human_assistant`: the demo data's "Human: ...\\n\\nAssistant:" template, turns separated by a
  blank line, tokenised exactly as in training;
- `auto` (default): `chat` when the tokenizer has a chat template, else `human_assistant`. A model
  fine-tuned on the demo data from an instruct model keeps that model's chat template: pass
  `--template human_assistant` to talk to it in the format it was fine-tuned on.

With `--env` and/or `--tools` (step 3's flags) each input line starts an episode of step 3's multi-turn
loop instead (the chat template is required): the model's turns, the tools' results and the environment's
replies are printed, up to `--max_turns` turns; no history is kept between lines.

Commands: `clear` resets the history, `quit` / `exit` / end of input (Ctrl-D) ends the chat.
When stdin is not a terminal (piped), each input line is one user turn and is echoed.
Greedy decoding by default; `--do_sample` samples.
"""

from __future__ import annotations

import os
import sys

from utils.cli import Number
from utils.errors import UsageError
from utils.train.config_file import ConfigFileParser
from utils.train.flags import add_device_arg, add_generation_args, resolve_generation_args

TEMPLATES = ("auto", "chat", "human_assistant")


def build_parser():
    """The argument parser of this entry point (the reference pages of docs/ are generated from it)."""
    p = ConfigFileParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model_name_or_path",
        required=True,
        help="the policy to chat with: a from_pretrained directory (step 1 or 3 output) or hub name",
    )
    p.add_argument(
        "--max_new_tokens", type=Number(int, low=1), default=128, help="max new tokens per reply (default %(default)s)"
    )
    p.add_argument("--system", default=None, help="system message prepended to the conversation")
    p.add_argument(
        "--template",
        choices=TEMPLATES,
        default="auto",
        help="prompt format: chat (the tokenizer's chat template), human_assistant (the demo data's), "
        "auto: chat when the tokenizer has a template, else human_assistant (default %(default)s)",
    )
    add_generation_args(p, do_sample=False)
    p.add_argument(
        "--seed",
        type=Number(int, low=0, high=2**32 - 1),
        default=0,
        help="random seed of the sampling (turn t uses this + t)",
    )
    add_device_arg(p)
    p.add_argument("--trust_remote_code", action="store_true", help="allow model code shipped with the model")
    from step3_ppo.agents.flags import add_agent_args  # no torch: --help stays fast

    add_agent_args(p)
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    from step3_ppo.agents.flags import check_agent_args  # no torch: --help stays fast

    if args.max_new_tokens < 1:
        p.error(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    args.max_answer_seq_len = args.max_new_tokens  # per turn, as step 3's flag
    check_agent_args(args)
    resolve_generation_args(args)
    return args


def resolve_template(tokenizer, template: str) -> str:
    has_chat = bool(getattr(tokenizer, "chat_template", None))
    if template == "chat" and not has_chat:
        where = getattr(tokenizer, "name_or_path", "") or "this tokenizer"
        raise UsageError(
            f"--template chat: the tokenizer of {where} has no chat template (use --template human_assistant)"
        )
    if template == "auto":
        return "chat" if has_chat else "human_assistant"
    return template


def context_length(model, tokenizer) -> int:
    config = model.config
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 1_000_000 else 2048


class Conversation:
    """History of (role, text) turns rendered in one template and tokenised for generation."""

    def __init__(self, tokenizer, template: str, system: str | None = None):
        self.tokenizer = tokenizer
        self.template = template
        self.system = system
        self.turns: list[tuple[str, str]] = []

    def clear(self) -> None:
        self.turns = []

    def add(self, role: str, text: str) -> None:
        self.turns.append((role, text))

    def prompt(self):
        """The conversation so far as training's prompts are: a message list for the chat template,
        or the Human/Assistant string ending with the cue for the assistant's next turn."""
        if self.template == "chat":
            return ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": role, "content": text} for role, text in self.turns
            ]
        parts = [self.system] if self.system else []
        for role, text in self.turns:
            parts.append(f"Human: {text}" if role == "user" else f"Assistant: {text}")
        return "\n\n".join(parts) + "\n\nAssistant:"

    def prompt_ids(self, max_len: int) -> list[int]:
        """Token ids of `prompt()` as training tokenises prompts (`tokenize_prompts`): the LAST tokens
        of a long history, a chat template's header and generation prompt kept."""
        from utils.data import tokenize_prompts  # lazily: utils.data pulls in torch (keeps --help fast)

        examples, stats = tokenize_prompts([{"prompt": self.prompt()}], self.tokenizer, max_len)
        if not examples:
            raise UsageError(f"the conversation does not fit the context ({stats['skipped']})")
        return examples[0]["input_ids"]

    def stop_ids(self) -> list[int]:
        from utils.data import stop_token_ids  # lazily: utils.data pulls in torch (keeps --help fast)

        return stop_token_ids(self.tokenizer, chat=self.template == "chat")

    def clean_reply(self, text: str) -> str:
        """The reply without a continuation the model invents for the user's next turn."""
        if self.template == "human_assistant":
            for marker in ("\n\nHuman:", "\nHuman:", "Human:"):
                cut = text.find(marker)
                if cut >= 0:
                    text = text[:cut]
        return text.strip()


def run_episode(args, agent, model, tokenizer, text: str, number: int) -> None:
    """--env/--tools: `text` starts an episode of step 3's multi-turn loop (`agent`, step3_ppo/agents/loop.py: tool
    calls answered by the tools, other turns by the environment, up to --max_turns); every message is printed."""
    from step3_ppo.agents.eval import ModelGenerate
    from step3_ppo.agents.loop import prompts_with_tools
    from utils.data import PromptCollator, stop_token_ids, tokenize_prompts
    from utils.models.forward import GenerationSettings

    prompt = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
    rows, schemas = prompts_with_tools([{"prompt": prompt, "origin": f"input:{number}"}], tokenizer, args.tool_list)
    room = max(1, context_length(model, tokenizer) - args.max_trajectory_len)
    examples, stats = tokenize_prompts(rows, tokenizer, room, tools=schemas)
    if not examples:
        raise UsageError(f"the prompt does not fit the context ({stats['skipped']})")
    stops = stop_token_ids(tokenizer, chat=True)
    settings = GenerationSettings(
        args.max_new_tokens, do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    (row,) = agent.rollout(
        ModelGenerate(model, stops, tokenizer.pad_token_id),
        PromptCollator(tokenizer.pad_token_id)(examples),
        settings,
        1,
        stops,
        tokenizer.pad_token_id,
    )
    for message in row.agent["messages"]:
        role = {"assistant": "Assistant", "tool": "Tool", "user": "Environment"}[message["role"]]
        print(f"{role}: {message['content'].strip()}", flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    # lazily, after the flags: torch and transformers (keeps --help and flag errors fast)
    from utils.evaluation import generate_answers_from_ids, load_policy
    from utils.models.forward import GenerationSettings
    from utils.models.loading import ModelLoadError

    try:
        model, tokenizer = load_policy(args.model_name_or_path, args.device, args.trust_remote_code)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    template = resolve_template(tokenizer, args.template)
    conversation = Conversation(tokenizer, template, args.system)
    max_prompt = max(1, context_length(model, tokenizer) - args.max_new_tokens)
    interactive = sys.stdin.isatty()
    if interactive:
        print(
            f"Chatting with {args.model_name_or_path} (template: {template}, "
            f"{'sampling' if args.do_sample else 'greedy'}). 'clear' resets, 'quit' or Ctrl-D ends.",
            flush=True,
        )
    from step3_ppo.agents.loop import build_agent

    agent = build_agent(args, tokenizer)  # None without --env/--tools; its tools' workers serve the whole chat
    try:
        turn = 0
        while True:
            try:
                line = input("User: " if interactive else "")
            except (EOFError, KeyboardInterrupt):
                if interactive:
                    print()
                break
            text = line.strip()
            if not text:
                continue
            if not interactive:
                print(f"User: {text}", flush=True)
            if text.lower() in ("quit", "exit"):
                break
            if text.lower() == "clear":
                conversation.clear()
                print("[history cleared]", flush=True)
                continue
            if agent is not None:  # each line its own episode of the multi-turn loop
                import torch

                torch.manual_seed(args.seed + turn)
                run_episode(args, agent, model, tokenizer, text, turn + 1)
                turn += 1
                continue
            conversation.add("user", text)
            settings = GenerationSettings(
                args.max_new_tokens,
                do_sample=args.do_sample,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
            )
            answer = generate_answers_from_ids(
                model,
                tokenizer,
                [conversation.prompt_ids(max_prompt)],
                settings,
                seed=args.seed + turn,
                stop_ids=conversation.stop_ids(),
            )[0]
            reply = conversation.clean_reply(answer.text)
            conversation.add("assistant", reply)
            turn += 1
            print(f"Assistant: {reply}", flush=True)
    finally:
        if agent is not None and agent.toolbox is not None:
            agent.toolbox.close()
    return 0


def cli() -> int:
    """`python chat.py` and the `rlhf-chat` command: main() ended by run_main (a chat template that fails or loops:
    one `error:` line, not a traceback)."""
    from utils.errors import run_main

    return run_main(main)


if __name__ == "__main__":
    if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(cli())
