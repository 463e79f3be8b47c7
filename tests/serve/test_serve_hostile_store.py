"""Through the server: whatever someone writes into the shared Redis, every request is a 200 (a miss
where the state is bad), and /metrics counts what was refused (findings 2 and 4 of issue 26)."""

from __future__ import annotations

import contextlib

import openai
import pytest
import redis
import torch

from kvtier.store import format as fmt
from kvtier.testing.services import redis_binary

from serve_testlib import TINY, metric, metrics, serve

served_with = contextlib.contextmanager(serve)
pytestmark = pytest.mark.skipif(redis_binary() is None, reason="redis-server is not installed")
SYSTEM = "You are a careful assistant. " * 8


def _ask(s, i: int) -> tuple[str, int]:
    client = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=60)
    r = client.chat.completions.create(model=TINY, max_tokens=4, temperature=0, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}])
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_junk_index_members_and_planted_chunks_are_misses_not_500s(tiny_model, tiny_server, redis_url):
    with served_with(tiny_model, store=redis_url, prefix_cache=False) as s:
        first, _ = _ask(s, 0)
        assert s.engine.flush(30)
        store = s.engine.link.store
        tier = store.tier("redis")
        raw = tier.client
        # Junk in every partial index, and a string where an index set belongs.
        for rk in list(raw.scan_iter(match=f"{tier.spec.prefix}:*:p:*")):
            raw.sadd(rk, b"x:y", b"-1:zz")
        raw.set(f"{tier.spec.prefix}:{tier.ns}:p:{store.root}", b"not a set")
        # Every stored chunk replaced by a well-formed one of twice the span under the same key.
        ns = store.namespace
        for rk in list(raw.scan_iter(match=f"{tier.spec.prefix}:*:c:*")):
            key = rk.decode().rsplit(":", 1)[-1]
            header = fmt.parse_header(raw.get(rk))
            shape = ns.part_shape("k", 2 * header.tokens)
            layers = {li: {"k": torch.ones(shape), "v": torch.ones(shape)} for li in range(ns.num_layers)}
            raw.set(rk, fmt.pack(ns, store.root, key, header.parent, header.index, header.start, False,
                                 layers).to_bytes())
        for i in range(3):
            text, cached = _ask(s, 0 if i == 0 else i)
            assert text == _ask(tiny_server, 0 if i == 0 else i)[0]
        m = metrics(s.url)
        assert metric(m, "kvtier:store_errors_total", tier="redis") >= 1
        assert metric(m, "kvtier:store_corrupt_total", tier="redis") >= 1
        assert first == _ask(tiny_server, 0)[0]


def test_an_acl_user_without_rights_gets_200s(tiny_model, tiny_server, redis_server):
    admin = redis.Redis.from_url(redis_server)
    admin.execute_command("ACL", "SETUSER", "serve-nokeys", "on", ">pw2", "~elsewhere:*", "+@all")
    host = redis_server.split("//", 1)[1]
    try:
        with served_with(tiny_model, store=f"redis://serve-nokeys:pw2@{host}/0?prefix=acl", prefix_cache=False) as s:
            for i in range(3):
                assert _ask(s, i)[0] == _ask(tiny_server, i)[0]
                assert s.engine.flush(30)
            m = metrics(s.url)
            assert metric(m, "kvtier:store_errors_total", tier="redis") >= 1
    finally:
        admin.execute_command("ACL", "DELUSER", "serve-nokeys")
