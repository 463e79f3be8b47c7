"""The interface every tier implements, and the read/verify logic they share.

A tier stores packed chunks (see format.py) by key. Subclasses provide raw access (`_open` a
reader, `put`, `delete`, `contains`, `children`); this base turns that into checked reads: any
header/checksum mismatch, truncation, or a header naming another key, namespace or model is
treated as a miss, the entry is removed, a counter goes up and a warning is logged. Any other
error a tier raises (a refused command, a value of the wrong type, a permission) is a miss too,
counted under `errors`: stored state can cost a recompute, never a failed request.

Reads go through an `OpenChunk`: the header is read and checked once when the chunk is opened,
then any number of layer ranges are read from the same version of it (a restore reads a chunk
group of layers by group of layers), optionally into a caller's staging buffer.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, TypeVar, cast

import torch

from .. import validate
from ..format import (
    PREAMBLE,
    ChunkHeader,
    FormatError,
    PackedChunk,
    Segment,
    SegmentTable,
    check_segment,
    checksum,
    header_length,
    parse_header,
)
from ..keys import Child
from ..policy import EvictionPolicy
from ..seal import Seal, digest
from ..throttle import Emulation, Throttle
from ..validate import Expect
from .breaker import Outage, Refused

W = TypeVar("W", bound=EvictionPolicy)  # a wrapper an engine puts around a tier's eviction policy

log = logging.getLogger(__name__)

Segments = dict[tuple[int, str], torch.Tensor]  # (layer, part) -> uint8 bytes of that segment
HEAD_BYTES = 16384  # what a header's first read fetches at least: a header fits, so one read, not two


@dataclass(frozen=True)
class PoolTarget:
    """Where one chunk's K and V may land directly: flat byte views of the whole pool buffers,
    with layer l's tokens at byte l * layer_bytes + slot * slot_bytes. Plain byte arithmetic: a
    direct read of a chunk needs no tensor op per segment."""

    k: memoryview
    v: memoryview
    align: int  # the largest power of two (up to 4096) both buffers' start addresses are aligned to
    layer_bytes: int
    slot_bytes: int
    slot: int

    def offset(self, layer: int) -> int:
        return layer * self.layer_bytes + self.slot * self.slot_bytes


@dataclass(frozen=True)
class ChunkData:
    header: ChunkHeader
    segments: Segments  # checked against their digests (when the tier verifies)
    nbytes: int  # bytes read from the tier
    whole: torch.Tensor | None = None  # uint8 [size]: the whole value, for whole-chunk reads


class Reader(ABC):
    """Ranged reads of one stored value, all from the same version of it."""
    size: int
    # The value's first bytes, read ahead by a tier that opens many chunks at once (disk): the
    # header is parsed from them without another read, and runs lying in them are served from
    # them (`OpenChunk.read`: the disk tier reads the first layer with the header).
    head: torch.Tensor | None = None

    @abstractmethod
    def read(self, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [nbytes] at `offset` (shorter at the end of the value). With `out` (a page-aligned
        buffer of at least `span(offset, nbytes)` bytes) the bytes land there, else in new memory
        or a view of the tier's own."""

    def span(self, offset: int, nbytes: int) -> int:
        """Bytes of `out` a read of (offset, nbytes) needs (direct I/O rounds to whole pages)."""
        return nbytes

    direct_align = 0  # readers that can read straight into aligned memory (direct I/O) set this

    def scatter(self, offset: int, dests: Sequence[memoryview]) -> None:
        """Read consecutive bytes from `offset` straight into `dests` (aligned to `direct_align`)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class OpenChunk:
    """One chunk opened on one tier: its checked header and a reader of that version of it."""

    def __init__(self, tier: "Tier", expect: Expect, reader: Reader, header: ChunkHeader, verify: bool) -> None:
        self.tier, self.expect, self.reader, self.header, self.verify = tier, expect, reader, header, verify

    def plan_read(self, layers: Iterable[int], parts: Iterable[str]) -> list[list[Segment]]:
        layers = list(layers)
        if any(li < 0 or li >= len(self.header.layer_reprs) for li in layers):
            raise FormatError("layer out of range")  # a caller bug, but never return wrong data
        return self.header.plan_read(layers, parts)

    def staging_bytes(self, runs: list[list[Segment]]) -> int:
        return sum(self.reader.span(r[0].offset, r[-1].offset + r[-1].nbytes - r[0].offset) for r in runs)

    def read(self, runs: list[list[Segment]], out: torch.Tensor | None = None,
             into: PoolTarget | None = None) -> tuple[Segments, int]:
        """Read planned runs (into `out` if given), verify them; -> (segments, bytes read).
        K/V runs the reader can put straight into their pool slots `into` (direct I/O, or a copy
        of what the opening read ahead) land there and are left out of the segments returned.
        Raises FormatError/OSError: the caller turns that into a miss."""
        segments: Segments = {}
        nbytes = pos = 0
        for run in runs:
            lo, hi = run[0].offset, run[-1].offset + run[-1].nbytes
            nbytes += hi - lo
            if self.in_head(run):  # read with the header: copied into the pool, or viewed there
                if into is not None and self._copy_from_head(run, into):
                    continue
                buf, base = cast(torch.Tensor, self.reader.head), 0
            elif into is not None and self._scatter(run, into):
                continue
            else:
                dest = None
                if out is not None:
                    need = self.reader.span(lo, hi - lo)
                    dest = out[pos:pos + need]
                    pos += need
                buf, base = self.reader.read(lo, hi - lo, dest), lo
                if buf.numel() != hi - lo:
                    raise FormatError("truncated payload")
            for s in run:
                view = buf[s.offset - base:s.offset - base + s.nbytes]
                if self.verify:
                    check_segment(s, view, self.header.digest)
                segments[(s.layer, s.part)] = view
        return segments, nbytes

    def read_granules(self, seg: Segment, first: int, last: int, granule_tokens: int) -> torch.Tensor:
        """Rows of granules [first, last] of `seg` (the importance layout), each verified against
        its own checksum; counted and throttled like any read of this tier. -> uint8 bytes.
        Raises FormatError/OSError (a miss for the caller)."""
        if len(seg.granules) != -(-seg.shape[0] // granule_tokens):
            raise FormatError(f"segment {seg.layer}/{seg.part} has no granule checksums: stored without "
                              "the importance layout")
        offset, nbytes = seg.granule_span(first, last, granule_tokens)
        try:
            buf = self.reader.read(offset, nbytes)
        except Refused as e:  # a miss for the caller like any OSError, counted as the tier's error
            self.tier.refused("read", e)
            raise
        if buf.numel() != nbytes:
            raise FormatError("truncated payload")
        if self.verify:
            step = granule_tokens * (seg.nbytes // seg.shape[0])
            for i, g in enumerate(range(first, last + 1)):
                if checksum(buf[i * step : (i + 1) * step], self.header.digest) != seg.granules[g]:
                    raise FormatError(f"segment {seg.layer}/{seg.part} granule {g}: checksum mismatch")
        self.tier._count_read(self.expect.key, nbytes)
        return buf

    def in_head(self, run: list[Segment]) -> bool:
        """The run lies in the bytes the opening read ahead (`Reader.head`)."""
        head = self.reader.head
        return head is not None and max(s.offset + s.nbytes for s in run) <= head.numel()

    def _copy_from_head(self, run: list[Segment], into: PoolTarget) -> bool:
        """A K/V run the opening read ahead, copied into its pool slots and verified there; False
        where it does not go straight there (then it is viewed in the head)."""
        dests = self._pool_dests(run, into, 1)
        if dests is None:
            return False
        src = cast(torch.Tensor, self.reader.head).numpy().data
        for s, d in zip(run, dests):
            d[:] = src[s.offset:s.offset + s.nbytes]
        self.check_scattered(run, dests)
        return True

    def _scatter(self, run: list[Segment], into: PoolTarget) -> bool:
        """One read of a gapless K/V run straight into the pool slots; verified there."""
        dests = self.scatter_dests(run, into)
        if dests is None:
            return False
        self.reader.scatter(run[0].offset, dests)
        self.check_scattered(run, dests)
        return True

    def scatter_dests(self, run: list[Segment], into: PoolTarget) -> list[memoryview] | None:
        """Where a gapless K/V run lands in its pool slots, one view per segment, if the reader can
        read it straight there (direct I/O: aligned offsets, lengths and addresses); else None."""
        a = self.reader.direct_align
        return self._pool_dests(run, into, a) if a else None

    def _pool_dests(self, run: list[Segment], into: PoolTarget, a: int) -> list[memoryview] | None:
        """`scatter_dests` for a copy whose offsets, lengths and addresses must be multiples of `a`."""
        want = self.header.tokens * into.slot_bytes  # what a chunk's K or V of one layer takes in the pool
        if into.align % a or run[0].offset % a or want % a:
            return None
        # One pass over the run (a restore asks this per chunk per layer group).
        dests, end = [], run[0].offset
        for s in run:
            off = into.offset(s.layer)
            if s.nbytes != want or s.offset != end or off % a or off + want > into.k.nbytes:
                return None  # (K and V buffers are the same size: a slice past the end would be short)
            if s.part == "k":
                dests.append(into.k[off:off + want])
            elif s.part == "v":
                dests.append(into.v[off:off + want])
            else:
                return None
            end += want
        return dests

    def check_scattered(self, run: list[Segment], dests: Sequence[memoryview]) -> None:
        """Verify a run read into `dests` (raises FormatError)."""
        if self.verify:
            alg = self.header.digest
            for s, d in zip(run, dests):
                if digest(alg, d) != s.digest:  # (each dest is the segment's length: scatter_dests)
                    raise FormatError(f"segment {s.layer}/{s.part}: checksum mismatch")

    def close(self) -> None:
        self.reader.close()


class Tier(ABC):
    name: str = "tier"
    verify_reads: bool = True  # memory skips checksums: its bytes never left this process
    owned_buffers: bool = True  # reads return fresh memory (False: views of cached bytes)
    stages_reads: bool = False  # a restore reads it into reused aligned buffers (direct I/O needs them)
    local_reads: bool = False  # reads come from this host's memory or disks, never over a network
    seal: Seal = Seal()  # the store's secret (set by the store): only sealed chunks are read when set

    @property
    def zero_copy(self) -> bool:
        """Reads are views of bytes this tier holds, with nothing to wait for: reading is instant."""
        return not self.owned_buffers and not self.verify_reads and not self.emulation.active

    def __init__(self, emulation: Emulation = Emulation()) -> None:
        self.emulation = emulation
        self.throttle = Throttle(emulation)
        self.lock = threading.RLock()
        self.counters = dict(hits=0, misses=0, bytes_read=0, bytes_written=0, evictions=0,
                             corrupt=0, puts=0, put_errors=0, errors=0)
        self._logged: set[str] = set()
        # Segment tables learned from fully checked headers, per (store digest, chunk tokens).
        self._tables: dict[tuple[str, int], SegmentTable] = {}
        # Called before an entry is evicted (the store demotes it to a lower tier). Tiers whose
        # capacity someone else manages (Redis: maxmemory) never call it.
        self.on_evict: Callable[[Tier, str], None] | None = None

    # --- subclass hooks -----------------------------------------------------------------------
    @abstractmethod
    def _open(self, key: str) -> Reader | None: ...

    @abstractmethod
    def put(self, packed: PackedChunk) -> bool:
        """Store a chunk (atomically: readers see all of it or nothing). False if it did not fit."""

    def replace(self, packed: PackedChunk) -> bool:
        """Store `packed` in place of the chunk this tier holds under its key (the same tokens in
        another layout: a reordered chunk). False if the tier no longer holds it or it did not fit;
        a reader sees the old value, the new one, or a miss, never a mix."""
        if not self.contains(packed.header.key):
            return False
        self.delete(packed.header.key)
        return self.put(packed)

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def children(self, parent: str, lead: str) -> list[Child]:
        """The chunks stored under `parent`, full and partial, that begin as `lead` says
        (keys.lead_key), and those without a lead: one lookup."""

    @abstractmethod
    def iterate(self) -> Iterator[str]:
        """Every key this tier holds (in its namespace, or all namespaces in admin mode)."""

    def contains_many(self, keys: list[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def touch(self, key: str) -> None:
        pass

    def wrap_policies(self, wrap: Callable[[EvictionPolicy], W]) -> list[W]:
        """Put `wrap(policy)` in place of each eviction policy this tier keeps (one per directory of
        a disk tier; none for a remote tier, whose server evicts) and return the wrappers: the
        engine's look-ahead steers eviction through them."""
        return []

    def size_of(self, key: str) -> int | None:
        """Stored bytes of `key` if the tier knows them without a read (memory, disk), else None."""
        return None

    def _evict_for(self, policy: EvictionPolicy, used: Callable[[], int], capacity: int, n: int,
                   protected: frozenset[str]) -> bool:
        """Evict `policy`'s victims until `n` more bytes fit under `capacity`; -> whether they do.
        `used()` is re-read after each deletion (the subclass's delete() updates it)."""
        need = used() + n - capacity
        if need <= 0:
            return True
        for victim in policy.victims(need, protected):
            if self.on_evict is not None:
                self.on_evict(self, victim)
            self.delete(victim)
            self.counters["evictions"] += 1
        return used() + n <= capacity

    def usage(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    def _known_header(self, key: str) -> ChunkHeader | None:
        """A header the tier already holds parsed (the memory tier keeps one per entry)."""
        return None

    # --- shared reads -------------------------------------------------------------------------
    def open_chunk(self, expect: Expect, verify: bool | None = None,
                   opened: Reader | Exception | None = None) -> OpenChunk | None:
        """Open a chunk for ranged reads: None if missing or corrupt (then removed). `opened`: what
        a `_open` of the key already gave (a reader, or the error it raised), used by the first try."""
        verify = self.verify_reads if verify is None else verify
        err: Exception | None = None
        for attempt in range(2):  # a concurrent overwrite can change the value between reads
            try:
                reader = opened if attempt == 0 and opened is not None else self._open(expect.key)
                if isinstance(reader, Exception):
                    raise reader
            except Exception as e:  # noqa: BLE001 - any tier failure is a miss (see the module doc)
                self.refused("open", e)
                return None
            if reader is None:
                self.counters["misses"] += 1
                return None
            try:
                header = self._known_header(expect.key) or self._header(reader, expect)
                self._check_header(header, expect, reader.size)
                self._learn(header, expect)
                return OpenChunk(self, expect, reader, header, verify)
            except Exception as e:  # noqa: BLE001
                reader.close()
                err = e
                if isinstance(e, Outage):
                    break
        self._failed(expect.key, err)
        return None

    def open_chunks(self, expects: Sequence[Expect]) -> list[OpenChunk | None]:
        """Open several chunks (a tier with per-read latency overlaps them)."""
        return [self.open_chunk(e) for e in expects]

    def read_runs(self, opened: Sequence[OpenChunk], runs: Sequence[list[list[Segment]]],
                  out: Sequence[torch.Tensor | None], into: Sequence[PoolTarget | None] | None = None) -> list[Segments] | None:
        """Read planned runs of several open chunks of this tier (one call per layer group of a
        restore; a tier with round trips batches them). None if any is missing or corrupt."""
        into = into or [None] * len(opened)
        return self._collect(opened, [self._try_read(oc, r, o, i) for oc, r, o, i in zip(opened, runs, out, into)])

    @staticmethod
    def _try_read(oc: OpenChunk, runs: list[list[Segment]], out: torch.Tensor | None,
                  into: PoolTarget | None = None) -> tuple[Segments, int] | Exception:
        try:
            return oc.read(runs, out, into)
        except Exception as e:  # noqa: BLE001 - a failed read is a miss (_collect sorts out which kind)
            return e

    def _collect(self, opened: Sequence[OpenChunk], results: Sequence[tuple[Segments, int] | Exception]) -> list[Segments] | None:
        got = []
        for oc, res in zip(opened, results):
            if isinstance(res, Exception):
                self._failed(oc.expect.key, res)
                return None
            self._count_read(oc.expect.key, res[1])
            got.append(res[0])
        return got

    def _count_read(self, key: str, nbytes: int) -> None:
        self._count_reads(1, nbytes)
        self.touch(key)

    def _count_reads(self, chunks: int, nbytes: int) -> None:
        """`chunks` reads of `nbytes` in all, at once (a restore's layer group of in-memory spans;
        the reader touched each chunk once when it opened them)."""
        self.throttle.read(nbytes)
        self.counters["hits"] += chunks
        self.counters["bytes_read"] += nbytes

    def read(self, expect: Expect, layers: Iterable[int] | None = None,
             parts: Iterable[str] = ("k", "v", "h"), verify: bool | None = None) -> ChunkData | None:
        """Read (and check) all of a chunk, or only `parts` of `layers`. None on miss/corruption."""
        if layers is None:
            return self._read_whole(expect, self.verify_reads if verify is None else verify)[0]
        oc = self.open_chunk(expect, verify)
        if oc is None:
            return None
        try:
            runs = oc.plan_read(layers, parts)
            got = self.read_runs([oc], [runs], [None])
        except FormatError as e:
            self.discard_corrupt(expect.key, str(e))
            return None
        finally:
            oc.close()
        if got is None:
            return None
        return ChunkData(oc.header, got[0], sum(v.numel() for v in got[0].values()))

    def _read_whole(self, expect: Expect, verify: bool) -> tuple[ChunkData | None, str]:
        """One sequential read of the whole value (promotion, demotion, verify). -> (data, or
        None and why: "missing" or the corruption found, after which the chunk is removed)."""
        err: Exception | None = None
        for _attempt in range(2):
            if isinstance(err, Outage):
                break
            try:
                reader = self._open(expect.key)
            except Exception as e:  # noqa: BLE001
                self.refused("open", e)
                return None, "unavailable"
            if reader is None:
                self.counters["misses"] += 1
                return None, "missing"
            try:
                # The header first: a value's size is trusted only once its header (checked, and
                # sealed when the store has a secret) accounts for every byte of it.
                header = self._header(reader, expect)
                self._check_header(header, expect, reader.size)
                self._learn(header, expect)
                whole = reader.read(0, reader.size)
                if whole.numel() != reader.size:
                    raise FormatError("truncated payload")
                segs: Segments = {}
                for s in header.segments:
                    view = whole[s.offset:s.offset + s.nbytes]
                    if verify:
                        check_segment(s, view, header.digest)
                    segs[(s.layer, s.part)] = view
            except Exception as e:  # noqa: BLE001
                err = e
                continue
            finally:
                reader.close()
            self._count_read(expect.key, whole.numel())
            return ChunkData(header, segs, whole.numel(), whole), ""
        self._failed(expect.key, err)
        return None, "unavailable" if isinstance(err, Outage) else (str(err) or type(err).__name__)

    def check(self, expect: Expect) -> str | None:
        """Read and checksum the whole chunk. None if intact, "missing", or why it was removed."""
        data, why = self._read_whole(expect, True)
        return None if data is not None else why

    @abstractmethod
    def clear(self) -> int:
        """Remove every chunk (of this namespace; of all in admin mode). Returns how many."""

    def _failed(self, key: str, err: Exception | None) -> None:
        """A read failed: an unreachable tier is a miss; bytes that fail a check are a bad stored
        value (removed); any other error is the tier refusing (counted, the entry left alone)."""
        if isinstance(err, Outage):
            self.counters["misses"] += 1
        elif isinstance(err, Refused):
            self.refused("read", err)
        elif err is None or isinstance(err, (FormatError, OSError)):
            self.discard_corrupt(key, (str(err) or type(err).__name__) if err else "unreadable")
        else:
            self.refused("read", err)

    def refused(self, what: str, err: BaseException) -> None:
        """A tier call raised something that is neither an outage nor a bad value (a permission,
        a wrong key type, a bug): a miss, counted under `errors`, logged once per kind of error."""
        self.counters["errors"] += 1
        self.counters["misses"] += what in ("open", "read")
        kind = f"{what}:{type(err).__name__}"
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning("%s tier: %s failed (%s: %s); treated as a miss (logged once per kind)",
                        self.name, what, type(err).__name__, err)

    def discard_corrupt(self, key: str, why: str) -> None:
        log.warning("%s tier: chunk %s is corrupt (%s); removed, will recompute", self.name, key, why)
        self.counters["corrupt"] += 1
        self.counters["misses"] += 1
        try:
            self.delete(key)
        except Exception as e:  # removal is best effort; the entry stays a miss for this read
            log.warning("could not remove corrupt chunk %s: %s", key, e)

    def _header(self, reader: Reader, expect: Expect | None = None) -> ChunkHeader:
        first = reader.head if reader.head is not None else reader.read(0, min(reader.size, HEAD_BYTES))
        n = header_length(bytes(first[:PREAMBLE.size].numpy()))  # raises on bad magic/version
        if n > first.numel():
            first = reader.read(0, n)
        key = self._table_key(expect)
        return parse_header(first.numpy().data, reader.size, self.seal, self._tables.get(key) if key else None)

    @staticmethod
    def _table_key(expect: Expect | None) -> tuple[str, int] | None:
        """Where a segment table may be learned and used: a reader that checks the namespace's
        layout and knows the chunk's length."""
        if expect is None or expect.ns is None or expect.namespace is None or expect.span is None:
            return None
        return expect.ns, expect.span[1] - expect.span[0]

    def _learn(self, header: ChunkHeader, expect: Expect) -> None:
        """Keep the segment table of a header that passed every check (a few per store: whole
        chunks and partial lengths)."""
        key = self._table_key(expect)
        if key is not None and key not in self._tables and len(self._tables) < 64 and SegmentTable.learnable(header):
            self._tables[key] = SegmentTable(header)

    @staticmethod
    def _check_header(header: ChunkHeader, expect: Expect, size: int) -> None:
        validate.check(header, expect, size)

    def stats(self) -> dict:
        d: dict[str, Any] = dict(self.counters)
        d.update(self.usage())
        d["emulated"] = self.emulation.describe()
        return d
