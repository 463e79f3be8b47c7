"""The masked decode call of a dynamic (not graph-captured) GPU step: a batch of decoding tokens,
each over its own context padded to the step's width. Its query heads are regrouped so the call
has no grouped K/V heads; here against SDPA over each context alone, cut to its length."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.models.attention import masked_decode_sdpa


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (32, 8)], ids=["mha", "gqa3", "gqa4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_masked_decode_equals_attention_over_each_context(heads, kv_heads, dtype):
    g = torch.Generator().manual_seed(heads)
    lengths, width, hd = [1, 17, 96, 50, 33], 96, 64
    q = torch.randn(len(lengths), heads, hd, generator=g).to(dtype)
    k = torch.randn(len(lengths), kv_heads, width, hd, generator=g).to(dtype)
    v = torch.randn(len(lengths), kv_heads, width, hd, generator=g).to(dtype)
    for r, n in enumerate(lengths):  # past a context: large finite garbage, which the mask must hide
        k[r, :, n:], v[r, :, n:] = 1e4, -1e4
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None])[:, None, None, :]  # [n, 1, 1, width]
    got = masked_decode_sdpa(q, k, v, mask)
    assert got.shape == q.shape
    for r, n in enumerate(lengths):
        kr, vr = (x[r : r + 1, :, :n].float() for x in (k, v))  # [1, kv_heads, n, hd]
        want = F.scaled_dot_product_attention(q[r, None, :, None].float(), kr, vr, enable_gqa=heads != kv_heads)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got[r].float(), want[0, :, 0], rtol=tol, atol=tol)
