"""Response bodies, as pydantic models so the OpenAPI schema documents what clients receive."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Literal

from fastapi import Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel
from pydantic_core import to_json

FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]


async def built_off_the_loop(build: Callable[[], BaseModel]) -> Response:
    """A body built and written as JSON on a worker thread: a whole answer with logprobs for many
    samples, or a long prompt's token ids, runs to tens of megabytes, seconds of work that on the
    event loop would stall every other request and stream. Written in pieces (`json_pieces`): one
    dump holds the GIL throughout, and the loop waits for it. (Returned as a Response, FastAPI
    neither validates the model again nor serializes it there.)"""
    return Response(await run_in_threadpool(lambda: b"".join(json_pieces(build()))), media_type="application/json")


# Elements of a long list dumped at once: a few milliseconds of serializing at most.
_SLICE = 256


def json_pieces(value: Any) -> Iterator[bytes]:
    """`value`'s JSON, the bytes of pydantic's own dump, in pieces: models and short lists field by
    field and element by element, long lists `_SLICE` elements at a time."""
    if isinstance(value, BaseModel):
        yield b"{"
        for i, (name, field) in enumerate(value):
            yield (b',"' if i else b'"') + name.encode() + b'":'
            yield from json_pieces(field)
        yield b"}"
    elif isinstance(value, list) and len(value) > _SLICE:
        yield b"["
        for i in range(0, len(value), _SLICE):
            yield (b"," if i else b"") + to_json(value[i : i + _SLICE])[1:-1]
        yield b"]"
    elif isinstance(value, list) and any(isinstance(v, (BaseModel, list)) for v in value):
        yield b"["
        for i, v in enumerate(value):
            if i:
                yield b","
            yield from json_pieces(v)
        yield b"]"
    else:
        yield to_json(value)


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens restored (device cache or store) instead of computed
    # kvtier: with --restore-method impress, the restored prefix tokens each layer attended to (the
    # rest were left out: an approximation); null when every cached token was attended to.
    attended_prefix_tokens: int | None = None
    # kvtier: a blended request's prompt tokens loaded from documents' state computed alone (an
    # approximation), and those it recomputed; null when it did not blend.
    blended_tokens: int | None = None
    recomputed_tokens: int | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int  # all n samples together
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class PromptLogprob(BaseModel):
    """vLLM's prompt logprob entry (keyed by token id as a string)."""

    logprob: float
    rank: int | None = None  # 1 = the likeliest
    decoded_token: str


# One entry per prompt token: null for the first (nothing precedes it), else the token's own entry
# and its position's k likeliest.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # With --reasoning-parser: the model's thinking (vLLM's field); content is then the answer after it.
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: ChatFinishReason
    logprobs: ChatLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs (vLLM's place for it)


class ToolCallDelta(BaseModel):
    index: int  # which call of this choice
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallOut | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser: thinking, before any content
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: ChatFinishReason | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    # On the last chunk with stream_options.include_usage; on every chunk (so far) with continuous_usage_stats.
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason | None = None  # None on streamed chunks before the last
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: PromptLogprobs | None = None  # with prompt_logprobs (vLLM's place for it)


class Completion(BaseModel):
    """Both the whole response and each streamed chunk of /v1/completions (as OpenAI does)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtier"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    waiting: int
    running: int
    # The restore planner's machine profile: "saved" (measured by `kvtier profile` or an earlier
    # start), "given", "estimate" (not measured yet), "measured" (while idle, since this start),
    # or null without a store.
    profile: str | None = None
    measuring: str | None = None  # what is being measured while no request is in flight, if anything


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str
