"""Continuous batching with a per-step token budget.

Each step: running decodes first (one token each), then running chunked prefills, then the
compute of restores in flight, then waiting requests fill what is left of the budget. When blocks run out, the most recently arrived running
request is preempted: its blocks are released and it is recomputed later from its tokens (its
full blocks usually survive in the device prefix cache, so resuming is cheap).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
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
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Restorer(Protocol):
    """What the scheduler needs from the store side (plain ints and opaque matches)."""

    def probe(self, req: Request) -> tuple[int, int, Any]: ...

    def start(self, req: Request, target: int, match: Any) -> None: ...

    def charge(self, budget: int) -> int:
        """Take up to `budget` tokens of this step for the compute of restores in flight."""
        ...


class Scheduler:
    def __init__(self, pool: BlockPool, max_batched_tokens: int, max_num_seqs: int, restorer: Restorer | None = None):
        self.pool = pool
        self.restorer = restorer
        self.restoring: list[Request] = []
        self.max_batched_tokens = max_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.restoring)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        decoding = [r for r in self.running if r.status == RequestStatus.DECODE]
        prefilling = [r for r in self.running if r.status == RequestStatus.PREFILL]
        for req in decoding + prefilling:
            if budget == 0:
                break
            if req not in self.running:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req not in self.running:
                continue
            chunks.append(ScheduledChunk(req.request_id, req.num_computed, n))
            budget -= n
        if self.restorer is not None and self.restoring:
            # Restores compute on the same cores (projection, placement, recomputed layers):
            # their work counts against the budget like a prefill that arrived before the queue.
            budget -= self.restorer.charge(budget)
        while self.waiting and budget > 0 and len(self.running) + len(self.restoring) < self.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed == 0:
                self._match_prefix(req)
                if self._try_restore(req):
                    budget -= self.restorer.charge(budget)  # its compute starts in this step
                    continue
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                # Wait for running requests to free blocks; hold nothing meanwhile.
                self.pool.release(req.block_ids)
                req.block_ids, req.num_computed = [], 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.PREFILL
            req.metrics.first_scheduled = req.metrics.first_scheduled or time.perf_counter()
            self.running.append(req)
            chunks.append(ScheduledChunk(req.request_id, req.num_computed, n))
            budget -= n
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _try_restore(self, req: Request) -> bool:
        """Send `req` to RESTORING when the store holds more of its prefix than the device does.
        The restore runs in the background; the request rejoins at `restored`."""
        if self.restorer is None or req.restore_tried:
            return False
        req.restore_tried = True
        target, keep, match = self.restorer.probe(req)
        if keep < req.num_computed:
            # The store lacks part of what the device cache holds: recompute that part once, so
            # its state is captured and the stored chain of chunks has no hole.
            n = keep // self.pool.block_size
            self.pool.release(req.block_ids[n:])
            req.block_ids = req.block_ids[:n]
            req.num_computed = n * self.pool.block_size
            req.metrics.prompt_tokens_reused = req.num_computed
            if req.num_computed:
                req.metrics.reused_by_tier["device"] = req.num_computed
            else:
                req.metrics.reused_by_tier.pop("device", None)
        if target <= req.num_computed:
            return False
        if not self._grow(req, target + 1):
            return False  # not enough blocks now: prefill normally instead
        self.waiting.popleft()
        req.status = RequestStatus.RESTORING
        req.metrics.first_scheduled = req.metrics.first_scheduled or time.perf_counter()
        self.restoring.append(req)
        self.restorer.start(req, target, match)
        return True

    def restored(self, req: Request, ok: bool, tokens: int) -> None:
        """A background restore ended: on success [0, tokens) are in the pool; prefill the rest."""
        self.restoring.remove(req)
        if ok:
            req.num_computed = tokens
            req.metrics.prompt_tokens_reused = tokens
        req.status = RequestStatus.PREFILL
        self.running.append(req)

    def finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if req in self.restoring:
            self.restoring.remove(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.pool.release(req.block_ids)
        req.block_ids = []
        self.requests.pop(req.request_id, None)

    def _match_prefix(self, req: Request) -> None:
        """Reuse device-cached full blocks; at least one prompt token is always computed (for logits)."""
        req.block_hashes = block_hashes(req.all_ids, self.pool.block_size, req.block_hashes)
        usable = (req.num_tokens - 1) // self.pool.block_size
        req.block_ids = self.pool.match_prefix(req.block_hashes[:usable])
        req.num_computed = len(req.block_ids) * self.pool.block_size
        if req.metrics.first_scheduled is None:  # count reuse once, not again after a preemption
            req.metrics.prompt_tokens_reused = req.num_computed
            if req.num_computed:
                req.metrics.reused_by_tier["device"] = req.num_computed

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = -(-num_tokens // self.pool.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_ids += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pool.release(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.restore_tried = False
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1
