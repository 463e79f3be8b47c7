"""Restore compute shares the step's token budget; the scheduler hands out restore tickets and
hands each ticket to the store side: exact chunk sizes and tickets with a scripted store side."""

from __future__ import annotations

import pytest

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.request import Request, RequestStatus, SamplingParams
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.scheduler_api import NoStore, RestoreOrder, StoreOffer
from kvtier.planning.plan import Method, Plan


class ScriptedStore(NoStore):
    """Offers every prompt of request "a" except its last token; that restore's compute costs
    `debt` tokens before its new tokens can run (the scheduler pays what it can at once)."""

    def __init__(self, debt: int):
        self.debt = debt
        self.order = RestoreOrder(Plan(Method.KV, (), 0, (), 0.0, 0.0))
        self.started: list[str] = []

    def offer(self, req: Request) -> StoreOffer:
        if req.request_id != "a":
            return StoreOffer(0, req.num_computed)
        return StoreOffer(req.num_tokens - 1, req.num_computed, self.order, self.debt)

    def start(self, req: Request, ticket) -> None:
        self.started.append(ticket.request_id)

    def charge(self, budget: int) -> int:  # later steps: what the ticket still owed
        pay = min(self.owed, budget)
        self.owed -= pay
        return pay


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1000 + 10 * len(rid), 1000 + 10 * len(rid) + n)), SamplingParams(max_tokens=4))


def _sizes(out) -> dict[str, int]:
    return {c.request_id: c.num_tokens for c in out.chunks}


def test_restore_compute_is_charged_before_waiting_prefills_but_after_decodes():
    store = ScriptedStore(debt=150)
    sched = Scheduler(BlockPool(64, 16), max_batched_tokens=100, max_num_seqs=8, store=store)
    dec = _req("d", 20)
    sched.add(dec)
    assert _sizes(sched.schedule()) == {"d": 20}  # "d" prefills alone (the store passes on it)
    dec.num_computed, dec.status = 20, RequestStatus.DECODE
    dec.append_output(7)

    a = _req("a", 200)
    sched.add(a)
    sched.add(_req("bb", 40))
    # Step 1: "d" decodes (1 token), "a" gets a ticket and its compute takes the other 99 now.
    out = sched.schedule()
    assert _sizes(out) == {"d": 1} and [r.request_id for r in sched.waiting] == ["bb"]
    assert [(t.request_id, t.start, t.target, t.debt) for t in out.restores] == [("a", 0, 199, 51)]
    assert out.restores[0].order is store.order and a.status is RequestStatus.RESTORING
    assert len(a.block_ids) == 13  # blocks for [0, 200): the restore writes into them
    store.owed = out.restores[0].debt  # what the caller's restore side now owes
    # Step 2: the decode again, the last 51 tokens of restore compute, then "bb" (40 tokens) fits in the 48 left.
    dec.num_computed += 1
    dec.append_output(8)
    out = sched.schedule()
    assert _sizes(out) == {"d": 1, "bb": 40} and store.owed == 0 and out.restores == ()
    assert [r.request_id for r in sched.postprocess(out)] == ["d", "bb"]  # both sample a token now
    dec.append_output(8)
    sched.requests["bb"].append_output(9)
    # The restore is ready: "a" computes its last prompt token, carrying 30 tokens of placement.
    sched.restored(a, 199, {"memory": 199}, attach_tokens=30)
    out = sched.schedule()
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("d", 22, 1), ("bb", 40, 1), ("a", 199, 1)]
    assert a.attach_tokens == 0 and a.metrics.reused_by_tier == {"memory": 199} and a.metrics.prompt_tokens_reused == 199


def test_without_restores_in_flight_nothing_is_charged():
    store = ScriptedStore(debt=10**6)
    store.owed = 10**6
    sched = Scheduler(BlockPool(64, 16), max_batched_tokens=100, max_num_seqs=8, store=store)
    sched.add(_req("bb", 40))
    assert _sizes(sched.schedule()) == {"bb": 40} and store.owed == 10**6


class InstantStore(ScriptedStore):
    """Offers request "a" from memory it holds (an instant restore): all but its last 8 tokens."""

    def offer(self, req: Request) -> StoreOffer:
        if req.request_id != "a":
            return StoreOffer(0, req.num_computed)
        order = RestoreOrder(self.order.plan, tier_tokens={"memory": req.num_tokens - 8})
        return StoreOffer(req.num_tokens - 8, req.num_computed, order, 0, instant=True, attach_tokens=30)


def test_an_instant_restore_runs_its_new_tokens_in_the_same_step():
    """Memory the store holds needs no RESTORING phase: the request's new tokens are a chunk of this
    very step, starting at the restored position and carrying the placement's cost."""
    sched = Scheduler(BlockPool(64, 16), max_batched_tokens=100, max_num_seqs=8, store=InstantStore(debt=0),
                      defer_instant=True)  # nothing decodes: nothing to defer for
    a = _req("a", 200)
    sched.add(a)
    sched.add(_req("bb", 70))
    out = sched.schedule()
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 192, 8), ("bb", 0, 62)]
    assert [(t.request_id, t.start, t.target, t.instant) for t in out.restores] == [("a", 0, 192, True)]
    assert a.status is RequestStatus.PREFILL and not sched.restoring and len(a.block_ids) == 13
    assert a.metrics.reused_by_tier == {"memory": 192} and a.attach_tokens == 0


@pytest.mark.parametrize("defer", [True, False], ids=["async-device", "cpu"])
def test_an_instant_restore_beside_a_decode(defer):
    """With a request decoding on an asynchronous device, the same instant offer takes the
    RESTORING phase: the restore is opened on the restore worker and the decode's step carries none
    of it. On the CPU (a step far longer than the opening) it stays in the decode's step."""
    store = InstantStore(debt=0)
    sched = Scheduler(BlockPool(64, 16), max_batched_tokens=100, max_num_seqs=8, store=store, defer_instant=defer)
    dec = _req("d", 20)
    sched.add(dec)
    sched.schedule()
    dec.num_computed, dec.status = 20, RequestStatus.DECODE
    dec.append_output(7)
    a = _req("a", 200)
    sched.add(a)
    out = sched.schedule()
    if not defer:
        assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("d", 20, 1), ("a", 192, 8)]
        assert [t.instant for t in out.restores] == [True] and not sched.restoring
        return
    assert _sizes(out) == {"d": 1} and store.started == ["a"]
    assert [(t.request_id, t.start, t.target, t.instant, t.debt) for t in out.restores] == [("a", 0, 192, False, 0)]
    assert a.status is RequestStatus.RESTORING and sched.restoring == [a] and len(a.block_ids) == 13
    dec.num_computed += 1
    dec.append_output(8)
    sched.restored(a, 192, {"memory": 192}, attach_tokens=30)  # prepared: its new tokens run next
    out = sched.schedule()
    assert [(c.request_id, c.start, c.num_tokens) for c in out.chunks] == [("d", 21, 1), ("a", 192, 8)]


def test_preemption_never_takes_a_request_already_in_the_step():
    """Running = [P (a long prefill, admitted first), D (decoding)]. Decodes go first, so D's chunk
    is in the step when P's blocks run out: the victim must be P itself, not D (whose chunk would
    then run on released blocks)."""
    sched = Scheduler(BlockPool(6, 16), max_batched_tokens=64, max_num_seqs=8)
    p, d = _req("p", 200), _req("d", 20)
    sched.add(p)
    sched.add(d)
    sched.running = [p, d]
    sched.waiting.clear()
    p.block_ids, p.num_computed, p.status = sched.pool.allocate(4), 64, RequestStatus.PREFILL
    d.block_ids, d.num_computed, d.status = sched.pool.allocate(2), 20, RequestStatus.DECODE
    d.append_output(5)
    out = sched.schedule()
    assert out.preempted == ("p",) and [c.request_id for c in out.chunks] == ["d"]
    assert d.block_ids and d in sched.running and p.status is RequestStatus.PREEMPTED
