"""Paged attention reading the KV pool in place: FlexAttention with a block mask over the page table.

The pool of a layer is [slots, kv_heads, hd], slot = block * block_size + offset. Run r's logical
page j is pool block table[r, j]; its queries sit at positions starts[r] + i and attend to the
logical positions at or before their own and before lengths[r]. Nothing is gathered: the block
mask lists each run's pages (so the kernel visits only those), and the mask function maps a
physical key slot back to its logical position through a [runs, pool blocks] table built on the
device (attention-gym's and vLLM's FlexAttention backends do the same), so every shape is fixed
by the pool and the batch, never by the contexts: what a CUDA graph needs.

Compiled (`torch.compile`, Triton on a GPU) it is a fused kernel; eager (the CPU here, and the
tests) it materialises the scores over the whole pool, so it is for small pools only. The engine
uses it on CUDA (the static decode step); the CPU keeps its exact kernels (models/attention.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 128  # query rows per block of the mask (FlexAttention's default tile)


@dataclass(frozen=True)
class PageTable:
    """Where each run's context is in the pool (tensors on the pool's device)."""

    table: torch.Tensor  # [runs, pages] long: logical page -> pool block; past a run's pages, `pad_block`
    starts: torch.Tensor  # [runs] long: the position of each run's first query
    lengths: torch.Tensor  # [runs] long: each run's context length, its queries included
    pad_block: int  # a block no run owns (the runner's sink): the table's padding points there


def block_mask(pages: PageTable, queries: int, block_size: int, pool_blocks: int) -> BlockMask:
    """The mask of `queries` query rows per run over a pool of `pool_blocks` blocks."""
    runs, width = pages.table.shape
    dev = pages.table.device
    q_blocks = -(-queries // Q_BLOCK)
    # Logical page of each pool block, per run (-1: not the run's). Padding entries all point at
    # pad_block with logical indices past the run's pages, so whichever lands, it is masked.
    logical = torch.full((runs, pool_blocks), -1, dtype=torch.int32, device=dev)
    logical.scatter_(1, pages.table, torch.arange(width, dtype=torch.int32, device=dev).expand(runs, width))
    # Each query block visits the pages up to its last query (causal), the run's pages at most.
    last = torch.clamp((torch.arange(q_blocks, device=dev) + 1) * Q_BLOCK, max=queries)  # [q_blocks]
    upto = torch.minimum(pages.starts[:, None] + last[None, :], pages.lengths[:, None])  # [runs, q_blocks]
    kv_num = (-(-upto // block_size)).to(torch.int32)[:, None]  # [runs, 1, q_blocks]
    # The kernel's indices span the whole key sequence (the pool): the table, then padding.
    kv_idx = torch.full((runs, pool_blocks), pages.pad_block, dtype=torch.int32, device=dev)
    kv_idx[:, :width] = pages.table
    kv_idx = kv_idx[:, None, None, :].expand(runs, 1, q_blocks, pool_blocks)
    starts, lengths = pages.starts, pages.lengths

    def mask_mod(b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        page = logical[b, kv // block_size]
        pos = page * block_size + kv % block_size
        return (page >= 0) & (pos <= starts[b] + qi) & (pos < lengths[b])

    return BlockMask.from_kv_blocks(kv_num, kv_idx.contiguous(), BLOCK_SIZE=(Q_BLOCK, block_size),
                                    mask_mod=mask_mod, seq_lengths=(queries, pool_blocks * block_size),
                                    compute_q_blocks=False)


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pages: PageTable,
                    block_size: int, compiled: bool = False) -> torch.Tensor:
    """q [runs, queries, heads, hd] (RoPE applied; rows past a run's queries are computed and
    meaningless), k_pool/v_pool [slots, kv_heads, hd] with slots a whole number of blocks ->
    [runs, queries, heads, hd]. Grouped K/V heads are read as they are (no repeat)."""
    runs, queries, heads, _ = q.shape
    slots, kv_heads, _ = k_pool.shape
    mask = block_mask(pages, queries, block_size, slots // block_size)
    k = k_pool.transpose(0, 1)[None].expand(runs, kv_heads, slots, -1)  # [runs, kv_heads, slots, hd], no copy
    v = v_pool.transpose(0, 1)[None].expand(runs, kv_heads, slots, -1)
    attend = cast("Callable[..., Any]", _compiled() if compiled else flex_attention)
    # The Triton kernel's KV tile must divide the page: small pages need a small tile.
    opts = {"BLOCK_N": block_size} if q.is_cuda and block_size < 64 else None
    out = attend(q.transpose(1, 2), k, v, block_mask=mask, enable_gqa=heads != kv_heads,
                 kernel_options=opts)  # [runs, heads, queries, hd]
    return out.transpose(1, 2)


@functools.cache
def _compiled() -> object:
    # One compiled kernel per shape (a decode bucket's); the pool's shape never changes.
    return torch.compile(flex_attention, dynamic=False)
