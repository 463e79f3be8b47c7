"""The app factory: `create_app(engine)` gives a FastAPI app serving the OpenAI-compatible API."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.engine import Engine
from kvtier.serve.completions import router as completions_router
from kvtier.serve.config import DEFAULT_MAX_BODY_BYTES, ServeConfig
from kvtier.serve.context import ServerContext
from kvtier.serve.errors import install_error_handlers
from kvtier.serve.metrics import ServerMetrics
from kvtier.serve.middleware import AuthMiddleware, BodyLimitMiddleware, HTTPMetricsMiddleware
from kvtier.serve.ops import models_router, ops_router
from kvtier.serve.stats_log import run_stats_log
from kvtier.serve.tokenize import router as tokenizer_router

log = logging.getLogger(__name__)

GRAMMAR_WARMUP_S = 60.0  # the longest a server's start waits for the grammar tokenizer


def create_app(
    engine: Engine | BackgroundEngine,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    served_model_name: str | None = None,
    default_max_tokens: int | None = None,
    max_queued_requests: int | None = 256,
    config: ServeConfig | None = None,
    api_keys: Mapping[str, str] | None = None,
    metrics_public: bool = False,
    shared_cache: bool = False,
) -> FastAPI:
    """Serve `engine`. Given an Engine, the app runs its step loop from startup to shutdown; given
    a BackgroundEngine, it uses that loop and leaves closing it to the caller. `config`, when
    given, replaces every other setting."""
    config = config or ServeConfig(
        served_model_name=served_model_name, api_key=api_key, api_keys=api_keys or {},
        metrics_public=metrics_public, shared_cache=shared_cache, max_body_bytes=max_body_bytes,
        default_max_tokens=default_max_tokens, max_queued_requests=max_queued_requests,
    )
    ctx = _context(engine, config)
    app = FastAPI(
        title="kvtier",
        summary="OpenAI-compatible API over the kvtier engine",
        version=_version(),
        lifespan=_lifespan(ctx),
        # curl users often omit the header; a missing Content-Type is read as JSON.
        strict_content_type=False,
    )
    app.state.kvtier = ctx
    install_error_handlers(app)
    app.include_router(completions_router)
    app.include_router(models_router)
    app.include_router(ops_router)
    app.include_router(tokenizer_router)
    _add_middleware(app, config, ctx.metrics)
    _finish_openapi(app, ctx)
    return app


def _context(engine: Engine | BackgroundEngine, config: ServeConfig) -> ServerContext:
    """The state every route shares, with the engine's grammar limits set from `config`. A
    BackgroundEngine is the caller's to close, so the context does not own it."""
    core = engine.engine if isinstance(engine, BackgroundEngine) else engine
    core.grammars.limits = config.grammar_limits
    metrics = ServerMetrics(config.served_model_name or core.model.name, core.max_model_len)
    if isinstance(engine, BackgroundEngine):
        ctx = ServerContext(engine.engine, config, metrics, background=engine, owns_background=False)
        metrics.attach(engine)
        return ctx
    return ServerContext(engine, config, metrics)


def _lifespan(ctx: ServerContext) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Startup and shutdown: the step loop (when the app owns it) and the periodic stats log."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        ctx.start()
        stats: asyncio.Task[None] | None = None
        try:  # from here on, a stop (a signal while the grammar tokenizer builds, too) closes the engine
            await _grammars_ready(ctx)
            interval = ctx.config.stats_interval_s
            stats = asyncio.create_task(run_stats_log(ctx.metrics, ctx.engine, interval)) if interval > 0 else None
            yield
        finally:
            try:
                if stats is not None:
                    stats.cancel()
                    with suppress(asyncio.CancelledError):
                        await stats
            finally:  # a second stop while the stats task ends still closes the engine
                if ctx.owns_background and ctx.background is not None:
                    ctx.background.close()
                    ctx.engine.close()  # drain pending saves into the store before the process exits

    return lifespan


async def _grammars_ready(ctx: ServerContext) -> None:
    """Build the model's grammar tokenizer before serving: it holds the GIL for a third of a second
    (and its imports for a second more), a stall of every request in flight were the first
    structured request to pay it. A failure is logged; structured requests then get its error."""
    grammars = ctx.engine.grammars
    if not grammars.available or grammars.built:
        return
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.wrap_future(grammars.ready()), GRAMMAR_WARMUP_S)  # cancels only its own wait
    except TimeoutError:  # the server starts all the same; the first structured request waits for the rest
        log.warning("the grammar tokenizer is still building after %.0f s; serving meanwhile", GRAMMAR_WARMUP_S)
        return
    except Exception as e:  # a tokenizer llguidance cannot read: only structured output is lost
        log.warning("structured output unavailable: the grammar tokenizer failed to build (%s)", e)
        return
    log.info("grammar tokenizer ready (%.1f s)", time.perf_counter() - t0)


def _add_middleware(app: FastAPI, config: ServeConfig, metrics: ServerMetrics) -> None:
    # add_middleware wraps: the last added runs first. Order: metrics -> API key -> body limit,
    # so unauthenticated callers are refused before their body is read, and every answer is counted.
    # The auth middleware runs without keys too: it is what names every request's tenant.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    app.add_middleware(AuthMiddleware, keys=config.tenant_keys, open_paths=config.open_paths,
                       metrics_key=config.metrics_key, metrics_refusal=config.metrics_refusal)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)


def _version() -> str:
    try:
        return version("kvtier")
    except PackageNotFoundError:
        return "0+unknown"


def _finish_openapi(app: FastAPI, ctx: ServerContext) -> None:
    """Make the OpenAPI schema say what this server does: validation errors are 400s in OpenAI's
    shape (not FastAPI's 422 list), every path but the open ones takes a bearer key when keys
    are configured, and what depends on the loaded model (its names, completion length,
    vocabulary) is filled in."""
    build = app.openapi
    config = ctx.config

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        secured = False
        for path, ops in schema.get("paths", {}).items():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                if config.key_required(path):
                    op["security"] = [{"bearer": []}]
                    secured = True
        comps = schema.setdefault("components", {})
        models = comps.get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            models.pop(name, None)
        if secured:
            comps.setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
        names = sorted({ctx.model_name, ctx.engine.model.name})
        _set_model_limits(models, names, ctx.engine.max_model_len - 1, ctx.engine.model.config.vocab_size - 1)
        for body in ("ChatCompletionRequest", "CompletionRequest"):  # unknown fields: a 400, unless warned about
            if body in models:
                models[body]["additionalProperties"] = config.unknown_fields != "reject"
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _set_model_limits(models: dict[str, Any], names: list[str], max_tokens: int, max_token_id: int) -> None:
    for body in ("ChatCompletionRequest", "CompletionRequest"):
        props = models.get(body, {}).get("properties", {})
        if "model" in props:
            props["model"]["enum"] = names
        for field in ("max_tokens", "max_completion_tokens"):
            for alt in props.get(field, {}).get("anyOf", []):
                if alt.get("type") == "integer":
                    alt["maximum"] = max_tokens
    for alt in models.get("CompletionRequest", {}).get("properties", {}).get("prompt", {}).get("anyOf", []):
        items = alt.get("items", {})
        inner = items.get("items", items)  # token ids, or a list holding one list of token ids
        if inner.get("type") == "integer":
            inner["maximum"] = max_token_id
