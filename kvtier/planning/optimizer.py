"""Request-level optimiser for partial token-wise KV caching (eLLM, EuroSys'26).

Under KV memory pressure a running sequence may keep KV only for its newest tokens: its first u_i
tokens (its "front", a multiple of the block size) leave the pool and come back in every decode
step, recomputed from their ids or read from a host swap space. Dropping fronts lets more sequences
run at once (a larger batch b) at the price of a slower step. This module picks b (the first b
sequences in FCFS order) and every u_i to maximise the throughput b / T(b, u) subject to a TPOT SLO
(T <= slo) and the pool's block budget.

- Cost models: `PaperCostModel` (the paper's FLOP count, eqs 2-5, literal or with its logit terms
  corrected) and `ProfileCostModel` (seconds measured on this machine, fitted by `fit_profile`).
- Solvers: `solve_enumerate` (every b; fronts water-filled block by block, or one uniform ratio;
  exact on the block grid for convex front costs) and `solve_slsqp` (the paper's continuous
  relaxation over (b, r), then rounded and repaired).
- Layer-level rules: `paper_swap_s`, `paper_recompute_s`, `choose_overlap`, `kernel_work` and
  `thread_split` (eqs 6-9: a GPU overlaps swapping some layers with recomputing others), and
  `choose_boundary` (how many front layers to recompute, the rest read from the swap space).

Pure Python and numpy; scipy is imported only inside `solve_slsqp`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np

PER_REQUEST = ("tokens", "ratio")
SOURCES = ("recompute", "swap")
_REL_TOL = 1e-9  # SLO comparisons: a step predicted within rounding of the SLO meets it
_TIE_TOL = 1e-12  # throughputs this close count as a tie (broken toward the larger batch)


# ----- cost models ----------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    """The model dimensions the paper's FLOP and memory formulas need."""

    hidden: int  # h
    layers: int  # L
    vocab: int  # V
    kv_dim: int  # width of K (and of V) per layer: hidden for MHA, less with GQA
    dtype_bytes: int = 2  # fp16

    @property
    def kv_token_bytes(self) -> int:
        """Bytes of K and V one token holds over all layers (eq.1's 4Lh for fp16 MHA)."""
        return 2 * self.layers * self.kv_dim * self.dtype_bytes


class CostModel(Protocol):
    """Seconds of one decode step, split so the solvers can price each front separately."""

    def base_s(self, lengths: Sequence[int]) -> float:
        """A decode step of sequences of these lengths, all of their KV cached."""
        ...

    def front_s(self, length: int, front: float) -> float:
        """Extra seconds a sequence of `length` tokens costs when its first `front` tokens are
        uncached: 0 at front 0 and non-decreasing in front. `front` may be fractional (the SLSQP
        relaxation prices unrounded fronts)."""
        ...


def step_s(model: CostModel, lengths: Sequence[int], fronts: Sequence[float]) -> float:
    """Predicted seconds of a step: the cached decode plus every sequence's front."""
    return model.base_s(lengths) + sum(model.front_s(s, u) for s, u in zip(lengths, fronts))


def _ratios(lengths: Sequence[int], r: float | Sequence[float]) -> list[float]:
    """One uncached ratio per sequence: a scalar is the paper's uniform r."""
    if isinstance(r, (int, float)):
        return [float(r)] * len(lengths)
    if len(r) != len(lengths):
        raise ValueError(f"{len(r)} ratios for {len(lengths)} sequences")
    return [float(x) for x in r]


@dataclass(frozen=True)
class PaperCostModel:
    """The paper's FLOP model (eqs 2-5) with r_i = u_i / s_i, in seconds at `flops` FLOP/s.

    literal=True follows the equations as printed, flaws included:
    - eq.3 charges the LM head 2hV for every context token of a decode, though a decode computes
      logits for its one new token only (2hV once);
    - eq.2 charges the LM head for every recomputed front token, though recomputing KV needs no
      logits at all.
    literal=False fixes both: a decode pays 2hV once and a recompute pays no logits.

    Either way the step is a pure sum of per-request FLOPs, so b / T(b) = FLOPS / (mean cost per
    request): the batch buys nothing (the weights are not read once per step as in a real
    memory-bound decode), throughput does not grow with b, and SLSQP on (b, r) has a flat
    direction along b (degenerate: it stays wherever it starts, see `solve_slsqp`).

    As a `CostModel`, eps0 (a per-request constant of eq.2) goes into `base_s` so that `front_s` is
    0 at front 0; `step_s` of the two still equals eq.4 exactly.
    """

    shape: ModelShape
    flops: float
    literal: bool = True
    eps0: float = 0.0
    eps1: float = 0.0

    def _rec_one(self, s: float, r: float) -> float:
        """Eq.2's summand for one request, less eps0."""
        h, L, V = self.shape.hidden, self.shape.layers, self.shape.vocab
        t = s * r  # uncached tokens
        work = 24 * h * h * L * t + 4 * h * L * t * t
        return work + 2 * h * V * t if self.literal else work

    def _dec_one(self, s: float) -> float:
        """Eq.3's summand for one request (eps1 included)."""
        h, L, V = self.shape.hidden, self.shape.layers, self.shape.vocab
        logits = 2 * h * V * s if self.literal else 2 * h * V
        return 24 * h * h * L + 4 * h * L * (s + 1) + logits + self.eps1

    def rec_flops(self, lengths: Sequence[int], r: float | Sequence[float]) -> float:
        """Eq.2: V_rec, the work of recomputing every request's uncached front."""
        return sum(self._rec_one(s, ri) + self.eps0 for s, ri in zip(lengths, _ratios(lengths, r)))

    def dec_flops(self, lengths: Sequence[int]) -> float:
        """Eq.3: V_dec, the work of one decode token per request."""
        return sum(self._dec_one(s) for s in lengths)

    def step_s_ratio(self, lengths: Sequence[int], r: float | Sequence[float]) -> float:
        """Eq.4: T(b, r) = (V_rec + V_dec) / FLOPS."""
        return (self.rec_flops(lengths, r) + self.dec_flops(lengths)) / self.flops

    def eq5_objective(self, lengths: Sequence[int], r: float | Sequence[float]) -> float:
        """Eq.5's objective T / b written out as printed (eps terms left out); with literal=False
        the logit terms are the corrected ones. Equals step_s_ratio / b when eps0 = eps1 = 0."""
        h, L, V = self.shape.hidden, self.shape.layers, self.shape.vocab
        total = 0.0
        for s, ri in zip(lengths, _ratios(lengths, r)):
            logits = 2 * h * V * s * (1 + ri) if self.literal else 2 * h * V
            total += 24 * h * h * L * (s * ri + 1) + 4 * h * L * (s * s * ri * ri + s + 1) + logits
        return total / (self.flops * len(lengths))

    def base_s(self, lengths: Sequence[int]) -> float:
        return (self.dec_flops(lengths) + self.eps0 * len(lengths)) / self.flops

    def front_s(self, length: int, front: float) -> float:
        return self._rec_one(length, front / length) / self.flops


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


def fit_profile(samples: Sequence[Sample]) -> ProfileCostModel:
    """Fit a `ProfileCostModel` to measured steps by least squares (numpy.linalg.lstsq).

    Rows are weighted by 1 / seconds, so the fit minimises relative error (what `mape` reports)
    and a few long steps do not drown the short ones. Constants must be >= 0: a negative one is
    clipped to 0 and the rest refitted without it, until none is negative. A constant no sample
    exercises is 0; w is fitted only when swap samples with fronts exist (else None).
    """
    if not samples:
        raise ValueError("no samples to fit")
    x = np.array([_features(s) for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    weight = 1.0 / np.maximum(y, 1e-12)
    x, y = x * weight[:, None], y * weight
    scale = np.abs(x).max(axis=0)  # columns span orders of magnitude (1 vs tokens^2)
    active = [k for k in range(x.shape[1]) if scale[k] > 0]
    coef = np.zeros(x.shape[1])
    while active:
        sol = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)[0] / scale[active]
        coef[:] = 0.0
        coef[active] = sol
        worst = int(np.argmin(sol))
        if sol[worst] >= 0:
            break
        active.pop(worst)
    has_swap = scale[5] > 0
    return ProfileCostModel(c0=float(coef[0]), c1=float(coef[1]), g=float(coef[2]), a=float(coef[3]),
                            q=float(coef[4]), w=float(coef[5]) if has_swap else None)


def mape(model: CostModel, samples: Sequence[Sample]) -> float:
    """Mean absolute percentage error of predicted vs measured step seconds. A `ProfileCostModel`
    prices each sample's fronts by the source it used; other models by their `front_s`."""
    if not samples:
        raise ValueError("no samples")
    errs = []
    for s in samples:
        pred = model.step_for(s) if isinstance(model, ProfileCostModel) else step_s(model, s.lengths, s.fronts)
        errs.append(abs(pred - s.seconds) / s.seconds)
    return float(np.mean(errs))


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


_INFEASIBLE = Decision(b=0, fronts=(), predicted_s=0.0, blocks=0, feasible=False)


def _decide(model: CostModel, wl: Workload, fronts: Sequence[int]) -> Decision:
    b = len(fronts)
    pred = step_s(model, wl.lengths[:b], fronts)
    blocks = wl.blocks(fronts)
    return Decision(b=b, fronts=tuple(fronts), predicted_s=pred, blocks=blocks,
                    feasible=b > 0 and blocks <= wl.capacity_blocks and wl.meets_slo(pred))


# ----- choosing fronts ------------------------------------------------------------------------
class _FrontBlocks:
    """The n cheapest front blocks over the sequences added so far, maintained as sequences join.

    Block j of sequence i (0-based) is its (j+1)-th front block; taking it frees one pool block and
    costs front_s(s, (j+1)*bs) - front_s(s, j*bs). Blocks are ranked by a key that never decreases
    along a sequence, so the selected blocks of each sequence are a prefix (a valid front):
    - "tokens": the marginal cost, as a running max. For a convex front_s the marginals already
      increase and taking the n smallest is the greedy that is optimal for separable convex
      allocation (each pick is the cheapest next block; an exchange argument shows no other set of
      n prefix blocks costs less). For a non-convex front_s (the min of recompute and swap) the
      running max keeps fronts valid but the greedy is only a heuristic.
    - "ratio": j / s_i. One uniform ratio r gives u_i = ceil(r s_i / bs) * bs: it takes block j
      exactly when j / s_i < r / bs. So the smallest r that frees n blocks takes the n smallest
      keys and every block tied with the n-th (`ties`); any r > 0 takes every first block.

    Two heaps: `low` holds the selected blocks (a max-heap on key), `high` the candidates (a
    min-heap). A sequence's next block enters `high` only once the one before it is selected, so
    the heaps stay near the selection's size. Adding a sequence and growing n costs O(log) per block
    moved instead of a fresh greedy per batch size.
    """

    def __init__(self, model: CostModel, wl: Workload, mode: str):
        if mode not in PER_REQUEST:
            raise ValueError(f"per_request {mode!r}: use one of {', '.join(PER_REQUEST)}")
        self.model, self.wl, self.ratio = model, wl, mode == "ratio"
        self.low: list[tuple[float, int, int, float]] = []  # (-key, -j, i, cost)
        self.high: list[tuple[float, int, int, float]] = []  # (key, j, i, cost)
        self.count: list[int] = []  # blocks selected per sequence: its front / block_size
        self.cost = 0.0  # sum of the selected blocks' costs: sum of front_s of the fronts
        self._pushed: list[int] = []  # highest block index pushed per sequence (-1: none)
        self._front_s: list[float] = []  # front_s at (pushed + 1) blocks
        self._key: list[float] = []  # key of the last pushed block

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
        key = j / s if self.ratio else max(cost, self._key[i])
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

    def ties(self) -> list[tuple[int, float]]:
        """Ratio mode: candidates whose key equals the largest selected key, as (sequence, cost).
        The uniform ratio that takes the n-th block takes them too (equal ratios round alike)."""
        if not self.low:
            return []
        kappa = -self.low[0][0]
        popped = []
        while self.high and self.high[0][0] == kappa:  # j/s is correctly rounded: equal ratios, equal floats
            popped.append(heapq.heappop(self.high))
        for item in popped:
            heapq.heappush(self.high, item)
        return [(i, cost) for _, _, i, cost in popped]

    def fronts(self, extra: Sequence[tuple[int, float]] = ()) -> list[int]:
        counts = list(self.count)
        for i, _ in extra:
            counts[i] += 1
        return [c * self.wl.block_size for c in counts]


def fronts_for(model: CostModel, wl: Workload, b: int, per_request: str = "tokens") -> tuple[int, ...] | None:
    """Fronts of the first b sequences that free just enough blocks, priced by `model`: the
    cheapest blocks ("tokens") or the smallest uniform ratio ("ratio"). None if even the largest
    fronts do not fit."""
    alloc = _FrontBlocks(model, wl, per_request)
    for _ in range(b):
        alloc.add()
    need = max(0, wl.need(b))
    if not alloc.fill(need):
        return None
    return tuple(alloc.fronts(alloc.ties() if alloc.ratio and need else ()))


def solve_enumerate(model: CostModel, wl: Workload, per_request: str = "tokens") -> Decision:
    """Best b and fronts by trying every batch size b = 1..B (FCFS prefixes).

    For each b the fronts free exactly the blocks the pool lacks (`fronts_for`, kept incrementally
    as b grows); b is infeasible if they cannot be freed or the step misses the SLO. The answer has
    the largest b / T, ties to the larger b. With per_request="tokens" and a convex front_s it is
    optimal over every (b, front vector) on the block grid.

    Once memory cannot be met it cannot for any larger b either: a sequence holds at least one
    block more than it can give up, so each added sequence deepens the deficit; the scan stops.
    """
    alloc = _FrontBlocks(model, wl, per_request)
    best_thr, best_fronts = -1.0, None
    for b in range(1, len(wl.lengths) + 1):
        alloc.add()
        need = max(0, wl.need(b))
        if not alloc.fill(need):
            break
        extra = alloc.ties() if alloc.ratio and need else []
        t = model.base_s(wl.lengths[:b]) + alloc.cost + sum(c for _, c in extra)
        if not wl.meets_slo(t):
            continue
        thr = b / t if t > 0 else math.inf
        if thr >= best_thr * (1 - _TIE_TOL):
            best_thr, best_fronts = thr, alloc.fronts(extra)
    return _INFEASIBLE if best_fronts is None else _decide(model, wl, best_fronts)


def _uniform_fronts(wl: Workload, b: int, r: float) -> list[int]:
    """u_i = ceil(r s_i / bs) * bs, capped at each sequence's largest front."""
    bs = wl.block_size
    # r comes from a float optimiser: forgive rounding noise before taking the ceiling
    return [min(math.ceil(r * s / bs - 1e-9), lim) * bs for s, lim in zip(wl.lengths[:b], wl.limits[:b])]


def solve_slsqp(model: CostModel, wl: Workload, start: tuple[float, float] = (1.0, 0.0)) -> Decision:
    """The paper's solver: SLSQP on a continuous relaxation over x = (b, r), rounded and repaired.

    Relaxation: b in [1, B] and r in [0, 1]; the step of a fractional b interpolates linearly
    between the first floor(b) and ceil(b) sequences; fronts are r * s_i unrounded (capped at each
    sequence's largest front). Minimise T(b, r) / b subject to T <= slo and the relaxed KV slots
    sum (block * full_blocks_i - u_i) <= capacity * block, full_blocks_i = ceil(s_i / block) +
    reserve: counting the fully cached footprint in whole blocks makes the relaxation exact at
    r = 0 (counting s_i tokens would let it overfill the pool by up to a block per sequence).

    Round and repair: b is the relaxed b rounded down or up (whichever does better); its fronts are
    ceil(r s_i / bs) * bs or, when cheaper or when those break memory or the SLO, the smallest
    uniform ratio that fits this b; if nothing is feasible, b steps down until something is. Both
    extras over "round b down, raise r only on a violation" matter because the relaxation ignores
    block rounding: rounding up gives every sequence a whole block of front for any r > 0, so the
    relaxed r (sized for a fractional b) can free far more than needed (at a memory-bound optimum
    with r near 0 that halved the throughput in trials), and the relaxed b often sits just below
    the integer that wins.

    Known weaknesses, kept because this is the paper's method (`solve_enumerate` is the exact one):
    the relaxation is only piecewise smooth (kinks at integer b; finite-difference gradients) and
    ignores block rounding; with mixed lengths throughput is bumpy along b (a long sequence joining
    costs much memory), so SLSQP can stop at a local optimum (in trials up to a quarter below
    `solve_enumerate`); and under a pure FLOP model (`PaperCostModel`) the objective is flat along
    b, so SLSQP stays at its start b.
    """
    from scipy.optimize import minimize  # lazy: scipy is heavy and only this solver needs it

    n_seq = len(wl.lengths)
    if n_seq == 0:
        return _INFEASIBLE
    bs = wl.block_size
    caps = [lim * bs for lim in wl.limits]

    def at(n: int, r: float) -> tuple[float, float]:
        """(step seconds, KV token slots held) of the first n sequences at ratio r, unrounded. The
        slots start from whole blocks (exact at r = 0) and the front frees r * s_i of them."""
        lengths = wl.lengths[:n]
        fronts = [min(r * s, c) for s, c in zip(lengths, caps)]
        return step_s(model, lengths, fronts), (wl.need(n) + wl.capacity_blocks) * bs - sum(fronts)

    def relaxed(x: np.ndarray) -> tuple[float, float]:
        b = float(np.clip(x[0], 1.0, n_seq))
        r = float(np.clip(x[1], 0.0, 1.0))
        n = min(int(b), n_seq)
        frac = b - n
        t0, m0 = at(n, r)
        if frac <= 0:
            return t0, m0
        t1, m1 = at(n + 1, r)
        return t0 + (t1 - t0) * frac, m0 + (m1 - m0) * frac

    # Scale objective and constraints to O(1): SLSQP's tolerances are absolute.
    t_ref = relaxed(np.array([1.0, 0.0]))[0] or 1.0
    mem_ref = max(1.0, wl.capacity_blocks * bs)
    cons = [{"type": "ineq", "fun": lambda x: (wl.capacity_blocks * bs - relaxed(x)[1]) / mem_ref}]
    if wl.slo_s is not None:
        slo = wl.slo_s
        cons.append({"type": "ineq", "fun": lambda x: (slo - relaxed(x)[0]) / slo})
    res = minimize(lambda x: relaxed(x)[0] / float(np.clip(x[0], 1.0, n_seq)) / t_ref,
                   np.array([min(max(start[0], 1.0), n_seq), min(max(start[1], 0.0), 1.0)]),
                   method="SLSQP", bounds=[(1.0, float(n_seq)), (0.0, 1.0)], constraints=cons,
                   options={"maxiter": 200, "ftol": 1e-12})
    b_relaxed = float(np.clip(res.x[0], 1.0, n_seq))
    r = float(np.clip(res.x[1], 0.0, 1.0))
    b_low = max(1, math.floor(b_relaxed + 1e-6))  # forgive rounding noise: 6.9999999 is 7
    b_high = max(b_low, math.ceil(b_relaxed - 1e-6))
    # Round b both ways, then step down until something fits.
    for tries in [(b_low, b_high)] + [(b,) for b in range(b_low - 1, 0, -1)]:
        options = [d for b in set(tries) for d in _repairs(model, wl, b, r) if d.feasible]
        if options:
            return max(options, key=lambda d: (d.throughput, d.b))
    return _INFEASIBLE


def _repairs(model: CostModel, wl: Workload, b: int, r: float) -> list[Decision]:
    """Block-grid candidates for b sequences at relaxed ratio r: r rounded up to blocks, and the
    smallest uniform ratio that fits memory (never dearer when both fit: uniform fronts grow with r)."""
    out = [_decide(model, wl, _uniform_fronts(wl, b, r))]
    least = fronts_for(model, wl, b, "ratio")
    if least is not None:
        out.append(_decide(model, wl, least))
    return out


# ----- layer-level rules ----------------------------------------------------------------------
def paper_swap_s(k: float, l1: int, alpha: float, beta: float, layers: int) -> float:
    """Eq.6: seconds to swap in k tokens' KV for l1 of the model's layers (alpha per token,
    beta per transfer, both for all layers)."""
    return (alpha * k + beta) * l1 / layers


def paper_recompute_s(shape: ModelShape, flops: float, lengths: Sequence[int], r: float | Sequence[float],
                      l2: int) -> float:
    """Eq.7 as printed: seconds to recompute the fronts for l2 layers.

    Its per-layer terms (24h^2 t + 4h t^2 for t = s r front tokens) are scaled by l2 / L, whereas
    eq.8 scales the same terms by l2; read literally eq.7 undercounts by a factor of L. It also
    charges the LM head (2 t h V) for recomputed tokens, which need no logits.
    """
    h, L, V = shape.hidden, shape.layers, shape.vocab
    total = 0.0
    for s, ri in zip(lengths, _ratios(lengths, r)):
        t = s * ri
        total += (24 * h * h * t + 4 * h * t * t) * l2 / L + 2 * t * h * V
    return total / flops


def kernel_work(shape: ModelShape, lengths: Sequence[int], r: float | Sequence[float], l1: int,
                l2: int) -> tuple[float, float]:
    """Eqs 8 and 9: FLOPs of the recompute kernel K1 (fronts over l2 layers) and of the decode
    kernel K2 (one token per request over the l1 + l2 layers of this pass). Eq.9 keeps eq.3's
    logits per context token."""
    h, V = shape.hidden, shape.vocab
    k1 = k2 = 0.0
    for s, ri in zip(lengths, _ratios(lengths, r)):
        t = s * ri
        k1 += 24 * h * h * l2 * t + 4 * h * l2 * t * t + 2 * h * V * t
        k2 += 24 * h * h * (l1 + l2) + 4 * h * (l1 + l2) * (s + 1) + 2 * h * V * s
    return k1, k2


def choose_overlap(t_swap: Callable[[int], float], t_rec: Callable[[int], float]) -> tuple[int, int]:
    """(l1, l2): swap l1 in {1, 2, 3} layers while recomputing l2 in {1, 2} so that the two take
    as nearly the same time as possible (neither waits for the other). Ties go to the first in
    (l1, l2) order."""
    configs = [(l1, l2) for l1 in (1, 2, 3) for l2 in (1, 2)]
    return min(configs, key=lambda c: abs(t_swap(c[0]) - t_rec(c[1])))


def thread_split(v_k1: float, v_k2: float, total: int = 1024) -> int:
    """Threads of a block given to the recompute kernel K1 (the rest, total - delta, to the
    decode kernel K2), in the ratio of their work, both multiples of a 32-thread warp and each at
    least one warp."""
    if total < 64 or total % 32:
        raise ValueError(f"total threads must be a multiple of 32 and >= 64, got {total}")
    work = v_k1 + v_k2
    share = 0.5 if work <= 0 else v_k1 / work
    delta = round(share * total / 32) * 32
    return min(max(delta, 32), total - 32)


def _layers_s(n: int, per_layer: float) -> float:
    """n layers at per_layer seconds each; 0 layers cost 0 even at an infinite rate."""
    return n * per_layer if n else 0.0


def choose_boundary(rec_per_layer_s: float, swap_per_layer_s: float, layers: int, overlap: bool) -> int:
    """Front layers to recompute, l_R in [0, layers]; the rest are read from the swap space.

    Recomputed layers must be a prefix: recomputing layer l needs the front's hidden state out of
    every layer before it. Without overlap (a CPU, where copies and compute share the cores) the
    cost l_R rec + (L - l_R) swap is linear in l_R, so an endpoint wins (ties: 0, read everything).
    With overlap (a GPU copy engine beside the compute) the cost is max(l_R rec, (L - l_R) swap):
    take the most balanced l_R (ties: the smaller).
    """
    if layers <= 0:
        return 0
    if not overlap:
        return layers if rec_per_layer_s < swap_per_layer_s else 0
    return min(range(layers + 1),
               key=lambda n: max(_layers_s(n, rec_per_layer_s), _layers_s(layers - n, swap_per_layer_s)))
