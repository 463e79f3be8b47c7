"""OpenAI-style error bodies, and the handlers that turn every failure into one.

Clients (the `openai` library first) parse `{"error": {"message", "type", "param", "code"}}`;
FastAPI's default shapes (`{"detail": ...}`, 422 with a list) would surface as opaque errors.
Bad input is a 4xx with a message that names the field; only a genuine server fault is a 5xx.
"""

from __future__ import annotations

import email.message
import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtier.serve.bodies import BodyInvalid

log = logging.getLogger("kvtier.serve")

_TYPE_BY_STATUS = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error", 503: "server_error"}
DESCRIBED_ERRORS = 64  # of a body's field errors, those a message is made from (the rest are counted)
QUOTED_CHARS = 100  # of a value a message quotes back


def quoted(value: object) -> str:
    """`value` as a message quotes it: repr, cut to QUOTED_CHARS (a value can be megabytes)."""
    return _cut(repr(value))


class APIError(Exception):
    """Raised anywhere in a handler to answer with an OpenAI-style error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        # A 400 without a code of its own is an invalid value (docs/serve.md's table): never null.
        self.code = code if code is not None or status != 400 else "invalid_value"
        self.type = type or error_type(status)


def error_type(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), err.status, headers=headers)


def _is_union_tag(part: object) -> bool:
    # pydantic names the member a value failed against ("str", "list[int]", "function-after[...]").
    return isinstance(part, str) and ("[" in part or part in {"str", "int", "float", "bool", "list", "dict"})


def _param(loc: tuple) -> list[str]:
    """A field path's parts as a message names them (a part can be a body's own key: cut short)."""
    return [_cut(str(p)) for p in loc if p != "body" and not _is_union_tag(p)]


def _cut(text: str) -> str:
    return text if len(text) <= QUOTED_CHARS else text[:QUOTED_CHARS] + "..."


def _describe_validation(exc: RequestValidationError) -> APIError:
    every = exc.errors()  # a bounded count: request lists stop at a bad item, objects at 16,384 members
    total = len(every)
    errors = list(every[:DESCRIBED_ERRORS])
    if not errors:
        return APIError(400, "invalid request body")
    first = errors[0]
    if first.get("type") == "json_invalid":
        where = first.get("ctx", {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON ({where})".replace(" ()", ""), code="invalid_json")
    # A value that matches no member of a union yields one error per member; name the field
    # they share and list the alternatives instead of reporting the first member's complaint.
    locs = [_param(e.get("loc", ())) for e in every]
    shared = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(shared), len(loc)) and shared[n] == loc[n]:
            n += 1
        shared = shared[:n]
    param = ".".join(shared or locs[0]) or None
    if shared:  # one field (maybe a union): every message is about it (the first DESCRIBED_ERRORS tell)
        msgs = list(dict.fromkeys(e.get("msg", "invalid value") for e in errors))
    else:  # several fields (or the body itself): report the first, count the rest
        more = total - 1
        tail = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        msgs = [f"{first.get('msg', 'invalid value')}{tail}"]
    if first.get("type") == "missing" and len(errors) == 1 and param:
        text = f"missing required parameter '{param}'"
    elif param:
        text = f"invalid value for '{param}': " + " or ".join(msgs[:3]) + (" ..." if len(msgs) > 3 else "")
    else:
        text = "invalid request body: " + " or ".join(msgs[:3])
    return APIError(400, text, param=param, code="invalid_value")


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, BodyInvalid):  # validated off the loop (serve/bodies.py): FastAPI's errors all the same
        exc = RequestValidationError(exc.errors)
    assert isinstance(exc, RequestValidationError)
    content_type = request.headers.get("content-type", "")
    if content_type and not _read_as_json(content_type):
        # e.g. `curl -d` without -H: the body was never read as JSON, so every field looks missing.
        return error_response(APIError(
            400, f"the request body must be JSON sent with 'Content-Type: application/json' (got {quoted(content_type)})",
            code="invalid_content_type",
        ))
    return error_response(_describe_validation(exc))


def _read_as_json(content_type: str) -> bool:
    """FastAPI's rule for reading a body as JSON, as FastAPI parses the header (email.message: a
    malformed type reads as text/plain): application/json or application/*+json."""
    message = email.message.Message()
    message["content-type"] = content_type
    sub = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (sub == "json" or sub.endswith("+json"))


async def _on_api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
    return error_response(exc, headers)


async def _on_http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    message = {
        # FastAPI's only 400 of its own: a body json.loads refused (malformed, not UTF-8, nested too deep)
        400: "the request body is not valid JSON (malformed, not UTF-8, or nested too deep)",
        404: "no such endpoint; see GET /openapi.json for the API",
        405: "method not allowed for this endpoint",
        413: "the request body is too large",
    }.get(status, str(exc.detail))
    if status == 413 and exc.detail != HTTPStatus(413).phrase:  # the size limit's own message (middleware.py)
        message = str(exc.detail)
    code = {400: "invalid_json", 413: "request_too_large", 404: "unknown_url", 429: "too_many_requests"}.get(status)
    return JSONResponse(error_body(message, error_type(status), None, code), status, headers=exc.headers)


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    # A bug, not bad input: log the traceback, keep serving, and do not leak internals.
    log.error("unhandled error while serving a request", exc_info=exc)
    return JSONResponse(error_body("internal server error", "server_error"), 500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(BodyInvalid, _on_validation)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(Exception, _on_unexpected)
