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
which lets only HTTP exceptions pass).
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
_LIMITER: RunVar[anyio.CapacityLimiter] = RunVar("kvtier_body_parse_limiter")  # one per event loop


class BodyInvalid(HTTPException):
    """Field errors of a body validated off the loop, in FastAPI's `RequestValidationError` form."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(400)
        self.errors = errors


class OffLoopBodyRoute(APIRoute):
    """An APIRoute whose JSON body, when large, is decoded and validated off the event loop."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        field = self.body_field
        if field is None:
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
                self._json = json.loads(raw)  # what Starlette's own json() does; FastAPI validates it
            else:
                self._json = await anyio.to_thread.run_sync(self._parse, raw, limiter=_limiter())
        return self._json

    def _parse(self, raw: bytes) -> Any:
        value, errors = self._validate(json.loads(raw), {}, loc=("body",))
        if errors:
            raise BodyInvalid(errors)
        return value


def _limiter() -> anyio.CapacityLimiter:
    try:
        return _LIMITER.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(PARSE_THREADS)
        _LIMITER.set(limiter)
        return limiter
