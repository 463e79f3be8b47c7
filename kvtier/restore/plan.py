"""Restore plans: plain values the planner produces and the executor applies without re-deciding."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.store import Repr


class Method(str, enum.Enum):
    RECOMPUTE = "recompute"  # prefill the history from its token ids
    KV = "kv"  # load pre-RoPE K/V layer by layer (CachedAttention)
    HIDDEN = "hidden"  # load layer inputs, project to K/V (HCache)
    BUBBLEFREE = "bubblefree"  # per-layer mix of hidden with KV load or token recompute (HCache §4.1)
    CAKE = "cake"  # compute chunks from the front while loading KV chunks from the back
    AUTO = "auto"  # let the planner choose


# Layer-wise methods read this many layers of a chunk per read call (layer-major chunks make them
# one contiguous range): a few layers amortize the per-read latency without delaying the first.
READ_GROUP_LAYERS = 4


@dataclass(frozen=True)
class ChunkSource:
    start: int
    end: int
    tier: str  # tier the chunk is read from ("" when computed from tokens)
    direction: str  # "load" (layer-wise), "front" (computed, Cake), "back" (loaded whole, Cake), "compute"


@dataclass(frozen=True)
class Plan:
    method: Method
    layer_reprs: tuple[Repr, ...]  # what is read per layer; leading NONE layers are recomputed
    history_tokens: int  # tokens [0, history_tokens) restored by this plan
    chunks: tuple[ChunkSource, ...]
    predicted_s: float  # restore time (new tokens excluded) predicted from the profile
    ideal_s: float  # max(bytes / bandwidth, compute seconds): no method of this kind can beat it
    prefetch_layers: int = 2  # IO read-ahead depth in layers (CachedAttention §3.2.1 buffer)
    bytes_read: int = 0
    compute_tokens: int = 0  # the restore's compute (projection, placement, recomputed layers) in prefill tokens

    @property
    def recompute_layers(self) -> int:
        """Leading layers restored by recomputing them from tokens (bubble-free with recompute)."""
        n = 0
        for r in self.layer_reprs:
            if r is not Repr.NONE:
                break
            n += 1
        return n

    def describe(self) -> str:
        counts = {r.value: sum(1 for x in self.layer_reprs if x is r) for r in Repr}
        mix = ", ".join(f"{k}={v}" for k, v in counts.items() if v)
        return f"{self.method.value} [{mix}] predicted {self.predicted_s * 1000:.0f} ms, ideal {self.ideal_s * 1000:.0f} ms"
