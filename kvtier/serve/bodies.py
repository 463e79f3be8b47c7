"""JSON request bodies decoded and validated on a worker thread, not on the event loop.

FastAPI decodes a body and validates it against the route's model on the event loop. A body at
the size limit made of many small objects (a chat of a hundred thousand one-letter messages)
costs a third of a second there, a stall of every other request and stream. Here a large body is
decoded and validated by FastAPI's own field on a worker thread, and FastAPI's validation of the
result is then a type check. The worker still holds the GIL while `json.loads` runs (C code), so
the loop can wait for that part; with the cyclic garbage collector paused meanwhile (a body's
JSON has no cycles, and a full collection scans every object of the process each time the body's
containers trigger one: most of the time of a body made of empty arrays) that is tens of
milliseconds at the size limit. Validation gives the loop turns. At most PARSE_THREADS bodies are
worked on at once, so a flood of large bodies queues instead of taking the GIL from the loop with
many threads (past MAX_WAITING waiting, a 429), and a body whose client has gone by its turn is
not parsed.

The errors are FastAPI's: invalid JSON raises the same exceptions from `Request.json()`, and
field errors reach the same handler (`BodyInvalid` carries them through FastAPI's body reader,
which lets only HTTP exceptions pass); a validator's fault (a bug) is a logged 500 as it is on the
loop. Two limits are added, the same for a body of any size: JSON nested deeper than MAX_DEPTH, or
with an object of more than MAX_KEYS members, is invalid. Without the first the depth
`json.loads` accepts would be what the caller's stack leaves of the recursion limit (about 960 on
the loop, 990 on a worker), and a value accepted deep on a worker could fail `json.dumps` on the
loop; without the second one object could carry a million unknown members, each a validation
error to build and describe (the schemas stop a list at its first bad item: `fail_fast`).
"""

from __future__ import annotations

import gc
import json
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
from anyio.lowlevel import RunVar
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

log = logging.getLogger("kvtier.serve")

OFF_LOOP_BYTES = 32 << 10  # on the loop, a body below this takes at most a few milliseconds
PARSE_THREADS = 2
# Large bodies waiting for a parse thread, at most: past it a 429 at once (Retry-After), not seconds
# of parsing queued ahead of the admission check every request meets after its body.
MAX_WAITING = 32
MAX_DEPTH = 512  # arrays and objects within each other; a grammar's own limit is lower (grammar_limits.py)
# Members of one object: logit_bias takes 1,024; a schema past the grammar limits is refused there, naming its field.
MAX_KEYS = 16384
_LIMITER: RunVar[anyio.CapacityLimiter] = RunVar("kvtier_body_parse_limiter")  # one per event loop


class BodyInvalid(HTTPException):
    """Field errors of a body validated off the loop, in FastAPI's `RequestValidationError` form."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(400)
        self.errors = errors


class _ValidatorFault(Exception):
    """A validator raised what validation never should (a bug): a 500, as on the loop."""


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON body, when large, is decoded and validated off the event loop. Only
    a route whose one body parameter is the whole body: FastAPI wraps several (or an embedded
    one) in a model of its own, read as a dict afterwards; such routes keep FastAPI's reader."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        params = self.dependant.body_params
        if field is None or len(params) != 1 or getattr(params[0].field_info, "embed", False):
            return handler

        async def handle(request: Request) -> Response:
            return await handler(_ThreadParsedRequest(request.scope, request.receive, validate=field.validate))

        return handle


class _ThreadParsedRequest(Request):
    def __init__(self, scope: Any, receive: Any, *, validate: Callable[..., tuple[Any, list[dict[str, Any]]]]) -> None:
        super().__init__(scope, receive)
        self._validate = validate

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            raw = await self.body()
            if len(raw) < OFF_LOOP_BYTES:
                self._json = decode(raw)  # FastAPI validates it, as always
            else:
                limiter = _limiter()
                if limiter.statistics().tasks_waiting >= MAX_WAITING:
                    raise HTTPException(429, f"over {MAX_WAITING} large request bodies are waiting to be read; retry",
                                        headers={"Retry-After": "1"})
                async with limiter:
                    if await self.is_disconnected():  # gone while queued: nobody reads the answer
                        raise HTTPException(499, "client closed request")  # nginx's code, as elsewhere
                    try:
                        value, errors = await anyio.to_thread.run_sync(_parse, self._validate, raw)
                    except _ValidatorFault as e:
                        log.error("a request body's validation failed", exc_info=e.__cause__)
                        raise HTTPException(500, "internal server error") from None
                if errors:  # raised here, not on the worker: its frames would keep the body alive
                    raise BodyInvalid(errors)
                self._json = value
        return self._json


def decode(raw: bytes) -> Any:
    """`json.loads`, with arrays and objects nested at most MAX_DEPTH deep and objects of at most
    MAX_KEYS members."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _refused(f"nested deeper than {MAX_DEPTH} levels") from None
    problem = shape_problem(value, MAX_DEPTH, MAX_KEYS)
    if problem is not None:
        raise _refused(problem)
    return value


def shape_problem(value: Any, depth: int, keys: int) -> str | None:
    """What makes `value` nest arrays and objects deeper than `depth`, or hold an object of more
    than `keys` members (None: nothing). A level at a time, without recursion."""
    level = [value] if isinstance(value, (dict, list)) else []
    reached = 0
    while level:
        reached += 1
        if reached > depth:
            return f"nested deeper than {depth} levels"
        inner: list[Any] = []
        for v in level:
            if isinstance(v, dict):
                if len(v) > keys:
                    return f"an object of more than {keys} members"
                inner += [x for x in v.values() if isinstance(x, (dict, list))]
            else:
                inner += [x for x in v if isinstance(x, (dict, list))]
        level = inner
    return None


def _refused(problem: str) -> json.JSONDecodeError:
    return json.JSONDecodeError(problem, "", 0)


_gc_lock = threading.Lock()
_gc_paused = 0  # parses under way with the collector paused
_gc_was_on = False


@contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a body is parsed (the first parse pauses it, the
    last one resumes it, as it was)."""
    global _gc_paused, _gc_was_on
    with _gc_lock:
        if _gc_paused == 0:
            _gc_was_on = gc.isenabled()
            gc.disable()
        _gc_paused += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_paused -= 1
            if _gc_paused == 0 and _gc_was_on:
                gc.enable()


def _parse(validate: Callable[..., tuple[Any, list[dict[str, Any]]]], raw: bytes) -> tuple[Any, list[dict[str, Any]]]:
    """-> the body's value and its field errors (without the inputs they quote)."""
    with _collector_paused():
        value = decode(raw)  # its errors are FastAPI's reader's
        try:
            value, errors = validate(value, {}, loc=("body",))
        except Exception as e:
            raise _ValidatorFault() from e
        return value, [{k: v for k, v in e.items() if k != "input"} for e in errors]


def _limiter() -> anyio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(PARSE_THREADS)
        _LIMITER.set(limiter)
        return limiter
