"""Eviction policies: which keys a tier gives up when it needs room.

A policy only sees keys, sizes and accesses; the tier owns the data. The interface is small so that
a look-ahead policy (CachedAttention: evict what the scheduler needs furthest in the future, never
what is inside the look-ahead window) or a score-based one (IMPRESS: access frequency times the
share of important tokens) can be added without touching any tier: both only need their own
ordering plus the `protected` set.
"""
from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Iterable, Iterator, Protocol


class EvictionPolicy(Protocol):
    def insert(self, key: str, nbytes: int) -> None: ...
    def touch(self, key: str) -> None: ...
    def remove(self, key: str) -> None: ...
    def victims(self, need_bytes: int, protected: Iterable[str] = ()) -> Iterator[str]:
        """Keys to evict, in order, until their sizes add up to `need_bytes` (skipping `protected`).

        The caller removes each yielded key (calling `remove`) before asking for the next.
        """
        ...
    def __len__(self) -> int: ...

    def size(self, key: str) -> int: ...


class _Ordered:
    """Shared base: an ordered map key -> nbytes, evicted from the front."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, int] = OrderedDict()

    def insert(self, key: str, nbytes: int) -> None:
        self._order[key] = nbytes
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        pass

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def __len__(self) -> int:
        return len(self._order)

    def size(self, key: str) -> int:
        return self._order.get(key, 0)

    def __contains__(self, key: str) -> bool:
        return key in self._order

    def _ranked(self) -> Iterable[str]:
        """Keys in eviction order: the map's own, front first, read a few at a time. A full tier
        evicts a key or two per write; copying every key per write made each one O(entries)."""
        kept = 0  # keys at the front that were offered and are still held (protected)
        while batch := list(islice(self._order, kept, kept + 64)):
            for key in batch:
                if key in self._order:
                    yield key
                    kept += key in self._order  # the caller removes what it evicts before asking again

    def victims(self, need_bytes: int, protected: Iterable[str] = ()) -> Iterator[str]:
        protected = set(protected)
        freed = 0
        for key in self._ranked():  # the caller removes keys while we iterate
            if freed >= need_bytes:
                return
            if key in protected or key not in self._order:
                continue
            freed += self._order[key]
            yield key


class FIFOPolicy(_Ordered):
    """Oldest insertion first; accesses do not matter."""


class LRUPolicy(_Ordered):
    """Least recently inserted-or-accessed first."""

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)


class LFUPolicy(_Ordered):
    """Fewest accesses first (insert counts as one); ties go to the least recently used."""

    def __init__(self) -> None:
        super().__init__()
        self._count: dict[str, int] = {}

    def insert(self, key: str, nbytes: int) -> None:
        super().insert(key, nbytes)
        self._count[key] = self._count.get(key, 0) + 1

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)
            self._count[key] += 1

    def remove(self, key: str) -> None:
        super().remove(key)
        self._count.pop(key, None)

    def _ranked(self) -> Iterable[str]:
        recency = {k: i for i, k in enumerate(self._order)}
        return sorted(self._order, key=lambda k: (self._count[k], recency[k]))  # a snapshot


class ScorePolicy(LFUPolicy):
    """IMPRESS §4.4.2: score = accesses x the chunk's share of important tokens (a moving average
    of what importance-only restores kept of it; 1.0 until first observed). Lowest score first;
    ties go to the least recently used. A chunk not held is admitted only if it fits or beats the
    lowest score held, so a faster tier keeps the chunks whose important part is read most."""

    EMA = 0.3  # weight of the newest observation

    def __init__(self) -> None:
        super().__init__()
        self._ratio: dict[str, float] = {}
        self._seen: OrderedDict[str, int] = OrderedDict()  # accesses of keys held or not (bounded)

    def score(self, key: str) -> float:
        return self._seen.get(key, 0) * self._ratio.get(key, 1.0)

    def _access(self, key: str) -> None:
        self._seen[key] = self._seen.get(key, 0) + 1
        self._seen.move_to_end(key)
        while len(self._seen) > 1_000_000:  # forget the coldest keys never seen again
            old, _ = self._seen.popitem(last=False)
            self._ratio.pop(old, None)

    def insert(self, key: str, nbytes: int) -> None:
        super().insert(key, nbytes)
        if key not in self._seen:  # a promoted chunk's read was already counted by `access`
            self._access(key)

    def touch(self, key: str) -> None:
        super().touch(key)
        self._access(key)

    def access(self, key: str) -> None:
        """A read of `key` wherever it is held (counted toward its score even while not held here)."""
        self._access(key)

    def observe(self, key: str, ratio: float) -> None:
        """The share of the chunk's tokens an importance-only restore needed."""
        old = self._ratio.get(key)
        self._ratio[key] = ratio if old is None else self.EMA * ratio + (1 - self.EMA) * old

    def admit(self, key: str, fits: bool) -> bool:
        """Whether a chunk not held should come in (`fits`: there is room without evicting)."""
        if fits or not self._order:
            return True
        return self.score(key) > min(self.score(k) for k in self._order)

    def _ranked(self) -> Iterable[str]:
        recency = {k: i for i, k in enumerate(self._order)}
        return sorted(self._order, key=lambda k: (self.score(k), recency[k]))


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "fifo": FIFOPolicy, "score": ScorePolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: use one of {sorted(POLICIES)}") from None
