"""Reusable, page-aligned host buffers that restores read stored bytes into.

Direct I/O needs aligned memory, and a fresh buffer costs a page fault per 4 KiB on first touch
(about a third of a copy's speed here), so buffers are kept and handed out again. On a CUDA host
this is where pinned slabs go: the interface is the same.
"""
from __future__ import annotations

import threading

import torch

PAGE = 4096
_GRAIN = 1 << 20  # sizes are rounded up to whole MiB so buffers fit later requests of similar size


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose first byte is page-aligned (direct I/O needs it); pinned
    for asynchronous copies to a CUDA device when `pin`."""
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip:skip + nbytes]


class Staging:
    """A free list of aligned buffers, at most `max_bytes` kept while idle."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.pin = False  # set by a store serving a CUDA engine: disk and Redis reads land in pinned slabs
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """An aligned uint8 buffer of at least `nbytes` (its size is what `give` gets back)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # by index: list.remove would compare tensors element by element
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return aligned_empty(-(-max(nbytes, 1) // _GRAIN) * _GRAIN, self.pin)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken earlier; nothing may still read it."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: -b.numel())
            kept = 0
            for i, b in enumerate(self._free):
                kept += b.numel()
                if kept > self.max_bytes:
                    del self._free[i:]  # the smallest go first
                    break

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)
