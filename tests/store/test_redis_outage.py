"""A Redis tier that dies costs misses and dropped saves, never an exception; when the server comes
back (same address, empty), the store uses it again by itself."""

import time

import pytest

from kvtier.store import TieredStore
from kvtier.testing.services import RedisServer, redis_binary

from store_testlib import make_state, tokens

pytestmark = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed")


def test_dead_redis_is_a_miss_and_comes_back(ns):
    srv = RedisServer().start()
    try:
        store = TieredStore.open(f"memory:1MB,{srv.url}", ns, chunk_tokens=16)
        redis = store.tier("redis")
        t = tokens(32)
        k, v, _ = make_state(32)
        store.save(t, 0, k, v, None)
        assert store.flush(10)
        for c in store.lookup(t).chunks:
            store.tier("memory").delete(c.key)  # only Redis holds them now
        assert [c.tier for c in store.lookup(t).chunks] == ["redis", "redis"]
        ref = store.lookup(t).chunks[0]

        srv.kill()
        assert store.lookup(t).num_tokens == 0  # no exception: nothing is found
        assert store.read_chunk(ref) is None
        assert not redis.breaker.up and redis.breaker.outages == 1
        refused = redis.breaker.failed_calls
        assert store.lookup(t).num_tokens == 0
        assert redis.breaker.failed_calls > refused  # failing fast while down, not reconnecting per call

        t2 = tokens(16, seed=5)
        store.save(t2, 0, *make_state(16, seed=5)[:2], None)
        assert store.flush(10)
        stats = store.stats()["tiers"]["redis"]  # a scrape works while Redis is down
        assert stats["put_errors"] == 1 and stats["up"] is False and stats["corrupt"] == 0
        assert store.lookup(t2).chunks[0].tier == "memory"  # the memory copy was still written

        srv.start()  # the same port, empty: a restarted server
        deadline = time.monotonic() + 15
        t3 = tokens(16, seed=9)
        while True:
            store.save(t3, 0, *make_state(16, seed=9)[:2], None)
            assert store.flush(10)
            if redis.contains(store.keys_for(t3)[0]):
                break
            assert time.monotonic() < deadline, "the store never went back to Redis"
            time.sleep(0.2)
        assert redis.breaker.up and store.stats()["tiers"]["redis"]["corrupt"] == 0
        store.close()
    finally:
        srv.close()
