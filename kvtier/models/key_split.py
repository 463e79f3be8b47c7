"""Which keys exact CPU attention reads for a query, as a function of the query's position alone.

A query at position p reads its whole key blocks before its own, [0, base) with
base = p - p % KEY_BLOCK, and its piece, [base, key_rows(p + 1)): from its block's start to the
end of its PIECE of positions (masked past p). Both kernels (`exact_attention`'s fused flash
kernel and `exact_matmul`'s GEMMs) split a query's keys there, so what a query computes never
depends on the call it ran in: a prompt in one piece, the same prompt in chunks, a single decode
and a batch of decodes all read the same keys the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KEY_BLOCK = 512  # the CPU flash kernel's key split: a query's keys before its own block are whole ones
PIECE = 64  # a query's own block is read up to the end of its piece of this many positions


def key_rows(ctx: int) -> int:
    """The keys the exact kernels read for a context of `ctx` positions: whole pieces."""
    return -(-ctx // PIECE) * PIECE


def split(ctx: int) -> tuple[int, int]:
    """How the token at position ctx - 1 reads its keys: (base, keys) = its whole key blocks
    [0, base) and its piece [base, base + keys)."""
    p = ctx - 1
    base = p - p % KEY_BLOCK
    return base, key_rows(ctx) - base


def cut_or_pad(x: torch.Tensor, keys: int) -> torch.Tensor:
    """x [ctx, kv_heads, hd] as exactly `keys` rows: cut, or zero-padded past the history (a copy of
    at most KEY_BLOCK rows: the engine passes contexts already padded to `key_rows`)."""
    if x.shape[0] >= keys:
        return x[:keys]
    return F.pad(x, (0, 0, 0, 0, 0, keys - x.shape[0]))
