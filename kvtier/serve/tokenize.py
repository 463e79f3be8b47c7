"""POST /tokenize, POST /detokenize and GET /version, in vLLM's shapes: clients count tokens or
check what they talk to before they send. /tokenize runs the very tokenization the completion
endpoints run (the same engine calls; chat messages through the chat endpoint's own render, tools
and template controls included), so its count is what a request will cost."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Response
from fastapi.concurrency import run_in_threadpool
from jinja2 import TemplateError

from kvtier.engine.engine import Engine, PromptError
from kvtier.serve import responses as r
from kvtier.serve.bodies import OffLoopBodyRoute
from kvtier.serve.context import ServerContext, get_context
from kvtier.serve.errors import APIError
from kvtier.serve.inputs import chat_prompt, completion_prompt, tool_setup
from kvtier.serve.schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["tokenizer"], route_class=OffLoopBodyRoute)
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": r.ErrorResponse}, 404: {"model": r.ErrorResponse},
    429: {"model": r.ErrorResponse, "description": "the server is at capacity; retry after Retry-After"},
}

T = TypeVar("T")


@router.post("/tokenize", response_model=r.TokenizeResponse, responses=ERRORS, summary="Token ids of a prompt")
async def tokenize(body: TokenizeRequest, ctx: ServerContext = Depends(get_context)) -> Response:
    if body.model is not None:
        ctx.check_model(body.model)
    ids = await _off_the_loop(ctx, _encode, ctx.engine, body, ctx.config.blend_separator)
    return await r.built_off_the_loop(
        lambda: r.TokenizeResponse(count=len(ids), max_model_len=ctx.engine.max_model_len, tokens=ids))


@router.post("/detokenize", response_model=r.DetokenizeResponse, responses=ERRORS, summary="Text of token ids")
async def detokenize(body: DetokenizeRequest, ctx: ServerContext = Depends(get_context)) -> Response:
    if body.model is not None:
        ctx.check_model(body.model)
    text = await _off_the_loop(ctx, _decode, ctx.engine, body.tokens)  # up to tens of MB: written off the loop too
    return await r.built_off_the_loop(lambda: r.DetokenizeResponse(prompt=text))


async def _off_the_loop(ctx: ServerContext, work: Callable[..., T], *args: Any) -> T:
    """Run `work` on a worker thread: a megabyte prompt takes seconds to tokenize, and on the event
    loop it would stall every other request and stream. It holds an admission slot meanwhile, as a
    generation does, so a flood of calls gets 429 rather than an ever longer queue of threads."""
    ctx.admit()
    try:
        return await run_in_threadpool(work, *args)
    finally:
        ctx.release()


def _encode(engine: Engine, body: TokenizeRequest, separator: str | None) -> list[int]:
    try:
        if body.messages is not None:
            chat = body.as_chat()
            return chat_prompt(engine, chat, tool_setup(engine, chat))[0]  # as a generation marks its documents
        return completion_prompt(engine, body.as_completion(), separator)[0]  # the --blend-separator taken out
    except (PromptError, TemplateError) as e:
        raise APIError(400, f"cannot tokenize: {e}", param="messages" if body.messages else "prompt") from e


def _decode(engine: Engine, tokens: list[int]) -> str:
    model = engine.model
    vocab = model.config.vocab_size
    if any(t >= vocab for t in tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    if model.tokenizer is None:
        raise APIError(400, f"model {model.name} has no tokenizer", param="tokens")
    return model.tokenizer.decode(tokens)


@router.get("/version", response_model=r.Version, summary="The kvtier version serving")
async def server_version() -> r.Version:
    try:
        return r.Version(version=version("kvtier"))
    except PackageNotFoundError:  # run from a source tree that was never installed
        return r.Version(version="unknown")
