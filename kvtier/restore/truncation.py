"""Context overflow without recompute (CachedAttention §3.4).

When a conversation outgrows the context window, keep an optional system prefix, drop the oldest
part of the rest (half by default), and reuse the stored pre-RoPE K/V of the kept tokens with RoPE
applied at their new, compacted positions. Because stored K is position-free, no token is
recomputed. The result is an approximation (kept tokens' K/V were computed while the dropped
tokens were visible), so such state is never saved back under the truncated token sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.models.attention import causal_attention
from kvtier.models.llama import CausalLM
from kvtier.models.rope import Rope, rotate


@dataclass(frozen=True)
class TruncationConfig:
    keep_prefix: int = 0  # tokens at the start that are never dropped (e.g. the system prompt)
    drop_ratio: float = 0.5  # share of the droppable history removed at once

    def __post_init__(self) -> None:
        if not 0.0 < self.drop_ratio < 1.0:
            raise ValueError(f"drop_ratio must be in (0, 1), got {self.drop_ratio}")
        if self.keep_prefix < 0:
            raise ValueError("keep_prefix must be >= 0")


def kept_positions(length: int, limit: int, cfg: TruncationConfig) -> list[int]:
    """Indices of the tokens kept from a sequence of `length` so that at most `limit` remain.

    Drops `drop_ratio` of the droppable part (everything after the kept prefix), more if that is
    not enough, always from the oldest end."""
    if length <= limit:
        return list(range(length))
    prefix = min(cfg.keep_prefix, limit - 1)
    droppable = length - prefix
    drop = max(math.ceil(droppable * cfg.drop_ratio), length - limit)
    if drop >= droppable:
        raise ValueError(f"cannot fit {length} tokens into {limit} while keeping a {prefix}-token prefix")
    return list(range(prefix)) + list(range(prefix + drop, length))


@torch.inference_mode()
def continuation_logits(model: CausalLM, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_positions: torch.Tensor,
                        new_ids: Sequence[int], new_start: int) -> torch.Tensor:
    """Logits [new, vocab] of `new_ids` run after a context given as stored K/V.

    k_ctx/v_ctx: [layers, ctx, kv_heads, hd] pre-RoPE; K is rotated at `ctx_positions` [ctx];
    the new tokens sit at positions new_start, new_start + 1, ...
    """
    cfg, n = model.cfg, len(new_ids)
    rope = Rope(cfg, int(max(ctx_positions.max().item() + 1, new_start + n)), model.dtype)
    ccos, csin = rope.cos_sin(ctx_positions)
    ncos, nsin = rope.cos_sin(torch.arange(new_start, new_start + n))
    ctx = k_ctx.shape[1]
    h = model.embed(torch.tensor(list(new_ids)))
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(h)
        keys = torch.cat([rotate(k_ctx[li].to(model.dtype), ccos, csin), rotate(k, ncos, nsin)])
        vals = torch.cat([v_ctx[li].to(model.dtype), v])
        h = layer.finish(h, causal_attention(rotate(q, ncos, nsin), keys, vals, ctx))
    return model.logits(h)


def continuation_nll(model: CausalLM, k_ctx: torch.Tensor, v_ctx: torch.Tensor, ctx_positions: torch.Tensor,
                     new_ids: Sequence[int], new_start: int) -> float:
    """Mean next-token NLL of `new_ids` (teacher forcing) after the stored context."""
    logits = continuation_logits(model, k_ctx, v_ctx, ctx_positions, new_ids, new_start)[:-1]
    return F.cross_entropy(logits, torch.tensor(list(new_ids[1:]))).item()


@dataclass(frozen=True)
class TruncationFidelity:
    ppl_token_truncation: float  # drop tokens, recompute the kept ones: the reference
    ppl_kv_rerope: float  # reuse stored KV of kept tokens, RoPE at new positions (kvtier)
    ppl_kv_naive: float  # reuse stored KV with its old positions baked in

    @property
    def rerope_vs_tokens(self) -> float:
        return self.ppl_kv_rerope / self.ppl_token_truncation - 1.0


def truncation_fidelity(model: CausalLM, context: Sequence[int], continuation: Sequence[int], limit: int,
                        cfg: TruncationConfig) -> TruncationFidelity:
    """Perplexity of `continuation` after truncating `context` to fit `limit` tokens, three ways."""
    from kvtier.restore.state import context_state

    keep = kept_positions(len(context), limit, cfg)
    kept_ids = [context[i] for i in keep]
    full = context_state(model, context)  # what the store holds for the original context
    fresh = context_state(model, kept_ids)  # recomputed after dropping tokens
    idx = torch.tensor(keep)
    m = len(keep)
    compact = torch.arange(m)
    tok = continuation_nll(model, fresh.k, fresh.v, compact, continuation, m)
    rerope = continuation_nll(model, full.k[:, idx], full.v[:, idx], compact, continuation, m)
    naive = continuation_nll(model, full.k[:, idx], full.v[:, idx], idx, continuation, m)
    return TruncationFidelity(math.exp(tok), math.exp(rerope), math.exp(naive))
