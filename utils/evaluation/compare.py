"""SFT vs RLHF: both policies generated, scored and summarised on the same prompts; the result table."""
from __future__ import annotations

from utils.data import prompt_text

import math
from typing import Callable, Sequence

import torch

from utils.evaluation.answers import Answer, generate_answers, retokenize
from utils.evaluation.judge import SentimentJudge
from utils.evaluation.loading import default_device, load_policy, load_reward_model, same_vocabulary
from utils.evaluation.scoring import kl_to_reference, reward_scores

POLICIES = ("sft", "rlhf")
# (result key, column title) of format_table's metric columns
METRIC_COLUMNS = (
    ("reward_mean", "reward (RM)"),
    ("judge_mean", "judge (VADER)"),
    ("kl_to_sft_mean", "KL to SFT"),
    ("response_len_mean", "response len"),
    ("eos_fraction", "EOS fraction"),
)


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
        out += ["", f"--- sample {i} ---", f"prompt: {_one_line(prompt_text(sample['prompt']))}"]
        for name in POLICIES:
            a = sample[name]
            out.append(f"{name.upper():<4} [reward {_fmt(a['reward'])}, judge {_fmt(a['judge'])}, "
                       f"KL {_fmt(a['kl_to_sft'])}, {a['response_len']} tok{', EOS' if a['ended_with_eos'] else ''}]: "
                       f"{_one_line(a['text'])}")
    return "\n".join(out)
