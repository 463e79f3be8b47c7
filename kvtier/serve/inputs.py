"""Turn a validated request body into prompt token ids and SamplingParams, or a 4xx.

The checks that need the tokenized prompt live here: the context window (prompt plus the
requested completion must fit) and the engine's own prompt validation; so do the chat prompt's
tools and the grammar a request constrains its output with.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from jinja2 import TemplateError
from pydantic import BaseModel

from kvtier.engine import documents
from kvtier.engine.engine import Engine, PromptError
from kvtier.engine.prompts import check_text
from kvtier.engine.request import GrammarSpec, SamplingError, SamplingParams
from kvtier.engine.structured import Constraint, GrammarError, too_slow
from kvtier.planning.blend import BlendOptions
from kvtier.serve.blend_inputs import Spans, blend_asked, content_parts, finder, marked_chat, marked_completion, marks
from kvtier.serve.budget import check_output_budget
from kvtier.serve.errors import APIError, quoted
from kvtier.serve.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    SamplingFields,
    template_messages,
)
from kvtier.serve.tools import ToolFamily, forced_grammar, prepare_messages, tag_tokens, tool_family

log = logging.getLogger("kvtier.serve")

# Unknown field names already warned about (--unknown-fields warn): one line per name, not per
# request. Bounded, since the names come from clients.
_WARNED: set[str] = set()
_WARNED_LOCK = threading.Lock()
_MAX_WARNED = 1024


def check_unknown_fields(body: BaseModel, mode: str) -> None:
    """Refuse a body's unknown top-level fields with a 400 naming them (OpenAI's answer), or, in
    "warn" mode, log each name once and drop them, so no code can read them by accident."""
    extra = body.model_extra
    if not extra:
        return
    names = [n[:100] for n in extra]
    if mode == "reject":
        shown = ", ".join(names[:5]) + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")
        raise APIError(
            400, f"Unrecognized request argument{'s' if len(names) > 1 else ''} supplied: {shown}; this server does "
            "not implement it (GET /openapi.json lists the fields it takes)",
            param=names[0], code="unknown_parameter",
        )
    with _WARNED_LOCK:
        new = [n for n in names if n not in _WARNED][: max(0, _MAX_WARNED - len(_WARNED))]
        _WARNED.update(new)
    for name in new:
        log.warning("ignoring the unknown request field %r (--unknown-fields warn); later requests with it are "
                    "not logged", name)
    extra.clear()


@dataclass(frozen=True)
class Prepared:
    ids: list[int]
    params: SamplingParams
    segments: Spans = ()  # the documents' spans a blended restore may load
    blend: bool | BlendOptions | None = None  # the request's `blend` (None: as the server says)


@dataclass(frozen=True)
class ToolSetup:
    """How a chat request's tools are laid out and read back: the family of its template."""

    mode: Literal["none", "auto", "required", "named"]
    family: ToolFamily
    names: tuple[str, ...]
    tools: list[dict[str, Any]]
    # tool_choice auto with a strict function: a grammar keeps the output to plain text or a call
    # that follows its schema, so only a call at the very start is one.
    strict: bool = False
    # The call tags the tokenizer has as added tokens: a forced call's grammar names them as tokens.
    tokens: frozenset[str] = frozenset()

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named") or self.strict


def tool_setup(engine: Engine, body: ChatCompletionRequest) -> ToolSetup:
    template = getattr(engine.model.tokenizer, "chat_template", None)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    strict = body.tool_mode == "auto" and any(t.function.strict for t in body.tools or [])
    constrained = body.tool_mode in ("required", "named") or strict
    return ToolSetup(body.tool_mode, tool_family(template), tuple(t["function"]["name"] for t in tools), tools,
                     strict, tag_tokens(engine.model.tokenizer) if constrained else frozenset())


def chat_prompt(engine: Engine, body: ChatCompletionRequest, tools: ToolSetup,
                salt: str | None = None) -> tuple[list[int], Spans]:
    """The chat prompt's ids, and its documents' spans where the server blends (blend_inputs.py;
    `salt`: the tenant's, whose precompiled documents are found in an unmarked prompt)."""
    template = getattr(engine.model.tokenizer, "chat_template", None)
    # tool_choice "none": the model is not shown the tools, so it cannot call one.
    messages, tools_arg = prepare_messages(template_messages(body.messages),
                                           tools.tools if tools.mode != "none" else None, template)
    # The request's tools first: a template without tools of its own gets them inside a message.
    for value, field in ((tools.tools, "tools"), (body.chat_template_kwargs, "chat_template_kwargs"),
                         (messages, "messages")):
        try:
            check_text(value, f"the {field}")
        except PromptError as e:
            raise APIError(400, str(e), param=field) from None
    try:
        contents = content_parts(body) if marks(engine, body) else []
        parts = any(p for _, p in contents)
        find = None if parts else finder(engine, body, salt)
        if parts or find is not None:
            marked = marked_chat(engine, lambda: _render_chat(engine, messages, tools_arg, body, tokenize=False),
                                 contents, find)
            if marked is not None:
                return marked
        if not body.continue_final_message and not body.chat_template_kwargs:
            return engine.encode_chat(messages, add_generation_prompt=body.add_generation_prompt, tools=tools_arg), ()
        return _render_chat(engine, messages, tools_arg, body), ()
    except (PromptError, TemplateError) as e:
        # Templates may reject a conversation shape (e.g. roles that do not alternate).
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e
    except ValueError as e:
        if not body.continue_final_message:
            raise
        # transformers cannot find the final message's text in the render to stop after it.
        raise APIError(400, f"cannot continue the final message: {e}", param="continue_final_message") from e


@overload
def _render_chat(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 body: ChatCompletionRequest) -> list[int]: ...
@overload
def _render_chat(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 body: ChatCompletionRequest, tokenize: Literal[False]) -> str: ...
def _render_chat(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 body: ChatCompletionRequest, tokenize: bool = True) -> list[int] | str:
    """The chat template with vLLM's controls: the final message left open, and the request's
    own template variables (the schema keeps them off the template's reserved names)."""
    tok = engine.model.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        raise PromptError(f"model {engine.model.name} has no chat template")
    out = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message, tokenize=tokenize, tools=tools,
                                  **(body.chat_template_kwargs or {}))
    if not tokenize:
        return str(out)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def completion_prompt(engine: Engine, body: CompletionRequest, separator: str | None = None,
                      salt: str | None = None) -> tuple[list[int], Spans]:
    """The prompt's ids, and its documents' spans where the server blends: those `separator`
    marks, else those of the corpus found in it (the tenant's `salt`'s and every tenant's)."""
    prompt = body.prompt
    try:
        marked = marked_completion(engine, body, separator, finder(engine, body, salt))
        if marked is not None:
            return marked
        if isinstance(prompt, str):
            if separator is not None and separator in prompt:  # the server's markup: out, blended or not
                prompt = documents.split_separated(prompt, separator)[0]
            return engine.encode(prompt, body.add_special_tokens), ()
        return engine.encode(list(prompt)), ()  # type: ignore[arg-type]
    except PromptError as e:
        raise APIError(400, str(e), param="prompt") from e


def grammar_spec(body: SamplingFields, tools: ToolSetup | None = None) -> tuple[GrammarSpec, str] | None:
    """The constraint a request asks for, and the field that asked (for errors), or None."""
    if tools is not None and tools.constrained:
        assert isinstance(body, ChatCompletionRequest)
        name = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        grammar = forced_grammar(tools.tools, name, tools.family, optional=tools.strict, tokens=tools.tokens)
        return GrammarSpec("lark", grammar), "tools" if tools.strict else "tool_choice"
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type == "json_object":
        return GrammarSpec("json_object", ""), "response_format"
    if fmt is not None and fmt.json_schema is not None:
        return GrammarSpec("json_schema", json.dumps(fmt.json_schema.schema_)), "response_format"
    if body.grammar is not None:
        return GrammarSpec("gbnf", body.grammar), "grammar"
    if so is None:
        return None
    if so.json_ is not None:
        text = so.json_ if isinstance(so.json_, str) else json.dumps(so.json_)
        return GrammarSpec("json_schema", text), "structured_outputs.json"
    if so.json_object:
        return GrammarSpec("json_object", ""), "structured_outputs.json_object"
    if so.regex is not None:
        return GrammarSpec("regex", so.regex), "structured_outputs.regex"
    if so.choice is not None:  # JSON string literals are Lark string literals
        return GrammarSpec("lark", "start: " + " | ".join(json.dumps(c) for c in so.choice)), "structured_outputs.choice"
    assert so.grammar is not None
    return GrammarSpec("lark", so.grammar), "structured_outputs.grammar"


async def build_constraint(engine: Engine, spec: tuple[GrammarSpec, str] | None) -> Constraint | None:
    """The request's grammar checked against the limits, compiled and ready, on a grammar thread
    (never the event loop's or the engine's), within its deadline; a 400 naming the field if
    it is past a limit, too slow, or refused by the grammar engine."""
    if spec is None:
        return None
    grammars = engine.grammars
    try:
        await asyncio.wrap_future(grammars.ready())  # the model's grammar tokenizer: once, not this grammar's time
        return await asyncio.wait_for(asyncio.wrap_future(grammars.build(spec[0])), grammars.limits.timeout_s)
    except TimeoutError:
        raise APIError(400, too_slow(grammars.limits), param=spec[1]) from None
    except GrammarError as e:
        raise APIError(400, str(e), param=spec[1]) from e


def prepare(
    engine: Engine, ids: Sequence[int], body: SamplingFields, requested: int | None, default_max_tokens: int | None,
    structured: GrammarSpec | None = None, max_output_entries: int = 0, segments: Spans = (),
) -> Prepared:
    """Check the prompt against the context window and build the sampling parameters."""
    window = engine.max_model_len
    ids = list(ids)
    truncated = _check_prompt(engine, ids, body)
    _check_token_limits(body, window)
    max_tokens = _max_tokens(body, len(ids), window, truncated, requested, default_max_tokens)
    check_output_budget(body, max_tokens, min(len(ids), window), max_output_entries)
    bias = _logit_bias(body, engine.model.config.vocab_size)
    return Prepared(ids, _sampling_params(body, max_tokens, bias, structured), segments, blend_asked(engine, body))


def _check_prompt(engine: Engine, ids: list[int], body: SamplingFields) -> bool:
    """A 400 if the prompt cannot be served; -> whether the engine will truncate it."""
    window = engine.max_model_len
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    # An engine configured to truncate keeps the start and the newest part of an overlong prompt,
    # leaving at most half the window for the completion; otherwise an overlong prompt is an error.
    truncated = len(ids) >= window and getattr(engine, "truncation", None) is not None
    if len(ids) >= window and not truncated:
        raise APIError(
            400,
            f"this model's maximum context length is {window} tokens, but the prompt has {len(ids)} tokens "
            "(at least one token must remain for the completion); shorten the prompt",
            param=param, code="context_length_exceeded",
        )
    try:
        if not truncated:  # a truncated prompt is validated by the engine after truncation (in submit)
            engine.validate(ids)
    except PromptError as e:
        raise APIError(400, str(e), param=param) from e
    return truncated


def _check_token_limits(body: SamplingFields, window: int) -> None:
    """A 400 if the completion-length fields disagree, or any of them alone exceeds the window."""
    n_predict = body.n_predict
    for name in ("max_tokens", "max_completion_tokens"):  # llama-server's name must agree with OpenAI's
        other = getattr(body, name, None)
        if n_predict is not None and other is not None and other != n_predict:
            raise APIError(400, f"n_predict={n_predict} and {name}={other} disagree; give one of them",
                           param="n_predict")
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):  # each given limit must fit, used or not
        value = getattr(body, name, None)
        if value is not None and value >= window:
            raise APIError(
                400, f"{name}={value} cannot fit this model's context window of {window} tokens",
                param=name, code="context_length_exceeded",
            )


def _max_tokens(body: SamplingFields, prompt_len: int, window: int, truncated: bool, requested: int | None,
                default_max_tokens: int | None) -> int:
    """The completion's token limit: the request's if it fits beside the prompt (else a 400), or
    the room left, capped by the server's default."""
    room = window // 2 if truncated else window - prompt_len
    if requested is None:
        return room if default_max_tokens is None else min(default_max_tokens, room)
    if requested > room:
        name = next(n for n in ("max_completion_tokens", "max_tokens", "n_predict") if getattr(body, n, None) is not None)
        raise APIError(
            400,
            f"this model's maximum context length is {window} tokens; you requested {prompt_len + requested} "
            f"({prompt_len} in the prompt, {requested} for the completion); lower {name} or shorten the prompt",
            param=name, code="context_length_exceeded",
        )
    return requested


def _logit_bias(body: SamplingFields, vocab: int) -> dict[int, float]:
    """`logit_bias` keyed by token id; a 400 if it or `stop_token_ids` names a token outside the vocabulary."""
    given = body.logit_bias or {}
    # Plain decimal ids only: int() would also read " 5", "+5", "05" and full-width digits, and two
    # spellings of one id would silently merge.
    odd = next((k for k in given if not (k.isascii() and k.isdigit() and (k == "0" or k[0] != "0"))), None)
    if odd is not None:
        raise APIError(400, f"logit_bias keys must be token ids in plain decimal digits, got {quoted(odd)}",
                       param="logit_bias")
    bias = {int(k): v for k, v in given.items()}
    for name, ids_given in (("logit_bias", bias), ("stop_token_ids", body.stop_token_ids or ())):
        if any(not 0 <= t < vocab for t in ids_given):
            raise APIError(400, f"token ids must be in [0, {vocab})", param=name)
    return bias


def _sampling_params(body: SamplingFields, max_tokens: int, bias: dict[int, float],
                     structured: GrammarSpec | None) -> SamplingParams:
    """The request's sampling fields with OpenAI's defaults filled in."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=max(body.top_k or 0, 0),  # vLLM's -1 and 0 both mean "all tokens"
            min_p=body.min_p or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            logit_bias=tuple(sorted(bias.items())),
            min_tokens=body.min_tokens or 0,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=body.num_logprobs,  # type: ignore[attr-defined]
            prompt_logprobs=body.prompt_logprobs,
            n=body.n,
            structured=structured,
            seed=body.generator_seed(),
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )
    except SamplingError as e:  # the schema already checks ranges; this is the engine's last word
        raise APIError(400, str(e)) from e
