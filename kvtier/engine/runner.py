"""The model runner: the paged KV tensors and one forward pass over a batch of token runs.

A step's tokens from all requests are concatenated ("varlen"), so the projections and MLP run as
one matmul per layer; attention runs per request over that request's blocks in the pool.
K enters the pool with RoPE applied at its position (DESIGN invariant 1); the pre-RoPE K and V,
and each layer's input, can be handed to an optional capture callback on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.models.attention import causal_attention
from kvtier.models.llama import CausalLM
from kvtier.models.rope import Rope, rotate

# capture(layer, request_index, h [n, hidden], k [n, kv_heads, hd], v [n, kv_heads, hd]); all pre-RoPE.
CaptureFn = Callable[[int, int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class RunItem:
    """One request's run of tokens in a step: positions [start, start + len(token_ids))."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    want_logits: bool


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_positions: int):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.rope = Rope(cfg, max_positions, model.dtype)
        device = model.lm_head.weight.device
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        # torch.zeros on the host maps pages lazily: an unused budget costs no memory.
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=device)  # [layers, slots, kv_heads, hd]
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=device)

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int) -> int:
        cfg = model.cfg
        return 2 * cfg.num_layers * block_size * cfg.kv_dim * model.dtype.itemsize

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Pool slot of every position in [start, end) for a request owning `block_ids`."""
        pos = torch.arange(start, end)
        table = torch.tensor(block_ids, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.inference_mode()
    def execute(self, items: Sequence[RunItem], capture: CaptureFn | None = None) -> torch.Tensor:
        """Run one step. Returns fp32 logits [num items with want_logits, vocab] (last token of each)."""
        model = self.model
        ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long)
        lens = [len(it.token_ids) for it in items]
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        positions = torch.cat([torch.arange(it.start, it.start + n) for it, n in zip(items, lens)])
        new_slots = torch.cat([self.slots(it.block_ids, it.start, it.start + n) for it, n in zip(items, lens)])
        # Requests with history read their whole context [0, end) back from the pool.
        ctx_slots = [
            self.slots(it.block_ids, 0, it.start + n) if it.start > 0 else None for it, n in zip(items, lens)
        ]
        cos, sin = self.rope.cos_sin(positions)
        h = model.embed(ids)  # [tokens, hidden]
        for li, layer in enumerate(model.layers):
            q, k, v = layer.qkv(h)  # pre-RoPE
            if capture is not None:
                for i in range(len(items)):
                    a, b = offsets[i], offsets[i + 1]
                    capture(li, i, h[a:b], k[a:b], v[a:b])
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            kc, vc = self.k_cache[li], self.v_cache[li]
            kc.index_copy_(0, new_slots, k)
            vc.index_copy_(0, new_slots, v)
            outs = []
            for i, it in enumerate(items):
                a, b = offsets[i], offsets[i + 1]
                if ctx_slots[i] is None:  # fresh sequence: its K/V are exactly this run's
                    outs.append(causal_attention(q[a:b], k[a:b], v[a:b], 0))
                else:
                    ks, vs = kc.index_select(0, ctx_slots[i]), vc.index_select(0, ctx_slots[i])
                    outs.append(causal_attention(q[a:b], ks, vs, it.start))
            h = layer.finish(h, torch.cat(outs) if len(outs) > 1 else outs[0])
        last = [offsets[i + 1] - 1 for i, it in enumerate(items) if it.want_logits]
        if not last:
            return torch.empty(0, model.cfg.vocab_size)
        return model.logits(h[torch.tensor(last)])  # [requests sampling, vocab]

    @torch.inference_mode()
    def place_kv(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Put externally produced pre-RoPE K [n, kv_heads, hd] and V into the pool at `slots`,
        rotating K for the positions it takes here (which may differ from where it was computed)."""
        cos, sin = self.rope.cos_sin(positions)
        self.k_cache[layer].index_copy_(0, slots, rotate(k.to(self.k_cache.dtype), cos, sin))
        self.v_cache[layer].index_copy_(0, slots, v.to(self.v_cache.dtype))
