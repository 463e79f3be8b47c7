"""Large JSON bodies are decoded and validated on a worker thread, never on the event loop, once,
with FastAPI's own errors; at most PARSE_THREADS at a time."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvtier.serve.bodies import MAX_DEPTH, OFF_LOOP_BYTES, PARSE_THREADS, OffLoopBodyRoute, deeper_than
from kvtier.serve.errors import install_error_handlers

VALIDATED_ON: list[int] = []  # the thread of each validation of Probe.text
HOLD = threading.Event()  # set: validations pass at once; clear: they wait (the concurrency test)
ACTIVE = [0, 0]  # validations running now, the most at once
LOCK = threading.Lock()


class Probe(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str
    n: int = Field(0, ge=0)
    data: list | None = None

    @field_validator("text")
    @classmethod
    def _record(cls, v: str) -> str:
        VALIDATED_ON.append(threading.get_ident())
        with LOCK:
            ACTIVE[0] += 1
            ACTIVE[1] = max(ACTIVE)
        try:
            HOLD.wait(timeout=30)
        finally:
            with LOCK:
                ACTIVE[0] -= 1
        return v


@pytest.fixture()
def client() -> Iterator[tuple[TestClient, list[int]]]:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=OffLoopBodyRoute)
    loop_threads: list[int] = []

    @router.post("/probe")
    async def probe(body: Probe) -> dict:
        loop_threads.append(threading.get_ident())
        return {"length": len(body.text), "n": body.n}

    app.include_router(router)
    VALIDATED_ON.clear()
    ACTIVE[:] = [0, 0]
    HOLD.set()
    with TestClient(app) as c:
        yield c, loop_threads


def _raw(body: dict, size: int) -> bytes:
    """`body` as JSON padded with whitespace to `size` bytes (the same value, any size)."""
    raw = json.dumps(body).encode()
    return raw + b" " * max(0, size - len(raw))


def _post(c: TestClient, raw: bytes):
    return c.post("/probe", content=raw, headers={"content-type": "application/json"})


def test_a_large_body_is_validated_once_on_a_worker_thread(client) -> None:
    c, loop_threads = client
    r = _post(c, _raw({"text": "x" * 1000, "n": 3}, OFF_LOOP_BYTES))
    assert r.status_code == 200 and r.json() == {"length": 1000, "n": 3}
    assert len(VALIDATED_ON) == 1, "FastAPI validated the body again"
    assert VALIDATED_ON[0] != loop_threads[0]


def test_a_small_body_is_validated_on_the_loop_as_before(client) -> None:
    c, loop_threads = client
    r = _post(c, _raw({"text": "x"}, OFF_LOOP_BYTES - 1))
    assert r.status_code == 200 and r.json() == {"length": 1, "n": 0}
    assert VALIDATED_ON == loop_threads


@pytest.mark.parametrize("body", [{"text": "x", "n": -1}, {"text": 5}, {"n": 1}, {"text": "x", "extra": 1}, [1]],
                         ids=["out of range", "wrong type", "missing", "unknown field", "not an object"])
def test_a_large_body_gets_the_errors_a_small_one_gets(client, body) -> None:
    c, _ = client
    small, large = _post(c, _raw(body, 0)), _post(c, _raw(body, OFF_LOOP_BYTES))
    assert small.status_code == large.status_code == 400
    assert small.json() == large.json(), (small.json(), large.json())


@pytest.mark.parametrize("raw", [b'{"text": ', b"[" * 5000 + b"]" * 5000, b'{"text": "\xff"}'],
                         ids=["truncated", "nested 5000 deep", "invalid utf-8"])
def test_large_invalid_json_is_the_same_400(client, raw: bytes) -> None:
    c, _ = client
    small, large = _post(c, raw), _post(c, raw + b" " * OFF_LOOP_BYTES)
    assert small.status_code == large.status_code == 400
    assert small.json()["error"]["code"] == large.json()["error"]["code"] == "invalid_json"


def test_at_most_parse_threads_bodies_are_worked_on_at_once(client) -> None:
    c, _ = client
    HOLD.clear()
    n = PARSE_THREADS + 2
    try:
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(_post, c, _raw({"text": str(i)}, OFF_LOOP_BYTES)) for i in range(n)]
            deadline = time.monotonic() + 30
            while ACTIVE[0] < PARSE_THREADS:
                assert time.monotonic() < deadline, ACTIVE
                time.sleep(0.01)
            time.sleep(0.3)  # room for a third to start, were there no cap
            assert ACTIVE[1] == PARSE_THREADS
            HOLD.set()
            assert [f.result().status_code for f in futures] == [200] * n
    finally:
        HOLD.set()
    assert ACTIVE[1] == PARSE_THREADS and len(VALIDATED_ON) == n


def _nested(levels: int) -> list:
    """`levels` lists within each other: [[...[]...]]."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_deeper_than_counts_arrays_and_objects() -> None:
    assert not deeper_than("x" * 100, 0) and not deeper_than(3, 0)
    assert not deeper_than({"a": [1, {"b": []}]}, 4) and deeper_than({"a": [1, {"b": []}]}, 3)
    assert not deeper_than(_nested(100_000), 100_000) and deeper_than(_nested(100_000), 99_999)


@pytest.mark.parametrize("size", [0, OFF_LOOP_BYTES], ids=["small", "large"])
def test_nesting_up_to_max_depth_is_read_at_any_size(client, size: int) -> None:
    c, _ = client
    r = _post(c, _raw({"text": "x", "data": _nested(MAX_DEPTH - 1)}, size))  # the body's own object: one more
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("levels", [MAX_DEPTH, 960, 980, 5000])
def test_nesting_past_max_depth_is_the_same_400_at_any_size(client, levels: int) -> None:
    """json.loads alone would take ~990 levels on a worker thread and fewer on the loop."""
    c, _ = client
    body = b'{"text": "x", "data": ' + b"[" * levels + b"]" * levels + b"}"  # levels + 1 deep
    for r in (_post(c, body), _post(c, body + b" " * OFF_LOOP_BYTES)):
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert f"nested deeper than {MAX_DEPTH}" in r.json()["error"]["message"]
