"""Pinned host memory for the memory tier of an engine on CUDA: pinned once, in big segments.

Pinning each chunk on its own would let PyTorch's caching host allocator round every allocation up
to a power of two: about 2x the configured capacity pinned for Llama-shaped chunks. The arena pins
power-of-two segments (so that rounding wastes nothing), at most `capacity / 20` each (so the last
one overshoots the capacity by at most 5%), lazily as the tier fills, and carves chunks out of them
first-fit with coalescing free lists.

A chunk's bytes are a tensor viewing a numpy slice of its segment; its slot goes back to the free
list only when that slice is garbage: once the tier has dropped the chunk *and* no restore still
holds a view of it (a restore keeps its views until the copies reading them have finished), so an
evicted chunk is never overwritten under an in-flight copy.
"""

from __future__ import annotations

import bisect
import threading
import weakref

import numpy as np
import torch

ALIGN = 512  # slot granularity: every stored dtype view stays aligned


class PinnedArena:
    def __init__(self, capacity: int, pin: bool = True, max_segment: int = 256 << 20) -> None:
        self.capacity = capacity
        self.pin = pin
        # The largest power of two <= capacity / 20, within [1 MiB, max_segment].
        self.segment_bytes = max(1 << 20, min(max_segment, 1 << max(0, (capacity // 20).bit_length() - 1)))
        self.max_segments = -(-capacity // self.segment_bytes)
        self._segments: list[tuple[torch.Tensor, np.ndarray]] = []
        self._free: list[list[tuple[int, int]]] = []  # per segment: sorted (offset, size)
        self._lock = threading.Lock()
        self.fallbacks = 0  # chunks too big for a segment, or that found no room: pageable instead

    @property
    def pinned_bytes(self) -> int:
        return len(self._segments) * self.segment_bytes

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of `nbytes` in pinned memory, or None (the caller keeps it unpinned)."""
        size = -(-max(nbytes, 1) // ALIGN) * ALIGN
        with self._lock:
            if size > self.segment_bytes:
                self.fallbacks += 1
                return None
            for si, free in enumerate(self._free):
                for j, (off, n) in enumerate(free):
                    if n >= size:
                        free[j:j + 1] = [(off + size, n - size)] if n > size else []
                        return self._slot(si, off, size, nbytes)
            if len(self._segments) >= self.max_segments:
                self.fallbacks += 1
                return None
            seg = torch.empty(self.segment_bytes, dtype=torch.uint8, pin_memory=self.pin)
            self._segments.append((seg, seg.numpy()))
            self._free.append([(size, self.segment_bytes - size)] if size < self.segment_bytes else [])
            return self._slot(len(self._segments) - 1, 0, size, nbytes)

    def _slot(self, si: int, off: int, size: int, nbytes: int) -> torch.Tensor:
        view = self._segments[si][1][off:off + nbytes]  # a numpy view: its lifetime is the slot's
        weakref.finalize(view, self._give, si, off, size)
        return torch.from_numpy(view)

    def _give(self, si: int, off: int, size: int) -> None:
        with self._lock:
            free = self._free[si]
            i = bisect.bisect(free, (off, size))
            free.insert(i, (off, size))
            # Coalesce with the neighbours.
            if i + 1 < len(free) and off + size == free[i + 1][0]:
                free[i:i + 2] = [(off, size + free[i + 1][1])]
            if i > 0 and free[i - 1][0] + free[i - 1][1] == free[i][0]:
                free[i - 1:i + 1] = [(free[i - 1][0], free[i - 1][1] + free[i][1])]

    def stats(self) -> dict:
        with self._lock:
            idle = sum(n for f in self._free for _, n in f)
        return dict(pinned_bytes=self.pinned_bytes, segment_bytes=self.segment_bytes, segments=len(self._segments),
                    idle_bytes=idle, fallbacks=self.fallbacks)
