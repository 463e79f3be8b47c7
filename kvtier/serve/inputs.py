"""Turn a validated request body into prompt token ids and SamplingParams, or a 4xx.

The checks that need the tokenized prompt live here: the context window (prompt plus the
requested completion must fit) and the engine's own prompt validation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jinja2 import TemplateError

from kvtier.engine.engine import Engine, PromptError
from kvtier.engine.request import SamplingError, SamplingParams
from kvtier.serve.errors import APIError
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

# The engine's sampler divides logits by the temperature and compares a float32 cumulative sum
# with top_p: a temperature near 0 overflows to inf/NaN and a top_p below float32's range drops
# every token, and either fails the whole engine step. Below these values the distributions are
# already indistinguishable from greedy / top-1, so they are mapped there (vLLM does the same).
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-8


@dataclass(frozen=True)
class Prepared:
    ids: list[int]
    params: SamplingParams


def chat_prompt(engine: Engine, body: ChatCompletionRequest) -> list[int]:
    try:
        return engine.encode_chat(body.template_messages())
    except (PromptError, TemplateError) as e:
        # Templates may reject a conversation shape (e.g. roles that do not alternate).
        raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from e


def completion_prompt(engine: Engine, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    try:
        if isinstance(prompt, str):
            return engine.encode(prompt, body.add_special_tokens)
        return engine.encode(list(prompt))  # type: ignore[arg-type]
    except PromptError as e:
        raise APIError(400, str(e), param="prompt") from e


def prepare(
    engine: Engine, ids: Sequence[int], body: SamplingFields, requested: int | None, default_max_tokens: int | None
) -> Prepared:
    """Check the prompt against the context window and build the sampling parameters."""
    window = engine.max_model_len
    ids = list(ids)
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
    for name in ("max_tokens", "max_completion_tokens"):  # each given limit must fit, used or not
        value = getattr(body, name, None)
        if value is not None and value >= window:
            raise APIError(
                400, f"{name}={value} cannot fit this model's context window of {window} tokens",
                param=name, code="context_length_exceeded",
            )
    room = window // 2 if truncated else window - len(ids)
    if requested is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif requested > room:
        name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None else "max_tokens"
        raise APIError(
            400,
            f"this model's maximum context length is {window} tokens; you requested {len(ids) + requested} "
            f"({len(ids)} in the prompt, {requested} for the completion); lower {name} or shorten the prompt",
            param=name, code="context_length_exceeded",
        )
    else:
        max_tokens = requested
    temperature = 1.0 if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < MIN_TEMPERATURE else temperature,
            top_p=max(top_p, MIN_TOP_P),
            seed=body.generator_seed(),
            stop=body.stop_strings(),
            top_k=max(body.top_k or 0, 0),  # vLLM's -1 and 0 both mean "all tokens"
            ignore_eos=body.ignore_eos,
        )
    except SamplingError as e:  # the schema already checks ranges; this is the engine's last word
        raise APIError(400, str(e)) from e
    return Prepared(ids, params)
