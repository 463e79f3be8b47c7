"""State survives a restart; partial chunks are found by prefix and superseded as contexts grow."""
import pytest
import torch

from kvtier.store import TieredStore
from kvtier.store.keys import lead_key

from store_testlib import make_state, tokens


def test_restart_finds_every_chunk(tmp_path, ns):
    spec = f"memory:1MB,disk:{tmp_path}/a:10MB,disk:{tmp_path}/b:10MB"
    contexts = {i: tokens(37 + 11 * i, seed=i) for i in range(4)}
    states = {i: make_state(len(t), seed=i) for i, t in contexts.items()}
    with TieredStore.open(spec, ns, chunk_tokens=16) as store:
        for i, t in contexts.items():
            k, v, _ = states[i]
            store.save(t, 0, k, v, None)
    # striped round-robin by chunk position over both directories
    assert any((tmp_path / "a").rglob("*.kvc")) and any((tmp_path / "b").rglob("*.kvc"))
    with TieredStore.open(spec, ns, chunk_tokens=16) as store:
        for i, t in contexts.items():
            m = store.lookup(t + [7, 7, 7])
            assert m.num_tokens == len(t)
            assert all(c.tier == "disk" for c in m.chunks)
            for c in m.chunks:
                got = store.read_chunk(c)
                assert torch.equal(got[2].v, states[i][1][2, c.start:c.end])
        store.flush()
        assert store.stats()["store"]["promotions"] > 0
        assert store.lookup(contexts[0]).chunks[0].tier == "memory"  # promoted on hit


@pytest.mark.parametrize("where", ["disk", "redis_url", "redis_cluster_url"])
def test_chat_turns_unaligned_saves_and_supersede(tmp_path, ns, where, request):
    """A context saved at 20 tokens, then grown to 45 with a save starting mid-chunk."""
    t = tokens(45)
    k, v, _ = make_state(45)
    spec = f"disk:{tmp_path}:10MB" if where == "disk" else request.getfixturevalue(where)
    tier = spec.split(":")[0].split("+")[0]
    with TieredStore.open(spec, ns, chunk_tokens=16) as store:
        store.save(t[:20], 0, k[:, :20], v[:, :20], None)
        store.flush()
        assert store.lookup(t).num_tokens == 20  # the partial chunk [16, 20) is found
        store.save(t, 20, k[:, 20:], v[:, 20:], None)
        store.flush()
        m = store.lookup(t)
        assert [(c.start, c.end) for c in m.chunks] == [(0, 16), (16, 32), (32, 45)]
        for c in m.chunks:
            assert torch.equal(store.read_chunk(c)[0].k, k[0, c.start:c.end])
        # the partial [16, 20) was superseded by the full chunk and deleted
        assert store.stats()["store"]["partials_superseded"] == 1
        assert sorted(store.tier(tier).iterate()) == sorted(c.key for c in m.chunks)
        # A query that stops inside the old partial finds only the full chunks before it.
        assert store.lookup(t[:18]).num_tokens == 16


def test_unaligned_save_without_stored_prefix_skips_only_that_chunk(tmp_path, ns):
    t = tokens(40)
    k, v, _ = make_state(40)
    with TieredStore.open("memory:1MB", ns, chunk_tokens=16) as store:
        store.save(t, 20, k[:, 20:], v[:, 20:], None)  # nothing stored for [0, 20)
        store.flush()
        assert store.lookup(t).num_tokens == 0
        assert store.stats()["store"]["chunks_skipped"] == 1
        store.save(t[:16], 0, k[:, :16], v[:, :16], None)
        store.flush()
        # chunk [32, 40) was written from the first save; [16, 32) is still missing
        assert store.lookup(t).num_tokens == 16


def test_branching_contexts_share_a_prefix(ns):
    base = tokens(16)
    a, b = base + [1, 2, 3], base + [4, 5]
    k, v, _ = make_state(19)
    with TieredStore.open("memory:1MB", ns, chunk_tokens=16) as store:
        store.save(a, 0, k, v, None)
        store.save(b, 16, k[:, 16:18], v[:, 16:18], None)
        store.flush()
        assert store.lookup(a).num_tokens == 19
        assert store.lookup(b).num_tokens == 18
        assert store.lookup(base + [1, 2]).num_tokens == 16  # partial longer than the query


def test_other_namespace_never_matches(tmp_path, ns):
    from store_testlib import make_ns
    t = tokens(16)
    k, v, _ = make_state(16)
    with TieredStore.open(f"disk:{tmp_path}:10MB", ns, chunk_tokens=16) as store:
        store.save(t, 0, k, v, None)
    with TieredStore.open(f"disk:{tmp_path}:10MB", make_ns(storage="float16"), chunk_tokens=16) as s2:
        assert s2.lookup(t).num_tokens == 0


@pytest.mark.parametrize("where", ["memory", "disk", "redis_url"])
def test_a_chunk_is_reused_in_part_where_the_query_stops_or_parts_inside_it(tmp_path, ns, where, request):
    """Found through its parent and prefix digests (after a restart, for disk), restored up to the
    last 16-token step that matches, and the base of a save that starts inside it."""
    t = tokens(200)
    k, v, _ = make_state(200)
    spec = {"memory": "memory:4MB", "disk": f"disk:{tmp_path}:10MB"}.get(where) or request.getfixturevalue(where)
    q = t[:100] + tokens(60, seed=9)  # parts from t at 100, inside the chunk [64, 128)
    qk, qv, _ = make_state(160, seed=9)
    with TieredStore.open(spec, ns, chunk_tokens=64) as store:
        store.save(t, 0, k, v, None)
        for seed in range(5):  # siblings: they share [0, 64) and part at once
            store.save(t[:64] + tokens(50, seed=20 + seed), 64, k[:, 64:114], v[:, 64:114], None)
        store.flush()
        if where == "disk":
            store.close()
            store = TieredStore.open(spec, ns, chunk_tokens=64)
        assert store.lookup(t[:150]).num_tokens == 144  # stops inside [128, 192)
        # Under [0, 64) one listing gives the chunk that begins as q goes on, not its 5 siblings.
        first = store.lookup(t[:64]).chunks[0].key
        tier = store.tiers[0]
        assert [c.key for c in tier.children(first, lead_key(first, q[64:]))] == [store.keys_for(t)[1]]
        m = store.lookup(q)
        assert m.num_tokens == 96 and [(c.start, c.end) for c in m.chunks] == [(0, 64), (64, 128)]
        assert torch.equal(store.read_chunk(m.chunks[1])[1].k, k[1, 64:128])
        assert store.lookup(t[:70]).num_tokens == 64  # fewer than 16 tokens inside: nothing more
        # A save of q from 96 takes [64, 96) from the chunk it reused in part.
        store.save(q, 96, qk[:, 96:], qv[:, 96:], None)
        store.flush()
        m = store.lookup(q)
        assert m.num_tokens == 160 and store.stats()["store"]["chunks_skipped"] == 0
        got = store.read_chunk(m.chunks[1])[0].k
        assert torch.equal(got[:32], k[0, 64:96]) and torch.equal(got[32:], qk[0, 96:128])
        assert store.lookup(t).num_tokens == 200  # the original is still whole
        store.close()


def test_prefix_digests_that_do_not_fit_the_chunk_are_a_miss(ns):
    from dataclasses import replace

    from kvtier.store import validate
    from kvtier.store.format import FormatError
    t = tokens(64)
    k, v, _ = make_state(64)
    with TieredStore.open("memory:4MB", ns, chunk_tokens=64) as store:
        store.save(t, 0, k, v, None)
        store.flush()
        key = store.lookup(t).chunks[0].key
        h = store.memory.header(key)
        assert len(h.prefix) == 3  # at 16, 32, 48 tokens
        exp = store._expect(key, (0, 64))
        for bad in (h.prefix[:2], h.prefix[:2] + ("zz" * 16,)):
            with pytest.raises(FormatError):
                validate.check(replace(h, prefix=bad), exp, h.total_bytes)
