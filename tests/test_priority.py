"""Request priority (vLLM's `--scheduling-policy priority`): waiting requests are admitted by
(priority, arrival), lowest value first; a running request is not preempted for a waiting one;
when blocks run out, the victim is the lowest-priority running request. Answers never change."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine.block_pool import BlockPool
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import MAX_PRIORITY, MIN_PRIORITY, Request, RequestStatus, SamplingError, SamplingParams
from kvtier.engine.scheduler import Scheduler

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def _prompt(i: int, vocab: int, n: int = 20) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(40 + i)).tolist()


def _req(rid: str, n: int, priority: int = 0) -> Request:
    return Request(rid, list(range(1000, 1000 + n)), SamplingParams(max_tokens=4), priority=priority)


def test_the_queue_is_ordered_by_priority_then_arrival():
    sched = Scheduler(BlockPool(64, 16), max_batched_tokens=64, max_num_seqs=8)
    for rid, pri in [("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", -1), ("f", 5)]:
        sched.add(_req(rid, 8, pri))
    assert [r.request_id for r in sched.waiting] == ["c", "e", "a", "d", "b", "f"]


def test_the_victim_is_the_lowest_priority_running_request_and_requeues_ahead_of_its_peers():
    """Running x, y (priority 5), z, admitted in that order; x's chunk needs 4 blocks with 2 free.
    First-come first-served alone would preempt z, the latest; priority takes y. Back in the queue,
    y goes ahead of the waiting requests of its own priority (it was admitted already) and behind
    the more urgent ones; and nothing is admitted in a step that preempted."""
    sched = Scheduler(BlockPool(8, 16), max_batched_tokens=64, max_num_seqs=8)
    x, y, z = _req("x", 100), _req("y", 40, priority=5), _req("z", 40)
    for r in (x, y, z):
        sched.add(r)
    sched.running, _ = [x, y, z], sched.waiting.clear()
    for r in (x, y, z):
        r.block_ids, r.num_computed, r.status = sched.pool.allocate(2), 32, RequestStatus.PREFILL
    sched.add(_req("q5", 8, priority=5))
    sched.add(_req("q0", 8))
    out = sched.schedule()
    assert out.preempted == ("y",) and [(c.request_id, c.num_tokens) for c in out.chunks] == [("x", 64)]
    assert y.status is RequestStatus.PREEMPTED and not y.block_ids and sched.running == [x, z]
    assert [r.request_id for r in sched.waiting] == ["q0", "y", "q5"]


def test_waiting_requests_are_admitted_by_priority_and_the_running_one_is_not_preempted(tiny_gqa):
    """One sequence at a time: "running" (the least urgent of all) is admitted first, alone; the
    others arrive while it runs. It still finishes first, then they run by (priority, arrival)."""
    vocab = tiny_gqa.config.vocab_size
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20, max_num_seqs=1))
    engine.add_request(_prompt(0, vocab), GREEDY, request_id="running", priority=10)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["running"]
    later = [("late", 5), ("urgent", -3), ("a", 0), ("b", 0), ("urgent2", -3), ("c", 0)]
    for i, (rid, pri) in enumerate(later, start=1):
        engine.add_request(_prompt(i, vocab), GREEDY, request_id=rid, priority=pri)
    finished, outs = [], {}
    while engine.has_work():
        for o in engine.step():
            if o.finished:
                finished.append(o.request_id)
                outs[o.request_id] = o.output_ids
    assert finished == ["running", "urgent", "urgent2", "a", "b", "c", "late"]
    # The order changes when each runs, never what it answers.
    alone = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    for i, rid in enumerate(["running"] + [rid for rid, _ in later]):
        assert outs[rid] == alone.generate([_prompt(i, vocab)], GREEDY)[0].output_ids, rid


def test_preemption_by_priority_keeps_answers_exact(tiny_gqa):
    """Too few blocks for all: requests are preempted (the least urgent first) and recomputed; each
    answer is the one it gets alone."""
    vocab = tiny_gqa.config.vocab_size
    ps = [_prompt(10 + i, vocab, n=30 + 10 * i) for i in range(4)]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    block_bytes = 2 * 4 * 16 * 2 * 16 * 4  # layers * block * kv_dim * fp32, K and V
    # 8 blocks (128 tokens) for 4 requests of 50 to 80 tokens each forces preemption.
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=8 * block_bytes, max_model_len=128))
    outs = engine.generate(ps, params, priority=[3, 0, 2, 1])
    assert engine.scheduler.num_preemptions > 0
    ref = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    assert [o.output_ids for o in outs] == [o.output_ids for o in ref.generate(ps, params)]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_priority_is_an_int_in_32_bits(tiny_gqa):
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20))
    for ok in (MIN_PRIORITY, MAX_PRIORITY):
        engine.add_request([5, 6, 7], GREEDY, priority=ok)
    for bad in (MAX_PRIORITY + 1, MIN_PRIORITY - 1, 1.5, True, "1"):
        with pytest.raises(SamplingError, match="priority"):
            engine.add_request([5, 6, 7], GREEDY, priority=bad)
    with pytest.raises(ValueError, match="2 prompts"):
        engine.generate([[5, 6], [7, 8]], GREEDY, priority=[0])
    with pytest.raises(SamplingError, match="priority"):
        engine.generate([[5, 6], [7, 8]], GREEDY, priority=[0, 2**40])
    assert engine._inbox.qsize() == 2  # only the two good ones were queued

