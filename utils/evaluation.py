"""Evaluation of the pipeline's models in ONE plain process (no DeepSpeed, no ZeRO, fp32).

What it measures, for the SFT policy and the RLHF (PPO) policy on the same prompts:
- `reward`: the step-2 reward model's score of prompt + response (the value at the last real token),
  i.e. the quantity PPO optimised; it can be gamed, so it is not enough on its own;
- `judge`: an INDEPENDENT judge the reward model never trained on (VADER sentiment of the
  response text, for the demo task "continue a movie review positively");
- `KL to SFT`: per-sequence sum over response tokens of log p_policy - log p_sft on the policy's
  OWN responses (k1, an unbiased estimate of KL(policy || SFT) when the responses are sampled);
  0 for the SFT policy itself;
- response length (tokens, the EOS included) and the fraction of responses that ended with EOS.

Prompts are tokenised exactly as in training (`utils.data.tokenize_prompts`: no special tokens,
plus BOS only where the tokenizer's config adds one), left-padded by `PromptCollator`; responses
are cut at their first EOS by `step3_ppo.experience.split_generation`, and packed for scoring by
`step3_ppo.experience.pack` (every forward uses mask-derived position ids), so a score does not
depend on the batch a row happens to be in.
"""
from __future__ import annotations

import contextlib
import math
import os
import random
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from step3_ppo.experience import Row, pack, split_generation
from step3_ppo.ppo import logprobs_from_logits, masked_sum
from utils.data import PromptCollator, bos_prefix, encode, load_source, normalize_row, tokenize_prompts
from utils.model import causal_lm_logits, load_causal_lm, load_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PROMPTS = os.path.join("data", "demo", "pairs", "eval.jsonl")
POLICIES = ("sft", "rlhf")
# (result key, column title) of format_table's metric columns
METRIC_COLUMNS = (
    ("reward_mean", "reward (RM)"),
    ("judge_mean", "judge (VADER)"),
    ("kl_to_sft_mean", "KL to SFT"),
    ("response_len_mean", "response len"),
    ("eos_fraction", "EOS fraction"),
)
_NO_PROMPT_LIMIT = 1 << 30


@dataclass
class Answer(Row):
    """A generated answer: a `Row` (prompt_ids, response_ids, ended_with_eos; packable with `pack`)
    plus the prompt text and the decoded response text (special tokens skipped)."""

    prompt: str = ""
    text: str = ""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #
def load_policy(path: str, device: str | torch.device | None = None, trust_remote_code: bool = False):
    """(causal LM in eval mode, fp32, on `device`; its tokenizer with padding_side="left").

    The tokenizer gets a pad token distinct from EOS (utils.model.load_tokenizer) and the model's
    embeddings are resized to it if needed, exactly as in training.
    """
    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code, padding_side="left")
    model = load_causal_lm(path, tokenizer, trust_remote_code=trust_remote_code)
    model.to(device=device or default_device(), dtype=torch.float32).eval()
    return model, tokenizer


def load_reward_model(path: str, device: str | torch.device | None = None, trust_remote_code: bool = False):
    """(RewardModel in eval mode, fp32, on `device`; its tokenizer). A causal-LM directory without
    `value_head.safetensors` gets a fresh (seeded) head, see utils.reward_model."""
    from utils.reward_model import RewardModel

    tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
    model = RewardModel.from_pretrained(path, tokenizer, trust_remote_code=trust_remote_code)
    model.to(device=device or default_device(), dtype=torch.float32).eval()
    return model, tokenizer


def same_vocabulary(a, b) -> bool:
    """True when two tokenizers map every token (and EOS/pad) to the same ids."""
    return (a.eos_token_id == b.eos_token_id and a.pad_token_id == b.pad_token_id
            and len(a) == len(b) and a.get_vocab() == b.get_vocab())


def load_prompts(path_or_source: str = DEFAULT_PROMPTS, n: int | None = 64, seed: int = 0) -> list[str]:
    """Prompts of a JSON/JSONL file or folder (or a `datasets` source), read through utils.data.

    A source with an eval split (a folder with train/eval files, a .json object with an "eval"
    list, a datasets dict with eval/test/validation) gives its eval prompts, otherwise all its
    rows are used. Duplicates are dropped (first kept), the rest is shuffled with `seed` and the
    first `n` are returned (all when `n` is None). The default is the demo pairs' eval split,
    resolved against the repository root when the working directory does not have it.
    """
    source = path_or_source
    if not os.path.exists(os.path.expanduser(source)) and not os.path.isabs(source) \
            and os.path.exists(os.path.join(REPO_ROOT, source)):
        source = os.path.join(REPO_ROOT, source)
    if source.endswith(DEFAULT_PROMPTS) and not os.path.exists(source):
        raise FileNotFoundError(f"{source} is missing: build the demo data with "
                                f"`python -m data.make_demo_data --out data/demo`")
    src = load_source(source)
    records = src.eval if src.eval else src.train
    prompts, seen = [], set()
    for obj, origin in records:
        row = normalize_row(obj, origin, ("prompt",))
        if row is not None and row["prompt"] not in seen:
            seen.add(row["prompt"])
            prompts.append(row["prompt"])
    if not prompts:
        raise ValueError(f"{path_or_source}: no non-empty prompts")
    random.Random(seed).shuffle(prompts)
    return prompts if n is None else prompts[:n]


# --------------------------------------------------------------------------- #
# Generation
# --------------------------------------------------------------------------- #
def generation_kwargs(tokenizer, max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                      top_p: float = 1.0, top_k: int = 0, num_beams: int = 1) -> dict:
    """`generate` keyword arguments; the sampling knobs are passed only when sampling."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    kwargs = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "num_beams": num_beams,
              "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, "use_cache": True}
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    return kwargs


@contextlib.contextmanager
def _eval_mode(*models):
    states = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, state in zip(models, states):
            m.train(state)


def generate_answers(model, tokenizer, prompts: Sequence[str], max_new_tokens: int, do_sample: bool = False,
                     temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, num_beams: int = 1,
                     batch_size: int = 8, seed: int = 0, max_prompt_len: int | None = None) -> list[Answer]:
    """One answer per prompt, generated in left-padded batches of `batch_size`; stops at EOS.

    Prompts are tokenised like training (`tokenize_prompts`: no special tokens, BOS only where the
    tokenizer's config adds one; `max_prompt_len` keeps the LAST tokens of a longer prompt, None
    keeps all). Each answer holds the real prompt ids, the response ids up to and including the
    first EOS (all `max_new_tokens` tokens when none came), `ended_with_eos`, the prompt and the
    decoded response text. Sampling draws from a torch RNG seeded with `seed` inside a forked RNG
    state (the caller's global RNG is left untouched).
    """
    prompts = list(prompts)
    examples, _ = tokenize_prompts([{"prompt": p} for p in prompts], tokenizer, max_prompt_len or _NO_PROMPT_LIMIT)
    return generate_answers_from_ids(model, tokenizer, [ex["input_ids"] for ex in examples], max_new_tokens,
                                     do_sample, temperature, top_p, top_k, num_beams, batch_size, seed, prompts)


@torch.no_grad()
def generate_answers_from_ids(model, tokenizer, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int,
                              do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                              num_beams: int = 1, batch_size: int = 8, seed: int = 0,
                              prompts: Sequence[str] | None = None) -> list[Answer]:
    """`generate_answers` for prompts already tokenised (lists of ids, used as they are)."""
    prompt_ids = [list(ids) for ids in prompt_ids]
    if not prompt_ids:
        return []
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    empty = [i for i, ids in enumerate(prompt_ids) if not ids]
    if empty:
        raise ValueError(f"prompts {empty} are empty after tokenisation")
    texts = list(prompts) if prompts is not None else [tokenizer.decode(ids) for ids in prompt_ids]
    kwargs = generation_kwargs(tokenizer, max_new_tokens, do_sample, temperature, top_p, top_k, num_beams)
    collate = PromptCollator(tokenizer.pad_token_id)
    device = model_device(model)
    answers: list[Answer] = []
    devices = [device.index or 0] if device.type == "cuda" else []
    with _eval_mode(model), torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        for start in range(0, len(prompt_ids), batch_size):
            batch = collate([{"input_ids": ids} for ids in prompt_ids[start:start + batch_size]])
            sequences = model.generate(input_ids=batch["input_ids"].to(device),
                                       attention_mask=batch["attention_mask"].to(device), **kwargs)
            rows = split_generation(sequences.cpu(), batch["input_ids"], batch["attention_mask"],
                                    tokenizer.eos_token_id)
            for prompt, row in zip(texts[start:start + batch_size], rows):
                text = tokenizer.decode(row.response_ids.tolist(), skip_special_tokens=True)
                answers.append(Answer(prompt_ids=row.prompt_ids, response_ids=row.response_ids,
                                      ended_with_eos=row.ended_with_eos, prompt=prompt, text=text))
    return answers


def retokenize(answers: Sequence[Answer], tokenizer) -> list[Answer]:
    """The same prompt/response TEXTS tokenised for another tokenizer (a reward model of another family)."""
    out = []
    for a in answers:
        response = encode(tokenizer, a.text) + ([tokenizer.eos_token_id] if a.ended_with_eos else [])
        if not response:
            response = [tokenizer.eos_token_id]
        out.append(Answer(prompt_ids=torch.tensor(bos_prefix(tokenizer) + encode(tokenizer, a.prompt)),
                          response_ids=torch.tensor(response), ended_with_eos=a.ended_with_eos,
                          prompt=a.prompt, text=a.text))
    return out


# --------------------------------------------------------------------------- #
# Scoring
# --------------------------------------------------------------------------- #
def _batches(rows: Sequence[Row], batch_size: int):
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, len(rows), batch_size):
        yield list(rows[start:start + batch_size])


@torch.no_grad()
def reward_scores(reward_model, tokenizer, rows: Sequence[Row], batch_size: int = 8) -> list[float]:
    """Reward-model score of each prompt + response: the value at its last real token.

    Rows are packed (`pack`: left-padded prompt, right-padded response) with the tokenizer's pad id.
    """
    device = model_device(reward_model)
    scores: list[float] = []
    with _eval_mode(reward_model):
        for chunk in _batches(rows, batch_size):
            batch = pack(chunk, tokenizer.pad_token_id)
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            scores += reward_model.score(ids, mask).float().cpu().tolist()
    return scores


def _pad_id(model) -> int:
    config = model.config
    for value in (getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, int):
            return value
    return 0


@torch.no_grad()
def sequence_logprobs(model, rows: Sequence[Row], batch_size: int = 8, pad_token_id: int | None = None) -> list[torch.Tensor]:
    """Per row, log p(response token | prefix) of each response token ([t] fp32 tensors)."""
    pad = _pad_id(model) if pad_token_id is None else pad_token_id
    device = model_device(model)
    out: list[torch.Tensor] = []
    with _eval_mode(model):
        for chunk in _batches(rows, batch_size):
            batch = pack(chunk, pad)
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            logprobs = logprobs_from_logits(causal_lm_logits(model, ids, mask)[:, :-1], ids[:, 1:]).cpu()
            p = batch["prompt_len"]
            for b, row in enumerate(chunk):
                out.append(logprobs[b, p - 1:p - 1 + row.response_ids.numel()].clone())
    return out


@torch.no_grad()
def kl_to_reference(policy, reference, rows: Sequence[Row], batch_size: int = 8,
                    pad_token_id: int | None = None) -> list[float]:
    """Per row: sum over its response tokens of log p_policy - log p_reference (k1).

    Evaluated on the POLICY's own responses this estimates KL(policy || reference) per sequence
    (unbiased when the responses were sampled from the policy; a single greedy answer gives the
    log-ratio of that answer). Both models see the same packed batch, mask-derived positions and
    `pack`'s action mask (response tokens up to and including the first EOS).
    """
    pad = _pad_id(policy) if pad_token_id is None else pad_token_id
    device_p, device_r = model_device(policy), model_device(reference)
    out: list[float] = []
    with _eval_mode(policy, reference):
        for chunk in _batches(rows, batch_size):
            batch = pack(chunk, pad)
            ids, mask = batch["input_ids"], batch["attention_mask"]
            lp = logprobs_from_logits(causal_lm_logits(policy, ids.to(device_p), mask.to(device_p))[:, :-1],
                                      ids[:, 1:].to(device_p)).cpu()
            lr = logprobs_from_logits(causal_lm_logits(reference, ids.to(device_r), mask.to(device_r))[:, :-1],
                                      ids[:, 1:].to(device_r)).cpu()
            out += masked_sum(lp - lr, batch["action_mask"], dim=-1).tolist()
    return out


class SentimentJudge:
    """VADER sentiment (compound score in [-1, 1]) of response texts: an INDEPENDENT judge.

    It is NOT the training reward: the reward model of step 2 learnt its preferences from the
    chosen/rejected pairs, while VADER is a fixed lexicon-and-rules scorer that never saw them.
    A policy that raises the reward-model score without raising the judge score is suspect of
    reward hacking. Empty texts score 0.
    """

    name = "VADER compound"

    def __init__(self):
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.analyzer = SentimentIntensityAnalyzer()

    def score(self, texts: Sequence[str]) -> list[float]:
        return [float(self.analyzer.polarity_scores(t or "")["compound"]) for t in texts]


# --------------------------------------------------------------------------- #
# SFT vs RLHF
# --------------------------------------------------------------------------- #
def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _win_rate(a: Sequence[float], b: Sequence[float]) -> float:
    """Fraction of prompts where a > b (ties count one half)."""
    if not a:
        return float("nan")
    return float(sum(1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(a, b)) / len(a))


def summarize(answers: Sequence[Answer], rewards: Sequence[float], judge: Sequence[float],
              kls: Sequence[float]) -> dict:
    lengths = [a.response_ids.numel() for a in answers]
    return {"reward_mean": _mean(rewards), "judge_mean": _mean(judge), "kl_to_sft_mean": _mean(kls),
            "response_len_mean": _mean(lengths), "eos_fraction": _mean([float(a.ended_with_eos) for a in answers]),
            "reward_std": float(torch.tensor(list(rewards)).std().item()) if len(rewards) > 1 else 0.0}


def compare_policies(sft_path: str, rlhf_path: str, reward_path: str, prompts: Sequence[str], max_new_tokens: int,
                     do_sample: bool = True, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                     num_beams: int = 1, batch_size: int = 8, num_samples: int = 3, seed: int = 0,
                     max_prompt_len: int | None = None, device: str | torch.device | None = None,
                     judge: SentimentJudge | None = None, log: Callable[[str], None] | None = print) -> dict:
    """Generate with the SFT and the RLHF policy on the same prompts (same settings and seed) and
    measure both: mean reward-model score, mean judge score, mean KL to the SFT model (0 for the
    SFT itself), mean response length in tokens and EOS fraction; plus the RLHF policy's win rates
    against SFT per prompt and `num_samples` side-by-side samples.

    Returns a JSON-serialisable dict: "settings", "policies" {"sft": {...}, "rlhf": {...}},
    "rlhf_vs_sft", "samples" (the first `num_samples` prompts) and "per_prompt" (all of them).
    """
    log = log or (lambda _msg: None)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to evaluate")
    device = device or default_device()
    judge = judge or SentimentJudge()
    gen = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_p=top_p,
               top_k=top_k, num_beams=num_beams, batch_size=batch_size, seed=seed, max_prompt_len=max_prompt_len)

    log(f"[eval] loading SFT policy {sft_path} and RLHF policy {rlhf_path}")
    sft, sft_tok = load_policy(sft_path, device)
    rlhf, rlhf_tok = load_policy(rlhf_path, device)
    if not same_vocabulary(sft_tok, rlhf_tok):
        raise ValueError(f"the SFT ({sft_path}) and RLHF ({rlhf_path}) tokenizers differ: "
                         f"the KL between the two policies is undefined")
    answers = {}
    for name, model, tok in (("sft", sft, sft_tok), ("rlhf", rlhf, rlhf_tok)):
        log(f"[eval] generating {len(prompts)} answers with the {name.upper()} policy")
        answers[name] = generate_answers(model, tok, prompts, **gen)
    log("[eval] KL of the RLHF policy to the SFT policy")
    kls = {"sft": [0.0] * len(prompts),
           "rlhf": kl_to_reference(rlhf, sft, answers["rlhf"], batch_size, pad_token_id=rlhf_tok.pad_token_id)}
    del sft, rlhf

    log(f"[eval] scoring with the reward model {reward_path}")
    reward_model, reward_tok = load_reward_model(reward_path, device)
    retok = not same_vocabulary(reward_tok, sft_tok)
    if retok:
        log("[eval] the reward model's tokenizer differs from the policies': responses are re-tokenised from text")
    rewards = {name: reward_scores(reward_model, reward_tok, retokenize(rows, reward_tok) if retok else rows, batch_size)
               for name, rows in answers.items()}
    del reward_model
    judged = {name: judge.score([a.text for a in rows]) for name, rows in answers.items()}

    policies = {name: {"path": path, **summarize(answers[name], rewards[name], judged[name], kls[name])}
                for name, path in (("sft", sft_path), ("rlhf", rlhf_path))}
    per_prompt = []
    for i, prompt in enumerate(prompts):
        entry = {"prompt": prompt}
        for name in POLICIES:
            a = answers[name][i]
            entry[name] = {"text": a.text, "reward": rewards[name][i], "judge": judged[name][i], "kl_to_sft": kls[name][i],
                           "response_len": a.response_ids.numel(), "ended_with_eos": a.ended_with_eos}
        per_prompt.append(entry)
    return {
        "settings": {"sft_model": sft_path, "rlhf_model": rlhf_path, "reward_model": reward_path,
                     "num_prompts": len(prompts), "judge": judge.name, "reward_retokenized": retok,
                     **{k: v for k, v in gen.items() if k != "batch_size"}},
        "policies": policies,
        "rlhf_vs_sft": {"reward_win_rate": _win_rate(rewards["rlhf"], rewards["sft"]),
                        "judge_win_rate": _win_rate(judged["rlhf"], judged["sft"])},
        "samples": per_prompt[:max(0, num_samples)],
        "per_prompt": per_prompt,
    }


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def format_table(result: dict) -> str:
    """A markdown-style table of both policies' metrics, the win rates, and the side-by-side samples."""
    titles = ["policy"] + [title for _, title in METRIC_COLUMNS]
    rows = [[name.upper()] + [_fmt(result["policies"][name][key]) for key, _ in METRIC_COLUMNS] for name in POLICIES]
    widths = [max(len(r[i]) for r in [titles] + rows) for i in range(len(titles))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    s = result.get("settings", {})
    out = [f"prompts: {s.get('num_prompts', '?')}, max_new_tokens: {s.get('max_new_tokens', '?')}, "
           + ("sampling (temperature {temperature}, top_p {top_p}, top_k {top_k})".format(**s) if s.get("do_sample")
              else "greedy" if s.get("num_beams", 1) == 1 else f"beam search ({s.get('num_beams')} beams)")
           + f", judge: {s.get('judge', '?')}",
           "", line(titles), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows]
    vs = result.get("rlhf_vs_sft", {})
    out += ["", f"RLHF vs SFT win rate: reward {_fmt(vs.get('reward_win_rate'))}, judge {_fmt(vs.get('judge_win_rate'))}"
            " (ties count 1/2)"]
    for i, sample in enumerate(result.get("samples", []), 1):
        out += ["", f"--- sample {i} ---", f"prompt: {_one_line(sample['prompt'])}"]
        for name in POLICIES:
            a = sample[name]
            out.append(f"{name.upper():<4} [reward {_fmt(a['reward'])}, judge {_fmt(a['judge'])}, "
                       f"KL {_fmt(a['kl_to_sft'])}, {a['response_len']} tok{', EOS' if a['ended_with_eos'] else ''}]: "
                       f"{_one_line(a['text'])}")
    return "\n".join(out)
