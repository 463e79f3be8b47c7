"""Restore compute shares the step's token budget: exact chunk sizes with a scripted restorer."""

from __future__ import annotations

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.request import Request, RequestStatus, SamplingParams
from kvtier.engine.scheduler import Scheduler


class ScriptedRestorer:
    """Restores every prompt of request "a" except its last token; its compute costs `debt` tokens."""

    def __init__(self, debt: int):
        self.debt = debt
        self.started: list[str] = []

    def probe(self, req: Request):
        if req.request_id != "a":
            return 0, req.num_computed, None
        return req.num_tokens - 1, req.num_computed, object()

    def start(self, req: Request, target: int, match) -> None:
        self.started.append(req.request_id)

    def charge(self, budget: int) -> int:
        pay = min(self.debt, budget)
        self.debt -= pay
        return pay


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1000 + 10 * len(rid), 1000 + 10 * len(rid) + n)), SamplingParams(max_tokens=4))


def _sizes(out) -> dict[str, int]:
    return {c.request_id: c.num_tokens for c in out.chunks}


def test_restore_compute_is_charged_before_waiting_prefills_but_after_decodes():
    restorer = ScriptedRestorer(debt=150)
    sched = Scheduler(BlockPool(64, 16), max_batched_tokens=100, max_num_seqs=8, restorer=restorer)
    dec = _req("d", 20)
    sched.add(dec)
    assert _sizes(sched.schedule()) == {"d": 20}  # "d" prefills alone (the restorer passes on it)
    dec.num_computed, dec.status = 20, RequestStatus.DECODE
    dec.output_ids.append(7)

    sched.add(_req("a", 200))
    sched.add(_req("bb", 40))
    # Step 1: "d" decodes (1 token), "a" starts restoring and its compute takes the other 99.
    out = sched.schedule()
    assert restorer.started == ["a"] and _sizes(out) == {"d": 1} and restorer.debt == 51
    assert [r.request_id for r in sched.waiting] == ["bb"]
    # Step 2: the decode again, the last 51 tokens of restore compute, then "bb" (40 tokens) fits in the 48 left.
    dec.num_computed += 1
    dec.output_ids.append(8)
    out = sched.schedule()
    assert _sizes(out) == {"d": 1, "bb": 40} and restorer.debt == 0


def test_without_restores_in_flight_nothing_is_charged():
    restorer = ScriptedRestorer(debt=10**6)
    sched = Scheduler(BlockPool(64, 16), max_batched_tokens=100, max_num_seqs=8, restorer=restorer)
    sched.add(_req("bb", 40))
    assert _sizes(sched.schedule()) == {"bb": 40} and restorer.debt == 10**6
