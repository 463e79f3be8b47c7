"""Percentiles and timers every benchmark shares (one definition each; no torch)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def quantile_round(xs: list[float], q: float) -> float | None:
    """The sample at index round(q * (n - 1)) of the sorted values (q in [0, 1]); None for none.
    (`kvtier bench partial`'s percentiles: kept so its numbers compare with earlier runs.)"""
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def quantile_linear(xs: list[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (q in [0, 1]); None for no values.
    (`kvtier bench trace`'s percentiles.)"""
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _times(fn: Callable[[], object], reps: int) -> list[float]:
    """Seconds each of `reps` runs of `fn` took."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def best_of(fn: Callable[[], object], reps: int) -> float:
    """Fastest of `reps` runs, in seconds (the least disturbed by other work on the machine)."""
    return min(_times(fn, reps))


def median_of(fn: Callable[[], object], reps: int) -> float:
    """Median of `reps` runs, in seconds."""
    return statistics.median(_times(fn, reps))


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def median_interval(xs: list[float], level: float = 0.9) -> tuple[float, float] | None:
    """A distribution-free interval for the median of the population `xs` was drawn from: the
    order statistics (x_(k), x_(n+1-k)) with the largest k whose coverage, 1 - 2 P(Bin(n, 1/2) < k),
    is at least `level`. None where even (min, max) covers less (under 5 values at 0.9)."""
    n, xs = len(xs), sorted(xs)
    below, k = 0.0, 0  # below = P(Bin(n, 1/2) < k + 1) as k grows
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if 1 - 2 * below < level:
            break
        k += 1
    return None if k == 0 else (xs[k - 1], xs[n - k])
