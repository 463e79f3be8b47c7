"""Request bodies of the OpenAI API subset we serve, as pydantic models.

They make the OpenAPI schema real (clients and schemathesis read it) and reject wrong types and
out-of-range values before anything reaches the engine. Unknown fields are ignored, as OpenAI
known fields we do not implement (beam search, best_of, ...) are accepted only in
their neutral form and otherwise refused with a 400 naming them, never silently ignored: a client
never gets a different behaviour than it asked for without knowing. Fields no schema knows are kept
(`model_extra`) so the handler can refuse them with a 400 naming them, as OpenAI does, or, with
`--unknown-fields warn`, log and ignore them. docs/serve.md lists every field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvtier.engine.request import MAX_LOGPROBS, MAX_N, MAX_PRIORITY, MIN_PRIORITY
from kvtier.serve.errors import quoted

# Bound on the free-form identifier fields (user, prompt_cache_key, cache_salt); OpenAI's limit for
# `user`. They are kept per request and per session, so an unbounded one would be a memory lever.
MAX_ID_CHARS = 256

StopString = Annotated[str, Field(min_length=1)]
NonEmptyText = Annotated[str, Field(min_length=1)]
# A list fails at its first bad item (fail_fast): a body of a million bad items is one error, not a
# million to build and describe.
FAIL_FAST = Field(fail_fast=True)
TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1), FAIL_FAST]


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
# A request body's top level: unknown fields are kept for the handler to refuse or warn about (a
# server setting, so not decided here). Nested objects ignore theirs: clients send back OpenAI's
# response objects (an assistant message with `refusal`, `annotations`, ...) as they got them.
_TOP = ConfigDict(extra="allow", strict=True)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage (so far) in every chunk, as vLLM offers")


class BlendField(BaseModel):
    """A request's own blend options (kvtier's); what it leaves out is the server's (--blend-*)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    mode: Literal["legolink", "cacheblend", "naive"] | None = None
    link_tokens: int | None = Field(None, ge=0, le=4096, description="legolink: leading tokens of each document "
                                    "recomputed")
    ratio: float | None = Field(None, ge=0.0, le=1.0, description="cacheblend: share of the loaded tokens recomputed")


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str = Field(description="the arguments as a JSON object, in a string (OpenAI's form)")


class ToolCallIn(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    # "developer" is OpenAI's newer name for "system"; "tool" carries a tool's result back.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], FAIL_FAST] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], FAIL_FAST] | None = Field(None, description="assistant only: the calls it made")
    tool_call_id: str | None = Field(None, description="tool only: the call this is the result of")

    @field_validator("content")
    @classmethod
    def _content_given(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") != "assistant":
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        return v

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("content is required (null only for an assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(
        None, description="true: with tool_choice auto, the answer is text or a call that follows the schema "
        "(required and named calls always do)",
    )


class Tool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionName


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="output always follows the schema, strict or not")


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of its forms."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema")
    json_object: bool | None = Field(None, description="any JSON object")
    regex: str | None = None
    choice: Annotated[list[str], FAIL_FAST] | None = Field(None, min_length=1, description="exactly one of these strings")
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")

    @model_validator(mode="after")
    def _one_form(self) -> StructuredOutputs:
        given = [k for k in ("json_", "json_object", "regex", "choice", "grammar") if getattr(self, k)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice and grammar")
        return self


# Fields of the OpenAI and vLLM APIs this server does not implement. Each is accepted only in its
# neutral form and refused otherwise with a 400 naming it, never silently ignored.
_REFUSED_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "allowed_token_ids": (None,),
    "bad_words": (None, ()),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}
# Why a refused field is refused, and what to do instead, where the generic message says too little.
_WHY = {
    "store": "stored completions are not supported; leave it out (or send false)",
    "metadata": "metadata is for stored completions, which are not supported; leave it out",
    "service_tier": "there is one service tier; leave it out (or send \"auto\" or \"default\")",
    "modalities": "text is the only output modality; leave it out (or send [\"text\"])",
    "prediction": "predicted outputs are not supported; leave it out",
    "reasoning_effort": "not supported; a reasoning model's chat template may take a switch in chat_template_kwargs "
                        "(e.g. {\"enable_thinking\": false})",
    "audio": "audio output is not supported; leave it out",
    "web_search_options": "web search is not supported; leave it out",
    "verbosity": "not supported; leave it out",
    "functions": "OpenAI's deprecated name; use tools",
    "function_call": "OpenAI's deprecated name; use tool_choice",
}
# Chat fields of OpenAI's API this server does not implement; clients may send them in their
# neutral form, which is accepted.
_REFUSED_CHAT: dict[str, tuple[Any, ...]] = {
    "store": (None, False),
    "metadata": (None,),
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ("text",)),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "audio": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
    "functions": (None, ()),
    "function_call": (None,),
}


def _is_neutral(value: Any, neutral: Any) -> bool:
    if neutral is None or neutral == ():
        return value is None or (neutral == () and value == [])
    if isinstance(neutral, tuple):  # a non-empty list
        return isinstance(value, list) and tuple(value) == neutral
    return bool(value == neutral) and isinstance(value, bool) == isinstance(neutral, bool)


def _refused(neutral: tuple[Any, ...], why: str) -> Any:
    values = [list(v) if isinstance(v, tuple) and v else v for v in neutral if v != ()]
    schema: dict[str, Any] = {"enum": values}
    if () in neutral:
        schema = {"anyOf": [{"type": "array", "maxItems": 0}, {"type": "null"}]}
    return only(schema, why)


def _check_neutral(table: dict[str, tuple[Any, ...]], v: Any, name: str) -> None:
    neutral = table[name]
    if not any(_is_neutral(v, n) for n in neutral):
        last = list(neutral[-1]) if isinstance(neutral[-1], tuple) else neutral[-1]
        raise ValueError(_WHY.get(name, f"not supported by this server; leave it out (or send {last!r})"))


# chat_template_kwargs: names the template gets from the server itself (or that apply_chat_template
# takes as its own arguments); a request may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "bos_token", "eos_token",
    "unk_token", "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens",
    "raise_exception", "strftime_now",
})
MAX_TEMPLATE_KWARGS = 32
MAX_TEMPLATE_VALUE_CHARS = 4096
_TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _TOP

    model: str = Field(min_length=1, description="the served model name (see GET /v1/models)")
    max_tokens: int | None = Field(None, ge=1, description="completion length limit")
    # llama-server's name; -1 is its "no limit".
    n_predict: int | None = Field(
        None, ge=-1, description="llama-server's max_tokens (-1: no limit); if both are given they must agree"
    )
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus sampling mass; default 1")
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = Field(
        None, description="up to 4 non-empty stop strings"
    )
    # Any integer: it is reduced to the generator's 64-bit range (JSON Schema bounds this large
    # would be written as floats and lose the exact limit).
    seed: int | None = Field(None, description="makes sampling reproducible (sample i of n uses seed + i)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N, description="samples of the prompt (one prefill, its blocks shared)")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="per generated token present")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="per occurrence in the output")
    # vLLM's sampling extras.
    top_k: int | None = Field(None, ge=-1, description="sample from the k likeliest tokens; 0 or -1 = all")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="drop tokens below min_p x the likeliest's")
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, description="over prompt and output; 1 = off")
    min_tokens: int | None = Field(None, ge=0, description="hold back EOS and stop_token_ids until this many")
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=1024)] | None = Field(
        None, description="token id (as a string) -> added to its logit; -100 bans it"
    )
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = Field(
        None, description="token ids that end the output"
    )
    ignore_eos: bool = Field(False, description="keep generating past the end-of-sequence token")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema")
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: json, regex, choice or grammar")
    grammar: str | None = Field(None, min_length=1, description="llama-server's: a GBNF grammar")
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS,
        description="vLLM's: each prompt token's logprob and rank, and the k likeliest (the prompt is computed, "
        "not restored); not with stream",
    )
    best_of: int | None = _refused(_REFUSED_NEUTRAL["best_of"], "not supported; use n")
    use_beam_search: bool | None = _refused(_REFUSED_NEUTRAL["use_beam_search"], "not supported")
    length_penalty: float | None = _refused(_REFUSED_NEUTRAL["length_penalty"], "beam search only; not supported")
    include_stop_str_in_output: bool | None = _refused(_REFUSED_NEUTRAL["include_stop_str_in_output"],
                                                       "not supported")
    skip_special_tokens: bool | None = _refused(_REFUSED_NEUTRAL["skip_special_tokens"], "not supported")
    allowed_token_ids: list[int] | None = _refused(_REFUSED_NEUTRAL["allowed_token_ids"], "not supported")
    bad_words: list[str] | None = _refused(_REFUSED_NEUTRAL["bad_words"], "not supported")
    truncate_prompt_tokens: int | None = _refused(_REFUSED_NEUTRAL["truncate_prompt_tokens"], "not supported")
    guided_json: Any = _refused(_REFUSED_NEUTRAL["guided_json"], "vLLM's old name; use structured_outputs")
    guided_regex: Any = _refused(_REFUSED_NEUTRAL["guided_regex"], "vLLM's old name; use structured_outputs")
    guided_choice: Any = _refused(_REFUSED_NEUTRAL["guided_choice"], "vLLM's old name; use structured_outputs")
    guided_grammar: Any = _refused(_REFUSED_NEUTRAL["guided_grammar"], "vLLM's old name; use structured_outputs")
    # llama-server's. Reuse is exact (a hit is bit-identical to computing the prompt), so false
    # changes the cost and what the caches hold afterwards, never the answer.
    cache_prompt: bool | None = Field(
        None, description="llama-server's: default true; false neither reuses cached or stored prompt state nor "
        "leaves this request's state for others (computed in full, not saved)",
    )
    # kvtier's: blended restores of marked documents (chat content parts; in a plain prompt, the
    # parts between the server's --blend-separator), lossy and allowed by the server's --blend.
    blend: bool | BlendField | None = Field(
        None, description="kvtier's: with the server's --blend, marked documents (the text parts of a message's "
        "content list) are loaded from state computed alone and a few tokens recomputed (lossy). Default: as the "
        "server says; false: never; true or {mode, link_tokens, ratio}: blend (a 400 where the server does not)",
    )
    # vLLM's (its --scheduling-policy priority); bounded to 32 bits.
    priority: int | None = Field(
        None, ge=MIN_PRIORITY, le=MAX_PRIORITY,
        description="vLLM's: default 0; waiting requests are admitted lowest value first, equal ones first-come "
        "first-served; a running request is not preempted for a waiting one",
    )
    return_tokens_as_token_ids: bool = Field(
        False, description="vLLM's: logprobs name tokens as \"token_id:N\" instead of their text"
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

    @field_validator(*_REFUSED_NEUTRAL, mode="before")
    @classmethod
    def _neutral_only(cls, v: Any, info: ValidationInfo) -> Any:
        _check_neutral(_REFUSED_NEUTRAL, v, str(info.field_name))
        return None

    @field_validator("n_predict")
    @classmethod
    def _n_predict(cls, v: int | None) -> int | None:
        if v == 0:
            raise ValueError("n_predict must be -1 (no limit) or at least 1")
        return None if v == -1 else v

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):
            raise ValueError("prompt logprobs come in the whole response; ask without stream")
        return v

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only for stream: true (as OpenAI and vLLM say)")
        return v

    @model_validator(mode="after")
    def _one_constraint(self) -> SamplingFields:
        given = [name for name in ("structured_outputs", "grammar") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"give at most one of response_format, structured_outputs and grammar (got {given})")
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def generator_seed(self) -> int | None:
        return None if self.seed is None else self.seed % 2**64

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], FAIL_FAST] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens")
    logprobs: bool = Field(False, description="return each output token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="and the k likeliest (needs logprobs)")
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto with tools, none without; required and a named function are enforced"
    )
    parallel_tool_calls: bool = Field(True, description="false: at most one call per response")
    # vLLM's chat template controls.
    add_generation_prompt: bool = Field(True, description="end the prompt with the assistant turn's opening")
    continue_final_message: bool = Field(
        False, description="leave the final message open and continue it (needs add_generation_prompt: false)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description=f"extra variables for the chat template (e.g. enable_thinking); at most "
        f"{MAX_TEMPLATE_KWARGS}, scalar values",
    )
    echo: bool = Field(False, description="vLLM's: the answer begins with the final message's content when it is "
                       "the assistant's (or with add_generation_prompt: false)")
    store: bool | None = _refused(_REFUSED_CHAT["store"], _WHY["store"])
    metadata: dict[str, str] | None = _refused(_REFUSED_CHAT["metadata"], _WHY["metadata"])
    service_tier: str | None = _refused(_REFUSED_CHAT["service_tier"], _WHY["service_tier"])
    modalities: list[str] | None = _refused(_REFUSED_CHAT["modalities"], _WHY["modalities"])
    prediction: Any = _refused(_REFUSED_CHAT["prediction"], _WHY["prediction"])
    reasoning_effort: str | None = _refused(_REFUSED_CHAT["reasoning_effort"], _WHY["reasoning_effort"])
    audio: Any = _refused(_REFUSED_CHAT["audio"], _WHY["audio"])
    web_search_options: Any = _refused(_REFUSED_CHAT["web_search_options"], _WHY["web_search_options"])
    verbosity: str | None = _refused(_REFUSED_CHAT["verbosity"], _WHY["verbosity"])
    functions: list[Any] | None = _refused(_REFUSED_CHAT["functions"], _WHY["functions"])
    function_call: Any = _refused(_REFUSED_CHAT["function_call"], _WHY["function_call"])

    @field_validator(*_REFUSED_CHAT, mode="before")
    @classmethod
    def _chat_neutral_only(cls, v: Any, info: ValidationInfo) -> Any:
        _check_neutral(_REFUSED_CHAT, v, str(info.field_name))
        return None

    @field_validator("continue_final_message")
    @classmethod
    def _continue_alone(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt", True):
            raise ValueError("continue_final_message continues the final message instead of opening a new "
                             "assistant turn; send add_generation_prompt: false with it")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if len(v) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} variables")
        for key, value in v.items():
            if not _TEMPLATE_NAME.fullmatch(key):
                raise ValueError(f"{quoted(key)} is not a template variable name (letters, digits, _)")
            if key in RESERVED_TEMPLATE_NAMES:
                raise ValueError(f"{quoted(key)} is set by the server (use the request field of that name, if any)")
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise ValueError(f"{quoted(key)}: values must be strings, numbers, booleans or null")
            if isinstance(value, str) and len(value) > MAX_TEMPLATE_VALUE_CHARS:
                raise ValueError(f"{quoted(key)}: a string value may have at most {MAX_TEMPLATE_VALUE_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice required or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {quoted(choice.function.name)}, which is not among the tools")
        strict = self.tool_mode == "auto" and any(t.function.strict for t in self.tools or [])
        constrained = choice not in (None, "none", "auto") or strict
        if constrained and (any(getattr(self, f) is not None for f in ("structured_outputs", "grammar")) or (
                self.response_format is not None and self.response_format.type != "text")):
            raise ValueError("a forced tool_choice or a strict tool already constrains the output; drop "
                             "response_format / structured_outputs / grammar")
        return self

    def requested_max_tokens(self) -> int | None:
        for given in (self.max_completion_tokens, self.max_tokens, self.n_predict):
            if given is not None:
                return given
        return None

    def echo_text(self) -> str:
        """What `echo` puts before the answer: the final message's content when that message is
        the turn being answered (the assistant's, or any with add_generation_prompt false), as vLLM does."""
        last = self.messages[-1]
        if not self.echo or (self.add_generation_prompt and last.role != "assistant"):
            return ""
        return last.text()

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts for the chat template ("developer" is the template's "system")."""
    role = {"developer": "system"}
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": role.get(m.role, m.role), "content": m.text() if m.content is not None else None}
        if m.name is not None:  # the template decides what a participant's name changes (most ignore it)
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


class CompletionRequest(SamplingFields):
    # A string or token ids; the batched forms (several prompts) are accepted only with one prompt.
    prompt: NonEmptyText | TokenIds | Annotated[list[NonEmptyText], Field(min_length=1, max_length=1)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=1)
    ] = Field(description="text or token ids; the batched forms only with a single prompt")
    # vLLM's field: a text prompt gets the tokenizer's special tokens (a Llama tokenizer's BOS) as
    # the tokenizer adds them by default; false sends the text alone. Token-id prompts run as given.
    add_special_tokens: bool = Field(True, description="add the tokenizer's special tokens (BOS) to a text prompt")
    echo: bool = Field(False, description="the answer begins with the prompt (its text; token ids decoded)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="each token's logprob and the k likeliest")
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

    @field_validator("logprobs")
    @classmethod
    def _not_echoed(cls, v: int | None, info: ValidationInfo) -> int | None:
        # OpenAI's echo with logprobs scores the prompt too; here that is prompt_logprobs' job.
        if v is not None and info.data.get("echo"):
            raise ValueError("logprobs with echo would score the prompt too; use prompt_logprobs for that")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix (fill-in-the-middle) is not supported by this server")
        return v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.n_predict

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a `prompt` or chat `messages` (exactly one)."""

    # Refused here, whatever --unknown-fields says: a misspelt option would change the count silently.
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, min_length=1, description="the served model name; optional")
    prompt: str | None = Field(None, description="text, tokenized as /v1/completions tokenizes it")
    messages: Annotated[list[ChatMessage], FAIL_FAST] | None = Field(
        None, min_length=1, description="chat messages, through the chat template")
    add_special_tokens: bool | None = Field(
        None, description="prompt only: add the tokenizer's special tokens (BOS). Default true, as /v1/completions "
        "tokenizes; with messages only false (the template places them)",
    )
    # The chat endpoint's template controls (vLLM's /tokenize takes them too), checked as it checks them.
    add_generation_prompt: bool = Field(True, description="messages only: end with the assistant turn's opening")
    continue_final_message: bool = Field(
        False, description="messages only: leave the final message open (needs add_generation_prompt: false)"
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="messages only: extra variables for the chat template (e.g. enable_thinking), as in "
        "/v1/chat/completions",
    )
    tools: Annotated[list[Tool], Field(max_length=128)] | None = Field(
        None, description="messages only: the tools, laid out in the prompt as /v1/chat/completions lays them out"
    )

    @field_validator("continue_final_message")
    @classmethod
    def _continue_alone(cls, v: bool, info: ValidationInfo) -> bool:
        return ChatCompletionRequest._continue_alone(v, info)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return ChatCompletionRequest._template_kwargs(v)

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens is for prompts; the chat template places special tokens itself")
        if self.prompt is not None:
            given = [n for n in ("continue_final_message", "chat_template_kwargs", "tools") if getattr(self, n)]
            if given:
                raise ValueError(f"{given[0]} is for messages (a prompt is tokenized as it is)")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        return self

    def as_completion(self) -> CompletionRequest:
        """The completions request whose prompt this is; checked already."""
        assert self.prompt is not None
        return CompletionRequest.model_construct(model=self.model or "", prompt=self.prompt,
                                                 add_special_tokens=self.add_special_tokens is not False)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt this is (tools shown, as with tool_choice auto); checked already."""
        assert self.messages is not None
        return ChatCompletionRequest.model_construct(
            model=self.model or "", messages=self.messages, tools=self.tools,
            add_generation_prompt=self.add_generation_prompt, continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, min_length=1, description="the served model name; optional")
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20), FAIL_FAST]
