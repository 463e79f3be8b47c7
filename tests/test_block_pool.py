"""Exact accounting of the device block pool: ids, ref counts, prefix cache and LRU reuse."""

import pytest

from kvtier.engine.block_pool import BlockPool, OutOfBlocks, block_hashes
from kvtier.engine.placement import KeepRuns


def test_allocate_release_and_lru_reuse_order():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert (a, b) == ([0, 1], [2, 3]) and pool.num_free == 0
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.release(b)  # freed tail first: 3 then 2
    pool.release(a)  # then 1, 0
    assert list(pool.clean) == [3, 2, 1, 0] and pool.num_free == 4
    assert pool.allocate(3) == [0, 1, 2]  # most recently freed (warm) first


def test_prefix_cache_match_refcount_and_eviction():
    pool = BlockPool(4, 2)
    toks = [5, 6, 7, 8, 9]
    hs = block_hashes(toks, 2)
    assert len(hs) == 2 and block_hashes(toks[:4], 2) == hs
    blocks = pool.allocate(3)
    pool.register(blocks[0], hs[0])
    pool.register(blocks[1], hs[1])
    assert pool.match_prefix(hs) == [0, 1] and pool.ref[:2] == [2, 2]
    pool.release(blocks)
    pool.release([0, 1])
    assert pool.match_prefix(block_hashes([5, 6, 1, 1], 2)) == [0]  # diverges at block 1
    pool.release([0])
    # Clean blocks first (2 was freed last, then the never-used 3), then the least recently freed
    # cached block (1): allocating 3 evicts block 1's content and keeps block 0's.
    assert list(pool.clean) == [3, 2] and list(pool.evictable) == [1, 0]
    assert pool.allocate(3) == [2, 3, 1]
    assert hs[1] not in pool.cached and pool.match_prefix(hs) == [0]


def test_register_first_writer_wins():
    pool = BlockPool(2, 2)
    h = block_hashes([1, 2], 2)[0]
    x, y = pool.allocate(2)
    pool.register(x, h)
    pool.register(y, h)
    assert pool.cached[h] == x and pool.hash_of[y] is None


def test_only_a_runs_own_unreached_slots_and_clean_blocks_are_clearable():
    """What exact CPU attention may zero past a context to read it in place (test_context_in_place.py)."""
    pool = BlockPool(8, 16)
    mine, other = pool.allocate(3), pool.allocate(1)  # blocks 0-2 (my context ends at slot 40), 3
    assert pool.clearable(mine, 40, 48)  # the rest of my last block: no token of mine there yet
    assert not pool.clearable(mine, 40, 64)  # into another request's block
    assert pool.clearable(mine, 64, 128)  # clean blocks, up to the pool's end
    assert pool.clearable(mine, 40, 48, clean=False) and not pool.clearable(mine, 64, 128, clean=False)  # off-thread
    assert not pool.clearable(mine, 64, 129)  # past the blocks: the sink, which placements write
    pool.register(3, b"h")
    pool.release(other)  # free, but its content is kept for a prefix hit
    assert 3 in pool.evictable and not pool.clearable(mine, 40, 64)
    pool.share(mine)  # a forked sequence holds my blocks too
    assert not pool.clearable(mine, 40, 48)


def test_a_cpu_run_grows_into_the_free_blocks_after_its_last_one():
    """KeepRuns: a run's next blocks follow its last one while they are clean, or cached with
    content that continues the run's own prefix or that no prefix can reach any more; then the
    stack's order. Another chain's cached block (another tenant's) is never taken out of order."""
    pool = BlockPool(10, 2, KeepRuns(2))
    doc = pool.allocate(2)  # [0, 1]: a document, cached
    pool.register(0, b"d0")
    pool.register(1, b"d1", b"d0")
    sib = pool.allocate(2)  # [2, 3]: its first question's answer, cached when it ends
    pool.register(2, b"s2", b"d1")
    pool.register(3, b"s3", b"s2")
    other = pool.allocate(2)  # [4, 5]: another chain (a tenant's own root), cached
    pool.register(4, b"o4")
    pool.register(5, b"o5", b"o4")
    pool.release(sib)
    pool.release(other)
    assert pool.allocate(3, after=doc[-1]) == [2, 3, 6]  # the sibling, then its unreachable child; 4 is not ours
    assert list(pool.cached) == [b"d0", b"d1", b"o4", b"o5"] and list(pool.clean) == [9, 8, 7]

def test_without_keeping_runs_the_stack_order_stands():
    pool = BlockPool(6, 2)
    doc = pool.allocate(2)
    pool.register(1, b"d1")
    sib = pool.allocate(2)
    pool.register(2, b"s2", b"d1")
    pool.release(sib)
    assert pool.allocate(2, after=doc[-1]) == [3, 4] and b"s2" in pool.cached


def test_a_cpu_run_that_grows_makes_clean_what_its_attention_may_clear_past_its_end():
    """reach: past a run's new last block, the blocks its attention may zero (a key piece of 64
    slots: 4 blocks of 16) are made clean where the run could have grown into them, so `clearable`
    (which only reads) finds them clean; the walk stops at the first it may not have."""
    pool = BlockPool(12, 16, KeepRuns(16, reach=64))
    doc = pool.allocate(2)  # [0, 1]
    pool.register(1, b"d1", b"d0")
    sib = pool.allocate(4)  # [2-5]: the document's last answer
    for b, (h, parent) in zip(sib, [(b"s2", b"d1"), (b"s3", b"s2"), (b"s4", b"s3"), (b"s5", b"s4")]):
        pool.register(b, h, parent)
    other = pool.allocate(1)  # [6]: another chain's, in use
    pool.release(sib)
    run = doc + pool.allocate(1, after=doc[-1])  # takes 2; 3, 4 and 5 (unreachable now) made clean
    assert run == [0, 1, 2] and set(pool.cached) == {b"d1"}
    assert pool.clearable(run, 40, 64) and pool.clearable(run, 48, 96)  # its own slots, then clean blocks
    assert not pool.clearable(run, 48, 112) and other == [6]  # block 6 is in use


def test_a_new_cpu_run_starts_where_its_whole_prompt_fits_in_a_row():
    """A prompt prefilled in chunks would otherwise start in whatever blocks the stack holds and
    soon have to grow elsewhere: its context could not be read in place."""
    pool = BlockPool(16, 2, KeepRuns(2))
    assert pool.allocate(2, room=2) == [0, 1]
    holes = [pool.allocate(1)[0] for _ in range(3)]  # single blocks: the stack's order
    assert holes == [2, 3, 4]
    pool.release(holes[:2])  # clean: 2, 3 (top of the stack) and 5-15
    first = pool.allocate(2, room=6)  # a 12-token prompt's first chunk of 4: not into 2 and 3
    assert first == [5, 6]
    assert pool.allocate(4, first[-1]) == [7, 8, 9, 10]  # its next chunk follows on
    assert pool.allocate(1, room=3) == [11]  # the next prompt: the lowest 3 clean in a row
    assert pool.allocate(1, room=5) == [2]  # no 5 in a row left: the stack's order
    plain = BlockPool(8, 2)  # not a CPU pool: the stack's order
    plain.allocate(1)
    plain.release([0])
    assert plain.allocate(2, room=4) == [0, 1]
    gpu_like = BlockPool(8, 2)
    gpu_like.allocate(2)
    gpu_like.release([0, 1])
    assert gpu_like.allocate(1, room=4) == [0]


def test_a_new_cpu_run_leaves_the_run_before_it_headroom_to_decode_into():
    """A run placed right after another would take the blocks that run's decode grows into: its
    context would then be scattered, and gathered on every layer of every step."""
    pool = BlockPool(20, 2, KeepRuns(2, headroom=8))  # 8 tokens: 4 blocks
    a = pool.allocate(3, room=3)
    assert a == [0, 1, 2]  # at block 0: nothing before it to leave room to
    b = pool.allocate(3, room=3)
    assert b == [7, 8, 9]  # 3-6 left to a
    assert pool.allocate(4, after=a[-1]) == [3, 4, 5, 6]  # a decodes 8 tokens in place
    assert pool.allocate(1, after=a[-1] + 4) == [10]  # then b's blocks stop it: the stack's top
    c = pool.allocate(4, room=4)  # 11-19 clean: 4 after b's headroom fit
    assert c == [15, 16, 17, 18]
    d = pool.allocate(2, room=2)  # 11-14 and 19: no 2 past 4 more, so without the headroom
    assert d == [11, 12]
    short = BlockPool(20, 2, KeepRuns(2, headroom=8))
    short.allocate(3, room=3)
    assert short.allocate(1) == [7]  # a one-block run too: the stack's top (3) is the headroom
    no_headroom = BlockPool(20, 2, KeepRuns(2))
    no_headroom.allocate(3, room=3)
    assert no_headroom.allocate(3, room=3) == [3, 4, 5]



def _cached_in_lru_order(pool: BlockPool, order: list[int], plain: tuple[int, ...] = ()) -> list[bytes]:
    """Every block of `pool` taken by one run and registered (but those in `plain`), then freed
    one by one in `order`: the registered ones least recently freed first, `plain` ones clean."""
    blocks = pool.allocate(pool.num_blocks)
    hs = block_hashes(list(range(pool.num_blocks * pool.block_size)), pool.block_size)
    for b in blocks:
        if b not in plain:
            pool.register(b, hs[b], hs[b - 1] if b else None)
    for b in order:
        pool.release([b])
    assert list(pool.evictable) == [b for b in order if b not in plain]
    return hs


def test_a_new_cpu_run_in_a_pool_full_of_cached_blocks_evicts_until_a_row_opens():
    """A server's pool fills with cached prefixes: no clean block is left. Plain LRU would hand a
    new run the least recently freed blocks wherever they lie (3 and 6), and its context would be
    gathered on every layer of every step. Evicting in the same order, but only until two free
    blocks lie in a row, gives 3 and 4: nothing fresher than 4 goes, and 6 and 1 keep their content."""
    pool = BlockPool(8, 1, KeepRuns(1))
    hs = _cached_in_lru_order(pool, [3, 6, 1, 4, 0, 7, 2, 5])
    assert pool.allocate(2, room=2) == [3, 4]
    assert hs[3] not in pool.cached and hs[4] not in pool.cached
    assert list(pool.evictable) == [6, 1, 0, 7, 2, 5] and all(hs[b] in pool.cached for b in pool.evictable)
    # with a block of headroom the row must be three long (0-2, once 2 goes): the run takes 0 and 1
    # and grows into 2; 3 and 4, evicted on the way but outside the row, keep their content
    pool = BlockPool(8, 1, KeepRuns(1, headroom=1))
    hs = _cached_in_lru_order(pool, [3, 6, 1, 4, 0, 7, 2, 5])
    assert pool.allocate(2, room=2) == [0, 1]
    assert list(pool.clean) == [2] and all(hs[b] in pool.cached for b in (3, 4, 5, 6, 7))
    assert pool.allocate(1, after=1) == [2]


def test_clean_blocks_join_a_row_first_and_cost_no_eviction():
    """Clean 1 and 5 and cached blocks freed in the order 7, 2, 0, 6, ...: 0, 1, 2 is the first row
    of three; 2 and 0 go, and 7, freed before them but outside the row, keeps its content."""
    pool = BlockPool(8, 1, KeepRuns(1))
    hs = _cached_in_lru_order(pool, [7, 1, 2, 5, 0, 6, 3, 4], plain=(1, 5))
    assert list(pool.clean) == [1, 5]
    assert pool.allocate(3, room=3) == [0, 1, 2]
    assert hs[7] in pool.cached and hs[0] not in pool.cached and hs[2] not in pool.cached
    assert list(pool.clean) == [5]


def test_where_no_row_can_open_the_run_takes_blocks_in_lru_order():
    pool = BlockPool(4, 1, KeepRuns(1))
    hs = block_hashes(list(range(4)), 1)
    for b, h in zip(pool.allocate(4), hs):
        pool.register(b, h)
    pool.release([2])
    pool.release([0])  # 1 and 3 stay in use: free blocks never lie two in a row
    assert pool.allocate(2, room=2) == [2, 0]
    assert set(pool.cached) == {hs[1], hs[3]}


def test_forget_free_cleans_the_cached_blocks_no_one_holds_and_keeps_those_in_use():
    pool = BlockPool(4, 2)
    hs = block_hashes([5, 6, 7, 8, 9, 10], 2)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, hs, strict=True):
        pool.register(b, h)
    pool.release(blocks[1:])  # blocks 1 and 2 free but cached; block 0 still held
    assert pool.forget_free() == 2
    assert list(pool.evictable) == [] and pool.hash_of == [hs[0], None, None, None]
    assert set(pool.clean) == {1, 2, 3} and pool.match_prefix(hs) == [0]  # the held block still hits
