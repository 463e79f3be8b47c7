"""Scheduler-aware look-ahead (CachedAttention §3.3): exact eviction and prefetch decisions."""

from __future__ import annotations

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import Request, SamplingParams
from kvtier.store import FIFOPolicy, LRUPolicy
from kvtier.store.lookahead import LookAheadPolicy
from kvtier.testing.reference import context_state

from kvtier_testlib import fake_profile


def lru_with(keys: str, touched: str = "") -> LookAheadPolicy:
    p = LookAheadPolicy(LRUPolicy())
    for k in keys:
        p.insert(k, 10)
    for k in touched:
        p.touch(k)
    return p


def test_without_lookahead_information_it_is_the_base_policy():
    p = lru_with("abcde", touched="a")
    assert list(p.victims(30)) == ["b", "c", "d"]


def test_window_is_never_evicted_and_furthest_future_goes_first():
    p = lru_with("abcdef")
    # Queue: b needed by request 0, e by 1, d by 3, f by 5; window covers requests 0-1.
    p.set_future({"b": 0, "e": 1, "d": 3, "f": 5}, window={"b", "e"})
    # Unneeded first in LRU order (a, c), then needed beyond the window, furthest first (f, d).
    assert list(p.victims(40)) == ["a", "c", "f", "d"]
    assert list(p.victims(1000)) == ["a", "c", "f", "d"]  # b and e stay whatever the need
    assert list(p.victims(1000, protected={"c"})) == ["a", "f", "d"]


def test_wraps_any_base_policy():
    p = LookAheadPolicy(FIFOPolicy())
    for k in "xyz":
        p.insert(k, 5)
    p.touch("x")  # FIFO ignores accesses
    p.set_future({"x": 2}, window=set())
    assert list(p.victims(15)) == ["y", "z", "x"]


def test_prefetch_brings_exactly_the_window_into_memory(tiny_gqa, tmp_path):
    """Three queued requests, each with 2 chunks on a slow disk only; memory fits 2.5 requests'
    state, so the window holds the first two requests: their 4 chunks are prefetched, the third's
    are not."""
    chunk = 64
    per_chunk = 4 * chunk * 2 * 32 * 4  # layers * tokens * (K+V) * kv_dim * fp32 bytes of payload
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=16 << 20), store=f"memory:{int(per_chunk * 5.3)}B,disk:{tmp_path}/d:1GB:bw=20MB/s",
                    profile=fake_profile(tiny_gqa.fingerprint), reuse=ReuseConfig(method="kv", chunk_tokens=chunk))
    store = engine.link.store
    reqs = []
    for i in range(3):
        ids = [1000 * (i + 1) + t for t in range(2 * chunk)] + [5]
        st = context_state(tiny_gqa.module, ids[: 2 * chunk])
        store.save(ids[: 2 * chunk], 0, st.k, st.v, None)
        reqs.append(Request(f"r{i}", ids, SamplingParams()))
    store.flush(30)
    for r in reqs:
        for c in store.lookup(r.all_ids).chunks:
            store.tier("memory").delete(c.key)
    assert all(c.tier == "disk" for r in reqs for c in store.lookup(r.all_ids).chunks)
    engine.link.scheduler_side.look_ahead(reqs)
    store.flush(30)
    tiers = [[c.tier for c in store.lookup(r.all_ids).chunks] for r in reqs]
    assert tiers == [["memory", "memory"], ["memory", "memory"], ["disk", "disk"]]
    assert engine.stats().counters["prefetches"] == 4
    # And the window's chunks are protected in the memory tier's eviction order.
    window = {c.key for r in reqs[:2] for c in store.lookup(r.all_ids).chunks}
    mem_policy = store.tier("memory").policy
    assert window <= mem_policy.window and not set(mem_policy.victims(1 << 40)) & window
    engine.close()


def test_prefetch_only_where_it_pays():
    """Copying a chunk up costs a read and a write on the compute cores; it saves what the restore
    would not hide under compute. Waiting on a slow link pays for it; reads that hide do not."""
    import dataclasses

    from kvtier.planning.costs import ModelShape, TierLink
    from kvtier.planning.planner import Planner

    prof = fake_profile("x", io_bps=1e9)
    hidden = dataclasses.replace(prof.tiers["disk"], overlap=1.0)
    shared = dataclasses.replace(prof.tiers["disk"], overlap=0.0)
    mem = TierLink(prof.tiers["memory"])
    shape = ModelShape(4, 256, 256)
    nbytes = 1 << 20
    assert not Planner(prof, shape, {"memory": mem, "disk": TierLink(hidden)}).prefetch_pays("disk", nbytes)
    assert not Planner(prof, shape, {"memory": mem, "disk": TierLink(shared)}).prefetch_pays("disk", nbytes)
    slow = TierLink(hidden, emulated_bps=1e7)  # 0.1 s of waiting per MB
    assert Planner(prof, shape, {"memory": mem, "disk": slow}).prefetch_pays("disk", nbytes)
