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

from kvtier.serve import bodies
from kvtier.serve.bodies import MAX_DEPTH, MAX_KEYS, OFF_LOOP_BYTES, PARSE_THREADS, OffLoopBodyRoute, shape_problem
from kvtier.serve.errors import install_error_handlers

VALIDATED_ON: list[int] = []  # the thread of each validation of Probe.text
HOLD = threading.Event()  # set: validations pass at once; clear: they wait (the concurrency test)
ACTIVE = [0, 0]  # validations running now, the most at once
LOCK = threading.Lock()


class Probe(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: str
    n: int = Field(0, ge=0)
    data: list | dict | None = None

    @field_validator("n")
    @classmethod
    def _bug(cls, v: int) -> int:
        if v == 13:
            raise KeyError("a validator's own bug")
        return v

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
    with TestClient(app, raise_server_exceptions=False) as c:  # a fault is the app's 500, as served
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


def test_past_max_waiting_large_bodies_a_429_comes_at_once(client, monkeypatch) -> None:
    """Parses queued past MAX_WAITING would be seconds of work ahead of every admission check."""
    c, _ = client
    monkeypatch.setattr(bodies, "MAX_WAITING", 1)
    HOLD.clear()
    try:
        with ThreadPoolExecutor(PARSE_THREADS + 1) as pool:
            futures = [pool.submit(_post, c, _raw({"text": str(i)}, OFF_LOOP_BYTES)) for i in range(PARSE_THREADS + 1)]
            deadline = time.monotonic() + 30
            while ACTIVE[0] < PARSE_THREADS:  # two parsing; the third waits for a thread
                assert time.monotonic() < deadline, ACTIVE
                time.sleep(0.01)
            time.sleep(0.2)
            r = _post(c, _raw({"text": "late"}, OFF_LOOP_BYTES))
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "too_many_requests"
            HOLD.set()
            assert [f.result().status_code for f in futures] == [200] * (PARSE_THREADS + 1)
    finally:
        HOLD.set()
    assert _post(c, _raw({"text": "x"}, OFF_LOOP_BYTES)).status_code == 200  # none waiting: read again


def _nested(levels: int) -> list:
    """`levels` lists within each other: [[...[]...]]."""
    value: list = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_shape_problem_counts_arrays_and_objects_and_members() -> None:
    deep = "nested deeper than"
    assert shape_problem("x" * 100, 0, 1) is None and shape_problem(3, 0, 1) is None
    assert shape_problem({"a": [1, {"b": []}]}, 4, 9) is None and deep in str(shape_problem({"a": [1, {"b": []}]}, 3, 9))
    assert shape_problem(_nested(100_000), 100_000, 9) is None and deep in str(shape_problem(_nested(100_000), 99_999, 9))
    assert shape_problem([{"a": 1, "b": 2}], 9, 2) is None
    assert shape_problem([[], {"a": 1, "b": 2, "c": 3}], 9, 2) == "an object of more than 2 members"
    assert shape_problem({str(i): 0 for i in range(3)}, 9, 2) == "an object of more than 2 members"


@pytest.mark.parametrize("size", [0, OFF_LOOP_BYTES], ids=["small", "large"])
def test_an_object_of_more_than_max_keys_members_is_the_same_400_at_any_size(client, size: int) -> None:
    """(a million unknown members would each be a validation error to build and describe)"""
    c, _ = client
    ok = _post(c, _raw({"text": "x", "data": {str(i): 0 for i in range(MAX_KEYS)}}, size))
    assert ok.status_code == 200, ok.text
    r = _post(c, _raw({"text": "x", "data": {str(i): 0 for i in range(MAX_KEYS + 1)}}, size))
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert f"an object of more than {MAX_KEYS} members" in r.json()["error"]["message"]


def test_a_validators_fault_is_the_same_logged_500_at_any_size(client, caplog) -> None:
    c, _ = client
    for size in (0, OFF_LOOP_BYTES):
        caplog.clear()
        r = _post(c, _raw({"text": "x", "n": 13}, size))
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
        assert "a validator's own bug" not in r.text  # internals stay in the log
        assert any(rec.exc_info and "a validator's own bug" in str(rec.exc_info[1]) + str(rec.exc_info[1].__cause__)
                   for rec in caplog.records), caplog.records


def test_the_collector_is_paused_while_bodies_parse_and_resumed_as_it_was() -> None:
    import gc

    assert gc.isenabled()
    with bodies._collector_paused():
        with bodies._collector_paused():  # two parses at once
            assert not gc.isenabled()
        assert not gc.isenabled()  # the first still parses
    assert gc.isenabled()
    gc.disable()
    try:
        with bodies._collector_paused():
            pass
        assert not gc.isenabled()  # paused by someone else: left so
    finally:
        gc.enable()


def test_a_large_body_whose_client_left_while_queued_is_not_parsed(client, monkeypatch) -> None:
    c, _ = client
    parsed: list[bytes] = []
    monkeypatch.setattr(bodies, "_parse", lambda validate, raw: parsed.append(raw) or pytest.fail("parsed"))

    async def gone(self) -> bool:
        return True

    monkeypatch.setattr(bodies._ThreadParsedRequest, "is_disconnected", gone)
    r = _post(c, _raw({"text": "x"}, OFF_LOOP_BYTES))
    assert r.status_code == 499 and not parsed


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
