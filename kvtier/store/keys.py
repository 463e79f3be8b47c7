"""Chained chunk keys.

key_i = blake2b(parent_key, length, token ids of chunk i), where the parent of chunk 0 is the
store digest (namespace digest + chunk size). A key therefore names the state of every token up to
the end of its chunk, in one namespace. A trailing partial chunk has a key of the same form with
its shorter length, so it never collides with the full chunk at the same position.

A chunk is also reusable in part: its header lists the keys its first 16, 32, ... tokens would have
as chunks of their own (`prefix_digests`), and tiers index every chunk under its parent and the
first of them (`Child.lead`). A reader whose tokens stop or part inside a stored chunk lists the
chunks that begin as its tokens do and takes the longest run of digests it can recompute itself:
the digests say which tokens match without the tokens themselves being stored.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Sequence

# Tokens per stored chunk, by default (LMCache's size). What a restore pays per chunk (an open, a
# header, a read per layer group, its checks) falls with the chunk's size, so a cold restore from
# disk is faster in chunks of 256 than of 64 (docs/benchmarks.md, "Measurements behind the
# defaults"). Reuse does not get coarser with it: a chunk is reused in part, in steps of
# PREFIX_GRANULE tokens, where a prompt stops or parts inside it.
DEFAULT_CHUNK_TOKENS = 256

# Tokens per prefix digest: a chunk is reusable in part in steps of this many tokens (the pool's
# block size, so a partial reuse ends on a block boundary).
PREFIX_GRANULE = 16
LEAD_CHARS = 16  # of the first prefix digest, in a tier's index entry: enough to pick candidates


@dataclass(frozen=True)
class Child:
    """A stored chunk as a tier's index lists it under its parent."""
    key: str
    tokens: int
    lead: str = ""  # the first LEAD_CHARS of its first prefix digest ("": too short, or older)


@dataclass(frozen=True)
class ChunkSpan:
    key: str
    parent: str
    index: int  # chunk number: covers tokens [index*C, index*C + length)
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def store_digest(namespace_digest: str, chunk_tokens: int, key_id: str = "") -> str:
    """Root of the key chain: chunk boundaries depend on the chunk size, so it is part of it; a
    sealed store's chains (seal.py) are its secret's own."""
    raw = f"kvtier-store:{namespace_digest}:{chunk_tokens}" + (f":sealed:{key_id}" if key_id else "")
    return hashlib.blake2b(raw.encode(), digest_size=16).hexdigest()


def salted_root(root: str, salt: str, space: str = "") -> str:
    """The chain root of one cache partition (a tenant, a request's `cache_salt`): chains under
    different salts share no key, so their requests never see, evict or time each other's chunks.
    `space` names a key space apart from the exact chains (blended segments' approximate state):
    its roots are hashed under another prefix, so no salt, and no exact lookup, ever reaches them."""
    if space:
        raw = f"kvtier-space:{space}:{root}:".encode() + salt.encode("utf-8", "surrogatepass")
        return hashlib.blake2b(raw, digest_size=16).hexdigest()
    if not salt:
        return root
    raw = f"kvtier-salt:{root}:".encode() + salt.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


def chunk_key(parent: str, tokens: Sequence[int]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(parent.encode())
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(array("q", tokens).tobytes())  # int64 ids: no vocabulary is too large
    return h.hexdigest()


def chunk_spans(root: str, token_ids: Sequence[int], chunk_tokens: int,
                include_partial: bool = True) -> list[ChunkSpan]:
    """Keys of every chunk of `token_ids`, the trailing partial one included if asked."""
    spans: list[ChunkSpan] = []
    parent = root
    n = len(token_ids)
    for i, start in enumerate(range(0, n, chunk_tokens)):
        end = min(start + chunk_tokens, n)
        if end - start < chunk_tokens and not include_partial:
            break
        key = chunk_key(parent, token_ids[start:end])
        spans.append(ChunkSpan(key, parent, i, start, end))
        parent = key
    return spans


def prefix_digests(parent: str, tokens: Sequence[int]) -> tuple[str, ...]:
    """The keys the chunk's first PREFIX_GRANULE, 2*PREFIX_GRANULE, ... tokens (short of all of
    them) would have as a chunk under `parent`: equal digests mean equal tokens, and the chunk key
    itself covers the rest."""
    return tuple(chunk_key(parent, tokens[:n]) for n in range(PREFIX_GRANULE, len(tokens), PREFIX_GRANULE))


def lead_of(prefix: Sequence[str]) -> str:
    """The lead a chunk with prefix digests `prefix` is indexed under ("": none)."""
    return prefix[0][:LEAD_CHARS] if prefix else ""


def lead_key(parent: str, ids: Sequence[int]) -> str:
    """The lead of a chunk under `parent` that begins with `ids` (the tiers' index is split by it:
    a reader lists only the chunks that begin as its tokens do, and those too short to have one)."""
    return chunk_key(parent, ids[:PREFIX_GRANULE])[:LEAD_CHARS] if len(ids) >= PREFIX_GRANULE else ""


def matched_tokens(parent: str, ids: Sequence[int], child: Child, prefix: Sequence[str]) -> int:
    """How many leading tokens of stored chunk `child` (under `parent`, with prefix digests
    `prefix`) are `ids`, the reader's tokens from the chunk's start: all of them if its key is the
    key of as many of `ids`, else PREFIX_GRANULE times the digests that agree."""
    if len(ids) >= child.tokens and chunk_key(parent, ids[:child.tokens]) == child.key:
        return child.tokens
    n = 0
    for theirs in prefix:
        end = n + PREFIX_GRANULE
        if end > len(ids) or chunk_key(parent, ids[:end]) != theirs:
            break
        n = end
    return n
