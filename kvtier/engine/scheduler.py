"""Continuous batching with a per-step token budget.

Each step: running decodes first (one token each), then running chunked prefills (a request whose
restore is ready computes its new tokens here, carrying the restore's placement cost), then the
compute of restores still preparing, then waiting requests fill what is left of the budget. A
waiting request whose stored prefix goes beyond the device prefix cache gets a `RestoreTicket`,
handed to the store side (`StoreSide.start`), which prepares it off the step loop; the scheduler
itself does no I/O. The store side and the feed policy are protocols with null defaults
(`NoStore`, `NoFeeds`), so a step has no "is there a store?" branches. When
blocks run out, the most recently admitted running request of the lowest priority (the highest
`priority` value) is preempted: its blocks are released and it is recomputed later from its tokens
(its full blocks usually survive in the device prefix cache, so resuming is cheap).

The waiting queue is ordered by (priority, arrival), as vLLM's `--scheduling-policy priority`:
with every priority 0 (the default) that is first-come first-served. Priority orders admission
and picks preemption victims only: a waiting request never preempts a running one to get in (as
in vLLM's V1 scheduler), so a running request always finishes what it started unless blocks run
out.

Plain values only: ints, token ids, hashes. No torch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from kvtier.engine.block_pool import BlockPool, block_hashes
from kvtier.engine.request import Request, RequestStatus
from kvtier.engine.scheduler_api import (
    FeedPlan,
    FeedPolicy,
    NoFeeds,
    NoStore,
    RestoreTicket,
    ScheduledChunk,
    SchedulerOutput,
    StoreSide,
)


@dataclass(frozen=True)
class _Issued:
    ticket: RestoreTicket
    plan_paid: int


LOOK_AHEAD_REQUESTS = 32  # queued requests the store side looks ahead at each step


@dataclass
class _Step:
    """One step as it is being scheduled."""

    budget: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    tickets: list[RestoreTicket] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)

    def add(self, req: Request, n: int) -> None:
        self.chunks.append(ScheduledChunk(req.request_id, req.num_computed, n))
        self.scheduled.add(req.request_id)
        self.budget -= n + req.attach_tokens
        req.attach_tokens = 0


class Scheduler:
    def __init__(self, pool: BlockPool, max_batched_tokens: int, max_num_seqs: int, store: StoreSide | None = None,
                 prefix_cache: bool = True, feeds: FeedPolicy | None = None, defer_instant: bool = False):
        """`defer_instant`: while requests decode, an instant restore is prepared on the restore
        worker instead of in the step (see _try_restore); right where a decode step is short beside
        a restore's host work (an asynchronous device), wrong where it is long (a CPU's step would
        then delay the restore by a step)."""
        self.pool = pool
        self.defer_instant = defer_instant
        self.feeds: FeedPolicy = feeds or NoFeeds()
        self.store: StoreSide = store or NoStore()
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
        self.store.arrived(req)
        self._enqueue(req, ahead=False)

    def _enqueue(self, req: Request, ahead: bool) -> None:
        """Into the waiting queue by priority: after the requests of its own priority (a new
        arrival: first-come first-served) or `ahead` of them (a preempted one: it was admitted
        already, they not yet). Searched from the back, where a new arrival of the most common
        priority lands: O(1) while every priority is the same."""
        i = len(self.waiting)
        while i and (self.waiting[i - 1].priority >= req.priority if ahead
                     else self.waiting[i - 1].priority > req.priority):
            i -= 1
        self.waiting.insert(i, req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.restoring)

    # ----- one step -------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decodes, then running prefills, then restore compute, then waiting requests, each out of
        what the token budget has left."""
        aborted = self._take_restores()
        step = _Step(self.max_batched_tokens)
        decoding = [r for r in self.running if r.status == RequestStatus.DECODE]
        prefilling = [r for r in self.running if r.status == RequestStatus.PREFILL]
        plan = self._plan_feeds(decoding, prefilling, step.preempted)
        self._schedule_running(step, decoding, prefilling, plan.recompute_tokens)
        if self.restoring:
            # Restores compute on the same cores (recomputed layers, layers computed while others load): their work
            # counts against the budget like a prefill that arrived before the queue.
            step.budget -= self.store.charge(max(step.budget, 0))
        self._admit_waiting(step, min(self.max_num_seqs, plan.cap))
        self.store.end_step(list(self._queued(LOOK_AHEAD_REQUESTS)))
        return SchedulerOutput(tuple(step.chunks), tuple(step.tickets), tuple(step.preempted), aborted)

    def _take_restores(self) -> tuple[str, ...]:
        """Restores that became ready rejoin the running set; those whose request was aborted end."""
        aborted = []
        for done in self.store.begin_step():
            req = self.requests[done.request_id]
            if done.aborted:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
                aborted.append(req.request_id)
            else:
                self.restored(req, done.tokens, dict(done.tier_tokens), done.attach_tokens)
        return tuple(aborted)

    def _schedule_running(self, step: _Step, decoding: list[Request], prefilling: list[Request],
                          fed_tokens: int) -> None:
        """One token per decode, then recomputed feeds' share, then chunks of running prefills;
        a request that cannot grow preempts the latest admitted of the lowest priority not already
        in the step (itself, at worst)."""
        charged = not fed_tokens
        for i, req in enumerate(decoding + prefilling):
            if i == len(decoding) and not charged:
                step.budget, charged = self._charge_feeds(step.budget, fed_tokens), True
            if step.budget <= 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, max(step.budget - req.attach_tokens, 1))
            while not self._grow(req, req.num_computed + n):
                victim = self._victim(step)
                self._preempt(victim)
                step.preempted.append(victim.request_id)
                if victim is req:
                    break
            if req in self.running:
                step.add(req, n)
        if not charged:
            step.budget = self._charge_feeds(step.budget, fed_tokens)

    def _victim(self, step: _Step) -> Request:
        """The running request to preempt: of those not already in this step, the lowest priority
        (highest value), and of those the most recently admitted (vLLM's choice). The request
        growing is never in the step yet, so there is always one."""
        victim: Request | None = None
        for r in reversed(self.running):
            if r.request_id not in step.scheduled and (victim is None or r.priority > victim.priority):
                victim = r
        assert victim is not None
        return victim

    def _admit_waiting(self, step: _Step, cap: int) -> None:
        """Waiting requests in queue order (priority, then arrival): the device prefix cache, then
        the store's offer (a restore ticket), then a prefill chunk, while budget, blocks and the
        batch cap allow."""
        if step.preempted:
            # Running requests gave blocks up for lack of room: none is taken for a new admission
            # in the same step (nor the victims' own way back), whatever its priority (vLLM's rule).
            return
        while self.waiting and step.budget > 0 and len(self.running) + len(self.restoring) < cap:
            req = self.waiting[0]
            instant = None
            if req.num_computed == 0:
                self._match_prefix(req)
                issued = self._try_restore(req, step.budget)
                if issued is not None:
                    step.budget -= issued.plan_paid
                    if not issued.ticket.instant:
                        step.tickets.append(issued.ticket)
                        continue
                    instant = issued.ticket
            n = min(req.num_tokens - req.num_computed, max(step.budget - req.attach_tokens, 1))
            if not self._grow(req, req.num_computed + n):
                # Wait for running requests to free blocks; hold nothing meanwhile.
                self.pool.release(req.block_ids)
                req.block_ids, req.num_computed, req.attach_tokens = [], 0, 0
                req.metrics.forget_reuse()  # the next admission counts what it finds
                if instant is not None:  # ask the store again when it can run
                    req.restore_tried = False
                break
            self._admit(req, RequestStatus.PREFILL, self.running)
            if instant is not None:
                self.store.start(req, instant)  # prepared now, placed by the chunk added next
                step.tickets.append(instant)
            step.add(req, n)

    def _queued(self, n: int) -> list[Request]:
        """The first `n` queued requests that will ask the store (cache_prompt false never does:
        protecting or prefetching its chunks would only displace others')."""
        out: list[Request] = []
        for req in self.waiting:
            if len(out) == n:
                break
            if req.cache_prompt:
                out.append(req)
        return out

    @staticmethod
    def _charge_feeds(budget: int, tokens: int) -> int:
        """Recomputed feeds take budget after the decodes and before prefills, at most half of
        what is left, so running prefills still advance."""
        return budget - min(tokens, max(budget, 0) // 2)

    def _plan_feeds(self, decoding: list[Request], prefilling: list[Request], preempted: list[str]) -> FeedPlan:
        """Ask the feed policy for this step's cap and feeds; grow the decodes' fed positions to
        them (releasing those blocks). Feeds only grow: a request keeps them until it finishes or
        is preempted. Blocks that prefills and restores hold or still need are not offered.
        Decodes past the cap (FCFS: the latest arrivals) are preempted."""
        held = sum(self._blocks_for(r, r.num_tokens) for r in prefilling + self.restoring)
        plan = self.feeds.plan(decoding, list(self.waiting), max(self.pool.num_blocks - held, 0))
        for req in decoding[max(plan.cap, 1):][::-1]:
            self._preempt(req)
            preempted.append(req.request_id)
        if not plan.fed:
            return plan  # nothing more is fed this step (always so without a feed policy)
        bs = self.pool.block_size
        for req in decoding[: max(plan.cap, 1)]:
            want = min(plan.fed.get(req.request_id, 0), (req.num_computed - 1) // bs * bs)
            if want <= req.fed or req.approximate:
                continue
            self.feeds.release(req, want)
            n = (want - req.fed) // bs
            self.pool.release(req.block_ids[:n])
            req.block_ids = req.block_ids[n:]
            req.feed_from(want)
        return plan

    def _admit(self, req: Request, status: RequestStatus, into: list[Request]) -> None:
        self.waiting.popleft()
        req.status = status
        req.metrics.first_scheduled = req.metrics.first_scheduled or time.perf_counter()
        into.append(req)

    def _try_restore(self, req: Request, budget: int) -> _Issued | None:
        """A ticket when the store holds more of `req`'s prefix than the device does. Its compute
        starts in this step: pay what the budget allows now, the rest in later steps."""
        if req.restore_tried or not req.cache_prompt or req.params.prompt_logprobs is not None:
            return None
        req.restore_tried = True
        probe = self.store.offer(req)
        if probe.keep < req.num_computed:
            # The store lacks part of what the device cache holds: recompute that part once, so
            # its state is captured and the stored chain of chunks has no hole.
            n = probe.keep // self.pool.block_size
            self.pool.release(req.block_ids[n:])
            req.block_ids = req.block_ids[:n]
            req.num_computed = n * self.pool.block_size
            req.metrics.forget_reuse()
            req.metrics.note_reuse("device", req.num_computed)
        if probe.target <= req.num_computed or probe.order is None:
            return None
        req.restored_lossy, req.unslotted = probe.lossy, probe.unslotted  # before growing: those have no slots
        req.exact_upto = probe.exact_upto
        if not self._grow(req, probe.target + 1):
            req.make_exact()
            return None  # not enough blocks now: prefill normally instead
        start = req.num_computed
        # An instant restore is opened and placed by this step's thread, inside the step. While
        # others decode on a device whose steps are short, that host work (several of their steps
        # for a long context) would stretch their time between tokens: it is prepared on the restore worker
        # instead, like a read from a device.
        deferred = self.defer_instant and any(r.status is RequestStatus.DECODE for r in self.running)
        # One that computes (an inline blend) runs in this step only where its compute fits the budget.
        fits = probe.compute_tokens == 0 or probe.attach_tokens <= budget
        if probe.instant and not deferred and fits:  # the caller schedules its new tokens in this step, placement beside them
            req.num_computed, req.attach_tokens = probe.target, probe.attach_tokens
            for tier, n in probe.order.tier_tokens.items():
                req.metrics.note_reuse(tier, n)
            return _Issued(RestoreTicket(req.request_id, start, probe.target, probe.order, instant=True), 0)
        self._admit(req, RequestStatus.RESTORING, self.restoring)
        paid = min(max(budget, 0), probe.compute_tokens)
        ticket = RestoreTicket(req.request_id, start, probe.target, probe.order, probe.compute_tokens - paid)
        self.store.start(req, ticket)
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
        """Register the request's newly full blocks in the device prefix cache. Of approximate
        state (a truncated context, an importance-only or blended restore), only the blocks of its
        exact prefix (`Request.exact_upto`): the rest must never be reused as exact. Nothing for
        cache_prompt false: its blocks go back to the pool clean, for no other request to hit."""
        if not self.prefix_cache or not req.cache_prompt:
            return
        upto = min(req.num_computed, req.exact_upto) if req.approximate else req.num_computed
        full = upto // self.pool.block_size
        if full <= req.num_published:
            return
        req.block_hashes = block_hashes(req.all_ids[: full * self.pool.block_size], self.pool.block_size,
                                        req.block_hashes, req.cache_salt)
        first = req.unslotted // self.pool.block_size  # block ids start past the unslotted positions
        for i in range(max(req.num_published, first), full):
            self.pool.register(req.block_ids[i - first], req.block_hashes[i], req.block_hashes[i - 1] if i else None)
        req.num_published = full

    def fork(self, parent: Request, child: Request) -> tuple[int, int, int] | None:
        """Start `child` (the same prompt) where `parent` stands after its prefill: its full
        blocks shared, its partial last block to be copied. -> (src, dst, tokens) of that copy
        ((-1, -1, 0) when there is none), or None when no block is free or the batch is full (the
        child then waits and prefills like any request, taking the published prefix from the
        device cache)."""
        bs = self.pool.block_size
        full, tail = divmod(parent.num_computed, bs)
        if parent.unslotted or parent.approximate or (tail and not self.pool.num_free) or \
                len(self.running) + len(self.restoring) >= self.max_num_seqs:
            return None
        self.pool.share(parent.block_ids[:full])
        child.block_ids = parent.block_ids[:full] + (self.pool.allocate(1) if tail else [])
        child.num_computed = parent.num_computed
        child.block_hashes, child.num_published = list(parent.block_hashes), parent.num_published
        child.metrics.note_reuse("device", parent.num_computed)  # computed once, by the parent
        child.status = RequestStatus.DECODE
        self.requests[child.request_id] = child
        self.store.arrived(child)
        self.running.append(child)
        return (parent.block_ids[full], child.block_ids[-1], tail) if tail else (-1, -1, 0)

    def finish(self, req: Request, status: RequestStatus) -> None:
        self.store.finished(req)
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
        its approximate rows also claim. Nor does cache_prompt false: it computes its whole prompt."""
        req.block_ids, req.num_computed, req.num_published = [], 0, 0
        if not self.prefix_cache or not req.cache_prompt or req.kept is not None or \
                req.params.prompt_logprobs is not None:
            return  # (prompt logprobs need every prompt token computed: a cached one has no logits)
        req.block_hashes = block_hashes(req.all_ids, self.pool.block_size, req.block_hashes, req.cache_salt)
        usable = (req.num_tokens - 1) // self.pool.block_size
        req.block_ids = self.pool.match_prefix(req.block_hashes[:usable])
        req.num_published = len(req.block_ids)  # found in the cache: registered already
        req.num_computed = len(req.block_ids) * self.pool.block_size
        req.metrics.note_reuse("device", req.num_computed)  # reuse counts what this admission found

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self._blocks_for(req, num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        if req.block_ids:
            req.block_ids += self.pool.allocate(need, req.block_ids[-1])
        else:  # a new run: room for its whole prompt
            req.block_ids = self.pool.allocate(need, room=self._blocks_for(req, req.num_tokens))
        return True

    def _blocks_for(self, req: Request, num_tokens: int) -> int:
        """Blocks holding a request's first `num_tokens` positions (unslotted ones are not in its slots)."""
        return -(-(num_tokens - req.unslotted) // self.pool.block_size)

    def abort(self, req: Request) -> bool:
        """End a request at the client's wish. -> False while a restore still writes into its
        blocks: it ends (and appears in `SchedulerOutput.aborted`) once the store side reports it."""
        if self.store.abort(req.request_id):
            return False
        self.finish(req, RequestStatus.FINISHED_ABORTED)
        return True

    def _preempt(self, req: Request) -> None:
        self.store.abort(req.request_id)  # a restore still reading into its blocks stops first
        self.running.remove(req)
        req.metrics.forget_reuse()
        self.pool.release(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.num_published = 0
        req.unslotted = req.fed = 0  # recomputed from its tokens, all of them in slots
        req.make_exact()
        req.restore_tried = False
        req.attach_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self._enqueue(req, ahead=True)
        self.num_preemptions += 1
