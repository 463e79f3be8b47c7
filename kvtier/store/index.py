"""Longest-prefix lookup over the tiers: one hash lookup per chunk per tier, never a scan.

Full chunks are found by recomputing their chained keys from the query tokens. A trailing partial
chunk cannot be found that way (its length is unknown), so tiers index partials by their parent
key: one lookup returns the few candidates, and each is verified by recomputing its key from the
query tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .keys import chunk_key, chunk_spans
from .layout import Repr


class StoredChunk(Protocol):
    """A stored chunk as lookup reports it (ChunkRef), or as a restore plan names it (PlannedChunk)."""

    @property
    def key(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...
    @property
    def tier(self) -> str: ...


@dataclass(frozen=True)
class ChunkRef:
    key: str
    start: int
    end: int
    layer_reprs: tuple[Repr, ...]
    tier: str  # fastest tier holding the chunk at lookup time
    nbytes: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class PrefixMatch:
    chunks: tuple[ChunkRef, ...]
    num_tokens: int


class TierView(Protocol):
    """What lookup needs from a tier (tiers satisfy it structurally)."""
    name: str

    def contains_many(self, keys: list[str]) -> list[bool]: ...
    def partials(self, parent: str) -> list[tuple[str, int]]: ...


def longest_prefix(root: str, token_ids: Sequence[int], chunk_tokens: int, tiers: Sequence[TierView],
                   layer_reprs: tuple[Repr, ...],
                   size_of: Callable[[str, str, int], int]) -> PrefixMatch:
    """`size_of(tier_name, key, tokens)` gives the stored size of a chunk (exact or estimated)."""
    spans = chunk_spans(root, token_ids, chunk_tokens, include_partial=False)
    where: list[str | None] = [None] * len(spans)
    limit = len(spans)  # first index known to be missing everywhere is found below
    for tier in tiers:
        todo = [i for i in range(limit) if where[i] is None]
        if not todo:
            break
        hits = tier.contains_many([spans[i].key for i in todo])
        for i, ok in zip(todo, hits):
            if ok:
                where[i] = tier.name
    refs: list[ChunkRef] = []
    for span, tier_name in zip(spans, where):
        if tier_name is None:
            break
        refs.append(ChunkRef(span.key, span.start, span.end, layer_reprs, tier_name,
                             size_of(tier_name, span.key, span.length)))
    pos = refs[-1].end if refs else 0
    parent = refs[-1].key if refs else root
    remaining = len(token_ids) - pos
    if remaining > 0:
        best: tuple[int, str, str] | None = None  # (tokens, key, tier)
        for tier in tiers:
            for key, n in tier.partials(parent):
                if n > remaining or (best is not None and n <= best[0]):
                    continue
                if n < chunk_tokens and chunk_key(parent, token_ids[pos:pos + n]) == key:
                    best = (n, key, tier.name)
        if best is not None:
            n, key, tier_name = best
            refs.append(ChunkRef(key, pos, pos + n, layer_reprs, tier_name,
                                 size_of(tier_name, key, n)))
    return PrefixMatch(tuple(refs), refs[-1].end if refs else 0)
