"""Chained chunk keys.

key_i = blake2b(parent_key, length, token ids of chunk i), where the parent of chunk 0 is the
store digest (namespace digest + chunk size). A key therefore names the state of every token up to
the end of its chunk, in one namespace. A trailing partial chunk has a key of the same form with
its shorter length, so it never collides with the full chunk at the same position.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Sequence


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


def salted_root(root: str, salt: str) -> str:
    """The chain root of one cache partition (a tenant, a request's `cache_salt`): chains under
    different salts share no key, so their requests never see, evict or time each other's chunks."""
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
