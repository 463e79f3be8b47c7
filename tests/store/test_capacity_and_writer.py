"""Byte caps (also across restarts), exact eviction orders per policy, and the bounded writer."""
import threading

import pytest

from kvtier.store import TieredStore
from kvtier.store.writer import BackgroundWriter

from store_testlib import make_state, tokens


def _save(store, i):
    t = tokens(16, seed=i)
    k, v, _ = make_state(16, seed=i)
    store.save(t, 0, k, v, None)
    store.flush()
    return t


def _chunk_bytes(ns):
    with TieredStore.open("memory:1MB", ns, chunk_tokens=16) as s:
        _save(s, 0)
        return s.stats()["tiers"]["memory"]["bytes_used"]


@pytest.mark.parametrize("policy, expected", [
    ("lru", ["d", "b", "a"]),
    ("lfu", ["d", "e", "f"]),
    ("fifo", ["a", "b", "c"]),
])
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_exact_eviction_order(tmp_path, ns, tier, policy, expected):
    size = _chunk_bytes(ns)
    cap = 4 * size + size // 2
    spec = f"memory:{cap}" if tier == "memory" else f"disk:{tmp_path}:{cap}"
    names = "abcdefg"
    with TieredStore.open(spec, ns, chunk_tokens=16, policy=policy) as store:
        ctx = {n: _save(store, i) for i, n in enumerate(names[:4])}
        for n in "bbbac":  # counts: a=2 b=4 c=2 d=1; recency: d, b, a, c
            assert store.read_chunk(store.lookup(ctx[n]).chunks[0]) is not None
        evicted = []
        for i, n in enumerate(names[4:], start=4):
            ctx[n] = _save(store, i)
            gone = [m for m in ctx if m not in evicted and store.lookup(ctx[m]).num_tokens == 0]
            evicted += gone
        assert evicted == expected
        assert store.stats()["tiers"][tier]["bytes_used"] <= cap


def test_disk_cap_holds_across_restart(tmp_path, ns):
    size = _chunk_bytes(ns)
    spec = f"disk:{tmp_path}:{6 * size}"
    with TieredStore.open(spec, ns, chunk_tokens=16) as store:
        ctx = [_save(store, i) for i in range(10)]
        assert store.stats()["tiers"]["disk"]["entries"] == 6

    def on_disk() -> int:
        return sum(p.stat().st_size for p in tmp_path.rglob("*.kvc"))

    assert on_disk() <= 6 * size
    with TieredStore.open(f"disk:{tmp_path}:{3 * size}", ns, chunk_tokens=16) as store:
        assert on_disk() <= 3 * size
        assert store.stats()["tiers"]["disk"]["bytes_used"] == on_disk()
        assert [store.lookup(t).num_tokens for t in ctx[-3:]] == [16, 16, 16]  # newest kept
        _save(store, 42)
        assert on_disk() <= 3 * size


def test_memory_eviction_keeps_durable_copy(tmp_path, ns):
    size = _chunk_bytes(ns)
    with TieredStore.open(f"memory:{2 * size},disk:{tmp_path}:10MB", ns, chunk_tokens=16) as store:
        ctx = [_save(store, i) for i in range(4)]
        assert store.lookup(ctx[0]).chunks[0].tier == "disk"
        assert store.lookup(ctx[3]).chunks[0].tier == "memory"
        assert store.stats()["tiers"]["memory"]["evictions"] == 2


def test_a_save_larger_than_the_queue_is_dropped_with_a_warning(caplog):
    w = BackgroundWriter(lambda x: None, max_bytes=100)
    with caplog.at_level("WARNING", logger="kvtier.store"):
        assert not w.submit("huge", 101)
    assert w.stats()["dropped_saves"] == 1 and "exceeds the writer queue" in caplog.text
    w.close()


def test_an_engines_writer_queue_holds_a_whole_context_twice(tiny_gqa, monkeypatch):
    """A prompt prefilled in one step is saved as one snapshot of every layer: the queue the
    engine gives its store takes two full-length contexts (else saves over the default bound,
    1 GiB, are dropped: an 8K llama3-8b context)."""
    from kvtier.engine.config import EngineConfig, ReuseConfig
    from kvtier.engine.engine import Engine
    monkeypatch.setattr("kvtier.engine.link.store_link.DEFAULT_QUEUE_BYTES", 4096)  # under one context here
    engine = Engine(tiny_gqa, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024), store="memory:64MB",
                    reuse=ReuseConfig(method="kv"))
    try:
        store = engine.link.store
        assert store is not None
        full = 1024 * store.namespace.bytes_per_token()
        assert full > 4096 and store.writer.max_bytes == 2 * full
    finally:
        engine.close()


def test_writer_drops_oldest_pending_never_blocks():
    gate = threading.Event()
    started = threading.Event()
    done = []

    def process(x):
        started.set()
        gate.wait(10)
        done.append(x)

    w = BackgroundWriter(process, max_bytes=100)
    assert w.submit("first", 10)
    assert started.wait(5)  # "first" is being written; the queue is empty
    assert w.submit("A", 40) and w.submit("B", 40)
    assert w.submit("C", 40)  # 120 > 100: drop the oldest pending (A)
    assert not w.submit("huge", 101)
    assert w.stats()["queue_depth"] == 2 and w.stats()["dropped_saves"] == 2
    assert w.stats()["writing"] == 1  # "first", still being written, is not in the queue
    gate.set()
    assert w.flush(10)
    assert w.stats()["writing"] == 0 and w.stats()["queue_depth"] == 0
    assert done == ["first", "B", "C"]
    w.close()


def test_store_counts_dropped_saves(ns):
    with TieredStore.open("memory:64MB", ns, chunk_tokens=16, writer_queue_bytes=20000) as store:
        k, v, _ = make_state(64)
        for i in range(50):
            store.save(tokens(64, seed=i), 0, k, v, None)  # 16 KiB each: the queue holds one
        store.flush()
        st = store.stats()["writer"]
        assert st["dropped_saves"] > 0 and st["queue_depth"] == 0
        assert st["jobs_done"] + st["dropped_saves"] == 50


def test_emulated_bandwidth_is_reported(tmp_path, ns):
    with TieredStore.open(f"disk:{tmp_path}:10MB:bw=50MB/s:lat=1ms", ns, chunk_tokens=16) as store:
        t = _save(store, 0)
        assert store.read_chunk(store.lookup(t).chunks[0]) is not None
        assert "emulated" in store.stats()["tiers"]["disk"]["emulated"]


def test_staging_hands_out_aligned_buffers_and_reuses_them():
    from kvtier.store.staging import PAGE, Staging

    st = Staging(max_bytes=64 << 20)
    a, b = st.take(3 << 20), st.take(5 << 20)
    assert a.data_ptr() % PAGE == 0 and b.data_ptr() % PAGE == 0 and a.numel() >= 3 << 20
    st.give(a)
    st.give(b)
    assert st.take(4 << 20).data_ptr() == b.data_ptr()  # the smallest that fits, not a new one
    assert st.take(1 << 20).data_ptr() == a.data_ptr()
    st.give(st.take(100 << 20))  # over the idle cap: not kept
    assert st.idle_bytes == 0
