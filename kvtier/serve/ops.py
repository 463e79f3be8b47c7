"""GET /v1/models, GET /health and GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from kvtier.serve import responses as r
from kvtier.serve.context import ServerContext, get_context
from kvtier.serve.errors import APIError, error_body

models_router = APIRouter(prefix="/v1", tags=["openai"])
ops_router = APIRouter(tags=["operations"])


def _card(ctx: ServerContext) -> r.ModelCard:
    return r.ModelCard(id=ctx.model_name, created=ctx.created, max_model_len=ctx.engine.max_model_len)


@models_router.get("/models", response_model=r.ModelList, summary="List the served model")
async def list_models(ctx: ServerContext = Depends(get_context)) -> r.ModelList:
    return r.ModelList(data=[_card(ctx)])


@models_router.get(
    "/models/{model}", response_model=r.ModelCard, responses={404: {"model": r.ErrorResponse}},
    summary="Describe a model",
)
async def get_model(model: str, ctx: ServerContext = Depends(get_context)) -> r.ModelCard:
    ctx.check_model(model)
    return _card(ctx)


@ops_router.get(
    "/health", response_model=r.Health, responses={503: {"model": r.ErrorResponse}},
    summary="Liveness: 200 while the engine loop runs",
)
async def health(ctx: ServerContext = Depends(get_context)):
    try:
        ctx.running()
    except APIError as e:
        return JSONResponse(error_body(e.message, e.type, None, e.code), e.status)
    st = ctx.engine.stats(with_store=False)
    return r.Health(status="ok", model=ctx.model_name, waiting=st.waiting, running=st.running,
                    profile=ctx.engine.profile_source, measuring=ctx.engine.idle.running)


@ops_router.get(
    "/metrics", summary="Prometheus metrics",
    responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    response_class=Response,
)
async def metrics(ctx: ServerContext = Depends(get_context)) -> Response:
    ctx.start()  # so engine gauges exist even before the first request
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
