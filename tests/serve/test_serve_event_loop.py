"""Slow request work stays off the event loop: while a large /tokenize runs, /health (and so every
stream's next chunk) keeps answering promptly. The probe's worst latency is compared with the
tokenize's own duration, so the test says something on a slow machine as on a fast one."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvtier.serve.config import DEFAULT_MAX_BODY_BYTES

from serve_testlib import Served, serve

PROMPT = "The quick brown fox jumps over the lazy dog; 17 zebras quietly vexed a jumping wizard. " * 22_000  # ~2 MB


@pytest.fixture(scope="module")
def big_body_server(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model, max_body_bytes=DEFAULT_MAX_BODY_BYTES)


def _probe_health(url: str, stop: threading.Event) -> list[float]:
    """Latencies of back-to-back GET /health until `stop` (each a failure past 10 s)."""
    latencies = []
    with httpx.Client(base_url=url, timeout=10) as client:
        while not stop.is_set():
            start = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)
    return latencies


def test_health_answers_while_a_large_prompt_is_tokenized(big_body_server) -> None:
    assert len(PROMPT.encode()) < DEFAULT_MAX_BODY_BYTES
    stop = threading.Event()
    latencies: list[float] = []
    prober = threading.Thread(target=lambda: latencies.extend(_probe_health(big_body_server.url, stop)))
    prober.start()
    try:
        time.sleep(0.2)  # the prober is connected and answered
        start = time.monotonic()
        r = httpx.post(big_body_server.url + "/tokenize", json={"prompt": PROMPT}, timeout=120)
        took = time.monotonic() - start
    finally:
        stop.set()
        prober.join(timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(big_body_server.engine.encode(PROMPT, add_special_tokens=True))
    assert len(latencies) >= 3
    worst = max(latencies)
    # The tokenize took seconds; /health never waited for it.
    assert worst < 1.0 and worst < took / 3, f"/health waited {worst:.2f} s while /tokenize took {took:.2f} s"


def test_tokenize_holds_an_admission_slot_while_it_runs(tiny_model) -> None:
    """A tokenize counts against the server's capacity, as a generation does: with room for one
    request, a second call during a long tokenize gets 429, and the slot is back afterwards."""
    with contextlib.contextmanager(serve)(tiny_model, max_num_seqs=1, max_queued_requests=0,
                                          max_body_bytes=DEFAULT_MAX_BODY_BYTES) as s:
        done: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: done.append(
            httpx.post(s.url + "/tokenize", json={"prompt": PROMPT}, timeout=120)))
        worker.start()
        deadline = time.monotonic() + 60
        while s.in_flight == 0 and worker.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        busy = httpx.post(s.url + "/tokenize", json={"prompt": "hello"}, timeout=30)
        worker.join(timeout=120)
        assert done and done[0].status_code == 200
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1", busy.text
        assert s.in_flight == 0
        assert httpx.post(s.url + "/detokenize", json={"tokens": [1, 2]}, timeout=30).status_code == 200
