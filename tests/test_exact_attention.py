"""Exact CPU attention at the kernel level (`kvtier/models/exact_attention.py`): a query's output bits
depend on its position, its query and the keys up to it, never on the call it ran in. The oracle is
the same function over the whole prompt in one call; every comparison is `torch.equal`. The engine
level (chunked prefill, cache hits, restores, batches) is tests/test_exact.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.models import exact_attention as X

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CTX = 1200  # three key blocks: positions with no whole-block part, one, and two


def inputs(dtype: torch.dtype, heads: int, kv_heads: int, hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(heads)
    q, k, v = (torch.randn(CTX, h, hd, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v


def decode_batch(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Each length's context gathered and zero-padded to the batch's width, as the runner does."""
    width = X.key_rows(max(lengths))
    kb = k.new_zeros(len(lengths), width, *k.shape[1:])
    vb = torch.zeros_like(kb)
    for r, n in enumerate(lengths):
        kb[r, :n], vb[r, :n] = k[:n], v[:n]
    return X.decode_padded(q[[n - 1 for n in lengths]], kb, vb, lengths)


def decode_in_place(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Each token's whole key blocks read in place (views of k/v, as the runner reads the pool),
    its piece gathered with garbage (finite) past its position."""
    splits = [X.split(n) for n in lengths]
    reach = max(keys for _, keys in splits)
    junk = torch.Generator().manual_seed(7)
    pk, pv = (torch.randn(len(lengths), reach, *k.shape[1:], generator=junk).to(k.dtype) for _ in range(2))
    for r, (n, (base, _)) in enumerate(zip(lengths, splits)):
        pk[r, : n - base], pv[r, : n - base] = k[base:n], v[base:n]
    wholes = [(k[:base], v[:base]) if base else None for base, _ in splits]
    return X.decode(q[[n - 1 for n in lengths]], (pk, pv), wholes, lengths)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 16)])
def test_a_querys_bits_do_not_depend_on_its_call(dtype, shape):
    q, k, v = inputs(dtype, *shape)
    whole = X.causal(q, k, v, 0)  # [CTX, heads, hd]
    for chunk in (37, 100, 512, 700):  # cut inside pieces, on them, across key blocks
        parts = [X.causal(q[a : a + chunk], k[: a + chunk], v[: a + chunk], a) for a in range(0, CTX, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    # One decoding token at a time (in place, and over a context padded past its end), at the
    # edges of pieces and key blocks.
    for p in (0, 5, 63, 64, 511, 512, 513, 1023, 1024, 1199):
        assert torch.equal(X.causal(q[p : p + 1], k[: p + 1], v[: p + 1], p), whole[p : p + 1]), p
        padded_k, padded_v = (F.pad(x[: p + 1], (0, 0, 0, 0, 0, 100)) for x in (k, v))
        assert torch.equal(X.causal(q[p : p + 1], padded_k, padded_v, p), whole[p : p + 1]), p
    # Batches of decodes: mixed key blocks (rows with no whole-block part beside rows with one or
    # two), shared and distinct piece lengths, and a batch of one.
    for lengths in ([1, 6, 64, 65, 512, 513, 514, 1024, 1025, 1200], [600, 1100], [1100, 1101], [700], [1025, 3]):
        for batch in (decode_batch, decode_in_place):
            out = batch(q, k, v, lengths)
            for r, n in enumerate(lengths):
                assert torch.equal(out[r], whole[n - 1]), (batch.__name__, lengths, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_is_as_accurate_as_one_pass(dtype):
    """Merging the whole-block part and the piece by their log-sum-exp (in fp32, rounded once) stays
    within the dtype's rounding of attention computed in fp64."""
    q, k, v = inputs(dtype, 9, 3, 64)
    want = F.scaled_dot_product_attention(*(x.double().transpose(0, 1)[None] for x in (q, k, v)),
                                          is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    err = (X.causal(q, k, v, 0).double() - want).abs()
    eps = torch.finfo(dtype).eps
    assert err.max() < 16 * eps and err.mean() < eps, (err.max(), err.mean())


def test_no_call_reads_more_than_a_piece_past_its_last_query(monkeypatch):
    """A continuation of 64 tokens after 1,024 reads 1,088 keys (whole blocks alone read 1,536):
    one unmasked call over the two whole blocks, one masked call over the 64-key piece."""
    calls = []
    kernel = X.FLASH_CPU

    def recording(q, k, v, *args, attn_mask=None):
        calls.append((k.shape[2], attn_mask is not None))
        return kernel(q, k, v, *args, attn_mask=attn_mask)

    monkeypatch.setattr(X, "FLASH_CPU", recording)
    q, k, v = inputs(torch.float32, 9, 3, 64)
    X.causal(q[1024:1088], k[:1088], v[:1088], 1024)
    assert sorted(calls) == [(64, True), (1024, False)]
    calls.clear()
    X.causal(q[1100:1101], k[:1101], v[:1101], 1100)  # one decode at 1100: its piece ends at 1152
    assert sorted(calls) == [(128, True), (1024, False)]


def test_a_decode_batch_wider_than_its_longest_context_is_refused():
    q, k, v = inputs(torch.float32, 4, 2, 16)
    with pytest.raises(ValueError, match="exact attention reads 128"):
        X.decode_padded(q[:1], k[None, :512], v[None, :512], [100])


def test_a_decode_without_its_whole_blocks_is_refused():
    q, k, v = inputs(torch.float32, 4, 2, 16)
    pieces = (k[None, 512:640], v[None, 512:640])
    with pytest.raises(ValueError, match="needs its 512 keys"):
        X.decode(q[:1], pieces, [None], [600])
    with pytest.raises(ValueError, match="needs its 512 keys"):
        X.decode(q[:1], pieces, [(k[:511], v[:511])], [600])
    with pytest.raises(ValueError, match="pieces of 127 keys; exact attention reads 128"):
        X.decode(q[:1], (k[None, 512:639], v[None, 512:639]), [(k[:512], v[:512])], [600])
