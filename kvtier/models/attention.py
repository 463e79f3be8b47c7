"""Causal attention of a run of query tokens over a contiguous key/value history."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kvtier.models import varlen

# The fused CPU flash kernel SDPA dispatches to, called directly where its log-sum-exp is needed.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
    """Queries at positions [q_start, q_start + n) attend to keys at positions [0, ctx).

    q: [n, heads, hd] (RoPE applied), k/v: [ctx, kv_heads, hd] with ctx = q_start + n; k/v may be
    strided views (a request's slots in the pool), read in place. Returns [n, heads, hd].
    """
    n, ctx = q.shape[0], k.shape[0]
    if 1 < n < ctx and q.device.type == "cpu" and _FLASH_CPU is not None:
        return _history_then_own(q, k, v, q_start)
    if 1 < n < ctx and varlen.usable(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2]):
        # CUDA: flash attention with the causal mask aligned bottom-right, no mask tensor
        return varlen.attend(q, k, v, *varlen.spans(n, ctx, q.device), n, ctx)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, heads | kv_heads, tokens, hd]
    # SDPA's fused CPU kernel (torch >= 2.5) handles grouped K/V heads itself: no repeat_interleave copy.
    gqa = q.shape[1] != k.shape[1]
    if n == 1:
        out = F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=gqa)
    elif n == ctx:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:  # a chunk continuing a history: the causal mask aligned bottom-right
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(n, ctx), enable_gqa=gqa)
    return out[0].transpose(0, 1)  # [n, heads, hd]


def _history_then_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """A chunk continuing a history, as two unmasked-or-square attentions merged by their
    log-sum-exp: every query sees the whole history [0, start) (no mask), and its own chunk
    causally. The fused kernel given the bottom-right mask instead computes the masked blocks
    too: 1.3-1.6x slower for 512-2048-token chunks here, and that is what chunked prefill runs."""
    flash = _FLASH_CPU
    assert flash is not None  # causal_attention checked it
    n, heads, hd = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    # History: no mask, so the query heads sharing a K/V head can be rows of one matrix (no copy of K/V).
    qg = q.view(n, kv_heads, g, hd).permute(1, 2, 0, 3).reshape(1, kv_heads, g * n, hd)  # [1, kv_heads, g*n, hd]
    hist_k, hist_v = k[:start].transpose(0, 1).unsqueeze(0), v[:start].transpose(0, 1).unsqueeze(0)
    o1, lse1 = flash(qg, hist_k, hist_v, 0.0, False)[:2]
    o1, lse1 = o1.reshape(1, heads, n, hd), lse1.reshape(1, heads, n)  # head order kv-major, as GQA repeats
    # Own chunk: square and causal (small: its K/V are expanded for the grouped heads).
    own_k, own_v = k[start:].transpose(0, 1).unsqueeze(0), v[start:].transpose(0, 1).unsqueeze(0)
    if g > 1:
        own_k, own_v = own_k.repeat_interleave(g, dim=1), own_v.repeat_interleave(g, dim=1)  # [1, heads, n, hd]
    o2, lse2 = flash(q.transpose(0, 1).unsqueeze(0), own_k, own_v, 0.0, True)[:2]
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m).unsqueeze(-1), torch.exp(lse2 - m).unsqueeze(-1)  # [1, heads, n, 1] fp32
    out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)  # [1, heads, n, hd]
    return out[0].transpose(0, 1).to(q.dtype)
