"""Compute the storable state of a context: every layer's input and pre-RoPE K/V."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.models.attention import causal_attention
from kvtier.models.llama import CausalLM
from kvtier.models.rope import Rope, rotate


@dataclass(frozen=True)
class ContextState:
    k: torch.Tensor  # [layers, tokens, kv_heads, hd] pre-RoPE
    v: torch.Tensor  # [layers, tokens, kv_heads, hd]
    h: torch.Tensor  # [layers, tokens, hidden] input of each layer


@torch.inference_mode()
def context_state(model: CausalLM, ids: Sequence[int], chunk: int = 1024) -> ContextState:
    """One chunked prefill that keeps what the store saves (the engine captures the same in-flight)."""
    n, cfg = len(ids), model.cfg
    rope = Rope(cfg, n, model.dtype)
    ks = torch.empty(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    vs = torch.empty_like(ks)
    hs = torch.empty(cfg.num_layers, n, cfg.hidden_size, dtype=model.dtype)
    kr = torch.empty_like(ks)  # rotated K for attention
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        cos, sin = rope.cos_sin(torch.arange(a, b))
        h = model.embed(torch.tensor(list(ids[a:b])))
        for li, layer in enumerate(model.layers):
            hs[li, a:b] = h
            q, k, v = layer.qkv(h)
            ks[li, a:b], vs[li, a:b] = k, v
            kr[li, a:b] = rotate(k, cos, sin)
            o = causal_attention(rotate(q, cos, sin), kr[li, :b], vs[li, :b], a)
            h = layer.finish(h, o)
    return ContextState(ks, vs, hs)
