"""Redis key names and SCAN patterns: what a request controls never reaches a key name (tenants,
cache salts and sessions reach the store only hashed into hex chain roots and chunk keys); the
prefix the operator gives in --store is matched literally by every SCAN (iterate, clear, the admin
lookup), so a prefix holding * ? [ ] never reaches another prefix's keys."""
from __future__ import annotations

import os

from kvtier.store import TieredStore
from kvtier.store.keys import chunk_spans, salted_root
from kvtier.store.tiers.redis_tier import glob_literal
from kvtier.store.validate import is_key

from store_testlib import make_state, tokens

C = 16


def _save(store: TieredStore, t: list[int], seed: int = 0) -> None:
    k, v, _ = make_state(len(t), seed)
    store.save(t, 0, k, v, None)
    assert store.flush(30)


def test_glob_literal_escapes_every_special_character():
    assert glob_literal("plain-prefix_1") == "plain-prefix_1"
    assert glob_literal("a*b?c[d]e\\f") == "a\\*b\\?c\\[d\\]e\\\\f"


def test_request_controlled_salts_become_hex_keys():
    root = "0" * 32
    for salt in ("tenant:*", "a]b[c?", "../../x", "x" * 1000, "\u00e9\n:"):
        salted = salted_root(root, salt)
        assert is_key(salted)
        assert all(is_key(s.key) and is_key(s.parent) for s in chunk_spans(salted, list(range(40)), C))


def test_a_clear_with_glob_characters_in_its_prefix_touches_only_its_own_keys(redis_server, ns):
    import redis

    base = "glob" + str(os.getpid())
    other, odd = f"{base}x", f"{base}?"
    client = redis.Redis.from_url(redis_server)
    try:
        with TieredStore.open(f"{redis_server}/0?prefix={other}", ns, chunk_tokens=C) as s:
            _save(s, tokens(C + 5))
        before = sorted(client.scan_iter(match=f"{other}:*"))
        assert before
        with TieredStore.open(f"{redis_server}/0?prefix={odd}", None, chunk_tokens=C) as admin:
            assert admin.clear() == {"redis": 0}
        assert sorted(client.scan_iter(match=f"{other}:*")) == before
    finally:
        for k in client.scan_iter(match=f"{base}*"):
            client.delete(k)
        client.close()
