"""A request's documents and blend options, for blended restores (engine/documents.py).

With the engine's blending on (`--blend`), the text parts of the messages' content lists are
documents, and in a completions text prompt the parts between `--blend-separator`s; a prompt that
marks none is searched for the documents the server was given to find (`--blend-corpus`). A request's
`blend` field turns it off for itself, or asks for other options; asking where the server does
not blend is a 400 naming the field. Runs in the request's thread-pool task, off the event loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from kvtier.engine import documents
from kvtier.engine.corpus import Finder
from kvtier.engine.engine import Engine
from kvtier.planning.blend import BlendMode, BlendOptions
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
    options = dataclasses.replace(engine.blend, **given)
    mode = BlendMode(options.mode)
    for name, applies in _APPLIES.items():  # a field the mode does not read is refused, never ignored
        if name in given and mode is not applies:
            raise APIError(400, f"blend.{name} applies to mode {applies.value} only, and this request blends in "
                           f"mode {mode.value}; drop it, or send blend.mode {applies.value!r}",
                           param=f"blend.{name}")
    return options


# The request's blend fields that one mode alone reads.
_APPLIES = {"link_tokens": BlendMode.LEGOLINK, "ratio": BlendMode.CACHEBLEND}


def marks(engine: Engine, body: SamplingFields) -> bool:
    """Whether the request's documents are marked: the server blends and the request does not refuse."""
    return engine.blend is not None and body.blend is not False


def finder(engine: Engine, body: SamplingFields, salt: str | None) -> Finder | None:
    """What finds the corpus's documents in the request's unmarked prompt (None: nothing to find)."""
    return engine.finder(None, salt) if marks(engine, body) else None


def content_parts(body: ChatCompletionRequest) -> list[str]:
    """The text parts of the messages' content lists, in order (each a document)."""
    return [p.text for m in body.messages if isinstance(m.content, list) for p in m.content if p.text.strip()]


def marked_chat(engine: Engine, render: Callable[[], str], parts: list[str],
                find: Finder | None = None) -> tuple[list[int], Spans] | None:
    """The rendered chat prompt with its content `parts` marked: each tokenized alone. A part the
    template does not render as given (trimmed, escaped) is left unmarked. No parts: the documents
    `find` finds in the render, None where it finds none."""
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
    if not parts and find is not None:
        found = find.text(text)
        if not found:
            return None
    ids, spans = documents.encode_marked(engine.encode, text, found)
    return ids, tuple(spans)


def marked_completion(engine: Engine, body: CompletionRequest, separator: str | None,
                      find: Finder | None = None) -> tuple[list[int], Spans] | None:
    """A text prompt's documents between `separator`s, the separators taken out; else the documents
    `find` finds in the prompt (text or ids); None: nothing to mark."""
    prompt = body.prompt
    if not marks(engine, body):
        return None
    if separator is not None and isinstance(prompt, str) and separator in prompt:
        text, docs = documents.split_separated(prompt, separator)
    elif find is not None and not isinstance(prompt, str):
        ids = engine.encode(list(prompt))  # type: ignore[arg-type]
        found = find.ids(ids)
        return (ids, tuple(documents.locate(ids, found))) if found else None
    elif find is not None and isinstance(prompt, str) and (docs := find.text(prompt)):
        text = prompt
    else:
        return None
    first = [body.add_special_tokens]  # a tokenizer's special tokens (a BOS) go before the first piece only
    head: list[int] = []
    if first[0] and docs and text.startswith(docs[0]):  # a BOS before the document, never inside its span
        head, first[0] = engine.encode("", True), False

    def encode(piece: str) -> list[int]:
        special, first[0] = first[0], False
        return engine.encode(piece, special)

    ids, spans = documents.encode_marked(encode, text, docs)
    return head + ids, tuple((a + len(head), b + len(head)) for a, b in spans)
