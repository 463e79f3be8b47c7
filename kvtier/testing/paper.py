"""The eLLM paper's cost equations and solver (EuroSys'26, eqs 1-9), kept for the tests.

The engine plans partial caching with `kvtier.planning.optimizer` (a measured cost model, the exact
enumeration with water-filled fronts, and a CPU's no-overlap layer boundary). The tests check that
against the paper's own method, which lives here:

- `PaperShape` and `PaperCostModel`: the paper's FLOP model (eqs 1-5), literal or with its logit
  terms corrected.
- `RatioBlocks`, `solve_enumerate` / `fronts_for` with per_request="ratio": one uniform uncached
  ratio for every sequence, as the paper has it ("tokens" is the engine's water-filling).
- `solve_slsqp`: the paper's continuous relaxation over (b, r), solved by scipy SLSQP, then
  rounded and repaired.
- `paper_swap_s`, `paper_recompute_s`, `kernel_work`, `choose_overlap`, `thread_split` and
  `balanced_boundary`: the GPU layer-level rules (eqs 6-9), where swapping some layers overlaps
  recomputing others.

numpy here, scipy inside `solve_slsqp` (both from the `test` extra); never imported by the product.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.planning.optimizer import (
    INFEASIBLE,
    CostModel,
    Decision,
    FrontBlocks,
    Workload,
    decide,
    step_s,
)

PER_REQUEST = ("tokens", "ratio")


@dataclass(frozen=True)
class PaperShape:
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

    shape: PaperShape
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


# ----- one uniform ratio ----------------------------------------------------------------------
class RatioBlocks(FrontBlocks):
    """Front blocks ranked by j / s_i: the paper's one uncached ratio r for every sequence.

    A uniform r gives u_i = ceil(r s_i / bs) * bs: it takes block j exactly when j / s_i < r / bs.
    So the smallest r that frees n blocks takes the n smallest keys and every block tied with the
    n-th (`extra`); any r > 0 takes every first block.
    """

    def rank(self, i: int, j: int, cost: float) -> float:
        return j / self.wl.lengths[i]

    def extra(self) -> list[tuple[int, float]]:
        """Candidates whose key equals the largest selected key, as (sequence, cost). The uniform
        ratio that takes the n-th block takes them too (equal ratios round alike)."""
        if not self.low:
            return []
        kappa = -self.low[0][0]
        popped = []
        while self.high and self.high[0][0] == kappa:  # j/s is correctly rounded: equal ratios, equal floats
            popped.append(heapq.heappop(self.high))
        for item in popped:
            heapq.heappush(self.high, item)
        return [(i, cost) for _, _, i, cost in popped]


def _blocks(per_request: str) -> type[FrontBlocks]:
    if per_request not in PER_REQUEST:
        raise ValueError(f"per_request {per_request!r}: use one of {', '.join(PER_REQUEST)}")
    return RatioBlocks if per_request == "ratio" else FrontBlocks


def fronts_for(model: CostModel, wl: Workload, b: int, per_request: str = "tokens") -> tuple[int, ...] | None:
    """Fronts of the first b sequences that free just enough blocks: the cheapest blocks
    ("tokens", the engine's `optimizer.fronts_for`) or the smallest uniform ratio ("ratio"). None if
    even the largest fronts do not fit."""
    return _blocks(per_request).fronts_for(model, wl, b)


def solve_enumerate(model: CostModel, wl: Workload, per_request: str = "tokens") -> Decision:
    """`optimizer.solve_enumerate` ("tokens") or its uniform-ratio form ("ratio"): the best b with
    the smallest ratio that fits each."""
    return _blocks(per_request).solve(model, wl)


# ----- the paper's SLSQP -----------------------------------------------------------------------
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
        return INFEASIBLE
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
    return INFEASIBLE


def _repairs(model: CostModel, wl: Workload, b: int, r: float) -> list[Decision]:
    """Block-grid candidates for b sequences at relaxed ratio r: r rounded up to blocks, and the
    smallest uniform ratio that fits memory (never dearer when both fit: uniform fronts grow with r)."""
    out = [decide(model, wl, _uniform_fronts(wl, b, r))]
    least = fronts_for(model, wl, b, "ratio")
    if least is not None:
        out.append(decide(model, wl, least))
    return out


# ----- layer-level rules (GPU) ---------------------------------------------------------------
def paper_swap_s(k: float, l1: int, alpha: float, beta: float, layers: int) -> float:
    """Eq.6: seconds to swap in k tokens' KV for l1 of the model's layers (alpha per token,
    beta per transfer, both for all layers)."""
    return (alpha * k + beta) * l1 / layers


def paper_recompute_s(shape: PaperShape, flops: float, lengths: Sequence[int], r: float | Sequence[float],
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


def kernel_work(shape: PaperShape, lengths: Sequence[int], r: float | Sequence[float], l1: int,
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


def balanced_boundary(rec_per_layer_s: float, swap_per_layer_s: float, layers: int) -> int:
    """`optimizer.choose_boundary` with overlap (a GPU copy engine beside the compute): the cost is
    max(l_R rec, (L - l_R) swap), so take the most balanced l_R (ties: the smaller)."""
    if layers <= 0:
        return 0
    return min(range(layers + 1),
               key=lambda n: max(_layers_s(n, rec_per_layer_s), _layers_s(layers - n, swap_per_layer_s)))
