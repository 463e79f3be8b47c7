"""The scheduler under a scripted front policy: exact admissions by its cap, fronts grown to its
plan (blocks released, the policy told first), decodes past the cap preempted, fronts kept."""

from __future__ import annotations

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.request import Request, RequestStatus, SamplingParams
from kvtier.engine.scheduler import Scheduler
from kvtier.engine.scheduler_api import FeedPlan


class ScriptedPolicy:
    """Returns the scripted plans in order and records what it was asked and told."""

    def __init__(self, plans: list[FeedPlan]):
        self.plans = list(plans)
        self.asked: list[tuple[list[str], list[str], int]] = []
        self.released: list[tuple[str, int, int]] = []

    def plan(self, decoding, waiting, capacity_blocks) -> FeedPlan:
        self.asked.append(([r.request_id for r in decoding], [r.request_id for r in waiting], capacity_blocks))
        return self.plans.pop(0)

    def release(self, req: Request, upto: int) -> None:
        self.released.append((req.request_id, req.fed, upto))


def _req(rid: str, n: int) -> Request:
    base = 1000 * (ord(rid[0]) - 96)  # distinct prompts: no device prefix-cache hits between them
    return Request(rid, list(range(base, base + n)), SamplingParams(max_tokens=50))


def _decode(sched: Scheduler, out) -> None:
    """The step ran: every scheduled request computed its chunk and (at its end) sampled a token."""
    for req in sched.postprocess(out):
        req.append_output(1)


def test_admissions_follow_the_cap_and_fronts_free_blocks():
    pool = BlockPool(20, 16)
    policy = ScriptedPolicy([
        FeedPlan(cap=2),  # step 1: a and b admitted, c waits
        FeedPlan(cap=2),  # step 2: a and b decode
        FeedPlan(cap=3, fed={"a": 32, "b": 16}),  # step 3: fronts free 3 blocks, c admitted
        FeedPlan(cap=2, fed={"a": 32, "b": 16}),  # step 4: c (the latest) preempted
    ])
    sched = Scheduler(pool, max_batched_tokens=1000, max_num_seqs=8, feeds=policy)
    for rid, n in (("a", 60), ("b", 40), ("c", 100)):
        sched.add(_req(rid, n))

    out = sched.schedule()
    assert [c.request_id for c in out.chunks] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    _decode(sched, out)
    a, b = sched.requests["a"], sched.requests["b"]
    assert (len(a.block_ids), len(b.block_ids)) == (4, 3)

    out = sched.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1)]
    _decode(sched, out)
    # capacity offered: every block (no prefill or restore holds any)
    assert policy.asked[1] == (["a", "b"], ["c"], 20)

    out = sched.schedule()
    assert policy.released == [("a", 0, 32), ("b", 0, 16)]  # told before the blocks went
    assert (a.fed, b.fed) == (32, 16)
    assert (len(a.block_ids), len(b.block_ids)) == (2, 2)  # 62 - 32 -> 2 blocks, 42 - 16 -> 2 blocks
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 1), ("c", 100)]
    assert pool.num_free == 20 - 2 - 2 - 7
    _decode(sched, out)

    out = sched.schedule()
    assert out.preempted == ("c",)
    c = sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED and c.block_ids == [] and c.fed == 0
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert [(ch.request_id, ch.num_tokens) for ch in out.chunks] == [("a", 1), ("b", 1)]
    assert (a.fed, b.fed) == (32, 16)  # fronts never shrink
    assert pool.num_free == 20 - 2 - 2


def test_front_never_reaches_the_newest_token():
    """A plan asking for more than a request has computed is capped at its last full block."""
    pool = BlockPool(10, 16)
    policy = ScriptedPolicy([FeedPlan(cap=1), FeedPlan(cap=1, fed={"a": 1000})])
    sched = Scheduler(pool, max_batched_tokens=1000, max_num_seqs=8, feeds=policy)
    sched.add(_req("a", 40))
    _decode(sched, sched.schedule())
    sched.schedule()
    a = sched.requests["a"]
    assert a.fed == 32 and a.num_computed == 40 and len(a.block_ids) == 1


def test_recomputed_fronts_share_the_budget_before_prefills():
    """Fronts recomputed in a step take budget after the decodes, before the prefills: at most
    half of what is left, so a running prefill still advances."""
    pool = BlockPool(40, 16)
    policy = ScriptedPolicy([FeedPlan(cap=1), FeedPlan(cap=2, recompute_tokens=64),
                             FeedPlan(cap=2, recompute_tokens=1000)])
    sched = Scheduler(pool, max_batched_tokens=200, max_num_seqs=8, feeds=policy)
    sched.add(_req("a", 40))
    _decode(sched, sched.schedule())
    sched.add(_req("b", 400))
    out = sched.schedule()  # a decodes (1), fronts take 64, b prefills the rest
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 200 - 1 - 64)]
    _decode(sched, out)
    out = sched.schedule()  # fronts would take everything: half of the 199 left goes to them
    assert [(c.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 199 - 99)]
