"""The importance layout: probe keys in one read per chunk, verified granule reads of chosen tokens,
and exact readers unchanged by it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.store import TieredStore
from kvtier.store.selective import TokenReadMiss, TokenReads

from store_testlib import HEAD_DIM, KV_HEADS, LAYERS, make_ns, make_state, tokens

CHUNK, G = 16, 4


def _store(spec: str, storage: str = "", probe_first: tuple[int, ...] = ()) -> TieredStore:
    ns = dataclasses.replace(make_ns(storage), probe_kv_heads=1, granule_tokens=G, probe_first=probe_first)
    return TieredStore.open(spec, ns, chunk_tokens=CHUNK)


def _saved(store: TieredStore, n: int):
    ids = tokens(n)
    k, v, h = make_state(n)
    store.save(ids, 0, k, v, None)
    assert store.flush(30)
    match = store.lookup(ids)
    assert match.num_tokens == n
    return match, k, v


def test_importance_layout_has_its_own_keys():
    plain = make_ns()
    imp = dataclasses.replace(plain, probe_kv_heads=1, granule_tokens=G)
    assert plain.digest() != imp.digest()
    assert dataclasses.replace(plain, probe_kv_heads=0).digest() == plain.digest()  # plain keys unchanged
    assert imp.bytes_per_token() == plain.bytes_per_token() + LAYERS * HEAD_DIM * 4  # the probe keys again
    with pytest.raises(ValueError, match="probe_kv_heads"):
        dataclasses.replace(plain, probe_kv_heads=KV_HEADS + 1)
    with pytest.raises(ValueError, match="storage dtype"):
        dataclasses.replace(make_ns("int8"), granule_tokens=G)


def test_token_reads_return_exactly_the_stored_rows(spec):
    with _store(spec) as store:
        match, k, v = _saved(store, 3 * CHUNK)
        reads = TokenReads(store, match.chunks)
        try:
            probes = reads.probe_keys()
            assert reads.counts.calls == 3  # one ranged read per chunk for every layer's probe keys
            for li in range(LAYERS):
                assert torch.equal(probes[li], k[li, :, :1])
            pick = torch.tensor([0, 1, 5, 17, 18, 19, 20, 47])
            before = reads.counts.nbytes
            for li in range(LAYERS):
                assert torch.equal(reads.rows(li, "k", pick), k[li, pick])
                assert torch.equal(reads.rows(li, "v", pick), v[li, pick])
                assert torch.equal(reads.whole(li, "v"), v[li])
            # Granules touched per part: chunk 0 {0, 1}, chunk 1 {0, 1} (rows 1-4 of it), chunk 2 {3}.
            row = KV_HEADS * HEAD_DIM * 4
            assert reads.counts.nbytes - before == LAYERS * (2 * 5 * G * row + 3 * CHUNK * row)
        finally:
            reads.close()


def test_the_probe_keys_are_those_of_each_layers_chosen_kv_head(tmp_path):
    firsts = tuple((li + 1) % KV_HEADS for li in range(LAYERS))  # a different head from layer to layer
    with _store(f"disk:{tmp_path}/d:64MB", probe_first=firsts) as store:
        match, k, _ = _saved(store, CHUNK)
        reads = TokenReads(store, match.chunks)
        probes = reads.probe_keys()
        reads.close()
        assert all(torch.equal(probes[li], k[li, :, f : f + 1]) for li, f in enumerate(firsts))
    plain = dataclasses.replace(make_ns(), probe_kv_heads=1, granule_tokens=G)
    assert plain.probe_first == (0,) * LAYERS  # empty: the first head in every layer
    assert dataclasses.replace(plain, probe_first=(0,) * LAYERS).digest() == plain.digest()
    assert dataclasses.replace(plain, probe_first=firsts).digest() != plain.digest()
    with pytest.raises(ValueError, match="probe_first"):
        dataclasses.replace(plain, probe_first=(KV_HEADS,) * LAYERS)
    with pytest.raises(ValueError, match="probe_first has 1 entries"):
        dataclasses.replace(plain, probe_first=(1,))


def test_token_reads_of_bf16_storage_decode_to_the_compute_dtype(tmp_path):
    with _store(f"disk:{tmp_path}/d:64MB", storage="bfloat16") as store:
        match, k, _ = _saved(store, 2 * CHUNK)
        reads = TokenReads(store, match.chunks)
        got = reads.rows(2, "k", torch.tensor([3, 30]))
        reads.close()
        assert got.dtype == torch.float32
        assert torch.equal(got, k[2, [3, 30]].bfloat16().float())


def test_a_flipped_granule_is_a_miss_and_the_chunk_is_dropped(tmp_path):
    with _store(f"disk:{tmp_path}/d:64MB") as store:
        match, _, _ = _saved(store, 2 * CHUNK)
        chunk = match.chunks[1]
        reads = TokenReads(store, match.chunks)
        seg = reads.opened[1].header.by_part[(1, "v")]
        [path] = [p for p in (tmp_path / "d").rglob("*.kvc") if chunk.key in p.name]
        raw = bytearray(path.read_bytes())
        raw[seg.offset + 2 * G * KV_HEADS * HEAD_DIM * 4 + 3] ^= 0xFF  # inside granule 2
        path.write_bytes(bytes(raw))
        reads.rows(1, "v", torch.tensor([CHUNK + 1]))  # granule 0 is intact: read fine
        with pytest.raises(TokenReadMiss, match="granule 2"):
            reads.rows(1, "v", torch.tensor([CHUNK + 2 * G]))
        reads.close()
        assert store.tier("disk").counters["corrupt"] == 1
        assert store.lookup(tokens(2 * CHUNK)).num_tokens == CHUNK


def test_token_reads_refuse_the_plain_layout(tmp_path):
    with TieredStore.open(f"disk:{tmp_path}/d:64MB", make_ns(), chunk_tokens=CHUNK) as store:
        ids = tokens(CHUNK)
        k, v, _ = make_state(CHUNK)
        store.save(ids, 0, k, v, None)
        assert store.flush(30)
        with pytest.raises(ValueError, match="importance store layout"):
            TokenReads(store, store.lookup(ids).chunks)
