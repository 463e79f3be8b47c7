"""Restoring inside the engine: tickets in, ready restores out, each placed by its request's step.

`offer` looks a request up and plans its restore (a frozen `RestoreOrder`); the scheduler decides
(a `RestoreTicket`), and `start` prepares it on the restore worker while the step loop serves everyone else (the RESTORING phase). Once its read
buffer is primed, `poll` hands the request back to the scheduler, whose next step computes its
new tokens; that step's `hook` places each layer of history just before the layer runs, and
`finish` closes the restore. A restore that fails before that is simply recomputed; one that fails
inside its step voids that request's result for the step (nothing computed on it is kept).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import torch

from kvtier.engine.config import ReuseConfig
from kvtier.engine.impress.policy import ImpressPolicy
from kvtier.engine.impress.restore import ImpressRestore
from kvtier.engine.link.stats import LinkStats
from kvtier.engine.request import Request, RestoreReport
from kvtier.engine.restore.blend import BlendRestore
from kvtier.engine.restore.job import RestoreJob
from kvtier.engine.restore.layerwise import Restore, RestoreMiss
from kvtier.engine.restore.segments import SegmentStates
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.engine.scheduler_api import RestoreDone, RestoreOrder, RestoreTicket, StoreOffer
from kvtier.engine.transient import TransientWorker
from kvtier.planning.blend import BlendMode, BlendOptions, BlendPlan, plan_blend
from kvtier.planning.costs import READ_GROUP_LAYERS
from kvtier.planning.plan import Method, Plan, PlannedChunk
from kvtier.planning.planner import Planner
from kvtier.store.layout import Repr
from kvtier.store.tiered import TieredStore

log = logging.getLogger(__name__)

# A blend reading this host's disks runs in its request's step (on the restore worker it would pay a
# second OpenMP team, docs/blend.md) where its reads are predicted to take at most INLINE_BLEND_READ_S,
# were none hidden under its recompute. In the step it waits at most INLINE_BLEND_WAIT_S for its reads
# in all (about what a blend's own recompute holds the step; twice the prediction, so a disk a little
# slower than its profile still blends); failed or slower reads make it a miss (a chunked prefill),
# and reads that were too slow send blends reading below the memory tier to the worker for
# INLINE_BLEND_BACKOFF_S (the profile overrated this disk, or it is busy).
INLINE_BLEND_READ_S = 0.25
INLINE_BLEND_WAIT_S = 0.5
INLINE_BLEND_BACKOFF_S = 60.0
# At close, how long the reads an in-step blend gave up on are waited for (a hung disk never ends them).
LINGERING_JOIN_S = 5.0


@dataclass
class _Job:
    req: Request
    order: RestoreOrder
    restore: RestoreJob
    future: Future
    debt: int  # background compute (prefill-token equivalents) not yet charged to a step budget
    started: float  # when the ticket was started (perf_counter)
    aborted: bool = False

    @property
    def plan(self) -> Plan:
        return self.order.plan


class Restorer:
    def __init__(self, store: TieredStore, runner: ModelRunner, planner: Planner, layout: Sequence[Repr],
                 config: ReuseConfig, stats: LinkStats, compute_chunk_tokens: int = 512) -> None:
        self.store, self.runner, self.planner = store, runner, planner
        self.layout = tuple(layout)
        self.config = config
        self.stats = stats
        self.compute_chunk_tokens = compute_chunk_tokens
        self.inline_blend_tokens = compute_chunk_tokens  # a blend recomputing at most this runs in its step
        self.jobs: dict[str, _Job] = {}  # preparing
        self.attached: dict[str, _Job] = {}  # ready: placed by their request's next step
        self.reused_by_method: dict[str, int] = {}
        self.reused_by_tier: dict[str, int] = {}
        self._worker = TransientWorker("kvtier-restore")  # its thread (and OpenMP team) only while restores run
        self._slow_reads_until = 0.0  # (monotonic) till then, blends reading below memory go to the worker
        self._lingering: list[threading.Thread] = []  # reads in-step blends gave up on, still running
        all_kv = all(r is Repr.KV for r in self.layout)
        # The methods the stored layout allows: all-KV state loads layer by layer or races compute
        # from the front (Cake); any other layout only as what it is.
        self.importance = ImpressPolicy.of(config.impress)
        if all_kv:
            self.allowed = {Method.KV: self.layout, Method.CAKE: self.layout}
            if config.allow_lossy:  # auto may weigh it against the exact methods
                self.allowed[Method.IMPRESS] = self.layout
        elif all(r is Repr.HIDDEN for r in self.layout):
            self.allowed = {Method.HIDDEN: self.layout, Method.BUBBLEFREE: self.layout}
        else:
            self.allowed = {Method.BUBBLEFREE: self.layout}
        # Blended restores load K/V or hidden states in every layer (none where a layer keeps nothing).
        self.segments = SegmentStates(store, runner, self.layout, config.save) if Repr.NONE not in self.layout else None

    # ----- the scheduler's side -----------------------------------------------------------------
    def offer(self, req: Request) -> StoreOffer:
        """Look the request up in the store (a lookup; never waits on the writer) and plan its
        restore. Restoring is capped so one prompt token is left to compute, and at the tokens the
        store's state matches (the chunk holding the cap is read whole and restored up to it). When filling holes,
        device-cached tokens beyond what the store holds are not kept, so their state is captured."""
        if req.blend is not None and req.segments and not req.output_ids and self.segments is not None:
            blended = self._offer_blend(req, req.blend)
            if blended is not None:
                return blended
        if self.config.fixed_method is Method.RECOMPUTE:
            return StoreOffer(0, req.num_computed)
        if req.kept is not None:
            return self._offer_truncated(req)
        match = self.store.lookup(req.all_ids, req.cache_salt)
        keep = min(req.num_computed, match.num_tokens) if self.config.save and self.config.fill_holes \
            else req.num_computed
        # The prompt's last token is always computed (it gives the logits); the store's state may
        # stop inside its last chunk (one reused in part).
        last = min(req.num_tokens - 1, match.num_tokens)
        # Chunks up to the last token, and the chunk holding it (a repeated prompt, or one reused in
        # part), read whole and restored up to it: not up to a chunk's worth recomputed.
        usable = [c for c in match.chunks if keep < c.end and c.start < last]
        end = min(usable[-1].end, last) if usable else 0
        whole = max((c.end for c in usable if c.end <= last), default=0)  # what a whole-chunk restore reaches
        if end - keep < self.config.min_restore_tokens:
            return StoreOffer(0, keep)
        new = req.num_tokens - end
        fixed = self.config.fixed_method
        # An importance restore reads whole chunks only (up to `whole`).
        importance = whole - keep >= self.config.min_restore_tokens
        if fixed is Method.IMPRESS:
            return self._offer_importance(req, match.chunks, whole) if importance else StoreOffer(0, keep)
        if fixed is None:
            # An importance restore reads the whole prefix: weighed only when the device holds none
            # of it (otherwise exact restores of the rest are both cheaper and exact).
            allowed = self.allowed if importance and keep == 0 else \
                {m: lay for m, lay in self.allowed.items() if m.exact}
            plan = self.planner.choose(usable, new, allowed, upto=end)
            if plan.method is Method.IMPRESS:
                return self._offer_importance(req, match.chunks, whole, plan.predicted_s)
        else:  # a method the stored layout cannot serve (e.g. cake over hidden states) reads it as stored
            method = fixed if fixed in self.allowed else next(iter(self.allowed))
            plan = self.planner.plan(method, usable, new, self.allowed[method], upto=end)
        if plan.method is Method.RECOMPUTE:
            return StoreOffer(0, keep)
        tiers: dict[str, int] = {}
        for c in usable:
            tiers[c.tier] = tiers.get(c.tier, 0) + min(c.end, end) - max(c.start, keep)
        order = RestoreOrder(plan, None, tiers)
        if self._instant(plan):
            return StoreOffer(end, keep, order, 0, instant=True, attach_tokens=plan.attach_tokens)
        return StoreOffer(end, keep, order, plan.background_tokens)

    def _offer_importance(self, req: Request, chunks: Sequence, end: int, predicted_s: float = 0.0) -> StoreOffer:
        """Restore the whole stored prefix [0, end) by importance (the device's copy of part of it
        is let go: the request's slots then hold only what each layer keeps). The restore computes
        every new token but the last, which the request's own step computes and samples from."""
        chunks = [c for c in chunks if c.end <= end]
        plan = Plan(Method.IMPRESS, self.layout, end,
                    tuple(PlannedChunk(c.key, c.start, c.end, c.tier, c.nbytes) for c in chunks), predicted_s, 0.0)
        tiers: dict[str, int] = {}
        for c in chunks:
            tiers[c.tier] = tiers.get(c.tier, 0) + c.end - c.start
        new = req.num_tokens - end
        return StoreOffer(req.num_tokens - 1, 0, RestoreOrder(plan, None, tiers), new, lossy=True,
                     dropped=end - self.importance.kept(end))

    def _offer_blend(self, req: Request, options: BlendOptions) -> StoreOffer | None:
        """Blend the prompt past its exact prefix (the device's, then the store's exact chain):
        its marked segments loaded at their positions, the rest recomputed by the restore, all
        but the last token, which the restore's last pass computes where it loads rows (its
        logits go to the request's step) and the step otherwise. None: no segment left to load."""
        keep, end = req.num_computed, req.num_tokens - 1
        match = self.store.lookup(req.all_ids, req.cache_salt)
        exact_end = min(match.num_tokens, end)
        chunks = [c for c in match.chunks if c.end > keep and c.start < exact_end] if exact_end > keep else []
        if not chunks:
            exact_end = keep
        blend = plan_blend(req.prompt_ids, req.segments, keep, exact_end, options)
        if blend is None:
            return None
        plan = Plan(Method.BLEND, self.layout, end,
                    tuple(PlannedChunk(c.key, c.start, c.end, c.tier, c.nbytes) for c in chunks), 0.0, 0.0,
                    background_tokens=blend.recomputed_tokens)
        tiers: dict[str, int] = {}
        for c in chunks:
            tiers[c.tier] = tiers.get(c.tier, 0) + min(c.end, exact_end) - max(c.start, keep)
        inline = self._inline_blend(blend, chunks, req.cache_salt)
        # Lossy even where every row is recomputed (an exact prefill's bits): of a blended request's
        # state, only its exact prefix and lead (`exact_upto`) are ever saved or published.
        return StoreOffer(end, keep, RestoreOrder(plan, None, tiers, blend), blend.recomputed_tokens, lossy=True,
                          exact_upto=blend.exact_upto, instant=inline,
                          attach_tokens=blend.recomputed_tokens if inline else 0)

    def _inline_blend(self, blend: BlendPlan, chunks: Sequence, salt: str) -> bool:
        """Whether a blend runs inside its request's step, on the step thread, charged to the
        step's budget like a prefill chunk (where it fits: the scheduler's check): one that
        recomputes no more than a compute chunk over state the memory tier holds, or that this
        host's disks give in at most INLINE_BLEND_READ_S at their predicted rate (the step waits
        for them at most INLINE_BLEND_WAIT_S: `BlendRestore`'s `read_wait_s`). A second thread's OpenMP
        team would slow each of its thousands of small ops (kvtier/engine/transient.py). On the
        restore worker: CacheBlend (its check runs layers over every loaded row), and a blend with
        a document to compute alone (a prefill's worth of work), or reading from Redis or more than
        a local disk gives in that time (a wait), or reading a disk while in-step reads were lately
        too slow (INLINE_BLEND_BACKOFF_S)."""
        if blend.options.mode is BlendMode.CACHEBLEND or blend.recomputed_tokens > self.inline_blend_tokens:
            return False
        assert self.segments is not None  # offer() blends only with segment states
        found = [self.segments.find(s.tokens, salt) for s in blend.segments]
        if any(m is None for m in found):
            return False
        tiers = {t.name: t for t in self.store.tiers}
        groups = -(-len(self.layout) // READ_GROUP_LAYERS)
        reads: dict[str, tuple[int, int]] = {}  # tier -> (bytes, read calls)
        # The loader reads a layer group of every document's chunks at once (a call per chunk and
        # group, as the profile counts them); the exact prefix's chunks are read whole, one call each.
        for c, calls in [(c, groups) for m in found if m is not None for c in m.chunks] + [(c, 1) for c in chunks]:
            tier = tiers[c.tier]
            if tier.zero_copy:
                continue
            if not tier.local_reads:
                return False
            n, k = reads.get(c.tier, (0, 0))
            reads[c.tier] = (n + c.nbytes, k + calls)
        if reads and time.monotonic() < self._slow_reads_until:
            return False
        return sum(self.planner.grouped_read_s(t, n, k) for t, (n, k) in reads.items()) <= INLINE_BLEND_READ_S

    def _instant(self, plan: Plan) -> bool:
        """A layer-wise plan over memory the store holds (views, no waiting) with no compute
        before the new tokens: nothing to wait for, so no RESTORING phase."""
        if plan.method is Method.CAKE or plan.recompute_layers:
            return False
        tiers = {t.name: t for t in self.store.tiers}
        return all(tiers[c.tier].zero_copy for c in plan.chunks)

    def _offer_truncated(self, req: Request) -> StoreOffer:
        """Kept tokens take new, compacted positions (CachedAttention §3.4): every chunk holding one
        of the first `target` kept tokens is read, its rows picked and K rotated by the shift."""
        if Repr.NONE in self.layout:
            return StoreOffer(0, req.num_computed)  # recomputed layers cannot be rebuilt at new positions
        assert req.source_ids is not None  # set together with `kept`
        match = self.store.lookup(req.source_ids, req.cache_salt)
        kept = req.kept or []
        target = min(bisect.bisect_left(kept, match.num_tokens), req.num_tokens - 1)
        if target < self.config.min_restore_tokens:
            return StoreOffer(0, req.num_computed)
        source = kept[:target]
        chunks = [c for c in match.chunks if c.end > source[0] and c.start <= source[-1]]
        method = Method.KV if all(r is Repr.KV for r in self.layout) else Method.BUBBLEFREE
        base = self.planner.plan(method, chunks, req.num_tokens - target, self.layout)
        plan = Plan(method, self.layout, target, base.chunks, base.predicted_s, base.ideal_s,
                    read_buffer_layers=len(self.layout), attach_tokens=base.attach_tokens)
        tiers: dict[str, int] = {}
        for c in chunks:
            tiers[c.tier] = tiers.get(c.tier, 0) + bisect.bisect_left(source, c.end) - bisect.bisect_left(source, c.start)
        return StoreOffer(target, req.num_computed, RestoreOrder(plan, tuple(source), tiers), 0)

    def charge(self, budget: int) -> int:
        """Pay restore compute out of this step's token budget, oldest job first."""
        taken = 0
        for job in self.jobs.values():
            if job.future.done():
                continue  # prepared: its compute is over
            pay = min(job.debt, budget - taken)
            job.debt -= pay
            taken += pay
        self.stats.restore_tokens_charged += taken
        return taken

    # ----- starting -------------------------------------------------------------------------
    def start(self, req: Request, ticket: RestoreTicket) -> None:
        """Start preparing a ticket's restore on the restore worker; an instant one is prepared
        here and placed by this very step (a failure then voids the request's result in it)."""
        order, started = ticket.order, time.perf_counter()
        restore = self._job_for(req, ticket)
        if ticket.instant:
            self.stats.restore_tokens_charged += order.plan.background_tokens  # an inline blend's, paid by this step
            done: Future = Future()
            try:
                restore.prepare()
                done.set_result(None)
            except RestoreMiss as e:
                done.set_exception(e)  # finish() raises it again: the step's result is void
            if isinstance(restore, BlendRestore):
                if restore.reads_too_slow:
                    self._slow_reads_until = time.monotonic() + INLINE_BLEND_BACKOFF_S
                    log.warning("a blend's reads took over %.2f s in its step: blends reading below memory run "
                                "on the restore worker for %.0f s", INLINE_BLEND_WAIT_S, INLINE_BLEND_BACKOFF_S)
                self._lingering = [t for t in self._lingering if t.is_alive()] + restore.lingering()
            self.attached[req.request_id] = _Job(req, order, restore, done, 0, started)
            return
        self.jobs[req.request_id] = _Job(req, order, restore, self._worker.submit(restore.prepare), ticket.debt,
                                         started)
        self.stats.restore_tokens_charged += order.plan.background_tokens - ticket.debt

    def _job_for(self, req: Request, ticket: RestoreTicket) -> RestoreJob:
        plan = ticket.order.plan
        if plan.method is Method.BLEND:
            assert ticket.order.blend is not None and self.segments is not None  # set by _offer_blend
            return BlendRestore(plan, ticket.order.blend, self.segments, self.store, self.runner, req.all_ids,
                                req.block_ids, req.cache_salt, self.compute_chunk_tokens,
                                in_step=ticket.instant, read_wait_s=INLINE_BLEND_WAIT_S if ticket.instant else None)
        if plan.method is Method.IMPRESS:
            return ImpressRestore(plan, self.importance, self.store, self.runner, req.all_ids, req.block_ids)
        return Restore(plan, self.store, self.runner, req.all_ids, req.block_ids, ticket.start, ticket.order.source,
                       self.compute_chunk_tokens)

    # ----- progress ---------------------------------------------------------------------------
    def poll(self) -> list[RestoreDone]:
        """Restores that left the RESTORING phase since the last poll."""
        done = []
        for rid, job in list(self.jobs.items()):
            if not job.future.done():
                continue
            failed = job.future.exception() is not None or job.aborted or job.restore.failed
            if not failed and not job.restore.ready():
                continue
            del self.jobs[rid]
            if failed:
                self._close(job, ok=False)
                done.append(RestoreDone(rid, None, {}, 0, job.aborted))
                continue
            self.attached[rid] = job
            placed = job.plan.history_tokens if job.restore.placed_to is None else job.restore.placed_to
            done.append(RestoreDone(rid, placed, job.order.tier_tokens, job.plan.attach_tokens, False))
        return done

    def hook(self, request_ids: Sequence[str]) -> Callable[[int], None] | None:
        """The runner's before_layer for a step: place layer l of every restore attached to it."""
        restores = [self.attached[r].restore for r in request_ids if r in self.attached]
        if not restores:
            return None

        def place(layer: int) -> None:
            for r in restores:
                r.place(layer)

        return place

    def given_logits(self, request_id: str, start: int) -> torch.Tensor | None:
        """The logits [1, vocab] of a request's token at `start` where the restore attached to its
        step computed that token (a blend folding the prompt's last token into its passes)."""
        job = self.attached.get(request_id)
        restore = job.restore if job is not None else None
        if isinstance(restore, BlendRestore) and restore.logits is not None and restore.blend.end == start:
            return restore.logits
        return None

    def finish(self, request_ids: Sequence[str]) -> dict[str, int]:
        """Close the restores placed by this step; -> {request: its restore's start} for those
        whose restore failed in it (they recompute from there)."""
        failed = {}
        for rid in request_ids:
            job = self.attached.pop(rid, None)
            if job is not None and not self._close(job, ok=True):
                failed[rid] = job.restore.start
        return failed

    def _close(self, job: _Job, ok: bool) -> bool:
        """Finish a restore; count it. -> whether it succeeded."""
        try:
            stats = job.restore.finish()
        except RestoreMiss as e:
            if not job.aborted:  # a silent fallback to recompute hid a GPU-only failure once: say why
                log.warning("restore of %s failed (%s); recomputing", job.req.request_id, e)
            stats, ok = None, False
        if not ok:
            if not job.aborted:
                self.stats.restore_failures += 1
            return False
        assert stats is not None  # ok: finish() returned them
        self.stats.restores += 1
        gained = sum(job.order.tier_tokens.values())
        self.stats.restored_tokens += gained
        method = job.plan.method.value
        self.reused_by_method[method] = self.reused_by_method.get(method, 0) + gained
        for tier, n in job.order.tier_tokens.items():
            self.reused_by_tier[tier] = self.reused_by_tier.get(tier, 0) + n
        seconds = time.perf_counter() - job.started
        tl = stats.timeline
        blended = job.restore.blended
        job.req.metrics.restore = RestoreReport(method, job.plan.describe_layout(), job.plan.predicted_s,
                                                job.plan.ideal_s, seconds, stats.bytes_read, stats.wait_s,
                                                tl.copy_s if tl else None, tl.compute_s if tl else None,
                                                tl.overlap if tl else None, stats.prefix_attended,
                                                stats.prepare_s + stats.place_s + stats.wait_s,
                                                blended.loaded if blended else None,
                                                blended.recomputed if blended else None)
        if blended is not None:
            self.stats.blended_tokens += blended.loaded
            self.stats.blend_recomputed_tokens += blended.recomputed
        if job.plan.predicted_s > 0:  # restore and the new tokens' step, as the plan predicted them
            self.planner.observe(job.plan.method, job.plan.predicted_s, seconds)
        chose = job.restore.chose
        if chose is not None and chose.chosen_share:
            self.planner.observe_importance(chose.chosen_share, chose.cheap_share)
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a restore of a request that is going away; True if one was in flight (its blocks
        are released once `poll` reports it)."""
        job = self.jobs.get(request_id)
        if job is not None:
            job.aborted = True
            job.restore.abort()
            return True
        job = self.attached.pop(request_id, None)
        if job is not None:  # ready but never placed (preempted or aborted): just close it
            job.aborted = True
            job.restore.abort()
            self._close(job, ok=False)
        return False

    def wait_any(self, timeout: float) -> None:
        """Block (without holding the GIL) until a restore may have become ready, or `timeout`."""
        pending = [j.future for j in self.jobs.values() if not j.future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        elif self.jobs:
            time.sleep(min(timeout, 0.001))  # prepared, waiting for the read buffer to fill

    def close(self) -> None:
        for rid in list(self.jobs) + list(self.attached):
            self.abort(rid)
        self._worker.shutdown(wait=True)
        for job in self.jobs.values():
            try:
                job.restore.finish()
            except RestoreMiss:
                pass
        self.jobs.clear()
        deadline = time.monotonic() + LINGERING_JOIN_S
        for t in self._lingering:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._lingering):
            log.warning("a read a blend gave up on has not ended after %.0f s: its thread is left to the process "
                        "(a daemon)", LINGERING_JOIN_S)
