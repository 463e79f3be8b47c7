"""A client that goes away cancels its request: the engine aborts it and frees its KV blocks.
Also: many clients at once all get complete streams."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest

from serve_testlib import TINY, Served, metric, metrics, serve, wait_idle

LONG_WINDOW = 4096  # a generation that would run for many seconds if it were not aborted


@pytest.fixture(scope="module")
def long_server(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model, window=LONG_WINDOW, kv_bytes=32 << 20, default_max_tokens=None)


def _long_chat(stream: bool) -> dict:
    # ignore_eos is not in the API, but a random-weight model rarely emits EOS; max_tokens is the
    # whole window so the request cannot finish on its own within the test's timeout.
    return {"model": TINY, "messages": [{"role": "user", "content": "go"}], "max_tokens": LONG_WINDOW - 64,
            "temperature": 1.0, "seed": 3, "stream": stream}


def _cancelled(url: str) -> float:
    return metric(metrics(url), "kvtier:request_success_total", endpoint="chat", finished_reason="abort")


def _busy(engine) -> bool:
    return bool(engine.scheduler.running) and engine.pool.num_free < engine.pool.num_blocks


def test_stream_disconnect_frees_blocks(long_server: Served) -> None:
    before = _cancelled(long_server.url)
    with httpx.Client(base_url=long_server.url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=_long_chat(True)) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = [next(lines) for _ in range(6)]  # a few events: the request is decoding
            assert any(line.startswith("data: ") for line in seen)
            assert _busy(long_server.engine)
        # Leaving the block closes the connection mid-stream.
    t0 = time.monotonic()
    wait_idle(long_server.engine, timeout=5)  # running to the end would take far longer
    assert time.monotonic() - t0 < 5
    assert _cancelled(long_server.url) == before + 1


def test_non_stream_disconnect_frees_blocks(long_server: Served) -> None:
    before = _cancelled(long_server.url)
    with httpx.Client(base_url=long_server.url, timeout=httpx.Timeout(1.0)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=_long_chat(False))
    wait_idle(long_server.engine, timeout=5)
    assert _cancelled(long_server.url) == before + 1


async def _stream(client: httpx.AsyncClient, i: int) -> tuple[bool, int]:
    body = {"model": TINY, "messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": 16,
            "temperature": 0.8, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    finish = done = False
    tokens = -1
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = True
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    return finish and done, tokens


def test_many_concurrent_streams(tiny_server: Served) -> None:
    async def main() -> list[tuple[bool, int]]:
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60) as client:
            return await asyncio.gather(*(_stream(client, i) for i in range(24)))

    results = asyncio.run(main())
    assert all(ok for ok, _ in results), results
    assert all(0 < n <= 16 for _, n in results), results
    wait_idle(tiny_server.engine)
