"""Reordering stored chunks by importance (IMPRESS §4.4.1): the mapping list round trip, the order
and moving average on hand-made values, and every reader of a reordered chunk (exact ones and
token reads) getting exactly the stored tokens back, with fewer granules read for what was kept."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.store import TieredStore
from kvtier.store import format as fmt
from kvtier.store.reorder import ImportanceStats, importance_order, kept_masks
from kvtier.store.selective import TokenReads

from store_testlib import LAYERS, make_ns, make_state, tokens

CHUNK, G = 16, 4


def _store(spec: str) -> TieredStore:
    ns = dataclasses.replace(make_ns(), probe_kv_heads=1, granule_tokens=G)
    return TieredStore.open(spec, ns, chunk_tokens=CHUNK)


def test_the_papers_mapping_list_example_round_trips():
    # Stored rows [t0, t3, t1, t2]: the mapping list (row of each token) is [0, 2, 3, 1].
    ns = dataclasses.replace(make_ns(), probe_kv_heads=1, granule_tokens=2)
    k, v, _ = make_state(4)
    order = torch.tensor([[0, 3, 1, 2]] * LAYERS)
    layers = {li: {"k": k[li], "v": v[li]} for li in range(LAYERS)}
    packed = fmt.pack(ns, "d", "key", "root", 0, 0, False, layers, order)
    header = fmt.parse_header(packed.to_bytes())
    assert header.order is not None and header.order.tolist() == order.tolist()
    assert header.row_of is not None and header.row_of[0].tolist() == [0, 2, 3, 1]
    blob = torch.frombuffer(bytearray(packed.to_bytes()), dtype=torch.uint8)
    seg = header.by_part[(0, "k")]
    stored = blob[seg.offset:seg.offset + seg.nbytes].view(torch.float32).view(seg.shape)
    assert torch.equal(stored, k[0, [0, 3, 1, 2]])  # the payload really is in importance order
    data = {(s.layer, s.part): blob[s.offset:s.offset + s.nbytes] for s in header.segments}
    for st in fmt.decode_layers(header, data, range(LAYERS), ("k", "v")):
        assert torch.equal(st.k, k[st.layer]) and torch.equal(st.v, v[st.layer])  # token order again
    kp = header.by_part[(0, "kp")]  # probe keys stay in token order
    assert torch.equal(blob[kp.offset:kp.offset + kp.nbytes].view(torch.float32).view(kp.shape), k[0, :, :1])


def test_a_header_whose_order_is_not_a_permutation_is_malformed():
    ns = make_ns()
    k, v, _ = make_state(4)
    layers = {li: {"k": k[li], "v": v[li]} for li in range(LAYERS)}
    doc_order = torch.tensor([[0, 0, 1, 2]] * LAYERS)  # token 3 missing
    with pytest.raises(ValueError, match="permutation"):
        fmt.pack(ns, "d", "key", "root", 0, 0, False, layers, doc_order)


def test_importance_order_and_moving_average():
    stats = ImportanceStats(weight=0.5)
    stats.observe("a", torch.tensor([[1, 0, 0, 1]]))
    stats.observe("a", torch.tensor([[0, 0, 1, 1]]))  # ema [0.5, 0, 0.5, 1]
    stats.observe("b", torch.tensor([[0, 1, 0, 0]]))
    assert dict(stats.due(2)).keys() == {"a"}  # b seen once
    (key, order), = stats.due(2)
    assert order.tolist() == [[3, 0, 2, 1]]  # 1 first, then the two 0.5s in token order, then 0
    assert importance_order(torch.zeros(2, 3)).tolist() == [[0, 1, 2]] * 2  # nothing told apart: identity


def test_kept_masks_cut_each_layers_kept_tokens_per_chunk():
    kept = [torch.tensor([0, 5, 6]), torch.tensor([1, 7])]
    got = kept_masks(kept, [("a", 0, 4), ("b", 4, 8)])
    assert got["a"].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0]]
    assert got["b"].int().tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]


def _granules_read(store: TieredStore, match, pick: torch.Tensor, k, v) -> int:
    """K/V granules read for `pick` of every layer (checking the rows, and whole parts too)."""
    reads = TokenReads(store, match.chunks)
    try:
        for li in range(LAYERS):
            got = reads.rows_of(li, ("k", "v"), pick)
            assert torch.equal(got["k"], k[li, pick]) and torch.equal(got["v"], v[li, pick])
        granules = reads.counts.granules
        for li in range(LAYERS):
            assert torch.equal(reads.whole(li, "k"), k[li])
        return granules
    finally:
        reads.close()


def test_reordered_chunks_read_back_exactly_and_kept_tokens_share_granules(spec):
    n = 3 * CHUNK
    ids = tokens(n)
    k, v, _ = make_state(n)
    # Every fourth token is important (one per 4-token granule: token order reads every granule).
    pick = torch.arange(1, n, 4)
    with _store(spec) as store:
        store.save(ids, 0, k, v, None)
        assert store.flush(30)
        match = store.lookup(ids)
        before = _granules_read(store, match, pick, k, v)
        spans = [(c.key, c.start, c.end) for c in match.chunks]
        for _ in range(2):
            store.observe_kept(kept_masks([pick] * LAYERS, spans))
        report = store.reorder()
        assert (report.chunks, report.unchanged, report.missing) == (3, 0, 0)
        assert store.reorder().unchanged == 3  # a second pass finds nothing to do
        match = store.lookup(ids)
        after = _granules_read(store, match, pick, k, v)
        assert (before, after) == (3 * 4 * 2 * LAYERS, 3 * 1 * 2 * LAYERS)  # per chunk: 4 granules -> 1
        # Exact readers: whole chunks, and a restore's planned reads of layer groups (views of the
        # memory tier; the disk's staged reads, offered the pool as a direct target they must refuse).
        for c in match.chunks:
            states = store.read_chunk(c)
            assert states is not None
            for st in states:
                assert torch.equal(st.k, k[st.layer, c.start:c.end]) and torch.equal(st.v, v[st.layer, c.start:c.end])
        reads = store.planned_reads(match.chunks)
        assert reads.open()
        try:
            group = reads.read(range(LAYERS), ("k", "v"))
            assert group is not None
            for ci, c in enumerate(match.chunks):
                assert torch.equal(group.parts["k"][ci], k[:, c.start:c.end])
                assert torch.equal(group.parts["v"][ci], v[:, c.start:c.end])
        finally:
            reads.close()


def test_every_tier_holding_a_chunk_is_rewritten(tmp_path):
    ids = tokens(CHUNK)
    k, v, _ = make_state(CHUNK)
    with _store(f"memory:64MB,disk:{tmp_path}/d:64MB") as store:
        store.save(ids, 0, k, v, None)
        assert store.flush(30)
        (chunk,) = store.lookup(ids).chunks
        order = torch.arange(CHUNK).flip(0).expand(LAYERS, CHUNK).contiguous()
        assert store.rewrite(chunk.key, order) > 0
        for tier in store.tiers:
            oc = tier.open_chunk(store._expect(chunk.key))
            assert oc is not None and oc.header.order is not None and torch.equal(oc.header.order, order)
            oc.close()
        assert store.rewrite(chunk.key, order) == 0  # already so
        assert store.rewrite("0" * 32, order) == -1  # not held


def test_a_partial_chunk_is_never_reordered(tmp_path):
    n = CHUNK + 5
    ids = tokens(n)
    k, v, _ = make_state(n)
    with _store(f"disk:{tmp_path}/d:64MB") as store:
        store.save(ids, 0, k, v, None)
        assert store.flush(30)
        match = store.lookup(ids)
        spans = [(c.key, c.start, c.end) for c in match.chunks]
        for _ in range(2):
            store.observe_kept(kept_masks([torch.tensor([3, n - 1])] * LAYERS, spans))
        report = store.reorder()
        assert (report.chunks, report.missing) == (1, 1)  # the full chunk, not the partial one
