"""Exact tests of the integer/string parts: keys, spec parsing, eviction orders."""
import logging

import pytest

from kvtier.store import FIFOPolicy, LFUPolicy, LRUPolicy, SpecError, chunk_key, chunk_spans, parse_spec
from kvtier.store.keys import store_digest
from kvtier.store.preflight import warn_if_unsealed
from kvtier.store.seal import Seal

from store_testlib import make_ns


def test_keys_chain_and_partial_length():
    root = store_digest(make_ns().digest(), 4)
    spans = chunk_spans(root, list(range(10)), 4)
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8), (8, 10)]
    assert spans[1].parent == spans[0].key and spans[2].parent == spans[1].key
    assert spans[0].key == chunk_key(root, [0, 1, 2, 3])
    # Same tokens in the second chunk but a different first chunk: a different key.
    other = chunk_spans(root, [9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert other[1].key != spans[1].key
    # The partial chunk's key depends on its length; the full chunk at that place differs.
    assert chunk_spans(root, list(range(11)), 4)[2].key != spans[2].key
    assert len(chunk_spans(root, list(range(10)), 4, include_partial=False)) == 2


def test_namespace_changes_every_key():
    a = make_ns().digest()
    assert make_ns(storage="float16").digest() != a
    assert make_ns(model="model-b").digest() != a
    assert store_digest(a, 64) != store_digest(a, 32)


def test_spec_parsing():
    s = parse_spec("memory:8GB,disk:/data/a:200GB:bw=100MB/s:lat=1ms,disk:/data/b:1.5GiB:bw=100MB/s:lat=1ms,"
                   "redis://h:6379/1?prefix=x&ttl=1d")
    assert s.memory.capacity == 8 * 10**9
    assert s.disk.paths == ("/data/a", "/data/b")
    assert s.disk.capacities == (200 * 10**9, int(1.5 * 2**30))
    assert s.disk.emulation.bandwidth == 100e6 and s.disk.emulation.latency == pytest.approx(1e-3)
    assert s.redis.url == "redis://h:6379/1" and s.redis.prefix == "x" and s.redis.ttl == 86400
    assert parse_spec("redis+cluster://h:7000").redis.cluster


@pytest.mark.parametrize("bad, words", [
    ("", "empty"), ("memory", "memory:SIZE"), ("memory:8XB", "512MB"), ("disk:/a", "disk:PATH:SIZE"),
    ("tape:/x:1GB", "unknown tier"), ("disk:/a:1GB:bw=fast", "bw=100MB/s"),
    ("disk:/a:1GB:foo=1", "unknown option"), ("disk:/a:1GB,disk:/a:2GB", "twice"),
])
def test_bad_specs_say_what_to_do(bad, words):
    with pytest.raises(SpecError, match=words):
        parse_spec(bad)


@pytest.mark.parametrize("spec, shown", [
    ("redis://:hunter2pass@h:6379/1?prefix=x", "redis://h:6379/1"),
    ("memory:1GB,redis+cluster://h:7000", "Redis Cluster tier redis://h:7000"),
])
def test_an_unsealed_redis_tier_warns_once(spec, shown, caplog):
    """Whoever can write to a shared Redis can plant state an unsealed store serves: one line says
    so, names the tier (never its password) and how to seal it."""
    caplog.set_level(logging.WARNING, logger="kvtier.store")
    warn_if_unsealed(parse_spec(spec), Seal())
    assert len(caplog.records) == 1 and caplog.records[0].levelno == logging.WARNING
    message = caplog.records[0].getMessage()
    assert shown in message and "hunter2pass" not in message and "\n" not in message
    assert "plant" in message and "--store-secret-file" in message
    caplog.clear()
    warn_if_unsealed(parse_spec(spec), Seal(b"0123456789abcdef"))
    assert not caplog.records


def test_a_store_without_redis_does_not_warn(caplog, tmp_path):
    caplog.set_level(logging.WARNING, logger="kvtier.store")
    warn_if_unsealed(parse_spec(f"memory:1GB,disk:{tmp_path}:1GB"), Seal())
    assert not caplog.records


def _evict_all(policy, protected=()):
    order = []
    for k in policy.victims(10**9, protected):
        order.append(k)
        policy.remove(k)
    return order


def test_lru_order():
    p = LRUPolicy()
    for k in "abcd":
        p.insert(k, 10)
    p.touch("a")
    p.touch("c")
    assert _evict_all(p) == ["b", "d", "a", "c"]


def test_lfu_order_ties_by_recency():
    p = LFUPolicy()
    for k in "abcd":
        p.insert(k, 10)
    for k in "aacab":  # counts: a=4, b=2, c=2, d=1; b touched after c
        p.touch(k)
    assert _evict_all(p) == ["d", "c", "b", "a"]


def test_fifo_ignores_access():
    p = FIFOPolicy()
    for k in "abcd":
        p.insert(k, 10)
    p.touch("a")
    assert _evict_all(p, protected={"b"}) == ["a", "c", "d"]


def test_victims_stop_at_needed_bytes():
    p = LRUPolicy()
    p.insert("a", 10)
    p.insert("b", 5)
    p.insert("c", 7)
    assert list(p.victims(12)) == ["a", "b"]
    assert list(p.victims(10)) == ["a"]


def test_victims_read_past_many_protected_keys_in_order():
    """The front is read a batch at a time: protected keys and keys the caller keeps (a failed
    delete) straddle batch boundaries, and each victim is still the next in LRU order."""
    p = LRUPolicy()
    keys = [f"k{i:03d}" for i in range(300)]
    for k in keys:
        p.insert(k, 1)
    protected = set(keys[:150:2]) | set(keys[100:170])
    got = []
    for key in p.victims(60, protected):
        got.append(key)
        if key != "k171":  # the caller fails to delete one: it stays, and is not offered again
            p.remove(key)
    want = [k for k in keys if k not in protected][:60]
    assert got == want and "k171" in want and "k171" in p


def test_score_policy_reproduces_the_papers_figure_14():
    """A is read 1.5x as often as B; half of A's tokens are important, all of B's. With room for
    one chunk in the faster tier, frequency keeps A and moves B's important vectors on each of its
    reads (10 x 2 = 20); the score (accesses x important share: A 15 x .5 = 7.5, B 10 x 1 = 10)
    keeps B and moves A's (15 x 1 = 15)."""
    from kvtier.store.policy import LFUPolicy, ScorePolicy

    important = {"A": 1, "B": 2}  # important vectors per chunk of 2
    reads = ["A", "A", "B", "A", "B"] * 5  # 15 A, 10 B

    def kept(policy) -> str:
        for key in ("A", "B"):
            policy.insert(key, 1)
        rest = list(reads)
        rest.remove("A")  # each chunk's first read inserted it
        rest.remove("B")
        for key in rest:
            policy.touch(key)
        if isinstance(policy, ScorePolicy):
            policy.observe("A", 0.5)
            policy.observe("B", 1.0)
        victim = next(policy.victims(1))
        return "B" if victim == "A" else "A"

    def moved(resident: str) -> int:
        return sum(important[k] for k in reads if k != resident)

    assert kept(LFUPolicy()) == "A" and moved("A") == 20
    score = ScorePolicy()
    assert kept(score) == "B" and moved("B") == 15
    assert score.score("A") == 7.5 and score.score("B") == 10.0
    # Admission: with no room, A (7.5) does not displace B (10); a chunk read 11 times at 100% would.
    score.remove("A")
    assert not score.admit("A", fits=False) and score.admit("A", fits=True)
    for _ in range(11):
        score.access("C")
    assert score.admit("C", fits=False)
    # The moving average: 0.3 x new + 0.7 x old after the first observation.
    score.observe("B", 0.0)
    assert score.score("B") == pytest.approx(10 * 0.7)
