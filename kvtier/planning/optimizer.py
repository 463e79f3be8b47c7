"""Request-level optimiser for partial token-wise KV caching (eLLM, EuroSys'26).

Under KV memory pressure a running sequence may keep KV only for its newest tokens: its first u_i
tokens (its "front", a multiple of the block size) leave the pool and come back in every decode
step, recomputed from their ids or read from a host swap space. Dropping fronts lets more sequences
run at once (a larger batch b) at the price of a slower step. This module picks b (the first b
sequences in FCFS order) and every u_i to maximise the throughput b / T(b, u) subject to a TPOT SLO
(T <= slo) and the pool's block budget.

- Cost model: `ProfileCostModel` (seconds measured on this machine, fitted by `fit_profile`).
- Solver: `solve_enumerate` (every b; fronts water-filled block by block; exact on the block grid
  for convex front costs).
- Layer rule: `choose_boundary` (how many front layers to recompute, the rest read from the swap
  space).

The paper's FLOP model, its SLSQP relaxation, its uniform-ratio fronts and its GPU overlap rules
(eqs 2-9) live in `kvtier.testing.paper`: the tests check them, the engine does not run them.

Pure Python: no numpy, no torch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

SOURCES = ("recompute", "swap")
_REL_TOL = 1e-9  # SLO comparisons: a step predicted within rounding of the SLO meets it
_TIE_TOL = 1e-12  # throughputs this close count as a tie (broken toward the larger batch)


# ----- cost models ----------------------------------------------------------------------------
class CostModel(Protocol):
    """Seconds of one decode step, split so the solvers can price each front separately."""

    def base_s(self, lengths: Sequence[int]) -> float:
        """A decode step of sequences of these lengths, all of their KV cached."""
        ...

    def front_s(self, length: int, front: float) -> float:
        """Extra seconds a sequence of `length` tokens costs when its first `front` tokens are
        uncached: 0 at front 0 and non-decreasing in front. `front` may be fractional (a
        continuous relaxation prices unrounded fronts)."""
        ...


def step_s(model: CostModel, lengths: Sequence[int], fronts: Sequence[float]) -> float:
    """Predicted seconds of a step: the cached decode plus every sequence's front."""
    return model.base_s(lengths) + sum(model.front_s(s, u) for s, u in zip(lengths, fronts))


@dataclass(frozen=True)
class Sample:
    """One measured decode step, for fitting a `ProfileCostModel`."""

    lengths: tuple[int, ...]  # context tokens of each sequence in the step
    fronts: tuple[int, ...]  # its uncached front
    source: str  # where the fronts came from: "recompute" | "swap"
    seconds: float

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"sample source {self.source!r}: use one of {', '.join(SOURCES)}")
        if len(self.fronts) != len(self.lengths):
            raise ValueError(f"{len(self.fronts)} fronts for {len(self.lengths)} sequences")


@dataclass(frozen=True)
class ProfileCostModel:
    """The cost of a decode step measured on a CPU, in seconds.

    Terms add rather than overlap: on a CPU the copies from the swap space and the compute share the
    same cores and memory bandwidth, so nothing hides behind anything else.
    """

    c0: float  # per step: reading the weights once (shared by the whole batch)
    c1: float  # per sequence in the step
    g: float  # per context token attended (cached or front)
    a: float  # per front token recomputed (all layers)
    q: float = 0.0  # per front token squared (the recompute's causal attention)
    w: float | None = None  # per front token read from the host swap space (all layers); None: no swap

    def base_s(self, lengths: Sequence[int]) -> float:
        if not lengths:
            return 0.0
        return self.c0 + self.c1 * len(lengths) + self.g * sum(lengths)

    def recompute_s(self, front: float) -> float:
        """Seconds to recompute a front of this many tokens."""
        return self.a * front + self.q * front * front

    def swap_s(self, front: float) -> float:
        """Seconds to read a front of this many tokens back from the swap space (inf without one)."""
        if self.w is None:
            return math.inf if front else 0.0
        return self.w * front

    def front_s(self, length: int, front: float) -> float:
        # The engine takes each step's fronts from the cheaper source.
        rec = self.recompute_s(front)
        return rec if self.w is None else min(rec, self.swap_s(front))

    def step_for(self, sample: Sample) -> float:
        """Predicted seconds of a measured step, its fronts priced by the source it used."""
        part = self.recompute_s if sample.source == "recompute" else self.swap_s
        return self.base_s(sample.lengths) + sum(part(u) for u in sample.fronts)


def _features(sample: Sample) -> list[float]:
    """One row of the least-squares design: the coefficients of c0, c1, g, a, q, w."""
    u = sum(sample.fronts)
    u2 = sum(x * x for x in sample.fronts)
    rec = sample.source == "recompute"
    return [1.0, len(sample.lengths), sum(sample.lengths), u if rec else 0.0, u2 if rec else 0.0,
            0.0 if rec else u]


def _lstsq(rows: Sequence[Sequence[float]], y: Sequence[float]) -> list[float]:
    """Least-squares coefficients of `rows` (m x n) for `y`, by Householder QR in pure Python.

    A column that adds nothing the ones before it do not already span (a zero on R's diagonal,
    relative to its largest entry) gets coefficient 0."""
    a = [list(map(float, r)) for r in rows]
    b = [float(v) for v in y]
    m, n = len(a), len(a[0]) if a else 0
    for k in range(min(m, n)):
        norm = math.sqrt(sum(a[i][k] ** 2 for i in range(k, m)))
        if norm == 0.0:
            continue
        alpha = -math.copysign(norm, a[k][k])
        v = [a[i][k] for i in range(k, m)]
        v[0] -= alpha
        vv = sum(x * x for x in v)
        if vv == 0.0:
            continue
        for j in range(k, n):
            f = 2.0 * sum(v[i - k] * a[i][j] for i in range(k, m)) / vv
            for i in range(k, m):
                a[i][j] -= f * v[i - k]
        f = 2.0 * sum(v[i - k] * b[i] for i in range(k, m)) / vv
        for i in range(k, m):
            b[i] -= f * v[i - k]
    top = max((abs(a[k][k]) for k in range(min(m, n))), default=0.0)
    coef = [0.0] * n
    for k in reversed(range(min(m, n))):
        if abs(a[k][k]) <= top * 1e-12:
            continue
        coef[k] = (b[k] - sum(a[k][j] * coef[j] for j in range(k + 1, n))) / a[k][k]
    return coef


def fit_profile(samples: Sequence[Sample]) -> ProfileCostModel:
    """Fit a `ProfileCostModel` to measured steps by least squares.

    Rows are weighted by 1 / seconds, so the fit minimises relative error (what `mape` reports)
    and a few long steps do not drown the short ones. Constants must be >= 0: a negative one is
    clipped to 0 and the rest refitted without it, until none is negative. A constant no sample
    exercises is 0; w is fitted only when swap samples with fronts exist (else None).
    """
    if not samples:
        raise ValueError("no samples to fit")
    rows, y = [], []
    for s in samples:
        weight = 1.0 / max(s.seconds, 1e-12)
        rows.append([x * weight for x in _features(s)])
        y.append(s.seconds * weight)
    width = len(rows[0])
    scale = [max(abs(r[k]) for r in rows) for k in range(width)]  # columns span orders of magnitude
    active = [k for k in range(width) if scale[k] > 0]
    coef = [0.0] * width
    while active:
        sol = [c / scale[k] for c, k in
               zip(_lstsq([[r[k] / scale[k] for k in active] for r in rows], y), active)]
        coef = [0.0] * width
        for k, c in zip(active, sol):
            coef[k] = c
        worst = min(range(len(sol)), key=sol.__getitem__)
        if sol[worst] >= 0:
            break
        active.pop(worst)
    has_swap = scale[5] > 0
    return ProfileCostModel(c0=coef[0], c1=coef[1], g=coef[2], a=coef[3], q=coef[4], w=coef[5] if has_swap else None)


def mape(model: CostModel, samples: Sequence[Sample]) -> float:
    """Mean absolute percentage error of predicted vs measured step seconds. A `ProfileCostModel`
    prices each sample's fronts by the source it used; other models by their `front_s`."""
    if not samples:
        raise ValueError("no samples")
    errs = []
    for s in samples:
        pred = model.step_for(s) if isinstance(model, ProfileCostModel) else step_s(model, s.lengths, s.fronts)
        errs.append(abs(pred - s.seconds) / s.seconds)
    return sum(errs) / len(errs)


# ----- the problem and its answer -------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Candidate sequences and the pool they share.

    Sequence i with front u_i holds ceil((s_i - u_i) / block_size) + reserve_blocks blocks: the
    reserve is headroom for the token it gains every step.
    """

    lengths: tuple[int, ...]  # s_i of candidate sequences, FCFS order (running ones, then waiting)
    capacity_blocks: int  # KV pool blocks available to them
    block_size: int = 16
    slo_s: float | None = None  # TPOT SLO: the predicted step must take at most this
    reserve_blocks: int = 1
    # Per sequence the largest front allowed (0 for a waiting request, which must prefill in
    # full). Default and upper bound: floor((s_i - 1) / block) * block, which leaves the newest
    # token's block cached.
    max_fronts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.reserve_blocks < 0 or self.capacity_blocks < 0:
            raise ValueError("block_size must be >= 1, reserve_blocks and capacity_blocks >= 0")
        if any(s < 1 for s in self.lengths):
            raise ValueError("every sequence needs at least one token")
        if self.max_fronts is not None and len(self.max_fronts) != len(self.lengths):
            raise ValueError(f"{len(self.max_fronts)} max fronts for {len(self.lengths)} sequences")
        if self.slo_s is not None and self.slo_s <= 0:
            raise ValueError(f"SLO must be positive, got {self.slo_s}")

    @cached_property
    def limits(self) -> tuple[int, ...]:
        """The most front blocks each sequence may give up."""
        bs = self.block_size
        most = [(s - 1) // bs for s in self.lengths]
        if self.max_fronts is None:
            return tuple(most)
        return tuple(max(0, min(m, f // bs)) for m, f in zip(most, self.max_fronts))

    @cached_property
    def _full_prefix(self) -> tuple[int, ...]:
        """Blocks the first b sequences hold fully cached, reserves included, for b = 0..B."""
        acc, out = 0, [0]
        for s in self.lengths:
            acc += -(-s // self.block_size) + self.reserve_blocks
            out.append(acc)
        return tuple(out)

    def need(self, b: int) -> int:
        """Blocks the first b sequences must free to fit (<= 0: they fit fully cached)."""
        return self._full_prefix[b] - self.capacity_blocks

    def blocks(self, fronts: Sequence[int]) -> int:
        """Blocks held by the first len(fronts) sequences with these fronts."""
        bs = self.block_size
        return sum(-(-(s - u) // bs) + self.reserve_blocks for s, u in zip(self.lengths, fronts))

    def meets_slo(self, seconds: float) -> bool:
        return self.slo_s is None or seconds <= self.slo_s * (1 + _REL_TOL)


@dataclass(frozen=True)
class Decision:
    """Run the first b sequences of the workload with these fronts."""

    b: int  # 0: nothing fits (memory or SLO)
    fronts: tuple[int, ...]  # u_i of each of the first b, multiples of the block size
    predicted_s: float  # step_s of this choice
    blocks: int  # blocks it holds
    feasible: bool

    @property
    def throughput(self) -> float:
        """Sequences advanced per second."""
        if self.b == 0:
            return 0.0
        return self.b / self.predicted_s if self.predicted_s > 0 else math.inf


INFEASIBLE = Decision(b=0, fronts=(), predicted_s=0.0, blocks=0, feasible=False)


def decide(model: CostModel, wl: Workload, fronts: Sequence[int]) -> Decision:
    """The decision to run the first len(fronts) sequences with these fronts, priced and checked."""
    b = len(fronts)
    pred = step_s(model, wl.lengths[:b], fronts)
    blocks = wl.blocks(fronts)
    return Decision(b=b, fronts=tuple(fronts), predicted_s=pred, blocks=blocks,
                    feasible=b > 0 and blocks <= wl.capacity_blocks and wl.meets_slo(pred))


# ----- choosing fronts ------------------------------------------------------------------------
class FrontBlocks:
    """The n cheapest front blocks over the sequences added so far, maintained as sequences join.

    Block j of sequence i (0-based) is its (j+1)-th front block; taking it frees one pool block and
    costs front_s(s, (j+1)*bs) - front_s(s, j*bs). Blocks are ranked by a key (`rank`) that never
    decreases along a sequence, so the selected blocks of each sequence are a prefix (a valid
    front). Here the key is the marginal cost as a running max: for a convex front_s the marginals
    already increase and taking the n smallest is the greedy that is optimal for separable convex
    allocation (each pick is the cheapest next block; an exchange argument shows no other set of n
    prefix blocks costs less). For a non-convex front_s (the min of recompute and swap) the running
    max keeps fronts valid but the greedy is only a heuristic. (`kvtier.testing.paper` ranks by
    j / s_i instead: the paper's one uniform ratio.)

    Two heaps: `low` holds the selected blocks (a max-heap on key), `high` the candidates (a
    min-heap). A sequence's next block enters `high` only once the one before it is selected, so
    the heaps stay near the selection's size. Adding a sequence and growing n costs O(log) per block
    moved instead of a fresh greedy per batch size.
    """

    def __init__(self, model: CostModel, wl: Workload):
        self.model, self.wl = model, wl
        self.low: list[tuple[float, int, int, float]] = []  # (-key, -j, i, cost)
        self.high: list[tuple[float, int, int, float]] = []  # (key, j, i, cost)
        self.count: list[int] = []  # blocks selected per sequence: its front / block_size
        self.cost = 0.0  # sum of the selected blocks' costs: sum of front_s of the fronts
        self._pushed: list[int] = []  # highest block index pushed per sequence (-1: none)
        self._front_s: list[float] = []  # front_s at (pushed + 1) blocks
        self._key: list[float] = []  # key of the last pushed block

    def rank(self, i: int, j: int, cost: float) -> float:
        """The key of sequence i's block j, which costs `cost`: never below the key of its block j - 1."""
        return max(cost, self._key[i])

    def extra(self) -> list[tuple[int, float]]:
        """Blocks the fronts take beyond the n selected, as (sequence, cost): none here."""
        return []

    def add(self) -> None:
        """Make the next sequence of the workload a candidate."""
        self.count.append(0)
        self._pushed.append(-1)
        self._front_s.append(0.0)
        self._key.append(-math.inf)
        self._push_next(len(self.count) - 1)

    def _push_next(self, i: int) -> None:
        j = self._pushed[i] + 1
        if j >= self.wl.limits[i]:
            return
        s, bs = self.wl.lengths[i], self.wl.block_size
        f = self.model.front_s(s, (j + 1) * bs)
        cost = f - self._front_s[i]
        key = self.rank(i, j, cost)
        self._pushed[i], self._front_s[i], self._key[i] = j, f, key
        heapq.heappush(self.high, (key, j, i, cost))

    def _promote(self) -> None:
        key, j, i, cost = heapq.heappop(self.high)  # the cheapest candidate is its sequence's next block
        heapq.heappush(self.low, (-key, -j, i, cost))
        self.count[i] += 1
        self.cost += cost
        if j == self._pushed[i]:
            self._push_next(i)

    def _demote(self) -> None:
        nkey, nj, i, cost = heapq.heappop(self.low)  # the dearest selected is its sequence's last block
        heapq.heappush(self.high, (-nkey, -nj, i, cost))
        self.count[i] -= 1
        self.cost -= cost

    def fill(self, n: int) -> bool:
        """Select the n cheapest blocks; False if fewer than n are available. n never shrinks
        between calls: a growing batch only ever lacks more blocks."""
        low, high = self.low, self.high
        assert n >= len(low), "the selection only grows"
        while low and high and high[0][0] < -low[0][0]:  # a newly added sequence undercuts the selection
            self._promote()
            self._demote()
        while len(low) < n:
            if not high:
                return False
            self._promote()
        return True

    def fronts(self, extra: Sequence[tuple[int, float]] = ()) -> list[int]:
        counts = list(self.count)
        for i, _ in extra:
            counts[i] += 1
        return [c * self.wl.block_size for c in counts]

    @classmethod
    def fronts_for(cls, model: CostModel, wl: Workload, b: int) -> tuple[int, ...] | None:
        """Fronts of the first b sequences that free just enough blocks, the cheapest by `rank`.
        None if even the largest fronts do not fit."""
        alloc = cls(model, wl)
        for _ in range(b):
            alloc.add()
        need = max(0, wl.need(b))
        if not alloc.fill(need):
            return None
        return tuple(alloc.fronts(alloc.extra() if need else ()))

    @classmethod
    def solve(cls, model: CostModel, wl: Workload) -> Decision:
        """Best b and fronts by trying every batch size b = 1..B (FCFS prefixes).

        For each b the fronts free exactly the blocks the pool lacks (kept incrementally as b
        grows); b is infeasible if they cannot be freed or the step misses the SLO. The answer has
        the largest b / T, ties to the larger b.

        Once memory cannot be met it cannot for any larger b either: a sequence holds at least one
        block more than it can give up, so each added sequence deepens the deficit; the scan stops.
        """
        alloc = cls(model, wl)
        best_thr, best_fronts = -1.0, None
        for b in range(1, len(wl.lengths) + 1):
            alloc.add()
            need = max(0, wl.need(b))
            if not alloc.fill(need):
                break
            extra = alloc.extra() if need else []
            t = model.base_s(wl.lengths[:b]) + alloc.cost + sum(c for _, c in extra)
            if not wl.meets_slo(t):
                continue
            thr = b / t if t > 0 else math.inf
            if thr >= best_thr * (1 - _TIE_TOL):
                best_thr, best_fronts = thr, alloc.fronts(extra)
        return INFEASIBLE if best_fronts is None else decide(model, wl, best_fronts)


def fronts_for(model: CostModel, wl: Workload, b: int) -> tuple[int, ...] | None:
    """Fronts of the first b sequences that free just enough blocks at the least cost (water-filled
    block by block). None if even the largest fronts do not fit."""
    return FrontBlocks.fronts_for(model, wl, b)


def solve_enumerate(model: CostModel, wl: Workload) -> Decision:
    """Best b and fronts by trying every batch size b = 1..B, fronts water-filled (`FrontBlocks`).
    With a convex front_s it is optimal over every (b, front vector) on the block grid."""
    return FrontBlocks.solve(model, wl)


# ----- layer-level rule -----------------------------------------------------------------------
def choose_boundary(rec_per_layer_s: float, swap_per_layer_s: float, layers: int) -> int:
    """Front layers to recompute, l_R in [0, layers]; the rest are read from the swap space.

    Recomputed layers must be a prefix: recomputing layer l needs the front's hidden state out of
    every layer before it. On a CPU copies and compute share the cores, so nothing overlaps: the
    cost l_R rec + (L - l_R) swap is linear in l_R and an endpoint wins (ties: 0, read everything).
    (With a GPU copy engine beside the compute the cost would be max(l_R rec, (L - l_R) swap):
    `kvtier.testing.paper.balanced_boundary`.)
    """
    if layers <= 0:
        return 0
    return layers if rec_per_layer_s < swap_per_layer_s else 0
