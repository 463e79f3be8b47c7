"""Known documents, found in prompts that do not mark them, for blended restores.

An engine that blends keeps the documents it was given to find: those of `kvtier serve
--blend-corpus FILE` (every tenant's) and those precompiled through the API (`Engine.precompile`,
`LLM.precompile`: only the cache partition they were stored for). A prompt that marks no document
(no content parts, separators, `documents=[...]` or `segments`) is searched for them, and each one
found is a document as if marked: tokenized alone in a text prompt, located in a prompt of ids.
A document too short to load (under MIN_SEGMENT_TOKENS tokens) is not kept.

Each kind (texts, ids) is a radix tree (edges labelled with the documents' shared runs). The
prompt is scanned once: at each position the tree is walked as far as the prompt follows it, the
longest document ending on the way is taken and the scan goes on after it. An edge label counts
one comparison per BLOCK elements (its first block compared alone, the rest, where the first
matched, in one call) and a scan stops after WORK_FACTOR comparisons per element of the prompt,
so a prompt built to follow the tree everywhere (a document's first run, repeated) costs a
bounded scan, and what it has not found by then is computed as unmarked text is. At most
MAX_DOCUMENTS are found. A prompt longer than the context window (in ids, or in characters as
many as the window's tokens could hold) is not searched: it is refused by its length anyway.
Runs on the caller's thread (a request's thread-pool task on the server), never the step thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.engine.documents import MAX_DOCUMENTS  # documents found per prompt, as marked ones
from kvtier.planning.blend import MIN_SEGMENT_TOKENS

BLOCK = 64  # elements (characters, ids) per comparison
WORK_FACTOR = 16  # comparisons per element of the prompt, at most
EVERY_TENANT = None  # the corpus key of --blend-corpus's documents; a salt ("" included) is one partition's

Doc = TypeVar("Doc", str, tuple[int, ...])


class _Node(Generic[Doc]):
    __slots__ = ("edges", "end")

    def __init__(self) -> None:
        self.edges: dict[object, tuple[Doc, _Node[Doc]]] = {}  # first element -> (label, child)
        self.end = False  # a document ends here


def _common(a: Doc, b: Doc) -> int:
    """The length of a's and b's common prefix (a binary search of slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class _Tree(Generic[Doc]):
    """Documents of one kind; added to under the corpus's lock, read without it (a node's edges are
    only ever added or replaced whole)."""

    def __init__(self) -> None:
        self.root: _Node[Doc] = _Node()

    def add(self, doc: Doc) -> bool:
        node, k = self.root, 0
        while k < len(doc):
            edge = node.edges.get(doc[k])
            if edge is None:
                leaf: _Node[Doc] = _Node()
                leaf.end = True
                node.edges[doc[k]] = (doc[k:], leaf)
                return True
            label, child = edge
            m = _common(label, doc[k:k + len(label)])
            if m < len(label):  # split the edge where the document leaves it
                mid: _Node[Doc] = _Node()
                mid.edges[label[m]] = (label[m:], child)
                node.edges[doc[k]] = (label[:m], mid)
                child = mid
            node, k = child, k + m
        new = not node.end
        node.end = True
        return new

    def find(self, hay: Doc, limit: int = MAX_DOCUMENTS) -> tuple[list[tuple[int, int]], int]:
        """Spans [a, b) of documents in `hay`, in order and disjoint (at each position the longest),
        at most `limit` of them; and the comparisons made (at most WORK_FACTOR x len(hay))."""
        spans: list[tuple[int, int]] = []
        budget = WORK_FACTOR * len(hay)
        n, i = len(hay), 0
        while i < n and len(spans) < limit and budget > 0:
            node, j, best = self.root, i, 0
            while j < n and budget > 0:
                edge = node.edges.get(hay[j])
                if edge is None or j + len(edge[0]) > n:
                    break
                label, child = edge
                budget -= 1
                head = min(BLOCK, len(label))
                if hay[j:j + head] != label[:head]:
                    break
                rest = -(-len(label) // BLOCK) - 1  # the label's other blocks, compared in one call
                if rest:
                    if rest > budget:
                        budget = 0
                        break
                    budget -= rest
                    if hay[j + BLOCK:j + len(label)] != label[BLOCK:]:
                        break
                node, j = child, j + len(label)
                if node.end:
                    best = j - i
            if best:  # a document compared whole, even where the budget ran out after it
                spans.append((i, i + best))
            i += best or 1
        return spans, WORK_FACTOR * n - budget


class Corpus:
    """The documents an engine finds in unmarked prompts: every tenant's (EVERY_TENANT) and each
    cache partition's (its salt)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: dict[str | None, _Tree[str]] = {}
        self._ids: dict[str | None, _Tree[tuple[int, ...]]] = {}
        self._count = 0

    def add(self, documents: Iterable[tuple[str | None, Sequence[int]]], salt: str | None = EVERY_TENANT) -> int:
        """Keep documents, each (its text, or None where given as ids; its ids tokenized alone):
        the text is found in text prompts, the ids in prompts of ids -> how many were new. Those
        under MIN_SEGMENT_TOKENS ids are left out (a blend would compute them anyway)."""
        new = 0
        with self._lock:
            texts = self._texts.setdefault(salt, _Tree())
            ids = self._ids.setdefault(salt, _Tree())
            for text, doc in documents:
                if len(doc) < MIN_SEGMENT_TOKENS:
                    continue
                added = ids.add(tuple(int(x) for x in doc))
                if text:
                    added = texts.add(text) or added
                new += added
            self._count += new
        return new

    def __len__(self) -> int:
        """Documents kept (a count kept under the lock: read on every request)."""
        return self._count

    def finder(self, salt: str = "", max_ids: int | None = None, max_chars: int | None = None) -> Finder:
        return Finder(self, salt, max_ids, max_chars)

    def find_text(self, text: str, salt: str = "") -> list[str]:
        """The documents in `text`, in order: every tenant's and the partition's, the longest at each position."""
        spans = [s for k in (EVERY_TENANT, salt) if (tree := self._texts.get(k)) for s in tree.find(text)[0]]
        return [text[a:b] for a, b in _disjoint(spans)]

    def find_ids(self, ids: Sequence[int], salt: str = "") -> list[list[int]]:
        """The documents in a prompt of ids, as find_text."""
        hay = tuple(ids)
        spans = [s for k in (EVERY_TENANT, salt) if (tree := self._ids.get(k)) for s in tree.find(hay)[0]]
        return [list(hay[a:b]) for a, b in _disjoint(spans)]


@dataclass(frozen=True)
class Finder:
    """A cache partition's search of the corpus (Engine.finder's): documents.mark calls it on any
    prompt. A prompt over `max_ids` ids or `max_chars` characters (None: any) is not searched."""

    corpus: Corpus
    salt: str
    max_ids: int | None = None
    max_chars: int | None = None

    def text(self, text: str) -> list[str]:
        if self.max_chars is not None and len(text) > self.max_chars:
            return []
        return self.corpus.find_text(text, self.salt)

    def ids(self, ids: Sequence[int]) -> list[list[int]]:
        if self.max_ids is not None and len(ids) > self.max_ids:
            return []
        return self.corpus.find_ids(ids, self.salt)

    def __call__(self, prompt: str | Sequence[int]) -> list[str] | list[list[int]]:
        return self.text(prompt) if isinstance(prompt, str) else self.ids(prompt)


def _disjoint(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted spans with each one that overlaps an earlier one dropped (the longer kept where two
    start together), at most MAX_DOCUMENTS."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans, key=lambda s: (s[0], -s[1])):
        if not out or a >= out[-1][1]:
            out.append((a, b))
    return out[:MAX_DOCUMENTS]
