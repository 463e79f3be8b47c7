"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel

from kvtier.engine.engine import Engine, PromptError, RequestOutput
from kvtier.engine.grammar_limits import GrammarError
from kvtier.engine.request import GrammarSpec, SamplingError
from kvtier.serve import responses as r
from kvtier.serve.bodies import OffLoopBodyRoute
from kvtier.serve.bridge import ClientGone, EngineFailed, Generation, GrammarFailed
from kvtier.serve.choices import (
    ChatChoiceStream,
    CompletionChoiceStream,
    TokenText,
    chat_choice,
    completion_choice,
    prompt_logprobs,
    usage,
)
from kvtier.serve.context import ServerContext, get_context
from kvtier.serve.errors import APIError
from kvtier.serve.inputs import (
    Prepared,
    ToolSetup,
    build_constraint,
    chat_prompt,
    check_unknown_fields,
    completion_prompt,
    grammar_spec,
    prepare,
    tool_setup,
)
from kvtier.serve.reasoning import ReasoningParser, request_parser
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvtier.serve.sse import SSE_EVENT_SCHEMA, GenerationStream, stream_events
from kvtier.serve.tenants import cache_salt, session_id, tenant_of

router = APIRouter(prefix="/v1", tags=["openai"], route_class=OffLoopBodyRoute)

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


Grammar = tuple[GrammarSpec, str]  # a request's grammar and the field that gave it


def _salt(ctx: ServerContext, body: SamplingFields, request: Request) -> str | None:
    """The request's cache partition: its tenant's, and its own `cache_salt` after it."""
    return cache_salt(tenant_of(request), body.cache_salt, shared=ctx.config.shared_cache)


async def _start(
    ctx: ServerContext, body: SamplingFields, rid: str, endpoint: str, received: float, request: Request,
    inputs: Callable[[], Awaitable[tuple[Prepared, Grammar | None]]],
) -> Generation:
    """Admit the request; then, holding its slot and off the event loop, make its inputs (the
    rendered, tokenized and checked prompt) and its grammar's matcher (a grammar thread, with a
    deadline), and submit it."""
    tenant = tenant_of(request)
    background = ctx.running()
    ctx.admit()
    try:
        prepared, grammar = await inputs()
        constraint = await build_constraint(ctx.engine, grammar)
        return Generation(
            background, prepared.ids, prepared.params, rid, endpoint=endpoint, metrics=ctx.metrics,
            session_id=session_id(tenant, body.prompt_cache_key),
            cache_salt=_salt(ctx, body, request),
            received=received, on_done=ctx.release, constraint=constraint,
            priority=body.priority or 0, cache_prompt=body.cache_prompt is not False,
            segments=prepared.segments, blend=prepared.blend,
        )
    except (PromptError, SamplingError) as e:  # checked already; the engine has the last word
        ctx.release()
        raise APIError(400, str(e)) from e
    except BaseException:
        ctx.release()
        raise


async def _finish(gen: Generation, request: Request) -> list[RequestOutput] | Response:
    try:
        return await gen.result(request)
    except ClientGone:
        return Response(status_code=499)  # nobody is listening; nginx's "client closed request"
    except GrammarFailed as e:
        raise APIError(400, str(e), code="grammar_failed") from e
    except EngineFailed as e:
        raise APIError(500, str(e), code="engine_error") from e


def _prepare(ctx: ServerContext, ids: Sequence[int], body: ChatCompletionRequest | CompletionRequest,
             grammar: Grammar | None, segments: tuple[tuple[int, int], ...] = ()) -> Prepared:
    return prepare(ctx.engine, ids, body, body.requested_max_tokens(), ctx.config.default_max_tokens,
                   grammar[0] if grammar else None, max_output_entries=ctx.config.max_output_entries,
                   segments=segments)


async def _token_text(engine: Engine, logprobs: bool, as_ids: bool) -> TokenText:
    """How logprobs name tokens; their exact bytes come from the grammar engine's tokenizer, built
    once per model on a grammar thread (never on the event loop). Where it cannot be built the
    bytes are null (as OpenAI's API allows); the texts stay."""
    if not logprobs or engine.model.tokenizer is None:
        return TokenText(engine.model.tokenizer, None, as_ids)
    try:
        ll = await asyncio.wrap_future(engine.grammars.ready())
    except GrammarError:
        return TokenText(engine.model.tokenizer, None, as_ids)
    return TokenText(engine.model.tokenizer, ll.decode_bytes, as_ids)


def _chunker(body: SamplingFields, streams: Sequence[ChatChoiceStream | CompletionChoiceStream],
             chunk: Callable[..., BaseModel]) -> Callable[[RequestOutput], list[BaseModel]]:
    """Each engine output as its choice's chunks, with the usage so far on each when
    continuous_usage_stats asks, and a last usage chunk once every sample has ended (include_usage)."""
    latest: dict[int, RequestOutput] = {}

    def chunks(out: RequestOutput) -> list[BaseModel]:
        latest[out.index] = out
        so_far = usage([latest[i] for i in sorted(latest)])
        made = [chunk(choices=[c], usage=so_far if body.continuous_usage else None)
                for c in streams[out.index].deltas(out)]
        if body.include_usage and len(latest) == body.n and all(o.finished for o in latest.values()):
            made.append(chunk(choices=[], usage=so_far))
        return made

    return chunks


@router.post(
    "/chat/completions", response_model=r.ChatCompletion, responses=_responses(r.ChatCompletion),
    summary="Create a chat completion",
)
async def chat_completions(body: ChatCompletionRequest, request: Request, ctx: ServerContext = Depends(get_context)):
    received = time.perf_counter()
    check_unknown_fields(body, ctx.config.unknown_fields)
    ctx.check_model(body.model)
    engine = ctx.engine
    salt = _salt(ctx, body, request)
    echo = body.echo_text()
    reasoning: ReasoningParser | None = None  # how this request's output is split (its prompt's end says)
    tools: ToolSetup | None = None

    async def inputs() -> tuple[Prepared, Grammar | None]:
        nonlocal reasoning, tools
        tools = await run_in_threadpool(tool_setup, engine, body)  # (copies every tool: off the loop)
        ids, spans = await run_in_threadpool(chat_prompt, engine, body, tools, salt)
        grammar = grammar_spec(body, tools)
        reasoning = request_parser(ctx.config.reasoning_parser, engine.model.tokenizer, ids, grammar is not None)
        return _prepare(ctx, ids, body, grammar, spans), grammar

    text = await _token_text(engine, body.logprobs or body.prompt_logprobs is not None, body.return_tokens_as_token_ids)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    gen = await _start(ctx, body, rid, "chat", received, request, inputs)
    assert tools is not None  # set by inputs()
    base: dict[str, Any] = dict(
        id=rid, created=int(time.time()), model=ctx.model_name, system_fingerprint=ctx.system_fingerprint
    )

    if body.stream:
        streams = [ChatChoiceStream(i, tools, body.parallel_tool_calls, text, body.logprobs, reasoning)
                   for i in range(body.n)]
        chunks = _chunker(body, streams, functools.partial(r.ChatCompletionChunk, **base))
        first = r.ChatCompletionChunk(**base, choices=[
            r.ChatChunkChoice(index=i, delta=r.ChatDelta(role="assistant", content=echo)) for i in range(body.n)
        ])
        return GenerationStream(gen, stream_events(gen, [first], chunks))

    outs = await _finish(gen, request)
    if isinstance(outs, Response):
        return outs
    return await r.built_off_the_loop(lambda: r.ChatCompletion(
        **base, choices=[chat_choice(o, tools, body.parallel_tool_calls, text, echo, reasoning) for o in outs],
        usage=usage(outs),
        prompt_logprobs=prompt_logprobs(outs[0], text),
    ))


@router.post(
    "/completions", response_model=r.Completion, responses=_responses(r.Completion),
    summary="Create a text completion",
)
async def completions(body: CompletionRequest, request: Request, ctx: ServerContext = Depends(get_context)):
    received = time.perf_counter()
    check_unknown_fields(body, ctx.config.unknown_fields)
    ctx.check_model(body.model)
    engine = ctx.engine
    salt = _salt(ctx, body, request)

    echo = ""

    async def inputs() -> tuple[Prepared, Grammar | None]:
        nonlocal echo
        ids, spans = await run_in_threadpool(completion_prompt, engine, body, ctx.config.blend_separator, salt)
        grammar = grammar_spec(body)
        prepared = _prepare(ctx, ids, body, grammar, spans)  # the prompt checked against the context first
        echo = await run_in_threadpool(_echoed_prompt, engine, body)
        return prepared, grammar

    text = await _token_text(engine, body.logprobs is not None or body.prompt_logprobs is not None,
                             body.return_tokens_as_token_ids)
    rid = f"cmpl-{uuid.uuid4().hex}"
    gen = await _start(ctx, body, rid, "completions", received, request, inputs)
    base: dict[str, Any] = dict(
        id=rid, created=int(time.time()), model=ctx.model_name, system_fingerprint=ctx.system_fingerprint
    )

    if body.stream:
        streams = [CompletionChoiceStream(i, text, body.logprobs is not None) for i in range(body.n)]
        chunks = _chunker(body, streams, functools.partial(r.Completion, **base))
        first: list[BaseModel] = [r.Completion(**base, choices=[r.CompletionChoice(index=i, text=echo)
                                                                 for i in range(body.n)])]
        return GenerationStream(gen, stream_events(gen, first if echo else [], chunks))

    outs = await _finish(gen, request)
    if isinstance(outs, Response):
        return outs
    return await r.built_off_the_loop(
        lambda: r.Completion(**base, choices=[completion_choice(o, text, echo) for o in outs], usage=usage(outs)))


def _echoed_prompt(engine: Engine, body: CompletionRequest) -> str:
    """The prompt as `echo` returns it: the text given, or the token ids decoded."""
    if not body.echo:
        return ""
    if isinstance(body.prompt, str):
        return body.prompt
    tok = engine.model.tokenizer
    if tok is None:
        raise APIError(400, f"model {engine.model.name} has no tokenizer to echo token ids with", param="echo")
    return str(tok.decode(list(body.prompt)))
