"""Segment state for blended restores: a document's per-layer state computed alone, stored and read
by its content.

A segment is computed alone after a fixed compile context (by default none: it starts at position
0; the model's BOS token before it blended worse on MuSiQue, docs/blend.md), with its own causal
attention and the exact kernels. Its K (rotated at positions [c, c + n) after a context of c tokens), V and, for
hidden-state layers, layer inputs are saved, the context's rows with them, as the chain of the
context's and the segment's tokens, through the store's writer like any chunk chain: sealed, validated on read, evicted by the tiers' policies. Its
chain starts at a root of the blend key space (`keys.salted_root(space=...)`), salted by the
tenant: the exact chains' lookups never reach it, and no tenant reads another's segments. The
store's namespace already names the model, the layout, the storage dtype and the numerics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch

from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.llama import LayerAttention
from kvtier.store.index import PrefixMatch
from kvtier.store.layout import Repr
from kvtier.store.tiered import TieredStore

# A layer's parts: k, v [n, kv_heads, hd] where it stores K/V, h [n, hidden] where hidden states.
Parts = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

# A layer's rows of a state in the pieces its stored chunks hold them, in order.
Pieces = tuple[Parts, ...]


def joined(pieces: Sequence[Parts]) -> Parts:
    """The pieces' rows as one part each (None where no piece has that part)."""
    def cat(ts: list[torch.Tensor]) -> torch.Tensor | None:
        return None if not ts else ts[0] if len(ts) == 1 else torch.cat(ts)

    return cast(Parts, tuple(cat([t for p in pieces if (t := p[i]) is not None]) for i in range(3)))


# The blend key space (keys.salted_root); the compile context leads each chain, so a different one
# gives other keys.
SPACE = "blend-segment"


@dataclass(frozen=True)
class SegmentState:
    """A segment's state per layer: k (rotated at positions [0, n)) and v [n, kv_heads, hd] where
    the layer stores K/V, h [n, hidden] (the layer's input) where it stores hidden states."""

    k: tuple[torch.Tensor | None, ...]
    v: tuple[torch.Tensor | None, ...]
    h: tuple[torch.Tensor | None, ...]
    stored: bool  # read from the store (else computed here)
    nbytes: int  # bytes read (0 when computed)


class _Alone(LayerAttention):
    """One segment attending causally to itself at positions [0, n), each layer's input, rotated K
    and V kept (the exact kernels: the same bits in any batch)."""

    def __init__(self, runner: ModelRunner, n: int, layout: Sequence[Repr]) -> None:
        self.causal = runner.attention.causal
        self.cos, self.sin = runner.rope.span(0, n)
        self.layout = layout
        self.k: list[torch.Tensor | None] = [None] * len(layout)
        self.v: list[torch.Tensor | None] = [None] * len(layout)
        self.h: list[torch.Tensor | None] = [None] * len(layout)

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def enter(self, li: int, h: torch.Tensor) -> torch.Tensor:
        if self.layout[li] is Repr.HIDDEN:
            self.h[li] = h
        return h

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.layout[li] is Repr.KV:
            self.k[li], self.v[li] = k, v
        return self.causal(q, k, v, 0)


class SegmentStates:
    """Reads a segment's state from the store, or computes it alone and saves it."""

    def __init__(self, store: TieredStore, runner: ModelRunner, layout: Sequence[Repr], save: bool = True,
                 context: Sequence[int] | None = None) -> None:
        """`context`: the compile context's token ids (none by default)."""
        if Repr.NONE in layout:
            raise ValueError("blended restores need K/V or hidden states in every layer")
        self.store, self.runner, self.layout, self.save = store, runner, tuple(layout), save
        self.context = tuple(context or ())

    @property
    def offset(self) -> int:
        """The position a segment's first row was computed at (its K is rotated there)."""
        return len(self.context)

    def find(self, tokens: Sequence[int], salt: str) -> PrefixMatch | None:
        """The stored chunks holding the whole segment; None where any part is missing."""
        chain = self.context + tuple(tokens)
        match = self.store.lookup(chain, salt, SPACE)
        return match if match.num_tokens >= len(chain) else None

    def read(self, tokens: Sequence[int], salt: str) -> SegmentState | None:
        """The whole segment's state from the store; None if any part of it is missing or fails
        its checks (a miss: it is computed instead)."""
        match = self.find(tokens, salt)
        if match is None:
            return None
        layers = self.read_layers(match, len(tokens), range(len(self.layout)))
        if layers is None:
            return None
        k, v, h = (tuple(layers[li][p] for li in range(len(self.layout))) for p in range(3))
        return SegmentState(k, v, h, True, sum(c.nbytes for c in match.chunks))

    def read_layers(self, match: PrefixMatch, n: int, layers: range) -> dict[int, Parts] | None:
        """`layers` of a segment of `n` tokens from its stored chunks (the context's rows left
        out): per layer (k, v, h) on the pool's device (None where the layer stores no such part);
        None on a failed read or check."""
        got = self.read_pieces(match, n, layers)
        return None if got is None else {li: joined(p) for li, p in got.items()}

    def read_pieces(self, match: PrefixMatch, n: int, layers: range) -> dict[int, Pieces] | None:
        """`read_layers` without joining: per layer the segment's rows each stored chunk holds, in
        order, as views of what the store read where it can (a reader that places rows in place
        copies them once); None on a failed read or check."""
        lo, hi = self.offset, self.offset + n  # the segment's rows of the stored chain
        dev, dtype = self.runner.device, self.runner.k_cache.dtype
        out: dict[int, list[Parts]] = {li: [] for li in layers}
        for c in match.chunks:
            if c.end <= lo or c.start >= hi:
                continue
            states = self.store.read_layers(c, layers, copy=False)
            if states is None:
                return None
            a, b = max(lo, c.start) - c.start, min(c.end, hi) - c.start
            for s in states:
                out[s.layer].append(cast(Parts, tuple(None if t is None else t[a:b].to(dev, dtype)
                                                      for t in (s.k, s.v, s.h))))
        for li in layers:
            need = (0, 1) if self.layout[li] is Repr.KV else (2,)
            for i in need:
                if any(p[i] is None for p in out[li]) or sum(cast(torch.Tensor, p[i]).shape[0] for p in out[li]) != n:
                    return None
        return {li: tuple(p) for li, p in out.items()}

    @torch.inference_mode()
    def compute(self, tokens: Sequence[int], salt: str) -> SegmentState:
        """The segment's state computed alone (and handed to the store's writer)."""
        model, chain, c = self.runner.model, self.context + tuple(tokens), self.offset
        alone = _Alone(self.runner, len(chain), self.layout)
        ids = torch.tensor(chain, dtype=torch.long, device=self.runner.device)
        model.run_layers(model.embed(ids), alone)
        if self.save:
            def stack(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
                have = [t for t in ts if t is not None]
                return torch.stack(have).cpu() if have else None

            self.store.save(chain, 0, stack(alone.k), stack(alone.v), stack(alone.h), salt, SPACE)
        k, v, h = (tuple(None if t is None else t[c:] for t in ts) for ts in (alone.k, alone.v, alone.h))
        return SegmentState(k, v, h, False, 0)
