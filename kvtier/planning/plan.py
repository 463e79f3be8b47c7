"""Restore plans: plain values the planner produces and the executor applies without re-deciding.

A plan names every chunk it reads, the tier it reads it from and how many bytes that is, the
representation read per layer, and the read-buffer depth; the executor reads exactly that (a chunk
missing from its planned tier is a miss, never a read from elsewhere).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvtier.store.layout import Repr


class Method(str, enum.Enum):
    RECOMPUTE = "recompute"  # prefill the history from its token ids
    KV = "kv"  # load K/V layer by layer (CachedAttention)
    HIDDEN = "hidden"  # load layer inputs, project to K/V (HCache)
    BUBBLEFREE = "bubblefree"  # per-layer mix of hidden with KV load or token recompute (HCache §4.1)
    CAKE = "cake"  # compute chunks from the front while loading KV chunks from the back
    IMPRESS = "impress"  # only the prefix tokens the new tokens' queries need (lossy; opt-in only)
    # Marked documents' state computed alone, moved to their positions, a few tokens recomputed
    # (lossy; asked for per request, planning/blend.py): never a restore method to choose.
    BLEND = "blend"

    @property
    def exact(self) -> bool:
        return self not in (Method.IMPRESS, Method.BLEND)


AUTO = "auto"  # a request for the planner's choice, not a method a plan carries
METHOD_CHOICES = (AUTO,) + tuple(m.value for m in Method if m is not Method.BLEND)
EXACT_METHODS = tuple(m for m in Method if m.exact)


@dataclass(frozen=True)
class PlannedChunk:
    key: str
    start: int  # tokens [start, end) of the context
    end: int
    tier: str  # the tier the planner costed: the executor reads it from there
    nbytes: int  # bytes the plan reads from this chunk (only the layers and parts it needs)

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    method: Method
    layer_reprs: tuple[Repr, ...]  # what is read per layer; leading NONE layers are recomputed
    # Tokens [0, history_tokens) restored by this plan. The last chunk may hold more (a repeated
    # prompt's last chunk: its final token is computed, not restored); it is read whole, as stored.
    history_tokens: int
    chunks: tuple[PlannedChunk, ...]  # what is read, from where (empty for recompute)
    predicted_s: float  # restore + new tokens' first step, predicted from the profile
    ideal_s: float  # max(bytes / bandwidth, compute seconds): no method of this kind can beat it
    read_buffer_layers: int = 2  # layers read ahead before the new tokens start (CachedAttention §3.2.1)
    background_tokens: int = 0  # compute before the new tokens start (recomputed layers, Cake's front), in prefill tokens
    attach_tokens: int = 0  # compute beside the new tokens (placement, projection), in prefill tokens

    @property
    def bytes_read(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def recompute_layers(self) -> int:
        """Leading layers restored by recomputing them from tokens (bubble-free with recompute)."""
        n = 0
        for r in self.layer_reprs:
            if r is not Repr.NONE:
                break
            n += 1
        return n

    def describe_layout(self) -> str:
        counts = {r.value: sum(1 for x in self.layer_reprs if x is r) for r in Repr}
        return ", ".join(f"{k}={v}" for k, v in counts.items() if v)

    def describe(self) -> str:
        return (f"{self.method.value} [{self.describe_layout()}] predicted {self.predicted_s * 1000:.0f} ms, "
                f"ideal {self.ideal_s * 1000:.0f} ms")
