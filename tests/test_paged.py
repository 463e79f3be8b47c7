"""Paged FlexAttention reading the pool in place (models/paged.py) against SDPA on the same K/V
gathered out of the pool: grouped and multi-head, 16- and 128-token pages, ragged batches of
decodes and of chunks continuing a history, pages scattered through the pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtier.models.paged import PageTable, paged_attention


def _case(heads: int, kv_heads: int, bs: int, lengths: list[int], queries: list[int], seed: int = 0):
    """A random pool, each run's pages at random free blocks, and its gathered reference."""
    g = torch.Generator().manual_seed(seed)
    hd = 32
    pages = [-(-n // bs) for n in lengths]
    blocks = sum(pages) + 3  # a few blocks no run owns; the last is the padding target
    k_pool = torch.randn(blocks * bs, kv_heads, hd, generator=g)
    v_pool = torch.randn(blocks * bs, kv_heads, hd, generator=g)
    order = torch.randperm(blocks - 1, generator=g).tolist()
    width = max(pages)
    table = torch.full((len(lengths), width), blocks - 1, dtype=torch.long)
    at = 0
    for r, p in enumerate(pages):
        table[r, :p] = torch.tensor(order[at : at + p])
        at += p
    q = torch.randn(len(lengths), max(queries), heads, hd, generator=g)
    starts = torch.tensor([n - m for n, m in zip(lengths, queries)])
    pt = PageTable(table, starts, torch.tensor(lengths), pad_block=blocks - 1)
    return q, k_pool, v_pool, pt


def _reference(q, k_pool, v_pool, pt: PageTable, bs: int, queries: list[int]) -> list[torch.Tensor]:
    outs = []
    for r, m in enumerate(queries):
        n = int(pt.lengths[r])
        slots = (pt.table[r, :, None] * bs + torch.arange(bs, device=q.device)).flatten()[:n]
        k, v = (x.index_select(0, slots).transpose(0, 1)[None] for x in (k_pool, v_pool))  # [1, kvh, n, hd]
        qh = q[r, :m].transpose(0, 1)[None]  # [1, heads, m, hd]
        at = torch.arange(n, device=q.device)
        mask = at[None, :] <= (n - m + at[:m])[:, None]  # causal, bottom-right
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=q.shape[2] != k.shape[1])
        outs.append(out[0].transpose(0, 1))  # [m, heads, hd]
    return outs


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("bs", [16, 128])
def test_paged_decode_equals_sdpa_on_gathered_kv(heads: int, kv_heads: int, bs: int):
    lengths = [1, 17, bs, bs + 1, 3 * bs - 5, 200]  # ragged: one token, page edges, several pages
    queries = [1] * len(lengths)
    q, k_pool, v_pool, pt = _case(heads, kv_heads, bs, lengths, queries)
    got = paged_attention(q, k_pool, v_pool, pt, bs)
    for r, want in enumerate(_reference(q, k_pool, v_pool, pt, bs, queries)):
        torch.testing.assert_close(got[r, :1], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("bs", [16, 128])
def test_paged_chunks_continuing_histories_equal_sdpa(heads: int, kv_heads: int, bs: int):
    # (context length, new queries at its end): a fresh prompt, chunks on histories, one over a
    # query block of the mask (128 rows), and a decode in the same batch.
    lengths, queries = [40, 300, 150, 90, 77], [40, 37, 140, 5, 1]
    q, k_pool, v_pool, pt = _case(heads, kv_heads, bs, lengths, queries, seed=1)
    got = paged_attention(q, k_pool, v_pool, pt, bs)
    for r, want in enumerate(_reference(q, k_pool, v_pool, pt, bs, queries)):
        torch.testing.assert_close(got[r, : queries[r]], want, rtol=1e-5, atol=1e-5)


def test_paged_attention_never_reads_another_runs_pages():
    """Poisoning every slot a run does not own (NaN would spread through any read of it: the
    eager kernel reads the whole pool, weighted 0) must not change its output, here where it
    lives only in blocks owned by the other runs."""
    bs = 16
    lengths, queries = [33, 64, 20], [1, 1, 1]
    q, k_pool, v_pool, pt = _case(6, 2, bs, lengths, queries, seed=2)
    before = paged_attention(q, k_pool, v_pool, pt, bs)
    k2, v2 = k_pool.clone(), v_pool.clone()
    other = pt.table[1, :4]  # run 1's blocks: changing them must leave runs 0 and 2 as they were
    for b in other.tolist():
        k2[b * bs : (b + 1) * bs] = 1e4
        v2[b * bs : (b + 1) * bs] = -1e4
    after = paged_attention(q, k2, v2, pt, bs)
    assert torch.equal(before[0], after[0]) and torch.equal(before[2], after[2])
    assert not torch.equal(before[1], after[1])
