"""Context overflow without recompute (CachedAttention §3.4).

When a conversation outgrows the context window, keep an optional system prefix, drop the oldest
part of the rest (half by default), and reuse the stored K/V of the kept tokens with K rotated on
to their new, compacted positions (rotations compose, so K stored at position p moves to p' by a
rotation of p' - p). No token is recomputed. The result is an approximation (kept tokens' K/V
were computed while the dropped tokens were visible), so such state is never saved, and never
enters the device prefix cache, under the truncated token sequence. Pure: no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


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
