"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from kvtier.engine.engine import PromptError, RequestOutput
from kvtier.engine.request import SamplingError
from kvtier.serve import responses as r
from kvtier.serve.bridge import ClientGone, EngineFailed, Generation
from kvtier.serve.context import ServerContext, get_context
from kvtier.serve.errors import APIError
from kvtier.serve.inputs import Prepared, chat_prompt, completion_prompt, prepare
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvtier.serve.sse import SSE_EVENT_SCHEMA, GenerationStream, stream_events
from kvtier.serve.tenants import cache_salt, session_id, tenant_of

router = APIRouter(prefix="/v1", tags=["openai"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": r.ErrorResponse, "description": why}
    for code, why in [
        (400, "invalid request (bad JSON, wrong types, out-of-range values, prompt too long)"),
        (401, "missing or wrong API key"),
        (404, "unknown model"),
        (413, "request body too large"),
        (500, "the engine failed while running this request (a bug; the server keeps serving)"),
        (503, "the engine is not running"),
    ]
}


def _responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    ok = {
        "description": "the completion, or with `stream: true` server-sent events ending in `data: [DONE]`",
        "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}},
            # One server-sent event; `data` holds a JSON chunk, or `[DONE]` at the end.
            "text/event-stream": {"schema": SSE_EVENT_SCHEMA},
        },
    }
    return {200: ok, **_ERRORS}


def _usage(out: RequestOutput) -> r.Usage:
    n = len(out.output_ids)
    return r.Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=n,
        total_tokens=out.prompt_tokens + n,
        prompt_tokens_details=r.PromptTokensDetails(
            cached_tokens=out.prompt_tokens_reused,
            attended_prefix_tokens=out.restore.prefix_attended if out.restore else None,
        ),
    )


def _reason(out: RequestOutput) -> r.FinishReason:
    # "abort" never gets here: the bridge raises EngineFailed for it, or nobody is listening any more.
    reason = out.finish_reason
    assert reason in ("stop", "length"), reason
    return reason


def _start(
    ctx: ServerContext, prepared: Prepared, body: SamplingFields, rid: str, endpoint: str, received: float,
    request: Request,
) -> Generation:
    tenant = tenant_of(request)
    background = ctx.running()
    ctx.admit()
    try:
        return Generation(
            background, prepared.ids, prepared.params, rid, endpoint=endpoint, metrics=ctx.metrics,
            session_id=session_id(tenant, body.prompt_cache_key),
            cache_salt=cache_salt(tenant, body.cache_salt, shared=ctx.config.shared_cache),
            received=received, on_done=ctx.release,
        )
    except (PromptError, SamplingError) as e:  # checked already; the engine has the last word
        ctx.release()
        raise APIError(400, str(e)) from e
    except BaseException:
        ctx.release()
        raise


async def _finish(gen: Generation, request: Request) -> RequestOutput | Response:
    try:
        return await gen.result(request)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    except EngineFailed as e:
        raise APIError(500, str(e), code="engine_error") from e


@router.post(
    "/chat/completions", response_model=r.ChatCompletion, responses=_responses(r.ChatCompletion),
    summary="Create a chat completion",
)
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(get_context)):
    received = time.perf_counter()
    ctx.check_model(body.model)
    ids = await run_in_threadpool(chat_prompt, ctx.engine, body)
    prepared = prepare(ctx.engine, ids, body, body.requested_max_tokens(), ctx.config.default_max_tokens)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = _start(ctx, prepared, body, rid, "chat", received, request)
    base: dict[str, Any] = dict(
        id=rid, created=int(time.time()), model=ctx.model_name, system_fingerprint=ctx.system_fingerprint
    )

    if body.stream:
        include_usage = body.include_usage

        def chunks(out: RequestOutput) -> list[BaseModel]:
            made: list[BaseModel] = []
            if out.delta_text:
                made.append(r.ChatCompletionChunk(
                    **base, choices=[r.ChatChunkChoice(index=0, delta=r.ChatDelta(content=out.delta_text))]
                ))
            if out.finished:
                made.append(r.ChatCompletionChunk(
                    **base, choices=[r.ChatChunkChoice(index=0, delta=r.ChatDelta(), finish_reason=_reason(out))]
                ))
                if include_usage:
                    made.append(r.ChatCompletionChunk(**base, choices=[], usage=_usage(out)))
            return made

        first = r.ChatCompletionChunk(
            **base, choices=[r.ChatChunkChoice(index=0, delta=r.ChatDelta(role="assistant", content=""))]
        )
        return GenerationStream(gen, stream_events(gen, [first], chunks))

    out = await _finish(gen, request)
    if isinstance(out, Response):
        return out
    return r.ChatCompletion(
        **base,
        choices=[r.ChatChoice(index=0, message=r.AssistantMessage(content=out.text), finish_reason=_reason(out))],
        usage=_usage(out),
    )


@router.post(
    "/completions", response_model=r.Completion, responses=_responses(r.Completion),
    summary="Create a text completion",
)
async def completions(body: CompletionRequest, request: Request, ctx: ServerContext = Depends(get_context)):
    received = time.perf_counter()
    ctx.check_model(body.model)
    ids = await run_in_threadpool(completion_prompt, ctx.engine, body)
    prepared = prepare(ctx.engine, ids, body, body.requested_max_tokens(), ctx.config.default_max_tokens)
    rid = f"cmpl-{uuid.uuid4().hex}"
    gen = _start(ctx, prepared, body, rid, "completions", received, request)
    base: dict[str, Any] = dict(
        id=rid, created=int(time.time()), model=ctx.model_name, system_fingerprint=ctx.system_fingerprint
    )

    if body.stream:
        include_usage = body.include_usage

        def chunks(out: RequestOutput) -> list[BaseModel]:
            made: list[BaseModel] = []
            if out.delta_text or out.finished:
                choice = r.CompletionChoice(
                    index=0, text=out.delta_text, finish_reason=_reason(out) if out.finished else None
                )
                made.append(r.Completion(**base, choices=[choice]))
            if out.finished and include_usage:
                made.append(r.Completion(**base, choices=[], usage=_usage(out)))
            return made

        return GenerationStream(gen, stream_events(gen, [], chunks))

    out = await _finish(gen, request)
    if isinstance(out, Response):
        return out
    return r.Completion(
        **base, choices=[r.CompletionChoice(index=0, text=out.text, finish_reason=_reason(out))], usage=_usage(out)
    )
