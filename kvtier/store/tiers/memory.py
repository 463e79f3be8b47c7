"""Host DRAM tier: packed chunks in uint8 buffers, byte-capped; for an engine on CUDA the buffers
are carved from a pinned arena (sources of asynchronous copies to the device)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .. import validate
from ..arena import PinnedArena
from ..format import ChunkHeader, FormatError, PackedChunk, layer_runs, sealed_by
from ..keys import Child, lead_of
from ..policy import EvictionPolicy, LRUPolicy
from ..throttle import Emulation
from ..validate import Expect
from .base import Reader, Tier, W


@dataclass
class _Entry:
    blob: torch.Tensor  # uint8 [nbytes]
    header: ChunkHeader
    checked: Expect | None = None  # the last expectation the header passed
    runs: dict = field(default_factory=dict)  # each part's all-layer view of the blob (format.layer_runs)


def _entry(blob: torch.Tensor, header: ChunkHeader) -> _Entry:
    """An entry with its all-layer views built: on the way in (the writer's thread), not on the
    first restore's critical path."""
    return _Entry(blob, header, runs=layer_runs(header, blob))


class _MemReader(Reader):
    def __init__(self, blob: torch.Tensor, runs: dict) -> None:
        self.blob = blob
        self.size = blob.numel()
        self.runs = runs  # the entry's all-layer views (format.layer_runs)

    def read(self, offset: int, nbytes: int, out: torch.Tensor | None = None) -> torch.Tensor:
        view = self.blob[offset:offset + nbytes]  # zero-copy: the blob is never written again
        return view if out is None else out[:view.numel()].copy_(view)


class MemoryTier(Tier):
    name = "memory"
    verify_reads = False  # bytes were checked (or produced) on their way in and never left RAM
    owned_buffers = False  # reads are views of the cached blob: decoding must copy
    local_reads = True

    def __init__(self, capacity: int, policy: EvictionPolicy | None = None,
                 emulation: Emulation = Emulation(), pin: bool = False) -> None:
        super().__init__(emulation)
        self.capacity = capacity
        self.policy: EvictionPolicy = policy if policy is not None else LRUPolicy()  # (an empty policy is falsy)
        self._entries: dict[str, _Entry] = {}
        self._children: dict[tuple[str, str], dict[str, Child]] = {}  # (parent, lead) -> {key: child}
        self.used = 0
        self.arena = PinnedArena(capacity) if pin else None  # the engine runs on CUDA
        # Called with (tier, key) before an entry is evicted, so the store can demote it.

    def wrap_policies(self, wrap: Callable[[EvictionPolicy], W]) -> list[W]:
        with self.lock:
            wrapped = wrap(self.policy)
            self.policy = wrapped
        return [wrapped]

    def _open(self, key: str) -> Reader | None:
        e = self._entries.get(key)
        return None if e is None else _MemReader(e.blob, e.runs)

    def header(self, key: str) -> ChunkHeader | None:
        e = self._entries.get(key)
        return None if e is None else e.header

    _known_header = header  # parsed once on the way in: reads never parse it again

    def _check_header(self, header: ChunkHeader, expect: Expect, size: int) -> None:  # type: ignore[override]
        """Checked once per entry and expectation: an entry's bytes never change, so a restore of a
        long prefix does not re-validate every chunk header it already checked."""
        e = self._entries.get(expect.key)
        if e is not None and e.header is header and e.checked == expect:
            return
        validate.check(header, expect, size, segments_checked=e is not None and e.header is header)
        if e is not None and e.header is header:
            e.checked = expect

    def contains(self, key: str) -> bool:
        return key in self._entries

    def children(self, parent: str, lead: str) -> list[Child]:
        out = list(self._children.get((parent, ""), {}).values())
        return out + list(self._children.get((parent, lead), {}).values()) if lead else out

    def iterate(self) -> Iterator[str]:
        return iter(list(self._entries))

    def touch(self, key: str) -> None:
        with self.lock:
            self.policy.touch(key)

    def put(self, packed: PackedChunk) -> bool:
        n = packed.nbytes
        key = packed.header.key
        if not self._admissible(packed):
            self.counters["put_errors"] += 1
            return False
        with self.lock:
            if key in self._entries:
                self.policy.touch(key)
                return True
            if n > self.capacity or not self._evict_for(self.policy, lambda: self.used, self.capacity, n,
                                                        frozenset({key})):
                return False
            self._entries[key] = _entry(self._blob_of(packed), packed.header)
            h = packed.header
            lead = lead_of(h.prefix)
            self._children.setdefault((h.parent, lead), {})[key] = Child(key, h.tokens, lead)
            self.used += n
            self.policy.insert(key, n)
            self.counters["bytes_written"] += n
            self.counters["puts"] += 1
            return True

    def replace(self, packed: PackedChunk) -> bool:
        """The entry swapped for a new blob (a reader holding the old one keeps reading it); its
        place in the eviction policy is kept."""
        key, n = packed.header.key, packed.nbytes
        if not self._admissible(packed):
            return False
        with self.lock:
            old = self._entries.get(key)
            if old is None or not self._evict_for(self.policy, lambda: self.used + n - old.blob.numel(),
                                                  self.capacity, 0, frozenset({key})):
                return False
            self._entries[key] = _entry(self._blob_of(packed), packed.header)
            self.used += n - old.blob.numel()
            self.counters["bytes_written"] += n
            return True

    def _admissible(self, packed: PackedChunk) -> bool:
        """Sealed with this store's secret (headers kept here are trusted on every read after), as
        long as its header says, and its segments inside those bytes (so reads check only what they
        expect of the chunk)."""
        if not sealed_by(packed, self.seal) or sum(memoryview(b).nbytes for b in packed.buffers) != packed.nbytes:
            return False
        try:
            validate.check_segments(packed.header, packed.nbytes)
        except FormatError:
            return False
        return True

    def _blob_of(self, packed: PackedChunk) -> torch.Tensor:
        n = packed.nbytes
        blob = self.arena.take(n) if self.arena is not None else None
        if blob is None:  # no arena (CPU engine), or no room in it: pageable (correct, slower copies)
            blob = torch.empty(n, dtype=torch.uint8)
        pos = 0
        view = blob.numpy()
        for b in packed.buffers:
            m = len(memoryview(b).cast("B"))
            view[pos:pos + m] = memoryview(b).cast("B")
            pos += m
        return blob

    def size_of(self, key: str) -> int | None:
        e = self._entries.get(key)
        return None if e is None else e.header.total_bytes

    def delete(self, key: str) -> None:
        with self.lock:
            e = self._entries.pop(key, None)
            if e is None:
                return
            self.used -= e.blob.numel()
            self.policy.remove(key)
            place = (e.header.parent, lead_of(e.header.prefix))
            sib = self._children.get(place)
            if sib is not None:
                sib.pop(key, None)
                if not sib:
                    del self._children[place]

    def clear(self) -> int:
        with self.lock:
            n = len(self._entries)
            for k in list(self._entries):
                self.delete(k)
            return n

    def usage(self) -> dict:
        out: dict[str, Any] = dict(entries=len(self._entries), bytes_used=self.used, capacity=self.capacity)
        if self.arena is not None:
            out["pinned"] = self.arena.stats()
        return out

