"""The importance restore outside the engine, for tests and benchmarks: a reduced cache that grows
as tokens are computed after it (`extend`), so a restore's result can be decoded on, or a
continuation scored teacher-forced, and an exact cache computed from nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.engine.impress.prefill import CompactKV
from kvtier.models.attention import causal_attention
from kvtier.models.config import ModelConfig
from kvtier.models.kernels import Kernels
from kvtier.models.llama import CausalLM, LayerAttention
from kvtier.models.rope import Rope


@dataclass
class ReducedCache:
    """One sequence's K/V per layer in compact slots: the kept prefix tokens of that layer (K rotated
    at their original positions), then every token computed since, at RoPE position slot + offset."""

    k: list[torch.Tensor]  # per layer [slots, kv_heads, hd]
    v: list[torch.Tensor]
    rope_offset: int

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @staticmethod
    def empty(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> ReducedCache:
        e = torch.empty(0, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)  # [0, kv_heads, hd]
        return ReducedCache([e] * cfg.num_layers, [e] * cfg.num_layers, 0)

    def copy(self) -> ReducedCache:
        """Another cache to extend, sharing the K/V computed so far."""
        return ReducedCache(list(self.k), list(self.v), self.rope_offset)

    @staticmethod
    def of(kv: CompactKV) -> ReducedCache:
        """A growable copy of a restore's compact K/V (the restore's own lists are left as they are)."""
        return ReducedCache(list(kv.k), list(kv.v), kv.rope_offset)


class _Appending(LayerAttention):
    """New rows attend to everything in the cache, their own K/V appended to it layer by layer."""

    def __init__(self, cache: ReducedCache, cos: torch.Tensor, sin: torch.Tensor, kernels: Kernels) -> None:
        self.cache, self.cos, self.sin, self.kernels = cache, cos, sin, kernels

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        c = self.cache
        start = c.k[li].shape[0]  # the new rows' first slot
        c.k[li] = torch.cat([c.k[li], k])  # [slots + n, kv_heads, hd]
        c.v[li] = torch.cat([c.v[li], v])
        return causal_attention(q, c.k[li], c.v[li], start, self.kernels)


@torch.inference_mode()
def extend(model: CausalLM, rope: Rope, cache: ReducedCache, ids: Sequence[int]) -> torch.Tensor:
    """Compute `ids` after everything in `cache` (appending their K/V): fp32 logits [len(ids), vocab].
    Decoding over a reduced cache, and teacher-forced scoring of a continuation."""
    n, start = len(ids), cache.slots
    dev = rope.cos_h.device
    cos, sin = rope.halves(torch.arange(start, start + n, device=dev) + cache.rope_offset)  # [n, 1, hd/2]
    h = model.embed(torch.tensor(list(ids), dtype=torch.long, device=dev))  # [n, hidden]
    return model.logits(model.run_layers(h, _Appending(cache, cos, sin, model.kernels)))
