"""Where the block pool puts a run's blocks: anywhere (`AnyBlocks`), or in rows (`KeepRuns`).

`KeepRuns` is for a CPU pool. CPU attention reads a context whose slots are consecutive in place,
and gathers a scattered one into a copy on every layer of every step (docs/benchmarks.md has what
that costs), so a run that grows takes the blocks that follow its last one first, while they are
free. A free block that holds cached content is taken out of LRU order only where that content is
another continuation of the run's own prefix (the same tenant's: chains start at the salt), or
cannot be matched any more (its parent block's content is gone). A document asked about again thus
grows into the blocks its last question's answer had cached, and never into another tenant's.

The blocks that the run's attention may clear past its end (`reach` slots: exact attention's key
piece) are made clean by the same rule when it grows, so that `BlockPool.clearable` finds them
clean. A new run that will need `room` blocks starts at the lowest place where that many clean
blocks lie in a row (if there is one), so that its prompt's later chunks follow on, and `headroom`
clean blocks after whatever block lies before that place, so that a run there can go on growing in
place while it decodes (where no such place is left, without the headroom). Where the clean blocks
never lie that many in a row (a server whose pool has filled with cached prefixes), cached blocks
are evicted least recently freed first until a row of `room` and the headroom opens, and only the
ones inside it go: a long context in a full pool is still read in place, and can grow in place.

All of this runs in `BlockPool.allocate`, on the scheduler's thread. Plain ints, no torch.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable
from typing import Protocol


class FreeBlocks(Protocol):
    """What a placement reads and changes of the pool (`BlockPool`'s own fields and methods)."""

    num_blocks: int
    ref: list[int]
    hash_of: list[bytes | None]
    parent_of: list[bytes | None]
    cached: dict[bytes, int]
    clean: dict[int, None]
    evictable: OrderedDict[int, None]

    def take(self, blocks: Iterable[int]) -> None:
        """Clean blocks handed to a run: out of the clean stack."""
        ...

    def drop(self, b: int) -> None:
        """Cached free block `b` made clean: its content forgotten."""
        ...

    def bury(self, blocks: Iterable[int]) -> None:
        """Clean blocks moved to the bottom of the clean stack (taken last by other runs)."""
        ...


class Placement(Protocol):
    def place(self, pool: FreeBlocks, n: int, after: int | None, room: int) -> list[int]:
        """Up to `n` blocks taken for a run (whose last block is `after`; None: a new run that will
        need `room` blocks); the pool takes the rest from the top of its clean stack, then LRU."""
        ...


class AnyBlocks:
    """A device pool: paged attention reads scattered blocks as fast as consecutive ones."""

    def place(self, pool: FreeBlocks, n: int, after: int | None, room: int) -> list[int]:
        return []


class KeepRuns:
    """A CPU pool: each run's blocks in a row where it can be had (see the module docstring)."""

    def __init__(self, block_size: int, reach: int = 0, headroom: int = 0) -> None:
        """`reach`, `headroom`: in tokens (slots), rounded up to whole blocks."""
        self.reach = -(-reach // block_size)  # blocks a run's attention may clear past its end
        self.headroom = -(-headroom // block_size)  # clean blocks a new run leaves to the run before it

    def place(self, pool: FreeBlocks, n: int, after: int | None, room: int) -> list[int]:
        out: list[int] = []
        # (with headroom, a one-block run too: the stack's top may be another run's headroom)
        if after is None and (max(room, n) > 1 or self.headroom):
            start = self._start(pool, max(room, n), n)
            if start is not None:
                out = list(range(start, start + n))
                pool.take(out)
                after = out[-1]
        if after is not None:
            b = after + 1
            while len(out) < n and b < pool.num_blocks and _spare(pool, b, pool.hash_of[after]):
                pool.take([b])
                out.append(b)
                b += 1
            if len(out) == n:  # the run ends at b - 1: past it, what its attention may clear made clean
                for c in range(b, min(b + self.reach, pool.num_blocks)):
                    if not _spare(pool, c, None):
                        break
        return out

    def _start(self, pool: FreeBlocks, need: int, taken: int) -> int | None:
        """Where a new run of `need` blocks (taking `taken` now) starts: in clean blocks if they lie
        in a row, else where evicting least recently freed first opens a row (with the run's own
        headroom after it if that opens too: its next turn or decode grows into it)."""
        start = _clean_extent(pool, need, self.headroom)
        for extra in (self.headroom, 0) if start is None and pool.evictable else ():
            start = _evicting_extent(pool, need + extra)
            if start is not None:
                _clear_row(pool, start, start + need + extra, taken)
                break
        return start


def _clean_extent(pool: FreeBlocks, n: int, gap: int = 0) -> int | None:
    """The first block of the lowest `n` clean blocks in a row that follow `gap` more clean blocks
    after the block before them (none at block 0, which has nothing before it); else of the lowest
    `n` in a row; None if there are none. (One walk over the clean blocks, sorted, once per new
    run: this module stays free of numpy and torch.)"""
    first, last, plain = 0, -2, None
    for b in sorted(pool.clean):
        if b != last + 1:
            first = b  # a row of clean blocks starts here
        last = b
        if plain is None and b - first + 1 == n:
            plain = first
        lead = gap if first else 0
        if b - first + 1 == lead + n:
            return first + lead
    return plain


def _evicting_extent(pool: FreeBlocks, n: int) -> int | None:
    """Where `n` free blocks in a row open up if cached blocks are evicted least recently freed
    first, as plain LRU would, but only until such a row exists: the first block of that row (the
    cached blocks in it are the ones to evict, none fresher than the last one taken); None if the
    free blocks never lie `n` in a row. Rows of free blocks are kept as intervals, merged as each
    block joins: O(clean + evicted) per new run."""
    end_of: dict[int, int] = {}  # first block of a row of free blocks -> its last
    start_of: dict[int, int] = {}  # and back
    for b in itertools.chain(pool.clean, pool.evictable):  # the clean ones first: they cost nothing
        lo = start_of.pop(b - 1, b)
        hi = end_of.pop(b + 1, b)
        end_of.pop(lo, None)
        start_of.pop(hi, None)
        end_of[lo], start_of[hi] = hi, lo
        if hi - lo + 1 >= n:
            return max(lo, b - n + 1)  # a row through b: it was the freshest block to go
    return None


def _clear_row(pool: FreeBlocks, lo: int, hi: int, taken: int) -> None:
    """Blocks [lo, hi) made clean (their cached content evicted) for a run taking the first
    `taken` now and growing into the rest: those go to the bottom of the clean stack, so that
    other runs take them last."""
    for b in range(lo, hi):
        if pool.hash_of[b] is not None:
            pool.drop(b)
    pool.bury(range(lo + taken, hi))


def _spare(pool: FreeBlocks, b: int, last: bytes | None) -> bool:
    """Whether free block `b` may go to a run whose last block's content hashes to `last`; if so
    it is made clean. Clean blocks may; a cached one only if it continues the very same prefix
    (its parent is `last`) or is unreachable (its parent's content is gone)."""
    if pool.ref[b]:
        return False
    if pool.hash_of[b] is None:
        return True
    parent = pool.parent_of[b]
    if parent is None or (parent != last and parent in pool.cached):
        return False
    pool.drop(b)
    return True
