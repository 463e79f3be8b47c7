"""POST /tokenize, POST /detokenize and GET /version, in vLLM's shapes: clients count tokens or
check what they talk to before they send. /tokenize runs the very tokenization the completion
endpoints run (the same engine calls), so its count is what a request will cost."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import APIRouter, Depends
from jinja2 import TemplateError

from kvtier.engine.engine import PromptError
from kvtier.serve import responses as r
from kvtier.serve.context import ServerContext, get_context
from kvtier.serve.errors import APIError
from kvtier.serve.schemas import DetokenizeRequest, TokenizeRequest, template_messages

router = APIRouter(tags=["tokenizer"])
ERRORS: dict[int | str, dict[str, Any]] = {400: {"model": r.ErrorResponse}, 404: {"model": r.ErrorResponse}}


@router.post("/tokenize", response_model=r.TokenizeResponse, responses=ERRORS, summary="Token ids of a prompt")
async def tokenize(body: TokenizeRequest, ctx: ServerContext = Depends(get_context)) -> r.TokenizeResponse:
    if body.model is not None:
        ctx.check_model(body.model)
    engine = ctx.engine
    try:
        if body.messages is not None:
            ids = engine.encode_chat(template_messages(body.messages), body.add_generation_prompt)
        else:
            assert body.prompt is not None  # the request model requires one of the two
            ids = engine.encode(body.prompt, body.add_special_tokens is not False)  # default true
    except (PromptError, TemplateError) as e:
        raise APIError(400, f"cannot tokenize: {e}", param="messages" if body.messages else "prompt") from e
    return r.TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)


@router.post("/detokenize", response_model=r.DetokenizeResponse, responses=ERRORS, summary="Text of token ids")
async def detokenize(body: DetokenizeRequest, ctx: ServerContext = Depends(get_context)) -> r.DetokenizeResponse:
    if body.model is not None:
        ctx.check_model(body.model)
    model = ctx.engine.model
    vocab = model.config.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    if model.tokenizer is None:
        raise APIError(400, f"model {model.name} has no tokenizer", param="tokens")
    return r.DetokenizeResponse(prompt=model.tokenizer.decode(body.tokens))


@router.get("/version", response_model=r.Version, summary="The kvtier version serving")
async def server_version() -> r.Version:
    try:
        return r.Version(version=version("kvtier"))
    except PackageNotFoundError:  # run from a source tree that was never installed
        return r.Version(version="unknown")
