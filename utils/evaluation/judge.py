"""The independent judge of evaluation: VADER sentiment of the response texts."""
from __future__ import annotations

from typing import Sequence


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
