"""Longest-prefix lookup over the tiers: one hash lookup per chunk per tier, never a scan.

Full chunks are found by recomputing their chained keys from the query tokens. Where the chain
stops, the query's next tokens may still begin a stored chunk: a trailing partial chunk (its length
is unknown), or a chunk that goes on past the query or parts from it. Tiers list the chunks under a
parent key that begin as the query's next tokens do, in one lookup; a partial one is verified by
recomputing its key from the query tokens, one reusable in part by its prefix digests (keys.py),
read from its header.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from .keys import Child, chunk_key, chunk_spans, lead_key, matched_tokens
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
    # Tokens whose stored state the chunks hold: the last chunk may go on past them (a chunk reused
    # in part), so a restore stops here, not at its end.
    num_tokens: int


# Headers read per lookup to reuse a chunk in part: the candidates already begin with the query's
# next 16 tokens, so more than a few means many stored contexts share a long opening.
MAX_IN_PART_READS = 8


class TierView(Protocol):
    """What lookup needs from a tier (tiers satisfy it structurally)."""
    name: str

    def contains_many(self, keys: list[str]) -> list[bool]: ...
    def children(self, parent: str, lead: str) -> list[Child]: ...


def longest_prefix(root: str, token_ids: Sequence[int], chunk_tokens: int, tiers: Sequence[TierView],
                   layer_reprs: tuple[Repr, ...], size_of: Callable[[str, str, int], int],
                   prefix_of: Callable[[str, Child, int], tuple[str, ...] | None]) -> PrefixMatch:
    """`size_of(tier_name, key, tokens)` gives the stored size of a chunk (exact or estimated);
    `prefix_of(tier_name, child, start)` its prefix digests from its checked header (None: unreadable)."""
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
    if pos < len(token_ids):
        tail = _longest_child(parent, token_ids[pos:pos + chunk_tokens], tiers, pos, prefix_of)
        if tail is not None:
            child, tier_name, n = tail
            refs.append(ChunkRef(child.key, pos, pos + child.tokens, layer_reprs, tier_name,
                                 size_of(tier_name, child.key, child.tokens)))
            return PrefixMatch(tuple(refs), pos + n)
    return PrefixMatch(tuple(refs), pos)


def _longest_child(parent: str, ids: Sequence[int], tiers: Sequence[TierView], start: int,
                   prefix_of: Callable[[str, Child, int], tuple[str, ...] | None]) -> tuple[Child, str, int] | None:
    """The stored chunk under `parent` whose leading tokens match most of `ids` (the query from
    the chunk's start): (child, tier, tokens matched), or None."""
    best: tuple[Child, str, int] | None = None
    lead = lead_key(parent, ids)
    reads, seen = 0, set()
    for tier in tiers:
        for child in tier.children(parent, lead):
            if child.key in seen or best is not None and min(child.tokens, len(ids)) <= best[2]:
                continue  # cannot match more than the best so far
            seen.add(child.key)
            if child.tokens <= len(ids) and chunk_key(parent, ids[:child.tokens]) == child.key:
                best = (child, tier.name, child.tokens)  # whole: a partial chunk the query covers
            elif lead and child.lead == lead and reads < MAX_IN_PART_READS:
                reads += 1
                prefix = prefix_of(tier.name, child, start)
                n = matched_tokens(parent, ids, child, prefix) if prefix is not None else 0
                if n and (best is None or n > best[2]):
                    best = (child, tier.name, n)
    return best
