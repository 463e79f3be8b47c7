"""Accounting for the paged device KV pool: block ids, ref counts and the device prefix cache.

Pure bookkeeping (ints and hashes); the tensors live in the runner. A full block whose tokens
are computed is registered under the chained hash of its tokens; when its last user frees it, it
stays cached until the space is needed. Allocation takes free blocks without cached content first,
most recently freed first (their pages are warm: the pool's host memory is mapped lazily, and a
never-touched block costs page faults), and evicts cached blocks least recently freed first only
when no clean block is left.

With `keep_runs` (a CPU pool), a run that grows takes the blocks that follow its last one first,
while they are free: CPU attention reads a context whose slots are consecutive in place, and
gathers a scattered one into a copy on every layer of every step (a decode after a shared prefix
measured 20% slower at 8K). A free block that holds cached content is taken out of LRU order only
where that content is another continuation of the run's own prefix (the same tenant's: chains
start at the salt), or cannot be matched any more (its parent block's content is gone). A document
asked about again thus grows into the blocks its last question's answer had cached, and never
into another tenant's. The blocks that the run's attention may clear past its end (`reach` slots:
exact attention's key piece) are made clean by the same rule when it grows, so that `clearable`
finds them clean. A new run that will need `room` blocks starts at the lowest place where that
many clean blocks lie in a row (if there is one), so that its prompt's later chunks follow on, and
`headroom` clean blocks after whatever block lies before that place, so that a run there can go on
growing in place while it decodes (where no such place is left, without the headroom). Where
the clean blocks never lie that many in a row (a server whose pool has filled with cached
prefixes), cached blocks are evicted least recently freed first until a row of `room` and the
headroom opens, and only the ones inside it go: a long context in a full pool is still read in
place, and can grow in place. All
of this happens in `allocate`, on the scheduler's thread; `clearable`, which
restores also call from their own thread, only reads.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence


def chain_root(salt: str = "") -> bytes:
    """Parent of a chain's first block. A cache salt (the tenant, and a request's `cache_salt`)
    gives a chain of its own: requests with different salts never share a block."""
    # surrogatepass: a salt is any Python str (the engine API takes what it is given), never an error.
    return hashlib.blake2b(b"root\x00" + salt.encode("utf-8", "surrogatepass"), digest_size=16).digest() \
        if salt else b"root"


def chain_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Hash of a full block given its parent's hash: equal hashes mean equal whole prefixes."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(b",".join(str(t).encode() for t in tokens))
    return h.digest()


def block_hashes(tokens: Sequence[int], block_size: int, start: list[bytes] | None = None,
                 salt: str = "") -> list[bytes]:
    """Chained hashes of every full block of `tokens`, extending the already-known `start` list."""
    out = list(start or [])
    root = chain_root(salt)
    for i in range(len(out), len(tokens) // block_size):
        out.append(chain_hash(out[-1] if out else root, tokens[i * block_size : (i + 1) * block_size]))
    return out


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, keep_runs: bool = False, reach: int = 0,
                 headroom: int = 0):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block; raise the memory budget")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.keep_runs = keep_runs
        self.reach_blocks = -(-reach // block_size)  # blocks a run's attention may clear past its end
        self.headroom_blocks = -(-headroom // block_size)  # clean blocks a new run leaves to the run before it
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.parent_of: list[bytes | None] = [None] * num_blocks  # a cached block's parent's hash (None: a chain's first)
        self.cached: dict[bytes, int] = {}  # hash -> block holding those tokens
        # ref 0, no content: a stack (popitem takes the last in), from which a run's next block
        # can also be taken out of order
        self.clean: dict[int, None] = dict.fromkeys(range(num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, cached content: LRU first
        self.hits = 0
        self.queries = 0

    @property
    def num_free(self) -> int:
        return len(self.clean) + len(self.evictable)

    def match_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Take (ref++) the cached blocks for the longest prefix of `hashes`."""
        blocks: list[int] = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
        for b in blocks:
            self._take(b)
        self.queries += len(hashes)
        self.hits += len(blocks)
        return blocks

    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """`n` blocks; with `keep_runs`, those following block `after` (the run's last) first, while
        `_spare` lets the run have them; a new run (no `after`) that will need `room` blocks starts
        where that many clean blocks lie in a row, if any do (past the headroom of the run before
        them, where there is room for it), so that it can grow in place."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        out: list[int] = []
        if self.keep_runs:
            # (with headroom, a one-block run too: the stack's top may be another run's headroom)
            if after is None and (max(room, n) > 1 or self.headroom_blocks):
                start = self._clean_extent(max(room, n), self.headroom_blocks)
                for extra in (self.headroom_blocks, 0) if start is None and self.evictable else ():
                    # its own headroom after it here: the run's next turn or decode grows into it
                    start = self._evicting_extent(max(room, n) + extra)
                    if start is not None:
                        self._clear_row(start, start + max(room, n) + extra, n)
                        break
                if start is not None:
                    out = list(range(start, start + n))
                    for b in out:
                        del self.clean[b]
                    after = out[-1]
            if after is not None:
                b = after + 1
                while len(out) < n and b < self.num_blocks and self._spare(b, self.hash_of[after]):
                    del self.clean[b]
                    out.append(b)
                    b += 1
                if len(out) == n:  # the run ends at b - 1: past it, what its attention may clear made clean
                    for c in range(b, min(b + self.reach_blocks, self.num_blocks)):
                        if not self._spare(c, None):
                            break
        for _ in range(n - len(out)):
            if self.clean:
                b, _ = self.clean.popitem()
            else:  # evict the least recently freed cached block
                b = next(iter(self.evictable))
                self._drop(b)
                del self.clean[b]
            out.append(b)
        for b in out:
            self.ref[b] = 1
        return out

    def _clean_extent(self, n: int, gap: int = 0) -> int | None:
        """The first block of the lowest `n` clean blocks in a row that follow `gap` more clean
        blocks after the block before them (none at block 0, which has nothing before it); else of
        the lowest `n` in a row; None if there are none. (One walk over the clean blocks, sorted,
        once per new run: this module stays free of numpy and torch.)"""
        first, last, plain = 0, -2, None
        for b in sorted(self.clean):
            if b != last + 1:
                first = b  # a row of clean blocks starts here
            last = b
            if plain is None and b - first + 1 == n:
                plain = first
            lead = gap if first else 0
            if b - first + 1 == lead + n:
                return first + lead
        return plain

    def _evicting_extent(self, n: int) -> int | None:
        """Where `n` free blocks in a row open up if cached blocks are evicted least recently freed
        first, as plain LRU would, but only until such a row exists: the first block of that row
        (the cached blocks in it are the ones to evict, none fresher than the last one taken);
        None if the free blocks never lie `n` in a row. Rows of free blocks are kept as intervals,
        merged as each block joins: O(clean + evicted) per new run."""
        end_of: dict[int, int] = {}  # first block of a row of free blocks -> its last
        start_of: dict[int, int] = {}  # and back
        for b in itertools.chain(self.clean, self.evictable):  # the clean ones first: they cost nothing
            lo = start_of.pop(b - 1, b)
            hi = end_of.pop(b + 1, b)
            end_of.pop(lo, None)
            start_of.pop(hi, None)
            end_of[lo], start_of[hi] = hi, lo
            if hi - lo + 1 >= n:
                return max(lo, b - n + 1)  # a row through b: it was the freshest block to go
        return None

    def _clear_row(self, lo: int, hi: int, taken: int) -> None:
        """Blocks [lo, hi) made clean (their cached content evicted) for a run taking the first
        `taken` now and growing into the rest: those go to the bottom of the clean stack, so that
        other runs take them last."""
        for b in range(lo, hi):
            if self.hash_of[b] is not None:
                self._drop(b)
        later = range(lo + taken, hi)
        self.clean = dict.fromkeys(itertools.chain(later, (b for b in self.clean if not lo + taken <= b < hi)))

    def _spare(self, b: int, last: bytes | None) -> bool:
        """Whether free block `b` may go to a run whose last block's content hashes to `last`; if
        so it is made clean. Clean blocks may; a cached one only if it continues the very same
        prefix (its parent is `last`) or is unreachable (its parent's content is gone)."""
        if self.ref[b]:
            return False
        if self.hash_of[b] is None:
            return True
        parent = self.parent_of[b]
        if parent is None or (parent != last and parent in self.cached):
            return False
        self._drop(b)
        return True

    def _drop(self, b: int) -> None:
        """Cached block `b` (ref 0) made clean: its content forgotten."""
        h = self.hash_of[b]
        assert h is not None
        del self.evictable[b]
        del self.cached[h]
        self.hash_of[b] = self.parent_of[b] = None
        self.clean[b] = None

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. Freed in reverse so a prefix outlives its tail."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} freed twice"
            if self.ref[b] == 0:
                if self.hash_of[b] is None:
                    self.clean[b] = None
                else:
                    self.evictable[b] = None

    def share(self, blocks: Sequence[int]) -> None:
        """One more reference to each of these blocks (in use already): a forked sequence's prompt."""
        for b in blocks:
            assert self.ref[b] > 0, f"block {b} is not in use"
            self.ref[b] += 1

    def clearable(self, owner: Sequence[int], lo: int, hi: int, clean: bool = True) -> bool:
        """Whether pool slots [lo, hi), just past the end of the context of the run holding blocks
        `owner`, may be zeroed for one step: every block they touch is the run's own and held by it
        alone (its slots past the context are not written yet), or, where `clean`, clean (held by
        no one, no cached content). Exact CPU attention then reads the context in place
        (`ModelRunner.clearable`). A run computed off the scheduler's thread asks without `clean`:
        the scheduler may hand a clean block out while that run zeroes it."""
        bs, own = self.block_size, set(owner)
        for b in range(lo // bs, -(-hi // bs)):
            mine = b in own
            if b >= self.num_blocks or self.ref[b] != (1 if mine else 0) or \
                    (not mine and (not clean or self.hash_of[b])):
                return False
        return True

    def register(self, block: int, h: bytes, parent: bytes | None = None) -> None:
        """Publish a full, computed block under its chained hash (first writer wins); `parent`: the
        hash of the block before it in its chain (None for a chain's first)."""
        if h not in self.cached and self.hash_of[block] is None:
            self.cached[h] = block
            self.hash_of[block] = h
            self.parent_of[block] = parent

    def _take(self, b: int) -> None:
        if self.ref[b] == 0:  # only cached blocks are matched, so it sits in `evictable`
            del self.evictable[b]
        self.ref[b] += 1
