"""Known documents, found in prompts that do not mark them, for blended restores.

An engine that blends keeps the documents it was given to find: those of `kvtier serve
--blend-corpus FILE` (every tenant's) and those precompiled through the API (`Engine.precompile`,
`LLM.precompile`; the tenant's salt they were stored under). A prompt that marks no document (no
content parts, separators, `documents=[...]` or `segments`) is searched for them, and each one
found is a document as if marked: tokenized alone in a text prompt, located in a prompt of ids.
Only documents that were given to this engine are found; no tenant's search sees another's.

The search indexes each document by its first ANCHOR_CHARS characters (ANCHOR_IDS ids), scans the
prompt once and, where an anchor matches, compares the whole document (the longest first). The
comparisons are capped at WORK_FACTOR times the prompt's length: a prompt built to match anchors
everywhere costs a bounded scan, and a document not found by then is computed as unmarked text is.
Runs on the caller's thread (a request's thread-pool task on the server), never the step thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvtier.planning.blend import MIN_SEGMENT_TOKENS

ANCHOR_CHARS = 32  # a document shorter than this is too short to load (about MIN_SEGMENT_TOKENS tokens)
ANCHOR_IDS = MIN_SEGMENT_TOKENS
WORK_FACTOR = 16

Doc = TypeVar("Doc", str, tuple[int, ...])


class _Index(Generic[Doc]):
    """Documents of one kind (texts or id tuples) by their anchors; added to under the corpus's lock,
    read without it (an anchor's list is replaced whole, never changed in place)."""

    def __init__(self, width: int) -> None:
        self.width = width
        self.docs: dict[Doc, list[Doc]] = {}  # anchor -> documents, longest first

    def add(self, doc: Doc) -> bool:
        if len(doc) < self.width:
            return False
        anchor = doc[:self.width]
        have = list(self.docs.get(anchor, ()))
        if doc in have:
            return False
        have.append(doc)
        self.docs[anchor] = sorted(have, key=len, reverse=True)
        return True

    def find(self, hay: Doc) -> tuple[list[tuple[int, int]], int]:
        """Spans [a, b) of indexed documents in `hay`, in order and disjoint (at each position the
        longest that matches, the scan going on after it), and the elements compared: at most
        WORK_FACTOR x len(hay), where the scan stops."""
        spans: list[tuple[int, int]] = []
        budget = WORK_FACTOR * len(hay)
        i, last = 0, len(hay) - self.width
        while i <= last:
            found = 0
            for doc in self.docs.get(hay[i:i + self.width], ()):
                if i + len(doc) > len(hay):  # runs past the prompt's end: no match, nothing compared
                    continue
                if len(doc) > budget:
                    return spans, WORK_FACTOR * len(hay) - budget
                budget -= len(doc)
                if hay[i:i + len(doc)] == doc:
                    found = len(doc)
                    break
            if found:
                spans.append((i, i + found))
            i += found or 1
        return spans, WORK_FACTOR * len(hay) - budget

    def __len__(self) -> int:
        return sum(len(v) for v in self.docs.values())


class Corpus:
    """The documents an engine finds in unmarked prompts, per tenant salt ("": every tenant's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._texts: dict[str, _Index[str]] = {}
        self._ids: dict[str, _Index[tuple[int, ...]]] = {}

    def add(self, texts: Iterable[str] = (), ids: Iterable[Sequence[int]] = (), salt: str = "") -> int:
        """Index documents given as texts (found in text prompts) and as ids (found in prompts of
        ids) -> how many were new."""
        new = 0
        with self._lock:
            ti = self._texts.setdefault(salt, _Index(ANCHOR_CHARS))
            ii = self._ids.setdefault(salt, _Index(ANCHOR_IDS))
            for t in texts:
                new += ti.add(t)
            for d in ids:
                new += ii.add(tuple(int(x) for x in d))
        return new

    def __len__(self) -> int:
        """Entries indexed: a document given as text and ids counts twice."""
        return sum(map(len, self._texts.values())) + sum(map(len, self._ids.values()))

    def finder(self, salt: str = "") -> Finder:
        return Finder(self, salt)

    def find_text(self, text: str, salt: str = "") -> list[str]:
        """The documents in `text`, in order: every tenant's and the salt's, the longest at each position."""
        spans = [s for k in _salts(salt) if (index := self._texts.get(k)) for s in index.find(text)[0]]
        return [text[a:b] for a, b in _disjoint(spans)]

    def find_ids(self, ids: Sequence[int], salt: str = "") -> list[list[int]]:
        """The documents in a prompt of ids, as find_text."""
        hay = tuple(ids)
        spans = [s for k in _salts(salt) if (index := self._ids.get(k)) for s in index.find(hay)[0]]
        return [list(hay[a:b]) for a, b in _disjoint(spans)]


@dataclass(frozen=True)
class Finder:
    """A tenant's search of the corpus (Engine.finder's): documents.mark calls it on any prompt."""

    corpus: Corpus
    salt: str

    def text(self, text: str) -> list[str]:
        return self.corpus.find_text(text, self.salt)

    def ids(self, ids: Sequence[int]) -> list[list[int]]:
        return self.corpus.find_ids(ids, self.salt)

    def __call__(self, prompt: str | Sequence[int]) -> list[str] | list[list[int]]:
        return self.text(prompt) if isinstance(prompt, str) else self.ids(prompt)


def _salts(salt: str) -> tuple[str, ...]:
    return ("",) if not salt else ("", salt)


def _disjoint(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted spans with each one that overlaps an earlier one dropped (the earlier, longer one kept
    where two start together)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans, key=lambda s: (s[0], -s[1])):
        if not out or a >= out[-1][1]:
            out.append((a, b))
    return out
