"""Causal attention of a run of query tokens over a contiguous key/value history."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Queries at positions [q_start, q_start + n) attend to keys at positions [0, ctx).

    q: [n, heads, hd] (RoPE applied), k/v: [ctx, kv_heads, hd] with ctx = q_start + n.
    Returns [n, heads, hd].
    """
    n, ctx = q.shape[0], k.shape[0]
    # SDPA's fused CPU kernel wants 4-D inputs and no enable_gqa (else it runs the slow math path),
    # so add a batch dim and expand the K/V heads for GQA ourselves.
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads, tokens, hd]
    if (rep := q.shape[1] // k.shape[1]) > 1:
        kh = kh.repeat_interleave(rep, dim=1)  # [1, heads, ctx, hd]
        vh = vh.repeat_interleave(rep, dim=1)
    if n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh)
    elif q_start == 0 and n == ctx:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:
        # SDPA's is_causal aligns the mask top-left; a chunk that continues a history needs
        # bottom-right alignment: query i sees keys up to q_start + i.
        qpos = torch.arange(q_start, q_start + n).unsqueeze(1)
        mask = torch.arange(ctx).unsqueeze(0) <= qpos  # [n, ctx]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
    return out[0].transpose(0, 1)  # [n, heads, hd]
