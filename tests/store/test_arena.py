"""The memory tier's pinned arena (its allocator runs the same with pinning off, on a CPU-only machine):
first fit, coalescing, a bounded footprint, and no slot reused while a view of it is alive."""

from __future__ import annotations

import gc

import torch

from kvtier.store.arena import ALIGN, PinnedArena


def test_slots_come_back_only_when_no_view_is_alive_and_coalesce():
    arena = PinnedArena(40 << 20, pin=False, max_segment=1 << 20)  # 1 MiB segments, at most 40
    a, b, c = arena.take(300_000), arena.take(300_000), arena.take(300_000)
    a.fill_(1)
    view = a[10:20]  # a restore still holding part of an evicted chunk
    del a
    gc.collect()
    d = arena.take(300_000)  # must not land on a's bytes
    assert d.data_ptr() != view.data_ptr() - 10 and bool((view == 1).all())
    del view
    gc.collect()
    e = arena.take(300_000)  # a's slot is free now: first fit takes it
    assert e.data_ptr() == b.data_ptr() - (-(-300_000 // ALIGN) * ALIGN)
    del b, c, d, e
    gc.collect()
    st = arena.stats()
    assert st["idle_bytes"] == st["pinned_bytes"]  # everything coalesced back
    assert arena.take(1 << 20) is not None  # a whole segment fits again: no fragments left behind


def test_the_footprint_stays_within_5_percent_of_the_capacity():
    cap = 100 << 20
    arena = PinnedArena(cap, pin=False)
    held = []
    while (t := arena.take(100_000)) is not None:
        held.append(t)
    assert arena.pinned_bytes <= 1.05 * cap
    assert len(held) * 100_000 >= 0.95 * cap  # chunks much smaller than a segment: little left at segment ends
    assert arena.take(arena.segment_bytes + 1) is None and arena.stats()["fallbacks"] >= 2


def test_a_memory_tier_on_the_arena_round_trips_and_evicts_within_its_footprint():
    from kvtier.store import TieredStore

    from store_testlib import make_ns, make_state, tokens

    cap = 4 << 20
    with TieredStore.open(f"memory:{cap}", make_ns(), chunk_tokens=16) as store:
        tier = store.tiers[0]
        assert tier.arena is None  # a CPU engine's store pins nothing
        tier.arena = PinnedArena(cap, pin=False, max_segment=1 << 20)  # what pin=True builds, unpinned here
        for seed in range(12):  # far more than fits: evictions free arena slots for later chunks
            toks, (k, v, h) = tokens(64, seed), make_state(64, seed)
            store.save(toks, 0, k, v, h)
            store.flush()
            match = store.lookup(toks)
            assert match.num_tokens == 64
            for c in match.chunks:
                for s in store.read_chunk(c):
                    assert torch.equal(s.k, k[s.layer, c.start:c.end]) and torch.equal(s.v, v[s.layer, c.start:c.end])
        assert tier.used <= cap and tier.arena.pinned_bytes <= 1.05 * cap
        assert tier.usage()["pinned"]["fallbacks"] == 0
