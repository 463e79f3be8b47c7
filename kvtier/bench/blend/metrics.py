"""Fidelity of a reuse method to the full prefill on the same ids, per question and per row.

A 135M model answers few MuSiQue questions right, so a method is judged first by how close it stays
to computing the prompt afresh (same first token, KL of the first token's distribution, greedy
continuation equal, token F1 of its answer against the fresh answer), and also by F1 against the
gold answers.
"""

from __future__ import annotations

import random
import re
import statistics
import string
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.bench.stats import wilson

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def kl_first(full: torch.Tensor, other: torch.Tensor) -> float:
    """KL(full || other) of the first token's distributions, in float64 (exactly 0 for equal logits)."""
    p_log = torch.log_softmax(full.to(torch.float64), dim=-1)  # [vocab]
    q_log = torch.log_softmax(other.to(torch.float64), dim=-1)  # [vocab]
    return float((p_log.exp() * (p_log - q_log)).sum().clamp_min(0.0))


def leading_equal(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two outputs share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD token F1 of two answers after normalize_answer (1.0 when both are empty)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(reference).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: Sequence[str]) -> float | None:
    """The best F1 over the gold answers; None where there are none (random ids)."""
    return max(token_f1(prediction, r) for r in references) if references else None


def bootstrap_mean(xs: Sequence[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean (seeded: the same values give the same
    interval). KL values are skewed, so no normal approximation."""
    if not xs:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    n = len(xs)
    means = sorted(sum(rng.choices(xs, k=n)) / n for _ in range(reps))
    return means[int(0.025 * reps)], means[min(reps - 1, int(0.975 * reps))]


@dataclass(frozen=True)
class Sample:
    """One row on one question, against the full prefill of the same ids."""

    question: int
    recomputed_share: float
    first_token_equal: bool
    kl: float
    leading_equal: int
    f1_full: float
    f1_gold: float | None
    ttft_s: float
    bytes_read: int
    recomputed_tokens: int  # prompt tokens computed for this row (the last one included)
    text: str


def _mean(xs: Sequence[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def summarize(samples: Sequence[Sample]) -> dict:
    """A row's columns over its questions: means, the agreement's Wilson and the KL's bootstrap
    intervals, the median TTFT."""
    n = len(samples)
    agree = sum(s.first_token_equal for s in samples)
    kls = [s.kl for s in samples]
    gold = [s.f1_gold for s in samples if s.f1_gold is not None]
    return dict(n=n, recomputed_share=_mean([s.recomputed_share for s in samples]),
                first_token_agreement=agree / n if n else None, first_token_ci=list(wilson(agree, n)),
                kl_mean=_mean(kls), kl_ci=list(bootstrap_mean(kls)), kl_median=statistics.median(kls) if kls else None,
                leading_equal=_mean([s.leading_equal for s in samples]),
                f1_full=_mean([s.f1_full for s in samples]), f1_gold=_mean(gold),
                ttft_s=statistics.median(s.ttft_s for s in samples) if n else None,
                bytes_read=_mean([s.bytes_read for s in samples]))
