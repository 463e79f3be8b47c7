"""Marking documents in a prompt, for blended restores: where each document's tokens lie.

A document is matched by content. In a text prompt each document (and each stretch of text between
them) is tokenized on its own, so the document's tokens are the same wherever it appears and never
merge with a neighbour's; in a prompt of token ids a document's ids are searched for. Three ways
in: `documents=[...]` (texts or token ids, in prompt order), a separator string between the parts
of a plain prompt (the parts between the first and the last separated part are documents), and
the text parts of chat messages' content lists (serve/blend_inputs.py); where none is marked, the
documents the engine was given to find (engine/corpus.py). Runs on the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from kvtier.engine.prompts import PromptError
from kvtier.planning.blend import BlendOptions, check_segments, find_segments, integer

Encode = Callable[[str], list[int]]
MAX_DOCUMENTS = 1024


def _count(documents: Sequence[object]) -> None:
    if len(documents) > MAX_DOCUMENTS:
        raise PromptError(f"at most {MAX_DOCUMENTS} documents per prompt, got {len(documents)}")


def given(documents: object) -> list[str | list[int]]:
    """Documents as the API takes them: texts or token ids (lists, tuples, arrays, tensors), in a
    list or any iterable but one string (which would be taken a character at a time)."""
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Iterable):
        raise PromptError("documents must be a list of documents (texts or token-id lists), not "
                          f"{type(documents).__name__}: wrap one document in a list")
    out: list[str | list[int]] = []
    for i, d in enumerate(documents):
        if isinstance(d, str):
            out.append(d)
            continue
        try:
            if isinstance(d, (bytes, Mapping)) or not isinstance(d, Iterable):
                raise TypeError
            out.append([integer(t) for t in d])
        except TypeError:
            raise PromptError(f"document {i} must be a text or token ids, got {type(d).__name__}") from None
    return out



def encode_marked(encode: Encode, text: str, documents: Sequence[str],
                  starts: Sequence[int] | None = None) -> tuple[list[int], list[tuple[int, int]]]:
    """`text`, in which each document occurs in order, as token ids with each document and each
    stretch between them tokenized alone; -> (ids, the documents' spans [a, b)). `starts`: where
    to look for each document from (else right after the one before)."""
    _count(documents)
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    at = 0
    for i, doc in enumerate(documents):
        if not isinstance(doc, str) or not doc:
            raise PromptError(f"document {i} must be a non-empty string")
        j = text.find(doc, at if starts is None else max(at, starts[i]))
        if j < 0:
            raise PromptError(f"document {i} does not occur in the prompt (after the document before it)")
        if j > at:
            ids += encode(text[at:j])
        a = len(ids)
        ids += encode(doc)
        spans.append((a, len(ids)))
        at = j + len(doc)
    if at < len(text):
        ids += encode(text[at:])
    return ids, spans


def split_separated(text: str, separator: str) -> tuple[str, list[str]]:
    """A plain prompt whose parts are separated by `separator`: -> (the prompt without the
    separators, its documents: every part but the first and the last)."""
    if not separator:
        raise PromptError("the document separator must not be empty")
    parts = text.split(separator)
    return "".join(parts), [p for p in parts[1:-1] if p]


def locate(prompt: Sequence[int], documents: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Spans of documents given as token ids in a prompt of token ids (each after the one before)."""
    _count(documents)
    try:
        found = find_segments(prompt, documents)
    except OverflowError:
        raise PromptError("token ids must be non-negative and fit in 64 bits") from None
    missing = [i for i, s in enumerate(found) if s is None]
    if missing:
        raise PromptError(f"document {missing[0]} does not occur in the prompt's token ids (after the document before it)")
    return [s for s in found if s is not None]


def mark(encode: Callable[[str | Sequence[int]], list[int]], prompt: str | Sequence[int],
         documents: Sequence[str | Sequence[int]] | None,
         segments: Sequence[tuple[int, int]],
         find: Callable[[str | Sequence[int]], Sequence[str | Sequence[int]]] | None = None,
         ) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """A prompt's token ids and its documents' spans: from `documents` (matched by content) or
    from `segments` (spans of the prompt's ids, given as they are); neither: the documents `find`
    finds in it (engine/corpus.py), else no document."""
    if documents is not None and segments:
        raise PromptError("give documents or segments, not both")
    if documents is not None:
        documents = given(documents)
    if documents is None and not segments and find is not None:
        documents = find(prompt) or None
    if documents is None:
        ids = encode(prompt)
        try:
            return ids, check_segments(segments, len(ids))
        except ValueError as e:
            raise PromptError(str(e)) from None
    if isinstance(prompt, str) and all(isinstance(d, str) for d in documents):
        ids, spans = encode_marked(encode, prompt, documents)  # type: ignore[arg-type]
        return ids, tuple(spans)
    return (ids := encode(prompt)), tuple(locate(ids, [encode(d) for d in documents]))


def blend_options(asked: bool | BlendOptions | None, allowed: BlendOptions | None, has_store: bool,
                  spans: Sequence[tuple[int, int]]) -> BlendOptions | None:
    """How a request blends: `asked` None follows the engine (blend marked documents where it
    allows blending), False never, True with the engine's options, or the request's own options;
    asking where the engine does not blend is an error naming how to turn it on."""
    if asked is False or (asked is None and (allowed is None or not spans)):
        return None
    if not has_store:
        raise PromptError("blending needs a store (start the engine with one, e.g. --store memory:4GB)")
    if allowed is None:
        raise PromptError("blending is off in this engine: start it with blending allowed "
                          "(kvtier serve --blend, or ReuseConfig(blend=BlendOptions()))")
    if asked is None or asked is True:
        return allowed
    if not isinstance(asked, BlendOptions):
        raise PromptError(f"blend must be true, false or BlendOptions, got {type(asked).__name__}")
    return asked
