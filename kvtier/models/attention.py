"""Causal attention of a run of query tokens over a contiguous key/value history."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Queries at positions [q_start, q_start + n) attend to keys at positions [0, ctx).

    q: [n, heads, hd] (RoPE applied), k/v: [ctx, kv_heads, hd] with ctx = q_start + n; k/v may be
    strided views (a request's slots in the pool), read in place. Returns [n, heads, hd].
    """
    n, ctx = q.shape[0], k.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads | kv_heads, tokens, hd]
    # SDPA's fused CPU kernel (torch >= 2.5) handles grouped K/V heads itself: no repeat_interleave copy.
    gqa = q.shape[1] != k.shape[1]
    if n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    elif n == ctx:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        # A chunk that continues a history needs the causal mask aligned bottom-right (query i sees
        # keys up to q_start + i); this bias lets the fused kernel skip the masked blocks instead
        # of reading a materialised [n, ctx] mask.
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, ctx), enable_gqa=gqa)
    return out[0].transpose(0, 1)  # [n, heads, hd]
