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


# Each message's content as the template renders it, and the text parts of its content list (each a document).
Contents = list[tuple[str, list[str]]]


def content_parts(body: ChatCompletionRequest) -> Contents:
    """Every message's content text and its content list's text parts, in order."""
    return [(m.text(), [p.text for p in m.content if p.text.strip()] if isinstance(m.content, list) else [])
            for m in body.messages]


def marked_chat(engine: Engine, render: Callable[[], str], contents: Contents,
                find: Finder | None = None) -> tuple[list[int], Spans] | None:
    """The rendered chat prompt with its content parts marked: each tokenized alone, found within
    its own message's content (each message's found in the render after the one before). A part
    the template does not render as given (trimmed, escaped) is left unmarked. No parts: the
    documents `find` finds in the render, None where it finds none. None too where marking would
    cut the template's own tokens apart (a part like "im_start" found inside "<|im_start|>")."""
    count = sum(len(parts) for _, parts in contents)
    if count > documents.MAX_DOCUMENTS:
        raise APIError(400, f"at most {documents.MAX_DOCUMENTS} content parts are documents to blend, got {count}; "
                       "join some, or send blend: false", param="messages")
    text = render()
    found: list[str] = []
    starts: list[int] = []
    at = 0
    for content, parts in contents:
        if not parts:
            continue  # only a message with documents is looked for (a template may move the others: Mistral's system)
        j = text.find(content, at) if content else -1
        if j < 0 and content.strip():  # a template that trims the content (Llama 3's)
            content = content.strip()
            j = text.find(content, at)
        if j < 0:
            continue  # not rendered as given: its parts are left unmarked
        k, at = j, j + len(content)
        for p in parts:
            q = text.find(p, k, at)
            if q >= 0:
                found.append(p)
                starts.append(q)
                k = q + len(p)
    if not count and find is not None:
        found = find.text(text)
        if not found:
            return None
    ids, spans = documents.encode_marked(engine.encode, text, found, starts if count else None)
    markup = _markup_ids(engine)
    if markup and spans and sum(i in markup for i in ids) != sum(i in markup for i in engine.encode(text)):
        return None
    return ids, tuple(spans)


def _markup_ids(engine: Engine) -> frozenset[int]:
    """The tokenizer's added tokens (a chat template's markup: <|im_start|>, <|eot_id|>)."""
    tok = engine.model.tokenizer
    added = getattr(tok, "get_added_vocab", None)
    return frozenset(added().values()) if added is not None else frozenset(getattr(tok, "all_special_ids", ()))


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
