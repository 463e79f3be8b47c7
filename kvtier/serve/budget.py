"""The output budget: how much output one request may ask for.

n, max_tokens and the logprobs counts are each bounded (MAX_N, the context window, MAX_LOGPROBS),
but not their product: a body of a hundred bytes asking for 16 samples of 8K tokens with the 20
top logprobs of each token asks for 2.75 million entries, an answer of well over 100 MB that the
server builds in memory before it sends a byte. The budget bounds that product. An output entry is
one sampled token or one logprob alternative sent with it; prompt logprobs count the same way,
once per copy of them the answer holds.

The default, 2**20 entries, lets through every request without logprobs on a window up to 64K
tokens (16 samples that each fill it) and a single sample of up to 49,932 tokens with the 20 top
logprobs, while it keeps an answer under about 100 MB of JSON (measured: 85 bytes per chat
logprob alternative with its `bytes` list, 31 per text-completion one); without it, 16 samples
over a 128K window with 20 top logprobs would be 44 million entries, several GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.serve.config import DEFAULT_MAX_OUTPUT_ENTRIES
from kvtier.serve.errors import APIError
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

__all__ = ["DEFAULT_MAX_OUTPUT_ENTRIES", "OutputAsk", "check_output_budget", "output_ask"]

OPTION = "--max-output-entries"


@dataclass(frozen=True)
class OutputAsk:
    """The most output one request can produce, as counts."""

    n: int
    max_tokens: int
    top_logprobs: int  # alternatives sent with each sampled token (0 without logprobs)
    prompt_tokens: int = 0
    prompt_logprobs: int | None = None  # None: the prompt's logprobs are not asked for
    prompt_copies: int = 1  # a text completion repeats them in every choice; a chat completion sends them once

    @property
    def sampled(self) -> int:
        return self.n * self.max_tokens * (1 + self.top_logprobs)

    @property
    def prompt(self) -> int:
        if self.prompt_logprobs is None:
            return 0
        return self.prompt_copies * self.prompt_tokens * (1 + self.prompt_logprobs)

    @property
    def entries(self) -> int:
        return self.sampled + self.prompt


def check_output_budget(body: SamplingFields, max_tokens: int, prompt_tokens: int, limit: int) -> None:
    """A 400 when `body`, allowed `max_tokens` per sample, can produce more than `limit` output
    entries (0: no limit)."""
    if limit <= 0:
        return
    ask = output_ask(body, max_tokens, prompt_tokens)
    if ask.entries > limit:
        raise APIError(400, _message(body, ask, limit), code="output_limit_exceeded")


def output_ask(body: SamplingFields, max_tokens: int, prompt_tokens: int) -> OutputAsk:
    chat = isinstance(body, ChatCompletionRequest)
    return OutputAsk(n=body.n, max_tokens=max_tokens, top_logprobs=_top_logprobs(body), prompt_tokens=prompt_tokens,
                     prompt_logprobs=body.prompt_logprobs, prompt_copies=1 if chat else body.n)


def _top_logprobs(body: SamplingFields) -> int:
    if isinstance(body, (ChatCompletionRequest, CompletionRequest)):
        return body.num_logprobs or 0
    return 0


def _names(body: SamplingFields) -> tuple[str, str]:
    """The request's own names for its completion length and its logprobs count."""
    if isinstance(body, ChatCompletionRequest):
        tokens = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return tokens, "top_logprobs"
    return "max_tokens", "logprobs"


def _message(body: SamplingFields, ask: OutputAsk, limit: int) -> str:
    tokens, logprobs = _names(body)
    given = body.max_tokens is not None or getattr(body, "max_completion_tokens", None) is not None
    length = f"{ask.max_tokens}" if given else f"{ask.max_tokens} ({tokens} not given: this server's default)"
    parts = f"n x {tokens} x (1 + {logprobs}) = {ask.n} x {length} x (1 + {ask.top_logprobs}) = {ask.sampled:,}"
    fields = f"n, {tokens} or {logprobs}"
    if ask.prompt_logprobs is not None:
        copies = f"{ask.prompt_copies} x " if ask.prompt_copies > 1 else ""
        parts += (f", plus {copies}{ask.prompt_tokens} prompt tokens x (1 + prompt_logprobs) = {copies}"
                  f"{ask.prompt_tokens} x (1 + {ask.prompt_logprobs}) = {ask.prompt:,}")
        fields = f"n, {tokens}, {logprobs} or prompt_logprobs"
    return (f"this request can produce {ask.entries:,} output entries ({parts}), more than this server's limit of "
            f"{limit:,} ({OPTION}); lower {fields}")
