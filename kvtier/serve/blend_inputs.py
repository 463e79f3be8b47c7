"""A request's documents and blend options, for blended restores (engine/documents.py).

With the engine's blending on (`--blend`), the text parts of the messages' content lists are
documents, and in a completions text prompt the parts between `--blend-separator`s. A request's
`blend` field turns it off for itself, or asks for other options; asking where the server does
not blend is a 400 naming the field. Runs in the request's thread-pool task, off the event loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvtier.engine import documents
from kvtier.engine.engine import Engine
from kvtier.planning.blend import BlendOptions
from kvtier.serve.errors import APIError
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields

Spans = tuple[tuple[int, int], ...]


def blend_asked(engine: Engine, body: SamplingFields) -> bool | BlendOptions | None:
    """The request's `blend` as the engine takes it (None: as the server says)."""
    asked = body.blend
    if asked is None or asked is False:
        return asked
    if engine.blend is None:
        raise APIError(400, "this server does not blend documents: start it with --blend (and a store), or drop "
                       "the field", param="blend")
    if asked is True:
        return True
    given = {k: v for k, v in asked.model_dump().items() if v is not None}
    return dataclasses.replace(engine.blend, **given)


def marks(engine: Engine, body: SamplingFields) -> bool:
    """Whether the request's documents are marked: the server blends and the request does not refuse."""
    return engine.blend is not None and body.blend is not False


def content_parts(body: ChatCompletionRequest) -> list[str]:
    """The text parts of the messages' content lists, in order (each a document)."""
    return [p.text for m in body.messages if isinstance(m.content, list) for p in m.content if p.text.strip()]


def marked_chat(engine: Engine, render: Callable[[], str], parts: list[str]) -> tuple[list[int], Spans]:
    """The rendered chat prompt with its content `parts` marked: each tokenized alone. A part the
    template does not render as given (trimmed, escaped) is left unmarked."""
    if len(parts) > documents.MAX_DOCUMENTS:
        raise APIError(400, f"at most {documents.MAX_DOCUMENTS} content parts are documents to blend, got {len(parts)}; "
                       "join some, or send blend: false", param="messages")
    text = render()
    found, at = [], 0
    for p in parts:  # in order, each after the one before, as encode_marked looks them up
        j = text.find(p, at)
        if j >= 0:
            found.append(p)
            at = j + len(p)
    ids, spans = documents.encode_marked(engine.encode, text, found)
    return ids, tuple(spans)


def marked_completion(engine: Engine, body: CompletionRequest, separator: str | None) -> tuple[list[int], Spans] | None:
    """A text prompt's documents between `separator`s, the separators taken out; None: nothing to mark."""
    prompt = body.prompt
    if not marks(engine, body) or separator is None or not isinstance(prompt, str) or separator not in prompt:
        return None
    text, docs = documents.split_separated(prompt, separator)
    first = [body.add_special_tokens]  # a tokenizer's special tokens (a BOS) go before the first piece only

    def encode(piece: str) -> list[int]:
        special, first[0] = first[0], False
        return engine.encode(piece, special)

    ids, spans = documents.encode_marked(encode, text, docs)
    return ids, tuple(spans)
