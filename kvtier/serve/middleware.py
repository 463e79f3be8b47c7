"""ASGI middleware: the request body limit, the API key check and per-request HTTP metrics.

The key is checked before the body is parsed, so an unauthenticated caller learns nothing about
the request format (a FastAPI dependency would run after JSON decoding). With keys configured,
only /health stays open (and /metrics with --metrics-public): the schema, the docs and the
metrics describe the deployment (model, limits, traffic), and unknown paths answer 401, not 404,
so a caller without a key cannot map the server. The metrics count every tenant's traffic, so
with several tenants /metrics takes the metrics key alone (ServeConfig.metrics_refusal).
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
                    raise HTTPException(413, self._error().message)  # an HTTP exception: FastAPI's body reader passes it
            return message

        await self.app(scope, limited_receive, send)

    def _error(self) -> APIError:
        return APIError(
            413, f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            code="request_too_large",
        )


class AuthMiddleware:
    """Decides the request's tenant from its API key, or answers 401 (403 for a tenant's key on
    /metrics when `metrics_refusal` says why not).

    Every key is compared, without stopping at a match, and against SHA-256 digests (equal
    lengths), so the time taken says nothing about which key or how much of one matched. With no
    tenant keys configured every request is the default tenant. The tenant goes into the scope's
    state (`request.state.tenant` in handlers). The metrics key is no tenant's: it reads /metrics
    and opens nothing else.
    """

    def __init__(self, app: ASGIApp, keys: Mapping[str, str], open_paths: frozenset[str],
                 metrics_key: str | None = None, metrics_refusal: str | None = None) -> None:
        self.app = app
        self.keys = [(_bearer_digest(key), tenant) for key, tenant in keys.items()]
        self.open_paths = open_paths
        self.metrics_key = _bearer_digest(metrics_key) if metrics_key is not None else None
        self.metrics_refusal = metrics_refusal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        tenant, scraper = self._identify(scope)
        refused = self._refusal(scope["path"], tenant, scraper)
        if refused is not None:
            headers = {"WWW-Authenticate": "Bearer"} if refused.status == 401 else None
            await error_response(refused, headers)(scope, receive, send)
            return
        if tenant is None and not self.keys:
            tenant = DEFAULT_TENANT  # an open server: every request is the default tenant's
        # On an open path without a (right) key there is no tenant; those handlers need none.
        if tenant is not None:
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _identify(self, scope: Scope) -> tuple[str | None, bool]:
        """The tenant whose key the request carries (None: no tenant's), and whether it carries
        the metrics key."""
        if not self.keys and self.metrics_key is None:
            return None, False
        got = _digest(Headers(scope=scope).get("authorization", "").encode("latin-1"))
        tenant = None
        for expected, name in self.keys:
            if secrets.compare_digest(got, expected):  # no break: the loop always runs in full
                tenant = name
        scraper = self.metrics_key is not None and secrets.compare_digest(got, self.metrics_key)
        return tenant, scraper

    def _refusal(self, path: str, tenant: str | None, scraper: bool) -> APIError | None:
        if path in self.open_paths:
            return None
        if path == "/metrics" and (self.metrics_key is not None or self.metrics_refusal is not None):
            if scraper:
                return None
            if tenant is None:
                return _missing_key()
            if self.metrics_refusal is not None:
                return APIError(403, self.metrics_refusal, code="metrics_forbidden", type="permission_error")
            return None
        if tenant is None and self.keys:
            return _missing_key()
        return None


def _missing_key() -> APIError:
    return APIError(401, "missing or incorrect API key; send 'Authorization: Bearer <key>'", code="invalid_api_key")


def _bearer_digest(key: str) -> bytes:
    return _digest(f"Bearer {key}".encode())


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
