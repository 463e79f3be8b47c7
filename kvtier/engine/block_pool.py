"""Accounting for the paged device KV pool: block ids, ref counts and the device prefix cache.

Pure bookkeeping (ints and hashes); the tensors live in the runner. A full block whose tokens
are computed is registered under the chained hash of its tokens; when its last user frees it, it
stays cached until the space is needed. Allocation takes free blocks without cached content first,
most recently freed first (their pages are warm: the pool's host memory is mapped lazily, and a
never-touched block costs page faults), and evicts cached blocks least recently freed first only
when no clean block is left. Which blocks a run gets first is the pool's `Placement`
(placement.py: anywhere on a device, in rows on a CPU). `allocate` runs on the scheduler's
thread; `clearable`, which restores also call from their own thread, only reads.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtier.engine.placement import AnyBlocks, Placement


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
    def __init__(self, num_blocks: int, block_size: int, placement: Placement | None = None):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block; raise the memory budget")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.placement: Placement = placement or AnyBlocks()
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.parent_of: list[bytes | None] = [None] * num_blocks  # a cached block's parent's hash (None: a chain's first)
        self.cached: dict[bytes, int] = {}  # hash -> block holding those tokens
        # ref 0, no content: a stack (popitem takes the last in), from which a placement can also
        # take blocks out of order
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
        """`n` blocks for a run whose last block is `after` (None: a new run that will need `room`
        blocks): the placement's first, then the clean stack's top, then least recently freed."""
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        out = self.placement.place(self, n, after, room)
        for _ in range(n - len(out)):
            if self.clean:
                b, _ = self.clean.popitem()
            else:  # evict the least recently freed cached block
                b = next(iter(self.evictable))
                self.drop(b)
                del self.clean[b]
            out.append(b)
        for b in out:
            self.ref[b] = 1
        return out

    def take(self, blocks: Iterable[int]) -> None:
        """Clean blocks a placement hands to a run: out of the clean stack."""
        for b in blocks:
            del self.clean[b]

    def bury(self, blocks: Iterable[int]) -> None:
        """Clean blocks moved to the bottom of the clean stack, so that other runs take them last."""
        first = list(blocks)
        moved = set(first)
        self.clean = dict.fromkeys(itertools.chain(first, (b for b in self.clean if b not in moved)))

    def drop(self, b: int) -> None:
        """Cached block `b` (ref 0) made clean: its content forgotten."""
        h = self.hash_of[b]
        assert h is not None
        del self.evictable[b]
        del self.cached[h]
        self.hash_of[b] = self.parent_of[b] = None
        self.clean[b] = None

    def forget_free(self) -> int:
        """Every cached block no run holds made clean (its content forgotten) -> how many."""
        free = list(self.evictable)
        for b in free:
            self.drop(b)
        return len(free)

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
