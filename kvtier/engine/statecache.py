"""The engine's link to the tiered store: save every request's state, restore it on return.

Saving: the runner's capture callback hands each computed token's layer inputs and pre-RoPE K/V
to a per-request buffer; whenever a buffer crosses a chunk boundary (and at the end of the
request, for the partial tail) a host snapshot goes to the store's background writer.
Restoring: when a waiting request's stored prefix goes beyond what the device prefix cache holds,
the planner picks a method and a background thread runs the executor into the request's blocks
while the step loop keeps serving other requests (the RESTORING phase).
Look-ahead (CachedAttention §3.3): chunks that queued requests will need are prefetched into the
memory tier, and eviction skips the chunks inside the look-ahead window.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from kvtier.engine.config import ReuseConfig
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sessions import SessionRetention
from kvtier.models.loading import LoadedModel
from kvtier.restore.executor import Executor, RestoreMiss
from kvtier.restore.glue import links, model_shape, namespace
from kvtier.restore.plan import Method, Plan
from kvtier.restore.planner import Chunk, Planner, TierLink
from kvtier.restore.profile import HardwareProfile, TierRates
from kvtier.store import PrefixMatch, Repr, TieredStore
from kvtier.store.lookahead import LookAheadPolicy
from kvtier.store.spec import StoreSpec, parse_spec

log = logging.getLogger(__name__)

@dataclass
class _SaveBuffer:
    start: int  # first position held
    h: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][piece] -> [tokens, hidden]
    k: list[list[torch.Tensor]] = field(default_factory=list)
    v: list[list[torch.Tensor]] = field(default_factory=list)
    tokens: int = 0


@dataclass
class _Job:
    req: Request
    plan: Plan
    future: Future
    by_tier: dict[str, int]
    aborted: bool = False
    debt: int = 0  # restore compute (prefill-token equivalents) not yet charged to a step budget


class StateCache:
    def __init__(self, model: LoadedModel, runner: ModelRunner, store_spec: str, profile: HardwareProfile,
                 config: ReuseConfig, policy: str = "lru"):
        self.model = model
        self.runner = runner
        self.config = config
        self.profile = profile
        self.layout = self._choose_layout(parse_spec(store_spec))
        self.store = TieredStore.open(store_spec, namespace(model, self.layout, config.storage_dtype),
                                      chunk_tokens=config.chunk_tokens, policy=policy)
        self.planner = Planner(profile, model_shape(model, config.storage_dtype), links(self.store, profile))
        self.executor = Executor(runner)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-restore")
        self.jobs: dict[str, _Job] = {}
        self.buffers: dict[str, _SaveBuffer] = {}
        self.lookahead = self._tier_policies() if config.lookahead else []
        self.counters = dict(restores=0, restore_failures=0, restored_tokens=0, saves=0, prefetches=0,
                             restore_tokens_charged=0, sessions_expired=0)
        self.reused_by_method: dict[str, int] = {}
        self.sessions = SessionRetention(config.session_ttl_s) if config.session_ttl_s else None
        self._next_expiry = 0.0
        self.tier_tokens: dict[str, int] = {}  # restored tokens by the tier they were read from

    # ----- which representation to store ------------------------------------------------------
    def _choose_layout(self, spec: StoreSpec) -> tuple[Repr, ...]:
        n = self.model.config.num_layers
        m = self.config.method
        if m == "hidden":
            return (Repr.HIDDEN,) * n
        if m in ("kv", "cake", "recompute"):
            return (Repr.KV,) * n
        # Decide once, for a typical 1024-token history on the slowest tier of the stack, whether a
        # bubble-free partition beats plain KV loading; the saving side then stores that layout.
        tiers = [(name, t) for name, t in (("memory", spec.memory), ("disk", spec.disk), ("redis", spec.redis)) if t]
        name, tier = tiers[-1]
        rates = self.profile.tiers.get(name) or next(iter(self.profile.tiers.values()), TierRates(1e9, 1e9, 1e-5))
        probe = Planner(self.profile, model_shape(self.model, self.config.storage_dtype),
                        {name: TierLink(rates, tier.emulation.bandwidth, tier.emulation.latency)})
        c = self.config.chunk_tokens
        chunks = [Chunk(a, a + c, name) for a in range(0, 1024, c)]
        partition = probe.partition(chunks)
        if m == "bubblefree":
            return partition
        kv = probe.plan(Method.KV, chunks, 64).predicted_s
        bf = probe.plan(Method.BUBBLEFREE, chunks, 64, partition).predicted_s
        return partition if bf < kv else (Repr.KV,) * n

    def _tier_policies(self) -> list[LookAheadPolicy]:
        """Wrap every tier's eviction policy so the look-ahead window can steer it."""
        out = []
        for t in self.store.tiers:
            if hasattr(t, "policy") and t.policy is not None:
                t.policy = LookAheadPolicy(t.policy)
                out.append(t.policy)
            for d in getattr(t, "dirs", []):
                d.policy = LookAheadPolicy(d.policy)
                out.append(d.policy)
        return out

    # ----- restoring ------------------------------------------------------------------------------
    def probe(self, req: Request) -> tuple[int, int, PrefixMatch | None]:
        """-> (tokens the store should restore, 0 if not worth it; device tokens to keep; match).

        Restoring is capped so one prompt token is left to compute. When saving, device-cached
        tokens beyond what the store holds are not kept, so their state gets captured."""
        if req.kept is not None:  # truncated: restore the kept tokens of the original context
            match = self.store.lookup(req.source_ids)
            target = min(bisect.bisect_left(req.kept, match.num_tokens), req.num_tokens - 1)
            return (target if target >= self.config.min_restore_tokens else 0), req.num_computed, match
        match = self.store.lookup(req.all_ids)
        fill = self.config.save and self.config.fill_holes
        if fill and match.num_tokens < req.num_computed and not self.store.writer.idle:
            # The missing part is most likely still in the writer queue (the previous turn ended
            # a moment ago): let it land, within a bound, rather than recompute device-cached tokens.
            self.store.flush(timeout=self.config.flush_wait_s)
            match = self.store.lookup(req.all_ids)
        keep = min(req.num_computed, match.num_tokens) if fill else req.num_computed
        usable = [c for c in match.chunks if c.end <= req.num_tokens - 1]
        end = usable[-1].end if usable else 0
        if end - keep < self.config.min_restore_tokens:
            return 0, keep, None
        return end, keep, match

    def start(self, req: Request, target: int, match: PrefixMatch) -> None:
        """Run the restore of [num_computed, target) into req.block_ids on the restore thread."""
        if req.kept is not None:
            plan = Plan(Method.KV, self.layout, target, (), 0.0, 0.0)
            source = req.kept[:target]
            by_tier: dict[str, int] = {}
            for c in match.chunks:
                n = bisect.bisect_left(source, c.end) - bisect.bisect_left(source, c.start)
                by_tier[c.tier] = by_tier.get(c.tier, 0) + n
            fut = self._pool.submit(self._run_remapped, match, source, list(req.block_ids))
            self.jobs[req.request_id] = _Job(req, plan, fut, by_tier, debt=self._placement_tokens(target))
            return
        chunks = [c for c in match.chunks if c.end <= target]
        planner_chunks = [Chunk(c.start, c.end, c.tier) for c in chunks]
        new = req.num_tokens - target
        m = self.config.method
        # The methods the stored layout allows: all-KV state can be loaded layer by layer or raced
        # against front compute (Cake); a partitioned layout only as the partition it is.
        layouts = {Method.KV: self.layout, Method.CAKE: self.layout} if all(r is Repr.KV for r in self.layout) else \
            {Method.BUBBLEFREE: self.layout} if m != "hidden" else {Method.HIDDEN: self.layout}
        if m == "recompute":
            plan = self.planner.plan(Method.RECOMPUTE, planner_chunks, new)
        elif m == "auto":
            plan = self.planner.choose(planner_chunks, new, layouts)
        elif m == "cake":
            plan = self.planner.plan(Method.CAKE, planner_chunks, new)
        else:
            method, layout = next(iter(layouts.items()))
            plan = self.planner.plan(method, planner_chunks, new, layout)
        by_tier: dict[str, int] = {}
        for c in chunks:
            if c.end > req.num_computed:
                by_tier[c.tier] = by_tier.get(c.tier, 0) + c.end - max(c.start, req.num_computed)
        restricted = PrefixMatch(tuple(chunks), target)
        fut = self._pool.submit(self._run, plan, restricted, list(req.all_ids), list(req.block_ids), req.num_computed)
        debt = 0 if plan.method is Method.RECOMPUTE else plan.compute_tokens  # recompute is prefilled in the step
        self.jobs[req.request_id] = _Job(req, plan, fut, by_tier, debt=debt)

    def _placement_tokens(self, tokens: int) -> int:
        """Prefill-token equivalents of placing (KV) or projecting (hidden) `tokens` in every layer."""
        p = self.profile
        per_token = sum(p.place_s if r is Repr.KV else p.project_s for r in self.layout)
        return int(per_token * tokens / p.prefill_a) if p.prefill_a > 0 else 0

    def charge(self, budget: int) -> int:
        """Scheduler hook: pay restore compute out of this step's token budget, oldest job first."""
        taken = 0
        for job in self.jobs.values():
            pay = min(job.debt, budget - taken)
            job.debt -= pay
            taken += pay
        self.counters["restore_tokens_charged"] += taken
        return taken

    def _run(self, plan: Plan, match: PrefixMatch, ids: list[int], blocks: list[int], start: int) -> float | None:
        """Seconds the restore itself took (not counting the wait for the step loop), None if it failed."""
        if plan.method is Method.RECOMPUTE:
            return None  # recompute = ordinary prefill in the step loop (shares the token budget)
        try:
            with torch.inference_mode():
                return self.executor.restore_history(plan, self.store, match, ids, blocks, start).seconds
        except RestoreMiss as e:
            log.warning("restore failed (%s); recomputing", e)
            return None

    def _run_remapped(self, match: PrefixMatch, source: list[int], blocks: list[int]) -> float | None:
        try:
            return self.executor.restore_remapped(self.layout, self.store, match, source, blocks).seconds
        except RestoreMiss as e:
            log.warning("truncated restore failed (%s); recomputing", e)
            return None

    def poll(self) -> list[tuple[Request, bool, int, bool]]:
        """Finished restores: (request, succeeded, restored tokens, aborted meanwhile)."""
        done = []
        for rid, job in list(self.jobs.items()):
            if not job.future.done():
                continue
            del self.jobs[rid]
            seconds = job.future.result()
            ok = seconds is not None
            tokens = job.plan.history_tokens if ok else 0
            if ok:
                self.counters["restores"] += 1
                gained = sum(job.by_tier.values())
                self.counters["restored_tokens"] += gained
                self.reused_by_method[job.plan.method.value] = self.reused_by_method.get(job.plan.method.value, 0) + gained
                for t, n in job.by_tier.items():
                    self.tier_tokens[t] = self.tier_tokens.get(t, 0) + n
                    job.req.metrics.reused_by_tier[t] = job.req.metrics.reused_by_tier.get(t, 0) + n
                job.req.metrics.restore_method = job.plan.method.value
                if job.plan.predicted_s > 0:  # the restore's own time: waiting for the step loop is not its cost
                    self.planner.observe(job.plan.method, job.plan.predicted_s, seconds)
            elif job.plan.method is not Method.RECOMPUTE:
                self.counters["restore_failures"] += 1
            done.append((job.req, ok, tokens, job.aborted))
        return done

    def wait_any(self, timeout: float) -> None:
        """Block (without holding the GIL) until a restore finishes or `timeout` passes."""
        if self.jobs:
            wait([j.future for j in self.jobs.values()], timeout=timeout, return_when=FIRST_COMPLETED)

    def abort(self, request_id: str) -> bool:
        """Mark a restoring request aborted; its blocks are released when the restore thread is done."""
        job = self.jobs.get(request_id)
        if job is not None:
            job.aborted = True
        return job is not None

    # ----- saving -------------------------------------------------------------------------------
    def capture_for(self, reqs: Sequence[Request]):
        """The runner callback for one step: collect h/K/V of tokens of saving requests."""
        bufs: list[_SaveBuffer | None] = []
        for r in reqs:
            if r.kept is not None:  # approximate state: never saved as if it were exact
                bufs.append(None)
                continue
            b = self.buffers.get(r.request_id)
            if b is None:
                b = self.buffers[r.request_id] = _SaveBuffer(r.num_computed)
            if b.start + b.tokens != r.num_computed:  # a gap (preemption): start over from here
                b = self.buffers[r.request_id] = _SaveBuffer(r.num_computed)
            bufs.append(b)
        n = self.model.config.num_layers

        def capture(layer: int, i: int, h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            b = bufs[i]
            if b is None:
                return
            if not b.h:
                b.h, b.k, b.v = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
            r = self.layout[layer]
            if r is Repr.HIDDEN:
                b.h[layer].append(h)
            elif r is Repr.KV:
                b.k[layer].append(k)
                b.v[layer].append(v)
            if layer == n - 1:
                b.tokens += h.shape[0]

        return capture

    def after_step(self, req: Request, finished: bool) -> None:
        """Hand full chunks (or, at the end, everything) of the request's buffer to the writer."""
        b = self.buffers.get(req.request_id)
        if b is None or not b.tokens:
            if finished:
                self.buffers.pop(req.request_id, None)
            return
        end = b.start + b.tokens
        c = self.config.chunk_tokens
        cut = end if finished else (end // c) * c
        if cut > b.start:
            self._save(req, b, cut)
        if finished:
            self.buffers.pop(req.request_id, None)

    def _save(self, req: Request, b: _SaveBuffer, cut: int) -> None:
        take = cut - b.start
        n = self.model.config.num_layers
        def stack(parts: list[list[torch.Tensor]], layers: list[int]) -> torch.Tensor | None:
            if not layers:
                return None
            whole = [torch.cat(parts[li]) for li in layers]  # [tokens held, ...] per layer
            rest = [w[take:] for w in whole]
            for li, r in zip(layers, rest):
                parts[li] = [r] if r.shape[0] else []
            return torch.stack([w[:take] for w in whole])  # [layers, take, ...] a fresh host copy
        kv_layers = [li for li in range(n) if self.layout[li] is Repr.KV]
        h_layers = [li for li in range(n) if self.layout[li] is Repr.HIDDEN]
        k, v, h = stack(b.k, kv_layers), stack(b.v, kv_layers), stack(b.h, h_layers)
        self.store.save(req.all_ids[:cut], b.start, k, v, h)
        self.counters["saves"] += 1
        b.start, b.tokens = cut, b.tokens - take

    def drop(self, request_id: str) -> None:
        self.buffers.pop(request_id, None)

    # ----- per-session retention --------------------------------------------------------------------
    def session_arrived(self, req: Request) -> None:
        # The prompt's chunks count as the session's from arrival on, so a chunk this request is
        # about to restore is not deleted under it because another session that saved it expired.
        if self.sessions is not None and req.session_id is not None:
            self.sessions.arrived(req.session_id, self.store.keys_for(req.all_ids), time.monotonic())

    def session_finished(self, req: Request) -> None:
        """A request ended (any reason): what it saved belongs to its session."""
        if self.sessions is not None and req.session_id is not None:
            saved = self.store.keys_for(req.all_ids[: req.num_computed]) if req.kept is None else []
            self.sessions.finished(req.session_id, saved, time.monotonic())

    def expire_sessions(self, now: float | None = None) -> int:
        """Delete the state of sessions idle past the TTL (checked at most once a second). -> chunks removed."""
        if self.sessions is None:
            return 0
        now = time.monotonic() if now is None else now
        if now < self._next_expiry:
            return 0
        self._next_expiry = now + min(1.0, self.sessions.ttl_s)
        gone, keys = self.sessions.expire(now)
        if not gone:
            return 0
        n = self.store.discard(keys)
        self.counters["sessions_expired"] += len(gone)
        log.info("expired %d idle session(s): removed %d stored chunks", len(gone), n)
        return n

    # ----- look-ahead ----------------------------------------------------------------------------
    def look_ahead(self, waiting: Sequence[Request]) -> None:
        """Prefetch into memory what the next queued requests need; protect it from eviction."""
        if not self.config.lookahead or self.store.memory is None or not waiting:
            return
        mem = self.store.memory
        free = max(mem.capacity - mem.used, 0)
        next_use: dict[str, int] = {}
        sizes = []
        matches = []
        for pos, req in enumerate(waiting):
            match = self.store.lookup(req.all_ids)
            matches.append(match)
            size = sum(c.nbytes for c in match.chunks)
            if size:
                sizes.append(size)
            for c in match.chunks:
                next_use.setdefault(c.key, pos)
        # CachedAttention §3.3: window length = free memory capacity / mean state size.
        mean = sum(sizes) / len(sizes) if sizes else 1
        window_len = max(1, int(free // max(mean, 1)))
        window = {c.key for m in matches[:window_len] for c in m.chunks}
        for p in self.lookahead:
            p.set_future(next_use, window)
        for m in matches[:window_len]:
            for c in m.chunks:
                if c.tier != "memory" and self.store.prefetch(c):
                    self.counters["prefetches"] += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.store.close()

