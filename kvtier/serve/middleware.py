"""ASGI middleware: the request body limit, the API key check and per-request HTTP metrics.

The key is checked before the body is parsed, so an unauthenticated caller learns nothing about
the request format (a FastAPI dependency would run after JSON decoding). With keys configured,
only /health stays open (and /metrics with --metrics-public): the schema, the docs and the
metrics describe the deployment (model, limits, traffic), and unknown paths answer 401, not 404,
so a caller without a key cannot map the server.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Mapping

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvtier.serve.errors import APIError, error_response
from kvtier.serve.metrics import KNOWN_PATHS, ServerMetrics
from kvtier.serve.tenants import DEFAULT_TENANT


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`, in OpenAI's error shape.

    FastAPI's own `max_body_size` answers a too-long declared Content-Length with a plain-text
    body that replaces whatever the app sends, so it cannot give clients a JSON error. A declared
    length is refused before reading; a chunked body is cut off once it passes the limit (the
    HTTPException raised from `receive` reaches the app's 413 handler).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await error_response(self._error())(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413)
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> APIError:
        return APIError(
            413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )


class AuthMiddleware:
    """Decides the request's tenant from its API key, or answers 401.

    Every key is compared, without stopping at a match, and against SHA-256 digests (equal
    lengths), so the time taken says nothing about which key or how much of one matched. With no
    keys configured every request is the default tenant. The tenant goes into the scope's state
    (`request.state.tenant` in handlers).
    """

    def __init__(self, app: ASGIApp, keys: Mapping[str, str], open_paths: frozenset[str]) -> None:
        self.app = app
        self.keys = [(_digest(f"Bearer {key}".encode()), tenant) for key, tenant in keys.items()]
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        tenant: str | None = DEFAULT_TENANT
        if self.keys:
            got = _digest(Headers(scope=scope).get("authorization", "").encode("latin-1"))
            tenant = None
            for expected, name in self.keys:
                if secrets.compare_digest(got, expected):  # no break: the loop always runs in full
                    tenant = name
            if tenant is None and scope["path"] not in self.open_paths:
                err = APIError(
                    401, "missing or incorrect API key; send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        # On an open path without a (right) key there is no tenant; those handlers need none.
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


def _digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


class HTTPMetricsMiddleware:
    """Counts every response by path and status code (401s and 413s included)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in KNOWN_PATHS else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_http(path, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
