"""The CPU KV pool's host memory: the pages of a long context's worth of slots (what the first
requests get: the block pool hands out blocks from the first on) are mapped when the runner starts,
so a restarted engine's first restore does not take page faults under its reads; the rest of the
budget stays unmapped until used. Checked on the page table itself (/proc/self/pagemap)."""

from __future__ import annotations

import mmap
import os
import struct

import pytest
import torch

from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.store.staging import PAGE

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux page table only")


def _present(t: torch.Tensor) -> list[bool]:
    """Whether each page under contiguous `t` is in memory (bit 63 of its pagemap entry)."""
    first, last = t.data_ptr() // PAGE, (t.data_ptr() + t.nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        raw = f.read((last - first + 1) * 8)
    return [bool(e >> 63) for e in struct.unpack(f"<{len(raw) // 8}Q", raw)]


def test_the_first_requests_slots_are_mapped_at_start_and_the_rest_is_not(tiny_gqa):
    block, max_len, cfg = 16, 1024, tiny_gqa.config
    slot_bytes = cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    runner = ModelRunner(tiny_gqa.module, -(-(96 << 20) // (block * slot_bytes)), block, max_len)
    for cache in (runner.k_cache, runner.v_cache):  # [layers, slots, kv_heads, hd]
        for layer in cache:
            assert all(_present(layer[:max_len]))
    # Whether the tail stays unmapped depends on memory the runner was given untouched: the
    # allocator may hand it heap pages an earlier test used (a CI run did). So the pool is swapped
    # for fresh anonymous mappings, which have no page present, and faulted in as at start.
    maps = [mmap.mmap(-1, c.nbytes) for c in (runner.k_cache, runner.v_cache)]
    runner.k_cache, runner.v_cache = (torch.frombuffer(m, dtype=c.dtype).view(c.shape)
                                      for m, c in zip(maps, (runner.k_cache, runner.v_cache)))
    runner._fault_in(max_len)
    for cache in (runner.k_cache, runner.v_cache):
        for layer in cache:
            assert all(_present(layer[:max_len]))
            assert not any(_present(layer[max_len + 2 * PAGE:]))  # past the page the last slot shares
