"""Every representation x storage dtype x tier round-trips; lossless dtypes bit for bit."""
import pytest
import torch

from kvtier.store import Repr, TieredStore

from store_testlib import make_ns, make_state, tokens

LAYOUTS = {
    "kv": (),
    "hidden": (Repr.HIDDEN,) * 4,
    "mixed": (Repr.KV, Repr.HIDDEN, Repr.NONE, Repr.KV),
}


def _expected(t: torch.Tensor, storage: str, compute: str) -> torch.Tensor:
    """What a lossless cast through the storage dtype gives back."""
    dt = getattr(torch, compute)
    return t.to(getattr(torch, storage)).to(dt) if storage != "int8" else t.to(dt)


def _check(states, k, v, h, reprs, lo, hi, storage, compute):
    for s in states:
        rep = reprs[s.layer]
        assert s.repr == rep
        for part, full in (("k", k), ("v", v), ("h", h)):
            got = getattr(s, part)
            if part not in rep.parts():
                assert got is None
                continue
            want = _expected(full[s.layer, lo:hi], storage, compute)
            assert got.dtype == getattr(torch, compute)
            if storage == "int8":
                # per-row absmax scaling: error at most half a quantisation step of the row max
                step = full[s.layer, lo:hi].abs().amax(-1, keepdim=True) / 127
                assert ((got.float() - want.float()).abs() <= step * 0.5 + 1e-6).all()
            else:
                assert torch.equal(got, want), (s.layer, part)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("storage", ["", "float16", "bfloat16", "int8"])
def test_roundtrip(spec, layout, storage):
    ns = make_ns(storage=storage, reprs=LAYOUTS[layout])
    toks = tokens(40)
    k, v, h = make_state(40)
    with TieredStore.open(spec, ns, chunk_tokens=16) as store:
        store.save(toks, 0, k, v, h)
        store.flush()
        match = store.lookup(toks)
        assert match.num_tokens == 40
        assert [(c.start, c.end) for c in match.chunks] == [(0, 16), (16, 32), (32, 40)]
        for c in match.chunks:
            states = store.read_chunk(c)
            assert len(states) == 4
            _check(states, k, v, h, ns.layer_reprs, c.start, c.end, ns.storage_dtype, "float32")
        # one layer range, and K without V
        c = match.chunks[1]
        states = store.read_layers(c, range(1, 4), parts=("k",))
        assert [s.layer for s in states] == [1, 2, 3]
        assert all(s.v is None and s.h is None for s in states)
        for s in states:
            if s.repr == Repr.KV:
                assert torch.equal(s.k, _expected(k[s.layer, 16:32], ns.storage_dtype, "float32")) \
                    or ns.storage_dtype == "int8"


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_half_compute_dtypes_are_exact(tmp_path, compute):
    ns = make_ns(compute=compute)
    toks = tokens(20)
    k, v, h = make_state(20, dtype=getattr(torch, compute))
    with TieredStore.open(f"disk:{tmp_path}:10MB", ns, chunk_tokens=8) as store:
        store.save(toks, 0, k, v, None)
        store.flush()
        got = store.read_chunk(store.lookup(toks).chunks[2])
        assert torch.equal(got[3].k, k[3, 16:20]) and got[3].k.dtype == getattr(torch, compute)


def test_kv_only_layer_rows_accepted(tmp_path, mixed_ns):
    """Tensors may hold all layers or only the layers of their representation."""
    toks = tokens(8)
    k, v, h = make_state(8)
    with TieredStore.open("memory:1MB", mixed_ns, chunk_tokens=8) as store:
        store.save(toks, 0, k[[0, 3]], v[[0, 3]], h[[1]])
        store.flush()
        got = store.read_chunk(store.lookup(toks).chunks[0])
        assert torch.equal(got[3].k, k[3]) and torch.equal(got[1].h, h[1])
        assert got[2].k is None and got[2].h is None


def test_bad_shapes_raise_on_caller_thread(ns):
    with TieredStore.open("memory:1MB", ns, chunk_tokens=8) as store:
        k, v, _ = make_state(8)
        with pytest.raises(ValueError, match="shape"):
            store.save(tokens(8), 0, k[:, :4], v, None)
        with pytest.raises(ValueError, match="None"):
            store.save(tokens(8), 0, k, None, None)
