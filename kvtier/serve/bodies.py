"""JSON request bodies decoded and validated on a worker thread, not on the event loop.

FastAPI decodes a body and validates it against the route's model on the event loop. A body at
the size limit made of many small objects (a chat of a hundred thousand one-letter messages)
costs a third of a second there, a stall of every other request and stream. Here a large body is
decoded and validated by FastAPI's own field on a worker thread, and FastAPI's validation of the
result is then a type check. The worker still holds the GIL while `json.loads` runs (C code), so
the loop can wait for that part (tens of milliseconds at the limit); validation gives it turns.
At most PARSE_THREADS bodies are worked on at once, so a flood of large bodies queues instead of
taking the GIL from the loop with many threads.

The errors are FastAPI's: invalid JSON raises the same exceptions from `Request.json()`, and
field errors reach the same handler (`BodyInvalid` carries them through FastAPI's body reader,
which lets only HTTP exceptions pass). One limit is added, the same for a body of any size: JSON
nested deeper than MAX_DEPTH is invalid. Without it the depth `json.loads` accepts would be what
the caller's stack leaves of the recursion limit (about 960 on the loop, 990 on a worker), and a
value accepted deep on a worker could fail `json.dumps` on the loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
from anyio.lowlevel import RunVar
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException

OFF_LOOP_BYTES = 32 << 10  # on the loop, a body below this takes at most a few milliseconds
PARSE_THREADS = 2
MAX_DEPTH = 512  # arrays and objects within each other; a grammar's own limit is lower (grammar_limits.py)
_LIMITER: RunVar[anyio.CapacityLimiter] = RunVar("kvtier_body_parse_limiter")  # one per event loop


class BodyInvalid(HTTPException):
    """Field errors of a body validated off the loop, in FastAPI's `RequestValidationError` form."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(400)
        self.errors = errors


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
                value, errors = await anyio.to_thread.run_sync(_parse, self._validate, raw, limiter=_limiter())
                if errors:  # raised here, not on the worker: its frames would keep the body alive
                    raise BodyInvalid([{k: v for k, v in e.items() if k != "input"} for e in errors])
                self._json = value
        return self._json


def decode(raw: bytes) -> Any:
    """`json.loads`, with arrays and objects nested at most MAX_DEPTH deep."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    if deeper_than(value, MAX_DEPTH):
        raise _too_deep()
    return value


def deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than `limit` deep in `value` (without recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v) if isinstance(x, (dict, list)))
    return False


def _too_deep() -> json.JSONDecodeError:
    return json.JSONDecodeError(f"nested deeper than {MAX_DEPTH} levels", "", 0)


def _parse(validate: Callable[..., tuple[Any, list[dict[str, Any]]]], raw: bytes) -> tuple[Any, list[dict[str, Any]]]:
    return validate(decode(raw), {}, loc=("body",))


def _limiter() -> anyio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(PARSE_THREADS)
        _LIMITER.set(limiter)
        return limiter
