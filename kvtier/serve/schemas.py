"""Request bodies of the OpenAI API subset we serve, as pydantic models.

They make the OpenAPI schema real (clients and schemathesis read it) and reject wrong types and
out-of-range values before anything reaches the engine. Unknown fields are ignored, as OpenAI
does; known features we do not implement (n > 1, logprobs, tools, penalties) are refused with a
clear message rather than silently ignored, so a client never gets a different behaviour than
it asked for without knowing.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Bound on the free-form identifier fields (user, prompt_cache_key, cache_salt); OpenAI's limit for
# `user`. They are kept per request and per session, so an unbounded one would be a memory lever.
MAX_ID_CHARS = 256

StopString = Annotated[str, Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


def only(schema: dict[str, Any], description: str) -> Any:
    """Field metadata for a feature we accept only in its "off" form: the OpenAPI schema says
    exactly which values are allowed (so schema-driven clients and fuzzers know), while the
    validator below gives a readable refusal for anything else."""

    def replace(s: dict[str, Any]) -> None:
        s.clear()
        s.update(schema, description=description)

    return Field(None, json_schema_extra=replace)


# Strict: no silent coercion ("5" -> 5, 0 -> false, 2.0 -> 2); a value of the wrong JSON type is a
# 400, as the schema says. Integers are still accepted where a number is expected.
_STRICT = ConfigDict(extra="ignore", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool | None = only({"enum": [False, None]}, "not supported; false or absent")

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("usage in every streamed chunk is not supported; usage comes in the last chunk")
        return v


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    # "developer" is OpenAI's newer name for "system". Tool and function messages are not
    # supported (no tool calling), so they are refused by the type.
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _STRICT

    model: str = Field(min_length=1, description="the served model name (see GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="completion length limit")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling mass; default 1")
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = Field(
        None, description="up to 4 non-empty stop strings"
    )
    # Any integer: it is reduced to the generator's 64-bit range (JSON Schema bounds this large
    # would be written as floats and lose the exact limit).
    seed: int | None = Field(None, description="makes sampling reproducible")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="only 1 is supported")
    presence_penalty: float | None = only({"enum": [0, None]}, "only 0 is supported")
    frequency_penalty: float | None = only({"enum": [0, None]}, "only 0 is supported")
    # vLLM's sampling extras. Honoured: top_k, ignore_eos. The others are accepted only in their
    # "off" form and refused otherwise (a 400 naming the field), never ignored.
    top_k: int | None = Field(None, ge=-1, description="sample from the k likeliest tokens; 0 or -1 = all")
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token")
    min_p: float | None = only({"enum": [0, None]}, "not supported; 0 or absent")
    repetition_penalty: float | None = only({"enum": [1, None]}, "not supported; 1 or absent")
    min_tokens: int | None = only({"enum": [0, None]}, "not supported; 0 or absent")
    logit_bias: dict[str, float] | None = only(
        {"anyOf": [{"type": "object", "maxProperties": 0}, {"type": "null"}]}, "not supported; empty or absent"
    )
    stop_token_ids: list[int] | None = only(
        {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}, "not supported; empty or absent"
    )
    user: str | None = Field(None, max_length=MAX_ID_CHARS, description="an end-user id (accepted, not used)")
    # OpenAI's hint for cache routing; we pass it to the engine as the session id (per tenant).
    prompt_cache_key: str | None = Field(
        None, max_length=MAX_ID_CHARS, description="session id: what a session saved expires together (--session-ttl)"
    )
    # vLLM's field: only requests with the same salt (within one tenant) share cached prompt state.
    cache_salt: str | None = Field(
        None, min_length=1, max_length=MAX_ID_CHARS,
        description="partitions prompt caching within your tenant: only requests with the same salt share it",
    )

    @field_validator("min_p", "min_tokens", "logit_bias", "stop_token_ids")
    @classmethod
    def _off_only(cls, v: Any) -> Any:
        if v:
            raise ValueError("not supported by this server yet; leave the field out (or send its neutral value)")
        return v

    @field_validator("repetition_penalty")
    @classmethod
    def _no_repetition_penalty(cls, v: float | None) -> float | None:
        if v is not None and v != 1:
            raise ValueError("repetition penalties are not supported by this server yet; send 1 or leave it out")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float | None) -> float | None:
        if v:
            raise ValueError("penalties are not supported by this server; send 0 or leave the field out")
        return v

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def generator_seed(self) -> int | None:
        return None if self.seed is None else self.seed % 2**64

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens")
    logprobs: bool | None = only({"enum": [False, None]}, "not supported; false or absent")
    tools: list[dict[str, Any]] | None = only(
        {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}, "tool calling is not supported"
    )

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("logprobs are not supported by this server")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        if v:
            raise ValueError("tool calling is not supported by this server")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template takes them ("developer" is the template's "system")."""
    role = {"developer": "system"}
    return [{"role": role.get(m.role, m.role), "content": m.text()} for m in messages]


class CompletionRequest(SamplingFields):
    # A string or token ids; the batched forms (several prompts) are accepted only with one prompt.
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)
    ] = Field(description="text or token ids; the batched forms only with a single prompt")
    # vLLM's field: a text prompt gets the tokenizer's special tokens (a Llama tokenizer's BOS) as
    # the tokenizer adds them by default; false sends the text alone. Token-id prompts run as given.
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (BOS) to a text prompt")
    echo: bool | None = only({"enum": [False, None]}, "not supported; false or absent")
    logprobs: int | None = only({"type": "null"}, "not supported")
    suffix: str | None = only({"enum": ["", None]}, "fill-in-the-middle is not supported")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
            raise ValueError("batched prompts are not supported; send one prompt per request")
        return v

    @field_validator("prompt")
    @classmethod
    def _unbatch(cls, v: Any) -> Any:
        return v[0] if isinstance(v, list) and isinstance(v[0], (str, list)) else v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported by this server")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this server")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt` or chat `messages` (exactly one)."""

    model_config = _STRICT

    model: str | None = Field(None, min_length=1, description="the served model name; optional")
    prompt: str | None = Field(None, description="text, tokenized as /v1/completions tokenizes it")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="chat messages, through the chat template")
    add_special_tokens: bool | None = Field(
        None, description="prompt only: add the tokenizer's special tokens (BOS). Default true, as /v1/completions "
        "tokenizes; with messages only false (the template places them)",
    )
    add_generation_prompt: bool = Field(True, description="messages only: end with the assistant turn's opening")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens is for prompts; the chat template places special tokens itself")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    model: str | None = Field(None, min_length=1, description="the served model name; optional")
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)]
