"""`EngineStats`: what the engine hands the server, the benchmarks and the CLI about itself.

Plain values, built on the engine's thread or read from another (lengths and counters only), so
nothing outside the engine reads its scheduler, pool or store link.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (plain values, safe to keep and to read from another thread): what
    it did so far, and its queues, pool and store now."""

    steps: int
    preemptions: int
    prefix_cache_hits: int  # full blocks found in the device prefix cache
    counters: dict[str, int]  # restores, restore_failures, restored_tokens, saves, prefetches, ...
    reused_by_method: dict[str, int]  # restored prompt tokens by restore method
    reused_by_tier: dict[str, int]  # restored prompt tokens by the store tier they were read from
    layout: tuple[str, ...] = ()  # what the store keeps per layer ("kv", "hidden", "none"); () without a store
    stored_bytes_per_token: int = 0  # payload bytes one token's stored state takes (all layers)
    store: dict[str, Any] | None = None  # TieredStore.stats(): per-tier bytes, hits, writer queue
    partial: dict[str, float] | None = None  # partial token-wise caching's totals and latest step; None when off
    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued for admission
    restoring: int = 0  # requests whose prefix is being restored from the store
    kv_blocks_total: int = 0  # blocks of the device KV pool
    kv_blocks_free: int = 0  # free blocks (cached but unused ones count as free)
    block_size: int = 0  # tokens per block
    prefix_cache_queries: int = 0  # full blocks looked up in the device prefix cache
    tiers: tuple[str, ...] = ()  # the store's tiers, fastest first; () without a store

    @property
    def kv_usage(self) -> float:
        """Share of the device KV blocks in use, 0 to 1 (as vLLM's kv_cache_usage_perc)."""
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0
