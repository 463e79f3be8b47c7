"""Continuous batching with a per-step token budget.

Each step: running decodes first (one token each), then running chunked prefills (a request whose
restore is ready computes its new tokens here, carrying the restore's placement cost), then the
compute of restores still preparing, then waiting requests fill what is left of the budget. A
waiting request whose stored prefix goes beyond the device prefix cache leaves the step as a
`RestoreTicket`: the caller starts it; nothing here does I/O beyond the store's lookup. When
blocks run out, the most recently arrived running request is preempted: its blocks are released
and it is recomputed later from its tokens (its full blocks usually survive in the device prefix
cache, so resuming is cheap).

Plain values only: ints, token ids, hashes. No torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.engine.block_pool import BlockPool, block_hashes
from kvtier.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request_id: str
    start: int  # first position computed this step
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class Probe:
    """What the store offers for a request: restore [keep, target) by `plan`, keeping the device's
    [0, keep); `compute_tokens` is the plan's compute before the new tokens can start."""

    target: int  # 0: nothing worth restoring (or the plan is to recompute)
    keep: int
    plan: Any = None  # a restore Plan (opaque here), handed on to the restore untouched
    compute_tokens: int = 0
    # Instant: nothing to wait for (views of memory, no compute before the new tokens), so the
    # new tokens run in this very step and the restore is placed layer by layer inside it.
    instant: bool = False
    tier_tokens: dict[str, int] = field(default_factory=dict)  # restored tokens by tier (instant only)
    attach_tokens: int = 0  # placement beside the new tokens, in prefill tokens (instant only)
    lossy: bool = False  # an importance-only restore: the request's state becomes approximate
    dropped: int = 0  # prefix tokens the restore leaves out of the pool (importance-only)


@dataclass(frozen=True)
class RestoreTicket:
    """Restore [start, target) of a request into its blocks by `plan`; its new tokens wait until
    the restore is ready. `debt`: compute tokens not yet paid out of a step's budget."""

    request_id: str
    start: int  # device-cached positions before this are kept and never written
    target: int
    plan: Any
    debt: int = 0
    instant: bool = False  # its new tokens are in the same step's chunks


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    restores: tuple[RestoreTicket, ...] = ()
    preempted: tuple[str, ...] = ()


@dataclass(frozen=True)
class FrontPlan:
    """One step's partial caching decision: at most `cap` running sequences, and the uncached front
    (positions, whole blocks) each decoding request should have at least."""

    cap: int
    fronts: dict[str, int] = field(default_factory=dict)
    # Front tokens recomputed this step (not read back): their compute shares the step's token
    # budget, after the decodes and before any prefill (else TTFT would pay for them).
    recompute_tokens: int = 0


class FrontPolicy(Protocol):
    """Partial token-wise caching (eLLM): decides the batch cap and the decodes' fronts."""

    def plan(self, decoding: Sequence[Request], waiting: Sequence[Request], capacity_blocks: int) -> FrontPlan: ...

    def release(self, req: Request, upto: int) -> None:
        """Positions [req.front, upto) leave the pool (their blocks are released right after):
        keep them elsewhere if the policy serves fronts from there."""
        ...


@dataclass(frozen=True)
class _Issued:
    ticket: RestoreTicket
    plan_paid: int


class StoreProbe(Protocol):
    """What the scheduler needs from the store side: a lookup and the restores' compute."""

    def probe(self, req: Request) -> Probe: ...

    def charge(self, budget: int) -> int:
        """Take up to `budget` tokens of this step for the compute of restores still preparing."""
        ...

    def abort(self, request_id: str) -> bool:
        """A request is preempted: stop any restore into its blocks before they are released."""
        ...


class Scheduler:
    def __init__(self, pool: BlockPool, max_batched_tokens: int, max_num_seqs: int, store: StoreProbe | None = None,
                 prefix_cache: bool = True, fronts: FrontPolicy | None = None):
        self.pool = pool
        self.fronts = fronts
        self.store = store
        self.prefix_cache = prefix_cache
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.restoring: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.restoring)

    # ----- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        decoding = [r for r in self.running if r.status == RequestStatus.DECODE]
        prefilling = [r for r in self.running if r.status == RequestStatus.PREFILL]
        cap, front_tokens = self.max_num_seqs, 0
        if self.fronts is not None:
            plan = self._plan_fronts(decoding, prefilling, preempted)
            cap, front_tokens = min(cap, plan.cap), plan.recompute_tokens
        scheduled: set[str] = set()
        charged = not front_tokens
        for i, req in enumerate(decoding + prefilling):
            if i == len(decoding) and not charged:
                budget, charged = self._charge_fronts(budget, front_tokens), True
            if budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, max(budget - req.attach_tokens, 1))
            while not self._grow(req, req.num_computed + n):
                # The most recently arrived request not already in this step (`req` itself at worst).
                victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req not in self.running:
                continue
            chunks.append(ScheduledChunk(req.request_id, req.num_computed, n))
            scheduled.add(req.request_id)
            budget -= n + req.attach_tokens
            req.attach_tokens = 0
        if not charged:
            budget = self._charge_fronts(budget, front_tokens)
        if self.store is not None and self.restoring:
            # Restores compute on the same cores (recomputed layers, Cake's front): their work
            # counts against the budget like a prefill that arrived before the queue.
            budget -= self.store.charge(max(budget, 0))
        tickets: list[RestoreTicket] = []
        while self.waiting and budget > 0 and len(self.running) + len(self.restoring) < cap:
            req = self.waiting[0]
            if req.request_id in preempted:
                break  # it just gave its blocks up for lack of room: not back in the same step
            instant = None
            if req.num_computed == 0:
                self._match_prefix(req)
                issued = self._try_restore(req, budget)
                if issued is not None:
                    budget -= issued.plan_paid
                    if not issued.ticket.instant:
                        tickets.append(issued.ticket)
                        continue
                    instant = issued.ticket
            n = min(req.num_tokens - req.num_computed, max(budget - req.attach_tokens, 1))
            if not self._grow(req, req.num_computed + n):
                # Wait for running requests to free blocks; hold nothing meanwhile.
                self.pool.release(req.block_ids)
                req.block_ids, req.num_computed, req.attach_tokens = [], 0, 0
                if instant is not None:  # probe the store again when it can run
                    req.restore_tried = False
                    req.metrics.forget_reuse()
                break
            self._admit(req, RequestStatus.PREFILL, self.running)
            chunks.append(ScheduledChunk(req.request_id, req.num_computed, n))
            if instant is not None:
                tickets.append(instant)
            budget -= n + req.attach_tokens
            req.attach_tokens = 0
        return SchedulerOutput(tuple(chunks), tuple(tickets), tuple(preempted))

    @staticmethod
    def _charge_fronts(budget: int, tokens: int) -> int:
        """Recomputed fronts take budget after the decodes and before prefills, at most half of
        what is left, so running prefills still advance."""
        return budget - min(tokens, max(budget, 0) // 2)

    def _plan_fronts(self, decoding: list[Request], prefilling: list[Request], preempted: list[str]) -> FrontPlan:
        """Ask the front policy for this step's cap and fronts; grow the decodes' fronts to them
        (releasing those blocks). Fronts only grow: a request keeps its front until it finishes
        or is preempted. Blocks that prefills and restores hold or still need are not offered.
        Decodes past the cap (FCFS: the latest arrivals) are preempted."""
        held = sum(-(-(r.num_tokens - r.dropped) // self.pool.block_size) for r in prefilling + self.restoring)
        assert self.fronts is not None
        plan = self.fronts.plan(decoding, list(self.waiting), max(self.pool.num_blocks - held, 0))
        for req in decoding[max(plan.cap, 1):][::-1]:
            self._preempt(req)
            preempted.append(req.request_id)
        bs = self.pool.block_size
        for req in decoding[: max(plan.cap, 1)]:
            want = min(plan.fronts.get(req.request_id, 0), (req.num_computed - 1) // bs * bs)
            if want <= req.front or req.approximate:
                continue
            self.fronts.release(req, want)
            n = (want - req.front) // bs
            self.pool.release(req.block_ids[:n])
            req.block_ids = req.block_ids[n:]
            req.front = want
        return plan

    def _admit(self, req: Request, status: RequestStatus, into: list[Request]) -> None:
        self.waiting.popleft()
        req.status = status
        req.metrics.first_scheduled = req.metrics.first_scheduled or time.perf_counter()
        into.append(req)

    def _try_restore(self, req: Request, budget: int) -> _Issued | None:
        """A ticket when the store holds more of `req`'s prefix than the device does. Its compute
        starts in this step: pay what the budget allows now, the rest in later steps."""
        if self.store is None or req.restore_tried:
            return None
        req.restore_tried = True
        probe = self.store.probe(req)
        if probe.keep < req.num_computed:
            # The store lacks part of what the device cache holds: recompute that part once, so
            # its state is captured and the stored chain of chunks has no hole.
            n = probe.keep // self.pool.block_size
            self.pool.release(req.block_ids[n:])
            req.block_ids = req.block_ids[:n]
            req.num_computed = n * self.pool.block_size
            req.metrics.forget_reuse()
            req.metrics.note_reuse("device", req.num_computed)
        if probe.target <= req.num_computed:
            return None
        req.restored_by_importance, req.dropped = probe.lossy, probe.dropped  # before growing: no slots for dropped
        if not self._grow(req, probe.target + 1):
            req.make_exact()
            return None  # not enough blocks now: prefill normally instead
        start = req.num_computed
        if probe.instant:  # the caller schedules its new tokens in this step, placement beside them
            req.num_computed, req.attach_tokens = probe.target, probe.attach_tokens
            for tier, n in probe.tier_tokens.items():
                req.metrics.note_reuse(tier, n)
            return _Issued(RestoreTicket(req.request_id, start, probe.target, probe.plan, instant=True), 0)
        self._admit(req, RequestStatus.RESTORING, self.restoring)
        paid = min(max(budget, 0), probe.compute_tokens)
        ticket = RestoreTicket(req.request_id, start, probe.target, probe.plan, probe.compute_tokens - paid)
        return _Issued(ticket, paid)

    # ----- after a step ---------------------------------------------------------------------
    def restored(self, req: Request, tokens: int | None, tier_tokens: dict[str, int] | None = None,
                 attach_tokens: int = 0) -> None:
        """A restore is ready (tokens: [0, tokens) will be in the pool once its first chunk runs,
        which carries `attach_tokens` of its compute) or failed (None: prefill from the device part)."""
        self.restoring.remove(req)
        if tokens is None:
            req.make_exact()  # recomputed in full from its tokens
        else:
            req.num_computed = tokens
            req.attach_tokens = attach_tokens
            for tier, n in (tier_tokens or {}).items():
                req.metrics.note_reuse(tier, n)
        req.status = RequestStatus.PREFILL
        self.running.append(req)

    def void(self, req: Request, start: int) -> None:
        """The step's result for `req` is void (its restore failed mid-step): recompute from
        `start`, the restore's own start (what the device held before it)."""
        req.metrics.forget_reuse()
        req.metrics.note_reuse("device", start)
        req.num_computed = start
        req.make_exact()
        req.status = RequestStatus.PREFILL

    def postprocess(self, out: SchedulerOutput, void: Collection[str] = ()) -> list[Request]:
        """Advance computed counts and publish newly full blocks; -> requests whose chunk reached
        the end of their tokens (they sample a token now)."""
        done = []
        for c in out.chunks:
            req = self.requests.get(c.request_id)
            if req is None or c.request_id in void:
                continue
            req.num_computed = c.end
            self._publish(req)
            if c.end == req.num_tokens:
                req.status = RequestStatus.DECODE
                done.append(req)
        return done

    def _publish(self, req: Request) -> None:
        """Register the request's newly full blocks in the device prefix cache. Never for a
        truncated context: its K/V are approximations and must not be reused as exact."""
        if not self.prefix_cache or req.approximate:
            return
        full = req.num_computed // self.pool.block_size
        if full <= req.num_published:
            return
        req.block_hashes = block_hashes(req.all_ids[: full * self.pool.block_size], self.pool.block_size,
                                        req.block_hashes)
        first = req.front // self.pool.block_size  # block ids start at the front
        for i in range(max(req.num_published, first), full):
            self.pool.register(req.block_ids[i - first], req.block_hashes[i])
        req.num_published = full

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        for queue in (self.restoring, self.running):
            if req in queue:
                queue.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.pool.release(req.block_ids)
        req.block_ids = []
        self.requests.pop(req.request_id, None)

    # ----- blocks -----------------------------------------------------------------------------
    def _match_prefix(self, req: Request) -> None:
        """Reuse device-cached full blocks; at least one prompt token is always computed (for logits).
        A truncated context never takes cached blocks: they would hold exact state at positions
        its approximate rows also claim."""
        req.block_ids, req.num_computed, req.num_published = [], 0, 0
        if not self.prefix_cache or req.kept is not None:
            return
        req.block_hashes = block_hashes(req.all_ids, self.pool.block_size, req.block_hashes)
        usable = (req.num_tokens - 1) // self.pool.block_size
        req.block_ids = self.pool.match_prefix(req.block_hashes[:usable])
        req.num_published = len(req.block_ids)  # found in the cache: registered already
        req.num_computed = len(req.block_ids) * self.pool.block_size
        req.metrics.note_reuse("device", req.num_computed)  # reuse counts what this admission found

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-(num_tokens - req.dropped - req.front) // self.pool.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_ids += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        if self.store is not None:
            self.store.abort(req.request_id)  # a restore still reading into its blocks stops first
        self.running.remove(req)
        req.metrics.forget_reuse()
        self.pool.release(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.num_published = 0
        req.front = 0
        req.make_exact()  # recomputed from its tokens
        req.restore_tried = False
        req.attach_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
