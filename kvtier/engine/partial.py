"""Partial token-wise KV caching (eLLM, EuroSys'26): under memory pressure a decoding request keeps
KV only for its newest tokens; its uncached front comes back in every decode step, recomputed
from its ids in the same batch as the decodes (one pass over the weights serves both) or read from
a host swap space, and is dropped after the step.

`PartialCaching` is the scheduler's front policy (b and every front, from the optimizer in
`kvtier/planning/optimizer.py` or a fixed ratio) and the engine's source of each step's front runs and front feed.
A causal prefix depends on nothing after it, so a recomputed front is exact: the tokens generated
equal those of a fully cached request (tests/test_partial.py).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from kvtier.engine.config import PartialConfig
from kvtier.engine.request import Request
from kvtier.engine.runner.model_runner import ContextFeed, ModelRunner, RunItem
from kvtier.engine.scheduler_api import FeedPlan, FeedPolicy, NoFeeds
from kvtier.planning import optimizer

RESIDUAL_WEIGHT = 0.05  # the residual's moving average spans about the last 20 decode steps


@dataclass
class PartialStats:
    """What partial caching did: totals, and the latest step's values (for /metrics and benches)."""

    steps: int = 0  # steps with a decode
    front_steps: int = 0  # of which some decode had a front
    recomputed_tokens: int = 0  # front tokens recomputed (all their recomputed layers), summed over steps
    swapped_tokens: int = 0  # front tokens read from the swap space, summed over steps
    slo_misses: int = 0  # decode steps slower than the TPOT SLO
    solves: int = 0
    solve_s: float = 0.0
    last_b: int = 0  # decodes in the latest step
    last_ratio: float = 0.0  # their uncached share: sum of fronts / sum of lengths
    last_boundary: int = 0  # front layers recomputed in the latest step (the rest were read)
    last_predicted_s: float = 0.0
    last_step_s: float = 0.0
    # Recent decode steps' mean excess over the cost model: the engine's own work (scheduling,
    # sampling) and the prefill chunks that share steps with decodes. The SLO is on the mean time
    # per output token, so the optimiser plans against the model plus this.
    step_residual_s: float = 0.0
    # per step: (time, decodes, uncached share, front tokens, boundary, seconds)
    history: list[tuple[float, int, float, int, int, float]] = field(default_factory=list)


class FrontSwap:
    """Host memory holding fronts that left the pool: per request K (rotated) and V of every layer
    for positions [0, front). The paper's host swap space; on a CPU it is the same DRAM as the
    pool, so its capacity is a budget, not physics. Reads can be throttled to emulate a slower tier."""

    def __init__(self, capacity_bytes: int, bandwidth: float | None = None):
        self.capacity = capacity_bytes
        self.bandwidth = bandwidth
        self.k: dict[str, torch.Tensor] = {}  # [layers, tokens, kv_heads, hd]
        self.v: dict[str, torch.Tensor] = {}
        self.used = 0

    def held(self, rid: str) -> int:
        k = self.k.get(rid)
        return 0 if k is None else k.shape[1]

    def room(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.capacity

    def append(self, rid: str, k: torch.Tensor, v: torch.Tensor) -> None:
        """Add the next positions of a request's front (k/v: [layers, n, kv_heads, hd])."""
        if rid in self.k:
            k, v = torch.cat([self.k[rid], k], 1), torch.cat([self.v[rid], v], 1)
            self.used -= self.k[rid].nbytes + self.v[rid].nbytes
        self.k[rid], self.v[rid] = k, v
        self.used += k.nbytes + v.nbytes

    def drop(self, rid: str) -> None:
        k, v = self.k.pop(rid, None), self.v.pop(rid, None)
        if k is not None and v is not None:
            self.used -= k.nbytes + v.nbytes

    def feed(self, rids: Sequence[str], boundary: int, device: torch.device) -> ContextFeed:
        """Layers >= boundary of these requests' fronts, back to back in `rids` order, on `device`.
        On CUDA this copy is synchronous for now; a copy stream ahead of the layers (as restores
        do) is where the paper's swap/compute overlap would go."""

        def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
            k = torch.cat([self.k[r][layer] for r in rids])  # [sum of fronts, kv_heads, hd]
            v = torch.cat([self.v[r][layer] for r in rids])
            if self.bandwidth is not None:  # emulated tier: the read takes bytes / bandwidth
                time.sleep((k.nbytes + v.nbytes) / self.bandwidth)
            return k.to(device, non_blocking=True), v.to(device, non_blocking=True)

        return ContextFeed(boundary, kv)


@dataclass(frozen=True)
class StepFronts:
    """One step's fronts as the runner takes them: front runs to append, and the feed."""

    runs: tuple[RunItem, ...]
    feed: ContextFeed | None
    boundary: int
    front_tokens: int


class Fronts(FeedPolicy, Protocol):
    """The front policy as the engine sees it: the scheduler's half (FeedPolicy: the cap and each
    decode's front) and the step's half (front runs and feed, the step's time, summaries)."""

    def step_fronts(self, items: Sequence[RunItem], reqs: Sequence[Request]) -> StepFronts: ...

    def observe(self, seconds: float) -> None: ...

    def forget(self, rid: str) -> None: ...

    def summary(self) -> dict[str, float] | None: ...


NO_FRONTS = StepFronts((), None, 0, 0)


class FullCaching(NoFeeds):
    """Partial caching off: every running request keeps all its KV (the null Fronts)."""

    def step_fronts(self, items: Sequence[RunItem], reqs: Sequence[Request]) -> StepFronts:
        return NO_FRONTS

    def observe(self, seconds: float) -> None:
        pass

    def forget(self, rid: str) -> None:
        pass

    def summary(self) -> dict[str, float] | None:
        return None


class PartialCaching:
    """The scheduler's front policy and the engine's source of front runs."""

    def __init__(self, cfg: PartialConfig, runner: ModelRunner, cost: optimizer.ProfileCostModel):
        self.cfg = cfg
        self.runner = runner
        self.block_size = runner.block_size
        self.layers = runner.model.cfg.num_layers
        self.swap = FrontSwap(cfg.swap_bytes, cfg.swap_bandwidth) if cfg.swap_bytes else None
        # Without a swap space every front is recomputed: the optimiser must not price a read.
        self.cost = cost if self.swap is not None else replace(cost, w=None)
        if self.swap is not None and cfg.swap_bandwidth is not None and cost.w is not None:
            # an emulated tier: the read also waits bytes / bandwidth per front token (all layers)
            per_token = 2 * self.layers * runner.k_cache[0, 0].nbytes
            self.cost = replace(cost, w=cost.w + per_token / cfg.swap_bandwidth)
        self.stats = PartialStats()
        self._t0 = time.perf_counter()
        # the step being executed: its decodes' (length, front) and fronts, until observe()
        self._inflight: tuple[list[tuple[int, int]], StepFronts] | None = None

    # ----- the scheduler's side ---------------------------------------------------------------
    def plan(self, decoding: Sequence[Request], waiting: Sequence[Request], capacity_blocks: int) -> FeedPlan:
        bs = self.block_size
        if self.cfg.policy == "fixed":
            fronts = {r.request_id: int(self.cfg.ratio * r.num_tokens) // bs * bs for r in decoding}
            return FeedPlan(cap=1 << 30, fed=fronts, recompute_tokens=self._recomputed(decoding, fronts))
        # FCFS: the running decodes, then the queue (admitted in full: a prompt has no front).
        slo = self.cfg.tpot_slo_s * self.cfg.slo_headroom if self.cfg.tpot_slo_s is not None else None
        cands = list(decoding) + list(waiting)[: max(0, 4 * len(decoding) + 8)]
        most = tuple(((r.num_tokens - 1) // bs * bs if i < len(decoding) and not r.approximate else 0)
                     for i, r in enumerate(cands))
        wl = optimizer.Workload(lengths=tuple(r.num_tokens for r in cands), capacity_blocks=capacity_blocks,
                               block_size=bs, slo_s=slo, max_fronts=most)
        t = time.perf_counter()
        d = self._solve(wl)
        if wl.slo_s is not None and (not d.feasible or d.b < len(decoding)):
            # The SLO alone would stop running decodes, or no b meets it: keep the running ones
            # (a preempted request pays its prefill again and waits) with the fronts memory needs,
            # and admit nobody new (one request when none runs) until the steps are fast enough.
            keep = max(1, len(decoding))
            d = self._solve(replace(wl, lengths=wl.lengths[:keep], max_fronts=most[:keep], slo_s=None))
        self.stats.solves += 1
        self.stats.solve_s += time.perf_counter() - t
        if not d.feasible:  # not even one sequence fits: admit nobody; blocks run out -> preemption
            return FeedPlan(cap=len(decoding), fed={})
        self.stats.last_predicted_s = d.predicted_s
        # b below the running decodes: the scheduler preempts the latest (cheaper than their fronts)
        fronts = {r.request_id: u for r, u in zip(cands, d.fronts)}
        return FeedPlan(cap=d.b, fed=fronts, recompute_tokens=self._recomputed(decoding[: d.b], fronts))

    def _recomputed(self, decoding: Sequence[Request], fronts: dict[str, int]) -> int:
        """Front tokens this step will recompute: those the swap space cannot serve (a front
        that grows now is swapped out as it grows, if there is room)."""
        if self.swap is None:
            return sum(max(fronts.get(r.request_id, 0), r.fed) for r in decoding)
        return sum(r.fed for r in decoding if r.fed and self.swap.held(r.request_id) != r.fed)

    def planning_cost(self) -> optimizer.ProfileCostModel:
        """The cost model the optimiser solves with: the fitted one, its per-step term moved by the
        residual the engine's decode steps show."""
        return replace(self.cost, c0=max(0.0, self.cost.c0 + self.stats.step_residual_s))

    def _solve(self, wl: optimizer.Workload) -> optimizer.Decision:
        return optimizer.solve_enumerate(self.planning_cost(), wl)

    def release(self, req: Request, upto: int) -> None:
        """Copy positions [req.fed, upto) to the swap space while it has room (else the front
        is recomputed every step)."""
        if self.swap is None:
            return
        rid = req.request_id
        if self.swap.held(rid) != req.fed:  # stale (preempted and readmitted) or never swapped
            self.swap.drop(rid)
            if req.fed:
                return
        n = upto - req.fed
        slots = self.runner.slots(req.block_ids, 0, n)  # the first n slot positions are [front, upto)
        nbytes = 2 * self.layers * n * self.runner.k_cache[0, 0].nbytes
        if not self.swap.room(nbytes):
            self.swap.drop(rid)
            return
        slots = slots.to(self.runner.device)
        k, v = self.runner.k_cache[:, slots], self.runner.v_cache[:, slots]  # [layers, n, kv_heads, hd] copies
        if k.device.type != "cpu":  # host memory is the point: the device blocks are freed
            k, v = k.to("cpu").pin_memory(), v.to("cpu").pin_memory()
        self.swap.append(rid, k, v)

    def forget(self, rid: str) -> None:
        if self.swap is not None:
            self.swap.drop(rid)

    # ----- the engine's side ------------------------------------------------------------------
    def step_fronts(self, items: Sequence[RunItem], reqs: Sequence[Request]) -> StepFronts:
        """Front runs and feed for a step's items (decodes with fronts among them); the step is
        held until observe() reports its time."""
        fronts = self._fronts_for(items, reqs)
        dec = [(r.num_tokens, r.fed) for it, r in zip(items, reqs) if len(it.token_ids) == 1 and it.start > 0]
        self._inflight = (dec, fronts)
        return fronts

    def _fronts_for(self, items: Sequence[RunItem], reqs: Sequence[Request]) -> StepFronts:
        """Every front comes from the swap space when all are there and reading beats
        recomputing; otherwise the boundary (recomputed layers) follows the cost model."""
        fronted = [(i, r) for i, (it, r) in enumerate(zip(items, reqs)) if it.context_feed]
        tokens = sum(r.fed for _, r in fronted)
        if not fronted:
            return NO_FRONTS
        swapped = self.swap is not None and all(self.swap.held(r.request_id) == r.fed for _, r in fronted)
        rec = sum(self.cost.recompute_s(r.fed) for _, r in fronted) / self.layers
        read = sum(self.cost.swap_s(r.fed) for _, r in fronted) / self.layers if swapped else float("inf")
        boundary = optimizer.choose_boundary(rec, read, self.layers) if swapped else self.layers
        if swapped and self.cfg.recompute_layers is not None:
            boundary = min(self.cfg.recompute_layers, self.layers)
        runs = tuple(RunItem(r.all_ids[: r.fed], 0, (), want_logits=False, feeds=i)
                     for i, r in fronted) if boundary else ()
        feed = None
        if boundary < self.layers:
            assert self.swap is not None
            feed = self.swap.feed([r.request_id for _, r in fronted], boundary, self.runner.device)
        return StepFronts(runs, feed, boundary, tokens)

    def observe(self, seconds: float) -> None:
        """Account the step step_fronts() prepared; `seconds` is the whole engine step (schedule,
        forward, sampling), the time its decodes wait for their next token. Steps without a
        decode do not count toward the SLO."""
        inflight, self._inflight = self._inflight, None
        if inflight is None or not inflight[0]:
            return
        dec, fronts = inflight
        st = self.stats
        predicted = self.cost.base_s([n for n, _ in dec]) + sum(self.cost.front_s(n, u) for n, u in dec)
        st.step_residual_s += RESIDUAL_WEIGHT * (seconds - predicted - st.step_residual_s)
        st.steps += 1
        st.front_steps += bool(fronts.front_tokens)
        st.recomputed_tokens += fronts.front_tokens if fronts.boundary else 0
        st.swapped_tokens += fronts.front_tokens if fronts.boundary < self.layers and fronts.front_tokens else 0
        slo = self.cfg.tpot_slo_s
        st.slo_misses += slo is not None and seconds > slo
        st.last_b = len(dec)
        st.last_ratio = fronts.front_tokens / max(1, sum(n for n, _ in dec))
        st.last_boundary = fronts.boundary
        st.last_step_s = seconds
        st.history.append((time.perf_counter() - self._t0, len(dec), st.last_ratio, fronts.front_tokens,
                           fronts.boundary, seconds))
        if len(st.history) > 100_000:
            del st.history[: len(st.history) // 2]

    def summary(self) -> dict[str, float]:
        st = self.stats
        return dict(steps=st.steps, front_steps=st.front_steps, recomputed_tokens=st.recomputed_tokens,
                    swapped_tokens=st.swapped_tokens, slo_misses=st.slo_misses, solves=st.solves,
                    solve_ms_mean=1e3 * st.solve_s / max(1, st.solves), last_b=st.last_b,
                    last_ratio=st.last_ratio, last_boundary=st.last_boundary,
                    step_residual_ms=1e3 * st.step_residual_s,
                    swap_bytes=self.swap.used if self.swap else 0)
