"""Scheduler-aware eviction (CachedAttention §3.3): the engine tells the policy which chunks the
queued requests will need and how soon.

Order of victims: chunks no queued request needs (in the base policy's order), then chunks needed
beyond the window, furthest in the future first. Chunks inside the window are never evicted.
With no look-ahead information this is exactly the base policy.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from .policy import EvictionPolicy


class LookAheadPolicy:
    def __init__(self, base: EvictionPolicy) -> None:
        self.base = base
        self.next_use: dict[str, int] = {}  # key -> queue position of the first request needing it
        self.window: frozenset[str] = frozenset()

    def set_future(self, next_use: Mapping[str, int], window: Iterable[str]) -> None:
        self.next_use = dict(next_use)
        self.window = frozenset(window)

    def insert(self, key: str, nbytes: int) -> None:
        self.base.insert(key, nbytes)

    def touch(self, key: str) -> None:
        self.base.touch(key)

    def remove(self, key: str) -> None:
        self.base.remove(key)

    def size(self, key: str) -> int:
        return self.base.size(key)

    def __len__(self) -> int:
        return len(self.base)

    def victims(self, need_bytes: int, protected: Iterable[str] = ()) -> Iterator[str]:
        skip = set(protected) | self.window
        ranked = list(self.base.victims(1 << 62, skip))  # every evictable key, base order
        unused = [k for k in ranked if k not in self.next_use]
        later = sorted((k for k in ranked if k in self.next_use), key=lambda k: -self.next_use[k])
        freed = 0
        for key in unused + later:
            if freed >= need_bytes:
                return
            freed += self.base.size(key)
            yield key


def window(sizes: Sequence[int], free_bytes: int) -> int:
    """CachedAttention §3.3: how many queued requests' states the look-ahead window covers: free
    memory over the mean state size of the queued requests that have stored state (at least one)."""
    held = [s for s in sizes if s]
    mean = sum(held) / len(held) if held else 1.0
    return max(1, int(free_bytes // max(mean, 1.0)))
