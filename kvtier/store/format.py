"""The chunk byte format, shared by every tier.

    preamble  48 bytes: magic "KVTC", format version u16, flags u16 (1: sealed), header length u32,
              header crc32, HMAC-SHA256 tag of the header (zeros unless sealed: see seal.py)
    header    JSON: key, parent, position, namespace digest, model fingerprint, dtypes, per-layer
              representation, the digest algorithm, and a segment table (layer, part, offset,
              length, digest, dtype, shape)
    payload   segments, layer-major: layer 0 (k, v | h, scales), layer 1, ...; each starts on a
              512-byte boundary (a disk's logical block), so a direct-I/O read of a layer group
              can land straight in the KV pool

Layer-major order lets a reader fetch one layer, or a contiguous layer range, with one ranged read;
per-segment checksums let it verify what it read without reading the rest, and K can be read
without V. Checksums are CRC-32C (the crc32c library, the SSE4.2/ARMv8 CRC instruction): it runs
at memory speed (zlib's crc32 ran at a third of it here) and without holding Python's GIL, so
verifying what a read thread fetched does not stall the thread that computes. The header has its
own checksum so a torn or foreign header is caught before any offset in it is trusted; what a
header says is then checked against what the reader expects (validate.py) before a byte moves.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Mapping, NamedTuple, Sequence

import torch

from . import codec
from .layout import FORMAT_VERSION, Repr, StoreNamespace
from .seal import BLAKE3, CRC32C, DIGESTS, Seal, digest

MAGIC = b"KVTC"
PREAMBLE = struct.Struct("<4sHHII32s")
SEALED = 1  # preamble flag: the tag is an HMAC under the store secret
ALIGN = 512  # the usual logical block of a disk: what direct I/O aligns offsets and lengths to
MAX_HEADER = 1 << 24
ORDERED_PARTS = ("k", "v")  # what a reordered chunk stores out of token order


def checksum(data: torch.Tensor | memoryview | bytes, alg: str = CRC32C) -> int:
    """Digest of a segment's bytes (a uint8 tensor or any buffer) under `alg`, GIL released."""
    return digest(alg, data.numpy().data if isinstance(data, torch.Tensor) else data)


class FormatError(Exception):
    """The bytes are not a valid chunk (or not the chunk asked for)."""


class Segment(NamedTuple):
    """One stored piece of a chunk. A NamedTuple, not a dataclass: a restore parses some sixty of
    these per chunk opened, and a tuple is built several times faster."""

    layer: int
    part: str  # "k", "v", "h", or "k.scale" etc.
    offset: int
    nbytes: int
    digest: int  # of the segment's bytes, under the header's digest algorithm
    dtype: str  # storage dtype of the data ("float32" for scales)
    shape: tuple[int, ...]
    # Digest of every `granule_tokens` rows (the importance layout): a read of a few granules is
    # verified on its own. Empty in the plain layout.
    granules: tuple[int, ...] = ()

    def granule_span(self, first: int, last: int, rows_per_granule: int) -> tuple[int, int]:
        """Byte range (offset, nbytes) of granules [first, last] of this segment."""
        row = self.nbytes // self.shape[0]
        lo = first * rows_per_granule
        hi = min((last + 1) * rows_per_granule, self.shape[0])
        return self.offset + lo * row, (hi - lo) * row


@dataclass(frozen=True)
class ChunkHeader:
    key: str
    parent: str
    index: int
    start: int
    tokens: int
    partial: bool  # a trailing chunk shorter than the chunk size, indexed under its parent
    ns: str  # store digest (namespace + chunk size)
    model: str
    compute_dtype: str
    storage_dtype: str
    layer_reprs: tuple[Repr, ...]
    segments: tuple[Segment, ...]
    total_bytes: int
    digest: str = CRC32C  # the segments' digest algorithm (BLAKE3 when sealed)
    # Keys of the chunk's first 16, 32, ... tokens as chunks of their own (keys.prefix_digests):
    # what lets a reader whose tokens stop or diverge inside this chunk reuse the part that matches.
    # Empty in chunks written before them (those are reused only whole).
    prefix: tuple[str, ...] = field(default=(), repr=False)
    # A chunk reordered by importance (IMPRESS §4.4.1): stored K/V row r of layer l holds token
    # order[l][r] of the chunk ([layers, tokens] int64), so the tokens a query keeps share
    # granules. None: token order. Probe keys and hidden states always stay in token order.
    order: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # The `SegmentTable` (learned from a fully checked header) this header's segments came from:
    # every chunk of a store and length shares one, and with it the plans of its reads.
    table: SegmentTable | None = field(default=None, repr=False, compare=False)
    # (layer, part) -> segment, built once: headers are parsed once and read from many times.
    by_part: dict[tuple[int, str], Segment] = field(init=False, repr=False, compare=False)
    # row_of[l][t]: the stored row of token t (the inverse of `order`), or None.
    row_of: torch.Tensor | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_part", {(s.layer, s.part): s for s in self.segments})
        object.__setattr__(self, "row_of", None if self.order is None else torch.argsort(self.order, dim=1))

    @property
    def from_table(self) -> bool:
        return self.table is not None

    def segment(self, layer: int, part: str) -> Segment | None:
        return self.by_part.get((layer, part))

    def segments_of(self, layers: Iterable[int], parts: Iterable[str]) -> list[Segment]:
        """Segments holding `parts` of `layers`, with the int8 scales they need, in file order
        (looked up, not scanned: a read of a few layers of a many-layer chunk)."""
        out = []
        for li in layers:
            for part in self.layer_reprs[li].parts():
                if part in parts:
                    out.append(self.by_part[(li, part)])
                    scale = self.by_part.get((li, part + ".scale"))
                    if scale is not None:
                        out.append(scale)
        out.sort(key=lambda s: s.offset)
        return out

    def plan_read(self, layers: Sequence[int], parts: Iterable[str]) -> list[list[Segment]]:
        """The segments of `parts` of `layers` as ranged reads (`coalesce`). A header that shares
        its store's segment table takes the table's plan, kept per (layers, parts): a restore
        plans the same reads for each of its chunks, one layer group at a time."""
        if self.table is None:
            return coalesce(self.segments_of(layers, parts))
        segs = self.segments
        return [[segs[i] for i in run] for run in self.table.runs(tuple(layers), tuple(parts))]


@dataclass(frozen=True)
class LayerState:
    layer: int
    repr: Repr
    k: torch.Tensor | None = None  # [tokens, kv_heads, head_dim], pre-RoPE
    v: torch.Tensor | None = None  # [tokens, kv_heads, head_dim]
    h: torch.Tensor | None = None  # [tokens, hidden]


@dataclass(frozen=True)
class PackedChunk:
    header: ChunkHeader
    buffers: tuple[bytes | memoryview, ...]  # preamble+header, then payload pieces (with padding)

    @property
    def nbytes(self) -> int:
        return self.header.total_bytes

    def to_bytes(self) -> bytes:
        return b"".join(self.buffers)


def _pad(n: int) -> int:
    return (-n) % ALIGN


def pack(ns: StoreNamespace, store_digest: str, key: str, parent: str, index: int, start: int,
         partial: bool, layers: Mapping[int, Mapping[str, torch.Tensor]],
         order: torch.Tensor | None = None, seal: Seal = Seal(), prefix: Sequence[str] = ()) -> PackedChunk:
    """Pack per-layer parts (`layers[l]["k"]` is [tokens, kv_heads, head_dim] etc., in token order)
    into a chunk. `order` ([layers, tokens]) stores layer l's K/V rows as tokens order[l]. With a
    sealing `seal` the segments get BLAKE3 digests and the header an HMAC tag."""
    alg = seal.digest_alg
    tokens, pieces = _encode_parts(ns, layers, order)
    seg_meta = [(l, p, b.numel(), checksum(b, alg), d, s, _granule_digests(b, s, p, ns.granule_tokens, alg))
                for l, p, b, d, s in pieces]
    doc_base = {
        "key": key, "parent": parent, "index": index, "start": start, "tokens": tokens,
        "partial": partial, "ns": store_digest, "model": ns.model_fingerprint, "compute": ns.compute_dtype,
        "storage": ns.storage_dtype, "reprs": [r.value for r in ns.layer_reprs], "digest": alg,
    }
    if prefix:
        doc_base["prefix"] = list(prefix)
    if order is not None:
        doc_base["order"] = order.tolist()
    segments, total = _place_segments(doc_base, seg_meta, alg)
    doc = {**doc_base, "segments": [[s.layer, s.part, s.offset, s.nbytes, s.digest, s.dtype,
                                     list(s.shape)] + ([list(s.granules)] if s.granules else []) for s in segments]}
    hjson = json.dumps(doc).encode()
    hjson += b" " * (segments[0].offset - PREAMBLE.size - len(hjson))  # pad up to the payload
    flags = SEALED if seal.sealed else 0
    pre = PREAMBLE.pack(MAGIC, FORMAT_VERSION, flags, len(hjson), zlib.crc32(hjson),
                        seal.tag(_tagged(FORMAT_VERSION, flags, hjson)))
    bufs: list[bytes | memoryview] = [pre + hjson]
    for (_, _, b, _, _), seg in zip(pieces, segments):
        bufs.append(b.numpy().data)
        if _pad(seg.nbytes):
            bufs.append(bytes(_pad(seg.nbytes)))
    header = _header_from_doc(doc, total)
    return PackedChunk(header, tuple(bufs))


# (layer, part, encoded bytes, stored dtype, stored shape): one segment's payload before placing.
_Piece = tuple[int, str, torch.Tensor, str, tuple[int, ...]]
# (layer, part, nbytes, digest, dtype, shape, granule digests): one segment before its offset is known.
_SegMeta = tuple[int, str, int, int, str, tuple[int, ...], tuple[int, ...]]


def _encode_parts(ns: StoreNamespace, layers: Mapping[int, Mapping[str, torch.Tensor]],
                  order: torch.Tensor | None) -> tuple[int, list[_Piece]]:
    """Every layer's parts encoded in the storage dtype, in payload order, after checking each
    part's shape; -> (the chunk's tokens, the pieces)."""
    tokens = -1
    pieces: list[_Piece] = []
    if ns.probe_kv_heads:  # every layer's probe keys first: one ranged read fetches them all
        for layer, rep in enumerate(ns.layer_reprs):
            if rep is Repr.KV:
                kp = layers[layer]["k"][:, ns.probes(layer)]  # [tokens, probes, hd]
                for _, buf in codec.encode(kp, ns.storage_dtype):
                    pieces.append((layer, "kp", buf, ns.storage_dtype, tuple(kp.shape)))
    for layer, rep in enumerate(ns.layer_reprs):
        for part in rep.parts():
            t = layers[layer][part]
            if tokens < 0:
                tokens = int(t.shape[0])
            expected = ns.part_shape(part, tokens)
            if tuple(t.shape) != expected:
                raise ValueError(f"layer {layer} part {part}: shape {tuple(t.shape)} != {expected}")
            if order is not None and part in ORDERED_PARTS:
                t = t.index_select(0, order[layer])  # [tokens, ...] in stored order
            for suffix, buf in codec.encode(t, ns.storage_dtype):
                if suffix:
                    dtype, shape = "float32", expected[:-1]
                else:
                    dtype, shape = ns.storage_dtype, expected
                pieces.append((layer, part + suffix, buf, dtype, shape))
    if tokens < 0:
        raise ValueError("nothing to store: every layer is Repr.NONE")
    return tokens, pieces


def _place_segments(doc_base: dict[str, object], seg_meta: Sequence[_SegMeta],
                    alg: str) -> tuple[list[Segment], int]:
    """Each segment's aligned offset after the header; -> (the segments, the chunk's total size)."""
    # Offsets depend on the header length, which depends on the offsets' digits: fix the header
    # size first with a generous reservation, then fill it in.
    big = 2**128 if alg == BLAKE3 else 2**32  # the widest digest, for the reservation
    reserve = len(json.dumps({**doc_base, "segments": [[l, p, 10**12, 10**12, big, d, list(s)] + ([[big] * len(g)] if g else [])
                                                        for l, p, _, _, d, s, g in seg_meta]}))
    header_space = PREAMBLE.size + reserve
    offset = header_space + _pad(header_space)
    segments: list[Segment] = []
    for l, p, n, crc, d, s, g in seg_meta:
        segments.append(Segment(l, p, offset, n, crc, d, tuple(s), g))
        offset += n + _pad(n)
    return segments, offset


def _granule_digests(buf: torch.Tensor, shape: tuple[int, ...], part: str, granule_tokens: int,
                     alg: str) -> tuple[int, ...]:
    """Digest of every `granule_tokens` rows of a K/V part's bytes (none for other parts)."""
    if not granule_tokens or part not in ("k", "v", "kp"):
        return ()
    step = granule_tokens * (buf.numel() // shape[0])
    return tuple(checksum(buf[i : i + step], alg) for i in range(0, buf.numel(), step))


def _tagged(version: int, flags: int, header: bytes) -> bytes:
    """What the HMAC covers: the format version and flags (no downgrade by flipping them) and the
    whole header (key, span, layout, every segment's digest)."""
    return struct.pack("<HH", version, flags) + header


def _header_bytes(buf: bytes | memoryview, seal: Seal) -> bytes:
    """The header JSON at the start of `buf`, after its checksum and (sealed) its tag verified."""
    n = header_length(bytes(buf[:PREAMBLE.size]))
    if len(buf) < n:
        raise FormatError("truncated header")
    _, version, flags, _, hcrc, tag = PREAMBLE.unpack_from(bytes(buf[:PREAMBLE.size]))
    raw = bytes(buf[PREAMBLE.size:n])
    if zlib.crc32(raw) != hcrc:
        raise FormatError("header checksum mismatch")
    if seal.sealed and not (flags & SEALED and seal.verify(_tagged(version, flags, raw), tag)):
        raise FormatError("not sealed with this store's secret")
    return raw


def sealed_by(packed: PackedChunk, seal: Seal) -> bool:
    """Whether `packed`'s header carries a valid tag under `seal` (always true unsealed): what a
    tier that keeps parsed headers (memory) checks on put, instead of parsing again on each read."""
    try:
        _header_bytes(memoryview(packed.buffers[0]).cast("B"), seal)
    except FormatError:
        return False
    return True


def header_length(preamble: bytes) -> int:
    """Total bytes of preamble + header, from the preamble."""
    if len(preamble) < PREAMBLE.size:
        raise FormatError("truncated preamble")
    magic, version, _, hlen, _, _ = PREAMBLE.unpack_from(preamble)
    if magic != MAGIC:
        raise FormatError("bad magic")
    if version != FORMAT_VERSION:
        raise FormatError(f"format version {version}, expected {FORMAT_VERSION}")
    if hlen > MAX_HEADER:
        raise FormatError("header length out of range")
    return PREAMBLE.size + hlen


def coalesce(segs: Sequence[Segment]) -> list[list[Segment]]:
    """Adjacent segments (layer-major layout: a layer group is contiguous) as single ranged reads."""
    runs: list[list[Segment]] = []
    for s in segs:
        if runs and s.offset - (runs[-1][-1].offset + runs[-1][-1].nbytes) < 64:
            runs[-1].append(s)
        else:
            runs.append([s])
    return runs


class SegmentTable:
    """The segment table that chunks of one store and length lay out, learned from a header that
    passed every check (`validate.check` against the reader's namespace). A later header listing
    the same segments, with any digests, takes its segments from here: one list comparison instead
    of a type test per field of some sixty segments (a restore opens a chunk per 64 tokens). The
    values come from the table, never from the new header, so a header that merely compares equal
    (JSON `true` for 1) still yields exactly the checked table; anything else is parsed in full."""

    def __init__(self, header: ChunkHeader) -> None:
        self.segments = header.segments
        self.total_bytes = header.total_bytes
        self._rows = [[s.layer, s.part, s.offset, s.nbytes, s.dtype, list(s.shape)] for s in header.segments]
        self._learned = header
        self._index = {s: i for i, s in enumerate(header.segments)}
        self._runs: dict[tuple[tuple[int, ...], tuple[str, ...]], tuple[tuple[int, ...], ...]] = {}

    def runs(self, layers: tuple[int, ...], parts: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """`ChunkHeader.plan_read` of any header with this table, as indices into its segments
        (planned once per layers and parts; at most a few dozen distinct ones per store)."""
        got = self._runs.get((layers, parts))
        if got is None:  # the learned header has no table: it plans in full
            got = tuple(tuple(self._index[s] for s in run) for run in self._learned.plan_read(layers, parts))
            if len(self._runs) < 1024:
                self._runs[(layers, parts)] = got
        return got

    @staticmethod
    def learnable(header: ChunkHeader) -> bool:
        return not header.from_table and header.order is None and all(not s.granules for s in header.segments)

    def match(self, entries: object) -> tuple[Segment, ...] | None:
        """The table's segments with `entries`' digests, or None unless `entries` lists exactly
        the table's segments (7 fields each) with integer digests."""
        if type(entries) is not list or len(entries) != len(self._rows):
            return None
        try:  # `entries` is this parse's own: take the digests out, compare the rest in one go
            digests = [e.pop(4) for e in entries]
        except (AttributeError, IndexError, KeyError, TypeError):  # an entry that is no list, or too short
            return None
        if entries != self._rows or set(map(type, digests)) != {int}:
            return None
        new = tuple.__new__  # a Segment from its fields without the generated __new__'s call
        return tuple([new(Segment, (s[0], s[1], s[2], s[3], d, s[5], s[6], s[7])) for s, d in zip(self.segments, digests)])


def parse_header(buf: bytes | memoryview, total_size: int | None = None, seal: Seal = Seal(),
                 table: SegmentTable | None = None) -> ChunkHeader:
    """Parse and check the header at the start of `buf` (which must hold the whole header); with a
    sealing `seal`, only a header whose tag verifies under its secret is parsed at all. `table`:
    the segment table such chunks were seen to have (the segments then come from it if they match)."""
    raw = _header_bytes(buf, seal)
    try:
        doc = json.loads(raw)
        known = table.match(doc["segments"]) if table is not None else None
        if known is not None and table is not None:
            header = _header_from_doc(doc, table.total_bytes, known, table)
        else:
            if table is not None:
                doc = json.loads(raw)  # a failed match may have taken digests out of its entries
            segs_end = max(s[2] + s[3] for s in doc["segments"])
            header = _header_from_doc(doc, segs_end + _pad(segs_end))
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
        raise FormatError(f"malformed header: {e}") from e
    if seal.sealed and header.digest != BLAKE3:
        raise FormatError("a sealed chunk must carry BLAKE3 segment digests")
    if total_size is not None and total_size < max(s.offset + s.nbytes for s in header.segments):
        raise FormatError("truncated payload")
    return header


def _int(x: object) -> int:
    if type(x) is not int:  # JSON true, 1.0 and "1" are not counts (bool is an int subclass)
        raise ValueError(f"expected an integer, got {x!r:.40}")
    return x


def _str(x: object) -> str:
    if type(x) is not str:
        raise ValueError(f"expected a string, got {x!r:.40}")
    return x


def _segment(s: object) -> Segment:
    # One type test per field, inline (no helper call per field): this runs per segment per open.
    if type(s) is not list or not 7 <= len(s) <= 8:
        raise ValueError("a segment entry is a list of 7 or 8 fields")
    layer, part, offset, nbytes, dig, dtype, shape = s[:7]
    granules = s[7] if len(s) > 7 else []
    if not (type(layer) is int and type(offset) is int and type(nbytes) is int and type(dig) is int
            and type(part) is str and type(dtype) is str and type(shape) is list and type(granules) is list
            and all(type(d) is int for d in shape) and all(type(g) is int for g in granules)):
        raise ValueError(f"a segment entry has a field of the wrong type: {s!r:.80}")
    return Segment(layer, part, offset, nbytes, dig, dtype, tuple(shape), tuple(granules))


@lru_cache(maxsize=64)
def _reprs(names: tuple) -> tuple[Repr, ...]:
    """Layer representations by name (a store's chunks share a handful of layouts: parsed once)."""
    return tuple(Repr(r) for r in names)


def _header_from_doc(doc: dict, total: int, segments: tuple[Segment, ...] | None = None,
                     table: SegmentTable | None = None) -> ChunkHeader:
    # Every field's type is checked here (the header is untrusted input: a float count or a list
    # where a string belongs must be a FormatError, not a TypeError deep inside a restore); what
    # the values must be is checked against the reader's expectation in validate.py.
    alg = doc.get("digest", CRC32C)
    if alg not in DIGESTS:
        raise ValueError(f"unknown digest algorithm {alg!r:.40}")
    if type(doc["partial"]) is not bool:
        raise ValueError("partial must be true or false")
    return ChunkHeader(
        key=_str(doc["key"]), parent=_str(doc["parent"]), index=_int(doc["index"]), start=_int(doc["start"]),
        tokens=_int(doc["tokens"]), partial=doc["partial"], ns=_str(doc["ns"]), model=_str(doc["model"]),
        compute_dtype=_str(doc["compute"]), storage_dtype=_str(doc["storage"]),
        layer_reprs=_reprs(tuple(doc["reprs"])),  # (a list of lists: TypeError, a malformed header)
        segments=segments if segments is not None else tuple(_segment(s) for s in doc["segments"]),
        total_bytes=total, digest=alg, prefix=_prefix_from_doc(doc), order=_order_from_doc(doc), table=table,
    )


def _prefix_from_doc(doc: dict) -> tuple[str, ...]:
    prefix = doc.get("prefix", [])
    if type(prefix) is not list or any(type(d) is not str for d in prefix):
        raise ValueError("prefix must be a list of strings")
    return tuple(prefix)


def _order_from_doc(doc: dict) -> torch.Tensor | None:
    if "order" not in doc:
        return None
    rows, tokens = doc["order"], _int(doc["tokens"])
    # Sizes first, from the list itself: a header's counts allocate nothing until they agree.
    if not isinstance(rows, list) or len(rows) != len(doc["reprs"]) or \
            any(not isinstance(r, list) or len(r) != tokens for r in rows):
        raise ValueError("order does not have one row of the chunk's tokens per layer")
    order = torch.tensor(rows, dtype=torch.long)  # [layers, tokens]
    if not bool((order.sort(dim=1).values == torch.arange(tokens)).all()):
        raise ValueError("order is not a permutation of the chunk's tokens per layer")
    return order


def check_segment(seg: Segment, data: torch.Tensor | memoryview, alg: str = CRC32C) -> None:
    """`data` is the bytes read for `seg`; raise FormatError if it is not what was written."""
    if (data.numel() if isinstance(data, torch.Tensor) else data.nbytes) != seg.nbytes:
        raise FormatError(f"segment {seg.layer}/{seg.part}: truncated")
    if checksum(data, alg) != seg.digest:
        raise FormatError(f"segment {seg.layer}/{seg.part}: checksum mismatch")


def decode_layers(header: ChunkHeader, data: Mapping[tuple[int, str], torch.Tensor],
                  layers: Iterable[int], parts: Iterable[str], copy: bool = True) -> list[LayerState]:
    """Build LayerStates from verified segment buffers keyed by (layer, part).

    copy=False when the buffers are fresh memory owned by this read (disk, redis): tensors may
    then alias them instead of being copied once more.
    """
    parts = tuple(parts)
    out = []
    for layer in layers:
        rep = header.layer_reprs[layer]
        fields = {part: in_token_order(header, (layer,), part, _decode_stored(header, data, layer, part, copy)[None])[0]
                  for part in rep.parts() if part in parts}
        out.append(LayerState(layer, rep, **fields))
    return out


def _decode_stored(header: ChunkHeader, data: Mapping[tuple[int, str], torch.Tensor], layer: int, part: str,
                   copy: bool) -> torch.Tensor:
    """One part of one layer in the compute dtype, rows as stored."""
    seg = header.by_part[(layer, part)]
    return codec.decode(data[(layer, part)], seg.dtype, seg.shape, header.compute_dtype,
                        data.get((layer, part + ".scale")), copy)


def in_token_order(header: ChunkHeader, layers: Sequence[int], part: str, x: torch.Tensor) -> torch.Tensor:
    """`part` of `layers` as read, [len(layers), tokens, ...] in stored row order -> token order
    (a copy for a reordered chunk's K/V; `x` itself otherwise)."""
    if header.row_of is None or part not in ORDERED_PARTS:
        return x
    rows = header.row_of[list(layers)]  # [L, tokens]
    return x[torch.arange(len(layers))[:, None], rows]


def strided_run(header: ChunkHeader, blob: torch.Tensor, layers: Sequence[int], part: str) -> torch.Tensor | None:
    """`part` of consecutive `layers` as one strided view of a whole stored value `blob` (uint8),
    from the header's offsets alone (no tensor op per segment), or None where the bytes are not in
    the compute dtype or not evenly spaced (then `decode_run` on read segments serves). Rows as
    stored: `in_token_order` puts a reordered chunk's K/V back in token order."""
    if header.storage_dtype != header.compute_dtype:
        return None
    segs = [header.by_part[(li, part)] for li in layers]
    first = segs[0]
    step = segs[1].offset - first.offset if len(segs) > 1 else first.nbytes
    dtype = codec.torch_dtype(first.dtype)
    width = dtype.itemsize
    if step <= 0 or step % width or first.offset % width or \
            any(s.offset - first.offset != i * step or s.shape != first.shape for i, s in enumerate(segs)):
        return None
    base = blob.view(dtype)  # the blob is a whole stored value: offsets are from its start
    return base.as_strided((len(segs), *first.shape), (step // width, *_contiguous_strides(first.shape)),
                           base.storage_offset() + first.offset // width)


def layer_runs(header: ChunkHeader, blob: torch.Tensor) -> dict[str, tuple[torch.Tensor, int] | None]:
    """Each part's layers of a whole stored value `blob` as one strided view, with the first layer
    it holds (`strided_run` over every layer storing the part): part -> (view, first layer), or
    None where the part's layers are not consecutive or the bytes not one even run."""
    runs: dict[str, tuple[torch.Tensor, int] | None] = {}
    for part in dict.fromkeys(p for _, p in header.by_part):
        stored = sorted(li for li, p in header.by_part if p == part)
        run = strided_run(header, blob, stored, part) if stored == list(range(stored[0], stored[-1] + 1)) else None
        runs[part] = None if run is None else (run, stored[0])
    return runs


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def decode_run(header: ChunkHeader, data: Mapping[tuple[int, str], torch.Tensor], layers: Sequence[int],
               part: str) -> torch.Tensor:
    """`part` of consecutive `layers` as one tensor [len(layers), *part shape] in the compute dtype.

    Where the bytes are already in the compute dtype and the layers' segments sit at an even
    stride in one buffer (the layer-major layout makes them so), this is a strided view of those
    bytes: no copy. Otherwise the layers are decoded and stacked (a copy). Rows as stored, as
    `strided_run`."""
    if header.storage_dtype == header.compute_dtype:
        return stored_run(header, data, layers, part)
    return torch.stack([_decode_stored(header, data, li, part, copy=False) for li in layers])


def stored_run(header: ChunkHeader, data: Mapping[tuple[int, str], torch.Tensor], layers: Sequence[int],
               part: str) -> torch.Tensor:
    """`part` of consecutive `layers` as stored: [len(layers), *segment shape] in the segment's own
    dtype (int8 values, their float32 ".scale" rows, a cast storage dtype), undecoded: what a
    restore copies to a GPU to decode there (codec.to_compute). A strided view of the read bytes
    where the segments lie at an even stride in one buffer, else a stack (a copy)."""
    segs = [header.by_part[(li, part)] for li in layers]
    bufs = [data[(li, part)] for li in layers]
    first = segs[0]
    dtype = codec.torch_dtype(first.dtype)
    base = bufs[0].view(dtype)
    step = bufs[1].data_ptr() - bufs[0].data_ptr() if len(bufs) > 1 else first.nbytes
    even = all(b.untyped_storage().data_ptr() == bufs[0].untyped_storage().data_ptr() and
               b.data_ptr() - bufs[0].data_ptr() == i * step for i, b in enumerate(bufs))
    if even and step > 0 and step % base.element_size() == 0 and all(s.shape == first.shape for s in segs):
        return base.as_strided((len(layers), *first.shape),
                               (step // base.element_size(), *_contiguous_strides(first.shape)), base.storage_offset())
    return torch.stack([b.view(dtype).reshape(s.shape) for b, s in zip(bufs, segs)])
