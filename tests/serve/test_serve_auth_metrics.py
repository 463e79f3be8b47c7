"""API key enforcement, /health, and the Prometheus metrics."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_testlib import TINY, Served, serve

KEY = "s3cret-key"
CHAT_BODY = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_api_key_required(keyed_server: Served) -> None:
    with keyed_server.client() as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            resp = c.post("/v1/chat/completions", json=CHAT_BODY, headers=headers)
            assert resp.status_code == 401, resp.text
            assert resp.json()["error"]["code"] == "invalid_api_key"
            assert resp.headers["www-authenticate"] == "Bearer"
        # Refused before the body is read: malformed JSON without a key is still a 401.
        assert c.post("/v1/completions", content=b"{oops").status_code == 401
        assert c.get("/v1/models").status_code == 401
        ok = c.post("/v1/chat/completions", json=CHAT_BODY, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200, ok.text
        # Only the liveness probe stays open; metrics and the schema need the key too.
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 401
        assert c.get("/openapi.json").status_code == 401
        assert c.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        schema = c.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_api_key_with_openai_client(keyed_server: Served) -> None:
    good = openai.OpenAI(base_url=keyed_server.v1, api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model=TINY, messages=CHAT_BODY["messages"], max_tokens=2).choices
    bad = openai.OpenAI(base_url=keyed_server.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health(tiny_server: Served) -> None:
    body = httpx.get(tiny_server.url + "/health").json()
    assert body["status"] == "ok" and body["model"] == TINY


def test_health_reports_dead_engine(tiny_model) -> None:
    for served in serve(tiny_model):
        served.background.close()  # the step loop is gone: requests could never finish
        with served.client() as c:
            assert c.get("/health").status_code == 503
            resp = c.post("/v1/chat/completions", json=CHAT_BODY)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_stopped"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels but model_name): value}: one model per server here, and every
    family carries its name (tests/serve/test_dashboard.py checks that)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics(tiny_server: Served) -> None:
    with tiny_server.client() as c:
        before = _samples(c.get("/metrics").text)
        msgs = [{"role": "system", "content": "A shared system prompt that is long enough to fill a block."},
                {"role": "user", "content": "metrics please"}]
        for _ in range(2):  # the second request reuses the first one's prompt blocks
            body = {"model": TINY, "messages": msgs, "max_tokens": 4, "temperature": 0}
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        assert c.post("/v1/chat/completions", json={"model": "nope", "messages": msgs}).status_code == 404
        resp = c.get("/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = _samples(resp.text)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("kvtier:time_to_first_token_seconds_count", endpoint="chat") == 2
    assert delta("kvtier:inter_token_latency_seconds_count", endpoint="chat") >= 2
    assert delta("kvtier:http_requests_total", path="/v1/chat/completions", code="200") == 2
    assert delta("kvtier:http_requests_total", path="/v1/chat/completions", code="404") == 1
    assert delta("kvtier:request_success_total", endpoint="chat", finished_reason="length") + \
        delta("kvtier:request_success_total", endpoint="chat", finished_reason="stop") == 2
    assert delta("kvtier:prompt_tokens_reused_total", tier="device") > 0
    assert delta("kvtier:prompt_tokens_reused_by_method_total", method="device_cache") > 0
    assert delta("kvtier:generation_tokens_total") >= 2
    assert delta("kvtier:prefix_cache_hits_total") > 0
    for gauge in ("kvtier:num_requests_waiting", "kvtier:num_requests_running", "kvtier:kv_blocks_free",
                  "kvtier:kv_blocks_total"):
        assert (gauge, ()) in after
    # Store families are exported even before a store is attached to the engine.
    for family in ("kvtier:store_bytes", "kvtier:store_hits_total", "kvtier:store_evictions_total",
                   "kvtier:store_dropped_saves_total"):
        assert re.search(rf"^# TYPE {family} ", resp.text, re.M), family


def test_store_reuse_is_reported(tiny_model) -> None:
    """With a store and no device prefix cache, later turns are restored from the store: usage,
    the per-tier and per-method counters and the store gauges all show it."""
    for served in serve(tiny_model, store="memory:64MB", prefix_cache=False):
        client = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0)
        # Long enough that the stored prefix passes the engine's minimum worth restoring (32 tokens).
        system = "You are a careful assistant. " * 8
        messages = [{"role": "system", "content": system}]
        cached = []
        for question in ("First question?", "Second question?", "Third question?"):
            messages.append({"role": "user", "content": question})
            resp = client.chat.completions.create(model=TINY, messages=messages, max_tokens=6, temperature=0)
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            cached.append(resp.usage.prompt_tokens_details.cached_tokens)
            assert served.engine.flush(30)  # this turn's saves are stored before the next
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached
        s = _samples(httpx.get(served.url + "/metrics").text)
        assert _value(s, "kvtier:prompt_tokens_reused_total", tier="memory") == sum(cached)
        assert _value(s, "kvtier:prompt_tokens_reused_by_method_total", method="kv") == sum(cached)
        assert _value(s, "kvtier:restores_total") == 2 and _value(s, "kvtier:saves_total") > 0
        assert _value(s, "kvtier:store_bytes", tier="memory") > 0


class FakeStore:
    """TieredStore.stats()'s shape, to check the store metrics without a real store."""

    def stats(self) -> dict:
        return {
            "tiers": {"memory": {"bytes_used": 1024, "capacity": 4096, "hits": 7, "misses": 2, "evictions": 3},
                      "disk": {"bytes_used": 10, "capacity": 100, "hits": 1, "misses": 0, "evictions": 0}},
            "writer": {"dropped_saves": 5, "queue_depth": 1, "writing": 1},
            "store": {"chunks_written": 11, "chunks_skipped": 2},
        }


class BrokenStore:
    def stats(self) -> dict:
        raise ConnectionError("redis is down")


def test_store_metrics(tiny_model) -> None:
    for served in serve(tiny_model):
        served.engine.link.store = FakeStore()
        s = _samples(httpx.get(served.url + "/metrics").text)
        assert _value(s, "kvtier:store_bytes", tier="memory") == 1024
        assert _value(s, "kvtier:store_hits_total", tier="memory") == 7
        assert _value(s, "kvtier:store_evictions_total", tier="memory") == 3
        assert _value(s, "kvtier:store_dropped_saves_total") == 5
        assert _value(s, "kvtier:store_write_queue_depth") == 1
        assert _value(s, "kvtier:store_writer_busy") == 1
        assert _value(s, "kvtier:store_chunks_written_total") == 11
        assert _value(s, "kvtier:store_chunks_skipped_total") == 2
        served.engine.link.store = BrokenStore()  # a scrape must survive an unreachable tier
        assert httpx.get(served.url + "/metrics").status_code == 200
