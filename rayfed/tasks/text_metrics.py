"""Scores of generated text against a reference, computed offline.

- ``token_f1``: SQuAD-style F1 of the bags of lower-cased words (a BERTScore stand-in that needs no model);
- ``exact_match``: the normalized strings are equal;
- ``meteor``: METEOR's exact-match stage (Banerjee & Lavie, 2005): unigram precision P and recall R,
  ``Fmean = 10 P R / (R + 9 P)``, fragmentation penalty ``0.5 (chunks / matches)^3``, score
  ``Fmean (1 - penalty)``. Stemming and synonym stages need WordNet; :func:`nltk_meteor` uses nltk's full
  METEOR when nltk and its WordNet data are installed, and :func:`bertscore_f1` BERTScore when
  ``bert_score`` and its model are available offline (each returns None otherwise).
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"\w+|[^\w\s]")


def words(text: str) -> list[str]:
    """Lower-cased words and punctuation marks."""
    return _WORD.findall(text.lower())


def token_f1(prediction: str, reference: str) -> float:
    predicted, expected = words(prediction), words(reference)
    if not predicted or not expected:
        return float(predicted == expected)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, reference: str) -> float:
    return float(words(prediction) == words(reference))


def meteor(prediction: str, reference: str) -> float:
    """METEOR with exact unigram matching only (see the module docstring)."""
    predicted, expected = words(prediction), words(reference)
    alignment = _align(predicted, expected)
    matches = len(alignment)
    if matches == 0:
        return 0.0
    precision, recall = matches / len(predicted), matches / len(expected)
    fmean = 10 * precision * recall / (recall + 9 * precision)
    chunks = 1 + sum(1 for (p0, r0), (p1, r1) in zip(alignment, alignment[1:]) if p1 != p0 + 1 or r1 != r0 + 1)
    return fmean * (1 - 0.5 * (chunks / matches) ** 3)


def _align(predicted: Sequence[str], expected: Sequence[str]) -> list[tuple[int, int]]:
    """(prediction index, reference index) pairs of equal words, each word used once, left to right."""
    used: set[int] = set()
    pairs = []
    for i, word in enumerate(predicted):
        for j, other in enumerate(expected):
            if j not in used and other == word:
                used.add(j)
                pairs.append((i, j))
                break
    return pairs


@functools.lru_cache(maxsize=1)
def _nltk_meteor():
    try:
        import nltk
        from nltk.translate.meteor_score import meteor_score

        nltk.data.find("corpora/wordnet")
    except (ImportError, LookupError):
        return None
    return meteor_score


def nltk_meteor(prediction: str, reference: str) -> float | None:
    """nltk's METEOR (stems and WordNet synonyms), or None when nltk or its WordNet data is missing."""
    score = _nltk_meteor()
    return None if score is None else float(score([words(reference)], words(prediction)))


@functools.lru_cache(maxsize=1)
def _bert_scorer():
    try:
        from bert_score import BERTScorer

        return BERTScorer(model_type="bert-base-uncased", lang="en")
    except Exception:  # not installed, or its model is not in the offline cache
        return None


def bertscore_f1(predictions: Sequence[str], references: Sequence[str]) -> list[float] | None:
    """BERTScore F1 (bert-base-uncased), or None when it cannot run offline."""
    scorer = _bert_scorer()
    if scorer is None:
        return None
    return [float(f) for f in scorer.score(list(predictions), list(references))[2]]
