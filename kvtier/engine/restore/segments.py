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

import numpy as np
import torch

from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.engine.runner.transfer import Transfer, byte_range
from kvtier.models.llama import LayerAttention
from kvtier.store import format as fmt
from kvtier.store.index import PrefixMatch, StoredChunk
from kvtier.store.layout import Repr
from kvtier.store.reads import LayerGroup, storage_bytes
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
    """A segment's state computed alone, per layer: k (rotated at positions [0, n)) and v [n,
    kv_heads, hd] where the layer stores K/V, h [n, hidden] (the layer's input) where it stores
    hidden states."""

    k: tuple[torch.Tensor | None, ...]
    v: tuple[torch.Tensor | None, ...]
    h: tuple[torch.Tensor | None, ...]


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
        return SegmentState(k, v, h)


@dataclass(frozen=True)
class Packed:
    """A read group's layers of K and V of the rows a blend places of every stored segment, on
    the device in one buffer laid out as the pool's rows: k, v [layers, rows, kv_heads, hd], the
    rows segment by segment as `SegmentReads`' `placed` names them."""

    k: torch.Tensor
    v: torch.Tensor


def uploaded(transfer: Transfer, ts: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Host views (None kept in place) on the engine's device, a copy per host buffer
    (`Transfer.upload_views`), waited for here: the host memory under them may go once this returns."""
    views, handle = transfer.upload_views([t for t in ts if t is not None])
    transfer.sync(handle)
    moved = iter(views)
    return [None if t is None else next(moved) for t in ts]


class SegmentReads:
    """Stored segments' rows read a group of layers at a time for every segment at once
    (`PlannedReads`: each chunk opened once, one batched read per tier and group): views of the
    memory tier's bytes, disk reads into the store's reused staging memory (fresh memory faults
    its pages in, which on a first blend of a process cost more than the reads themselves). A
    group's memory goes back to the staging pool once its layers are placed (`release`).

    Given `placed` (on a device with memory of its own), a group of K/V layers goes over as one
    submission of a run per stored chunk, and one gather on the device packs the rows placed
    (`Packed`), which the blend places with one rotation and two scatters for the group."""

    def __init__(self, states: SegmentStates, found: Sequence[tuple[PrefixMatch, int]],
                 placed: Sequence[Sequence[tuple[int, int]]] | None = None) -> None:
        """`found`: each stored segment's chunks and its tokens (the compile context's rows left
        out); `placed`: per segment, the spans of its rows [a, b) to pack (None: views)."""
        self.placed = placed
        self.layout = states.layout
        self.transfer, self.dtype = states.runner.transfer, states.runner.k_cache.dtype
        self.rows: list[list[tuple[int, int, int]]] = []  # per segment: (chunk index, first row, end row)
        self.sizes = [n for _, n in found]
        chunks: list[StoredChunk] = []
        for match, n in found:
            lo, hi = states.offset, states.offset + n  # the segment's rows of the stored chain
            mine = []
            for c in match.chunks:
                if c.end > lo and c.start < hi:
                    mine.append((len(chunks), max(lo, c.start) - c.start, min(c.end, hi) - c.start))
                    chunks.append(c)
            self.rows.append(mine)
        self.chunks = tuple(chunks)
        self.reads = states.store.planned_reads(chunks)
        self._held: dict[int, list[LayerGroup]] = {}  # by first layer: the groups read and not released

    def open(self) -> bool:
        """Open every chunk (its header read and checked); False where any is missing."""
        return self.reads.open()

    def read(self, layers: range) -> tuple[list[dict[int, Pieces]], Packed | None] | None:
        """`layers`, per segment: per layer its rows in the pieces its stored chunks hold, in order
        (views of what was read, on the engine's device), and the group packed where it is (its
        pieces are then host views, for the checks alone); None on a failed read or check (the
        chunk is dropped as corrupt)."""
        out: list[dict[int, list[Parts]]] = [{li: [] for li in layers} for _ in self.rows]
        held = self._held.setdefault(layers.start, [])
        packed = None
        for run in _same_repr(self.layout, layers):
            parts = self.layout[run[0]].parts()
            group = self.reads.read(run, parts)
            if group is None:
                self.release(layers.start)
                return None
            held.append(group)
            packed = self._pack(group, len(run)) if run == layers and self.layout[run[0]] is Repr.KV else None
            here = group.parts if packed is not None else self._on_device(group, parts)
            for seg, mine in zip(out, self.rows):
                for c, a, b in mine:
                    got = [here[p][c] if p in parts else None for p in ("k", "v", "h")]  # [layers, T, ...]
                    for j, li in enumerate(run):
                        seg[li].append(cast(Parts, tuple(None if t is None else t[j, a:b] for t in got)))
        for seg, n in zip(out, self.sizes):  # every row of every layer, in the parts its layout stores
            for li in layers:
                for i in (0, 1) if self.layout[li] is Repr.KV else (2,):
                    if any(p[i] is None for p in seg[li]) or sum(cast(torch.Tensor, p[i]).shape[0] for p in seg[li]) != n:
                        self.release(layers.start)
                        return None
        return [{li: tuple(p) for li, p in seg.items()} for seg in out], packed

    def _pack(self, group: LayerGroup, n: int) -> Packed | None:
        """The placed rows of the group's `n` K/V layers of every segment, packed on the device
        (the copy waited for here, on the reading thread); None where packing is off or a part is
        not rows of the compute dtype lying whole (then views go over)."""
        if self.placed is None:
            return None
        pieces = []  # (chunk, first row, end row, packed row)
        at = 0
        for mine, spans in zip(self.rows, self.placed, strict=True):
            for a, b in spans:  # rows of the segment
                off = 0
                for c, f, e in mine:
                    lo, hi = max(a, off), min(b, off + e - f)
                    if lo < hi:
                        pieces.append((c, f + lo - off, f + hi - off, at + lo - a))
                    off += e - f
                at += b - a
        ks, vs = group.parts.get("k", []), group.parts.get("v", [])
        if not pieces or any(t is None or t.dtype != self.dtype for t in (*ks, *vs)):
            return None
        parts = [cast(torch.Tensor, t) for t in (*ks, *vs)]
        if any(t.dim() != 4 or t.shape[0] != n or t.shape[2:] != parts[0].shape[2:] for t in parts):
            return None  # parts that disagree with the group's shape: views go over (and the checks refuse them)
        kvh, hd = parts[0].shape[2:]
        row = kvh * hd * self.dtype.itemsize
        # Each chunk's K and V of these layers go over as the one span of bytes they lie in (or a
        # span each), at a whole row of the stage: every stored row is then a row of the stage,
        # and one gather on the device packs the placed ones (a run per chunk, not per layer,
        # part and piece).
        runs: list[tuple[int, torch.Tensor]] = []
        first: dict[tuple[int, int], tuple[int, int]] = {}  # (chunk, part) -> its first row in the stage, rows per layer
        pos = 0
        for c in sorted({c for c, *_ in pieces}):
            k, v = cast(torch.Tensor, ks[c]), cast(torch.Tensor, vs[c])
            # Together where the layer-major layout lays them (each layer's K, then its V after at
            # most an alignment's padding): one span of the group's own layers, never more bytes
            together = k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() and \
                (byte_range(v)[0] - byte_range(k)[0]) % row == 0 and \
                max(byte_range(k)[1], byte_range(v)[1]) - min(byte_range(k)[0], byte_range(v)[0]) <= \
                (n - 1) * k.stride(0) * k.element_size() + k[0].nbytes + v[0].nbytes + fmt.ALIGN
            for part in [((0, k), (1, v))] if together else [((0, k),), ((1, v),)]:
                lo = min(byte_range(t)[0] for _, t in part)
                hi = max(byte_range(t)[1] for _, t in part)
                for p, t in part:
                    step = t.stride(0) * t.element_size()  # bytes from one layer's rows to the next's
                    if step % row or t.stride(1) * t.element_size() != row or t.stride(2) != hd or t.stride(3) != 1:
                        return None  # not rows lying whole: views go over
                    first[c, p] = (pos + (byte_range(t)[0] - lo) // row, step // row)
                runs.append((pos * row, storage_bytes(part[0][1])[lo:hi]))
                pos += -(-(hi - lo) // row)
        index = np.full(n * 2 * at, -1, dtype=np.int64)  # [layers, K|V, placed rows]: the stage row of each
        for c, f, e, r in pieces:
            for p, x in enumerate((ks[c], vs[c])):
                if e > cast(torch.Tensor, x).shape[1]:
                    return None  # a short read: the checks after this refuse it
                base, per = first[c, p]
                for j in range(n):
                    o = (j * 2 + p) * at + r
                    index[o : o + e - f] = np.arange(base + j * per + f, base + j * per + e)
        if index.min() < 0 or index.max() >= pos:  # rows no chunk covers: never a gather out of bounds
            return None
        stage, handle = self.transfer.upload_runs(runs, pos * row)
        # Waited for here, on the reading thread: the compute stream never waits for a read. The
        # gather then runs on this thread's stream, the default one, which every engine thread
        # computes on (the stage is recorded on it: `upload_runs`).
        self.transfer.sync(handle)
        rows = stage.view(self.dtype).view(pos, kvh, hd)  # [stage rows, kvh, hd]
        kv = rows.index_select(0, self.transfer.upload(torch.from_numpy(index))).view(n, 2, at, kvh, hd)
        return Packed(kv[:, 0], kv[:, 1])

    def _on_device(self, group: LayerGroup, parts: Sequence[str]) -> dict[str, list[torch.Tensor | None]]:
        """The group's parts [layers, T, ...] per chunk, in the compute dtype, on the engine's
        device: on the CPU the read's views; else each chunk's read group in one copy, waited
        for here (on the reading thread) so that its staging memory may go back once placed."""
        host = [None if t is None else t.to(self.dtype) for p in parts for t in group.parts[p]]
        moved = iter(uploaded(self.transfer, host))
        return {p: [next(moved) for _ in group.parts[p]] for p in parts}

    def release(self, first: int) -> None:
        """The group read from layer `first` is placed: its staging memory may be reused."""
        for group in self._held.pop(first, []):
            self.reads.release(group)

    def close(self) -> None:
        for first in list(self._held):
            self.release(first)
        self.reads.close()


def _same_repr(layout: Sequence[Repr], layers: range) -> list[range]:
    """`layers` cut into runs of one representation (a read asks every layer for the same parts)."""
    runs: list[range] = []
    for li in layers:
        if runs and layout[runs[-1][0]] is layout[li]:
            runs[-1] = range(runs[-1].start, li + 1)
        else:
            runs.append(range(li, li + 1))
    return runs
