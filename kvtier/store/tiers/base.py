"""The interface every tier implements, and the read/verify logic they share.

A tier stores packed chunks (see format.py) by key. Subclasses provide raw access (`_open` a
reader, `_put_bytes`, `_delete`, `_keys`, `partials`); this base turns that into checked reads:
any header/checksum mismatch, truncation, or a header naming another key, namespace or model is
treated as a miss, the entry is removed, a counter goes up and a warning is logged.
"""
from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ..format import (PREAMBLE, ChunkHeader, FormatError, PackedChunk, check_segment,
                      header_length, parse_header)
from ..throttle import Emulation, Throttle

log = logging.getLogger("kvtier.store")


@dataclass(frozen=True)
class Expect:
    """What the reader expects in a header; None fields are not checked (admin mode)."""
    key: str
    ns: str | None = None
    model: str | None = None


@dataclass(frozen=True)
class ChunkData:
    header: ChunkHeader
    segments: dict  # (layer, part) -> uint8 tensor, checked against its crc
    nbytes: int  # bytes read from the tier
    whole: torch.Tensor | None = None  # uint8 [size]: the whole value, for whole-chunk reads


class Reader(ABC):
    """Ranged reads of one stored value, all from the same version of it."""
    size: int

    @abstractmethod
    def read(self, offset: int, nbytes: int) -> torch.Tensor: ...  # uint8 [nbytes]

    def close(self) -> None:
        pass


class Tier(ABC):
    name: str = "tier"
    durable: bool = True
    verify_reads: bool = True  # memory skips checksums: its bytes never left this process
    owned_buffers: bool = True  # reads return fresh memory (False: views of cached bytes)

    def __init__(self, emulation: Emulation = Emulation()) -> None:
        self.emulation = emulation
        self.throttle = Throttle(emulation)
        self.lock = threading.RLock()
        self.counters = dict(hits=0, misses=0, bytes_read=0, bytes_written=0, evictions=0,
                             corrupt=0, puts=0, put_errors=0)

    # --- subclass hooks -----------------------------------------------------------------------
    @abstractmethod
    def _open(self, key: str) -> Reader | None: ...

    @abstractmethod
    def put(self, packed: PackedChunk) -> bool:
        """Store a chunk (atomically: readers see all of it or nothing). False if it did not fit."""

    @abstractmethod
    def delete(self, key: str) -> None: ...

    @abstractmethod
    def contains(self, key: str) -> bool: ...

    @abstractmethod
    def partials(self, parent: str) -> list[tuple[str, int]]:
        """(key, tokens) of every partial chunk stored under `parent`: one lookup."""

    @abstractmethod
    def iterate(self) -> Iterator[str]:
        """Every key this tier holds (in its namespace, or all namespaces in admin mode)."""

    def contains_many(self, keys: list[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def touch(self, key: str) -> None:
        pass

    def usage(self) -> dict:
        return {}

    def close(self) -> None:
        pass

    # --- shared reads -------------------------------------------------------------------------
    def read(self, expect: Expect, layers: Iterable[int] | None = None,
             parts: Iterable[str] = ("k", "v", "h"), verify: bool | None = None) -> ChunkData | None:
        """Read (and check) all of a chunk, or only `parts` of `layers`. None on miss/corruption."""
        verify = self.verify_reads if verify is None else verify
        layers = None if layers is None else list(layers)
        parts = tuple(parts)
        err: FormatError | None = None
        for _attempt in range(2):  # a concurrent overwrite can change the value between reads
            reader = self._open(expect.key)
            if reader is None:
                self.counters["misses"] += 1
                return None
            try:
                data = self._read_checked(reader, expect, layers, parts, verify)
            except FormatError as e:
                err = e
                continue
            except OSError as e:
                err = FormatError(f"unreadable: {e}")
                continue
            finally:
                reader.close()
            self.throttle.read(data.nbytes)
            self.counters["hits"] += 1
            self.counters["bytes_read"] += data.nbytes
            self.touch(expect.key)
            return data
        self.discard_corrupt(expect.key, str(err))
        return None

    def check(self, expect: Expect) -> str | None:
        """Read and checksum the whole chunk. None if intact, "missing", or why it was removed."""
        reader = self._open(expect.key)
        if reader is None:
            return "missing"
        why = None
        try:
            self._read_checked(reader, expect, None, (), True)
        except (FormatError, OSError) as e:
            why = str(e) or type(e).__name__
        finally:
            reader.close()
        if why is not None:
            self.discard_corrupt(expect.key, why)
        return why

    @abstractmethod
    def clear(self) -> int:
        """Remove every chunk (of this namespace; of all in admin mode). Returns how many."""

    def discard_corrupt(self, key: str, why: str) -> None:
        log.warning("kvtier store: %s tier: chunk %s is corrupt (%s); removed, will recompute",
                    self.name, key, why)
        self.counters["corrupt"] += 1
        self.counters["misses"] += 1
        try:
            self.delete(key)
        except Exception as e:  # removal is best effort; the entry stays a miss for this read
            log.warning("kvtier store: could not remove corrupt chunk %s: %s", key, e)

    def _header(self, reader: Reader) -> ChunkHeader:
        first = reader.read(0, min(reader.size, 4096))
        n = header_length(bytes(first[:PREAMBLE.size].numpy()))  # raises on bad magic/version
        if n > first.numel():
            first = reader.read(0, n)
        return parse_header(memoryview(first.numpy()), reader.size)

    def _read_checked(self, reader: Reader, expect: Expect, layers: list[int] | None,
                      parts: tuple[str, ...], verify: bool) -> ChunkData:
        whole = None
        if layers is None:
            whole = reader.read(0, reader.size)  # one sequential read of the whole value
            header = parse_header(memoryview(whole.numpy()), reader.size)
            segs = list(header.segments)
        else:
            header = self._header(reader)
            segs = header.segments_for(layers, parts)
        if header.key != expect.key:
            raise FormatError(f"header names chunk {header.key}")
        if expect.ns is not None and header.ns != expect.ns:
            raise FormatError("chunk belongs to another namespace (model, layout or dtype)")
        if expect.model is not None and header.model != expect.model:
            raise FormatError("chunk belongs to another model fingerprint")
        if layers is not None and any(l < 0 or l >= len(header.layer_reprs) for l in layers):
            raise FormatError("layer out of range")  # a caller bug, but never return wrong data
        out: dict = {}
        nbytes = 0 if whole is None else whole.numel()
        # Coalesce adjacent segments (layer-major layout) into single ranged reads.
        runs: list[list] = []
        for s in segs:
            if runs and s.offset - (runs[-1][-1].offset + runs[-1][-1].nbytes) < 64:
                runs[-1].append(s)
            else:
                runs.append([s])
        for run in runs:
            lo, hi = run[0].offset, run[-1].offset + run[-1].nbytes
            if whole is not None:
                buf = whole[lo:hi]
            else:
                buf = reader.read(lo, hi - lo)
                nbytes += buf.numel()
            if buf.numel() != hi - lo:
                raise FormatError("truncated payload")
            for s in run:
                view = buf[s.offset - lo:s.offset - lo + s.nbytes]
                if verify:
                    check_segment(s, view)
                out[(s.layer, s.part)] = view
        return ChunkData(header, out, nbytes, whole)

    def stats(self) -> dict:
        d = dict(self.counters)
        d.update(self.usage())
        d["emulated"] = self.emulation.describe()
        return d
