"""What a reader expects of a stored chunk, checked before a byte of it moves.

Stored bytes are untrusted: another server, another version, a disk that lies, or anyone who can
write to the shared Redis or the store directory may have put them there. A header whose checksum
passes is well-formed, not right: before any of its offsets or sizes is used, it must describe
exactly the chunk the reader planned: its key, its place in the chain (span, index, parent), and the
namespace's layout (dtypes, per-layer representation, every segment's shape and size). A chunk that
differs in any way is a miss; a read sized by a header can then never write outside the pool slots
the plan gave that chunk.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from kvtier.dtypes import WIDTH

from .format import ALIGN, ChunkHeader, FormatError
from .keys import LEAD_CHARS, PREFIX_GRANULE, Child
from .layout import Repr, StoreNamespace

KEY = re.compile(r"[0-9a-f]{32}\Z")  # chunk keys, parents and store roots: blake2b-128 in hex


def is_key(s: object) -> bool:
    """A chunk key (or a chain root) as this store makes them: safe in a path or a Redis key."""
    return isinstance(s, str) and KEY.match(s) is not None


LEAD = re.compile(rf"[0-9a-f]{{{LEAD_CHARS}}}\Z")


def child_entry(tokens: str, key: str, lead: str = "") -> Child | None:
    """A child index entry's fields (a Redis set member "tokens:key[:lead]", a disk file name
    "tokens-key[-lead].kvc"), or None if it is not one this store wrote: anyone who can write to the
    tier can add entries, so they are parsed strictly and junk is skipped, never an error."""
    if not (tokens.isascii() and tokens.isdigit() and len(tokens) <= 6 and is_key(key)) or int(tokens) == 0:
        return None  # isascii + isdigit: plain digits only (no sign, space or superscript two)
    if lead and LEAD.match(lead) is None:
        return None
    return Child(key, int(tokens), lead)


@dataclass(frozen=True)
class Expect:
    """What the reader expects of a chunk. Fields left None are not checked: admin tools (verify,
    stats, clear) open a store without a namespace and can only check what a header says of itself."""

    key: str
    ns: str | None = None  # the store digest (namespace + chunk size)
    model: str | None = None
    namespace: StoreNamespace | None = None  # dtypes, layer representations, shapes
    chunk_tokens: int = 0
    span: tuple[int, int] | None = None  # tokens [start, end) the reader planned this chunk to hold


def check(header: ChunkHeader, expect: Expect, size: int, segments_checked: bool = False) -> None:
    """Raise FormatError unless `header` (of a stored value of `size` bytes) is the chunk expected.
    `segments_checked`: `check_segments` already passed for this header and size (a tier that
    checks what it holds on the way in)."""
    if header.key != expect.key:
        raise FormatError(f"header names chunk {header.key!r:.40}")
    if not is_key(header.key) or not is_key(header.parent):
        raise FormatError("key or parent is not a chunk key")
    if expect.ns is not None and header.ns != expect.ns:
        raise FormatError("chunk belongs to another namespace (model, layout or dtype)")
    if expect.model is not None and header.model != expect.model:
        raise FormatError("chunk belongs to another model fingerprint")
    if expect.span is not None:
        start, end = expect.span
        if header.start != start or header.tokens != end - start:
            raise FormatError(f"chunk covers tokens [{header.start}, {header.start + header.tokens}), "
                              f"the reader planned [{start}, {end})")
    _check_place(header, expect.chunk_tokens)
    if header.prefix and (len(header.prefix) != len(range(PREFIX_GRANULE, header.tokens, PREFIX_GRANULE))
                          or not all(is_key(d) for d in header.prefix)):
        raise FormatError("prefix digests do not fit the chunk's tokens")
    if not (segments_checked or header.from_table):
        check_segments(header, size)
    elif size != header.total_bytes:  # a table already checked: only this value's length is new
        raise FormatError(f"the stored value has {size} bytes, its header accounts for {header.total_bytes}")
    if expect.namespace is not None:
        _check_layout(header, expect.namespace)


def _check_place(header: ChunkHeader, chunk_tokens: int) -> None:
    if header.tokens <= 0 or header.index < 0 or header.start < 0:
        raise FormatError("chunk span out of range")
    if chunk_tokens and (header.tokens > chunk_tokens or header.start != header.index * chunk_tokens
                         or header.partial != (header.tokens < chunk_tokens)):
        raise FormatError(f"chunk span [{header.start}, {header.start + header.tokens}) at index {header.index} "
                          f"does not fit {chunk_tokens}-token chunks")


def check_segments(header: ChunkHeader, size: int) -> None:
    """The value exactly as long as its header says, every segment inside it and as large as its
    dtype and shape say."""
    if size != header.total_bytes:
        raise FormatError(f"the stored value has {size} bytes, its header accounts for {header.total_bytes}")
    for s in header.segments:
        width = WIDTH.get(s.dtype)
        if width is None or s.offset < 0 or any(d <= 0 for d in s.shape) or \
                s.nbytes != math.prod(s.shape) * width or s.offset + s.nbytes > size:
            raise FormatError(f"segment {s.layer}/{s.part}: size, shape or offset out of range")
    if len(header.by_part) != len(header.segments):
        raise FormatError("a segment is listed twice")


def _check_layout(header: ChunkHeader, ns: StoreNamespace) -> None:
    if (header.compute_dtype, header.storage_dtype, header.layer_reprs) != \
            (ns.compute_dtype, ns.storage_dtype, ns.layer_reprs):
        raise FormatError("chunk dtypes or layer representations differ from the namespace's")
    want = expected_segments(ns, header.tokens)
    if {k: (s.dtype, s.shape) for k, s in header.by_part.items()} != want:
        raise FormatError("segment table does not match the namespace's layout")
    granules = -(-header.tokens // ns.granule_tokens) if ns.granule_tokens else 0
    for s in header.segments:
        if s.granules and (len(s.granules) != granules or s.part not in ("k", "v", "kp")):
            raise FormatError(f"segment {s.layer}/{s.part}: granule digests do not match the layout")


@lru_cache(maxsize=256)
def expected_segments(ns: StoreNamespace, tokens: int) -> dict[tuple[int, str], tuple[str, tuple[int, ...]]]:
    """(layer, part) -> (dtype, shape) of every segment a chunk of `tokens` tokens holds in `ns`
    (what format.pack writes: probe keys, each layer's parts, int8 row scales)."""
    out: dict[tuple[int, str], tuple[str, tuple[int, ...]]] = {}
    for layer, rep in enumerate(ns.layer_reprs):
        parts = rep.parts() + (("kp",) if ns.probe_kv_heads and rep is Repr.KV else ())
        for part in parts:
            shape = ns.part_shape(part, tokens)
            out[(layer, part)] = (ns.storage_dtype, shape)
            if ns.storage_dtype == "int8" and part != "kp":
                out[(layer, part + ".scale")] = ("float32", shape[:-1])
    return out


def first_layer_bytes(expect: Expect) -> int:
    """Bytes of the first stored layer's segments of the chunk `expect` plans (0 when it does not
    say its layout): a header read that also fetches them saves a restore its first read of every
    chunk (layer-major: they follow the header)."""
    ns = expect.namespace
    if ns is None or expect.span is None or ns.probe_kv_heads or ns.granule_tokens:
        return 0  # (the importance layout: probe keys come first, and its restores read rows)
    segs = expected_segments(ns, expect.span[1] - expect.span[0])
    if not segs:
        return 0
    first = min(layer for layer, _ in segs)
    sizes = [math.prod(shape) * WIDTH[dtype] for (layer, _), (dtype, shape) in segs.items() if layer == first]
    return sum(n + (-n) % ALIGN for n in sizes)  # each segment starts on an ALIGN boundary
