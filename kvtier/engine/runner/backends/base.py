"""The attention-backend seam of the runner, shaped like vLLM's `AttentionMetadataBuilder`: the runner
builds a step's common metadata (`StepBatch`) and each backend builds the layout of its batched
decodes (`AttentionBackend.decodes`) and runs their attention (`attend_decodes`) and that of each
run attended on its own (`attend_run`). The runner picks one backend when it is built (`choose`).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from kvtier.engine.runner.batch import RunItem, RunRead, Uploads, slot_array
from kvtier.models.attention import causal_attention
from kvtier.models.kernels import Kernels

D = TypeVar("D")
Clearable = Callable[[RunItem, range], bool]


@dataclass(frozen=True)
class PoolSpec:
    """What a backend knows of the pool and the model's attention."""

    device: torch.device
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    zero_slot: int  # holds zeros and nothing writes it: padding reads it (masked, and finite)
    kernels: Kernels  # the model's (exact or plain; bf16 attention's CPU kernel)

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Pool slot of every position in [start, end) (on the host)."""
        return torch.from_numpy(slot_array(block_ids, start, end, self.block_size))


@dataclass(frozen=True)
class StepLayout:
    """A step as a backend's builder sees it, on the host."""

    items: Sequence[RunItem]
    lens: Sequence[int]  # tokens per run
    offsets: Sequence[int]  # run i is rows offsets[i]:offsets[i+1]
    decode_rows: tuple[int, ...]  # run indices attending in one decode batch
    ctx_len: Sequence[int]  # per decode: fed positions + slotted positions + its token
    ctx: Sequence[range | torch.Tensor | None]  # per run: its context's slots (None: fresh, or a decode)
    # Whether a run may read its context in place past its end, given the pool slots there
    # (`ModelRunner.clearable`); None: never.
    clearable: Clearable | None

    @property
    def fed(self) -> bool:
        return any(self.items[i].context_feed for i in self.decode_rows)


class StepDecoder(Protocol):
    """A whole-step path for the plain decode steps it accepts (static buffers; CUDA graphs)."""

    graphs_on: bool

    def accepts(self, items: Sequence[RunItem]) -> bool: ...

    def run(self, items: Sequence[RunItem]) -> torch.Tensor: ...


def read_context(new: torch.Tensor, cache: torch.Tensor, ctx: range | torch.Tensor | None,
                 pad: torch.Tensor | None) -> torch.Tensor:
    """A run's context K or V [rows, kv_heads, hd] for attention: this step's own rows (a fresh run),
    a view of its consecutive pool slots, or its slots gathered; written into `pad` where given."""
    if isinstance(ctx, torch.Tensor):
        if pad is None:
            return cache.index_select(0, ctx)
        torch.index_select(cache, 0, ctx, out=pad[: ctx.numel()])
        return pad
    rows = new if ctx is None else cache[ctx.start : ctx.stop]
    if pad is None:
        return rows
    pad[: rows.shape[0]].copy_(rows)
    return pad


def padded_slots(spec: PoolSpec, layout: StepLayout, width: int) -> tuple[torch.Tensor, list[int]]:
    """The decodes' contexts padded to `width`: pool slots [decodes, width] (fed positions and
    padding: the zero slot), and where each context starts in them, flat."""
    rows, items = layout.decode_rows, layout.items
    slots = torch.full((len(rows), width), spec.zero_slot, dtype=torch.long)  # [decodes, width]
    for r, i in enumerate(rows):
        slots[r, items[i].context_feed : layout.ctx_len[r]] = spec.slots(items[i].block_ids, 0, items[i].slot_start + 1)
    return slots, [r * width for r in range(len(rows))]


def feed_rows(layout: StepLayout, ctx_at: Sequence[int]) -> torch.Tensor | None:
    """[sum of fed positions] flat rows of the gathered contexts where the fed K/V go; None if none."""
    if not layout.fed:
        return None
    items = layout.items
    return torch.cat([torch.arange(at, at + items[i].context_feed) for at, i in zip(ctx_at, layout.decode_rows)])


class Gathers:
    """Where the decodes' contexts of K and V are gathered, [rows, kv_heads, hd] per part. On the
    CPU one buffer per part, kept between steps and grown as needed: a fresh one of tens of MB is
    page-faulted in on every allocation. A device's caching allocator already reuses its blocks."""

    def __init__(self, spec: PoolSpec, parts: int) -> None:
        self.spec = spec
        self._bufs: list[torch.Tensor | None] = [None] * parts

    def buffer(self, part: int, rows: int) -> torch.Tensor:
        spec = self.spec
        shape = (rows, spec.kv_heads, spec.head_dim)
        if spec.device.type != "cpu":
            return torch.empty(shape, dtype=spec.dtype, device=spec.device)
        buf = self._bufs[part]
        if buf is None or buf.shape[0] < rows:
            buf = self._bufs[part] = torch.empty(shape, dtype=spec.dtype)
        return buf[:rows]

    def contexts(self, cache: torch.Tensor, slots: torch.Tensor, part: int, feed_dst: torch.Tensor | None,
                 fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """cache [pool slots, kv_heads, hd] at `slots` (flat) -> [slots, kv_heads, hd], with the
        fed K (part 0) or V (1) put in place at rows `feed_dst` (one copy each)."""
        out = self.buffer(part, slots.numel())
        torch.index_select(cache, 0, slots, out=out)
        if fed is not None and feed_dst is not None:
            out.index_copy_(0, feed_dst, fed[part])
        return out


class AttentionBackend(abc.ABC, Generic[D]):
    """One way of running a step's attention. `D` is the layout of its batched decodes."""

    can_pack = False  # packs ragged decode batches (varlen) rather than padding them

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec

    def reads(self, layout: StepLayout) -> list[RunRead]:
        """How each run attended on its own reads its context (host tensors)."""
        return [RunRead(c) for c in layout.ctx]

    @abc.abstractmethod
    def decodes(self, layout: StepLayout, up: Uploads) -> Callable[[], D]:
        """The layout of the step's decodes (there are some): its host tensors go into `up`; the
        returned function builds it from their device copies once `up` is sent."""

    @abc.abstractmethod
    def attend_decodes(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: D,
                       fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """One attention call for every decode: q [decodes, heads, hd] over the layer's pool
        kc/vc [slots, kv_heads, hd]; `fed`: K/V of the fed positions, back to back. -> [decodes, heads, hd]."""

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
        """Queries at [q_start, q_start + n) over keys [0, ctx): q [n, heads, hd], k/v [ctx+, kv_heads, hd]."""
        return causal_attention(q, k, v, q_start, self.spec.kernels)

    def attend_run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   read: RunRead, q_start: int) -> torch.Tensor:
        """A run attended on its own: q/k/v [n, heads | kv_heads, hd] its rows (K/V already in the
        pool unless it is fresh). -> [n, heads, hd]."""
        if read.tail is not None:  # read in place over slots no one reads: zero for this layer
            kc[read.tail.start : read.tail.stop].zero_()
            vc[read.tail.start : read.tail.stop].zero_()
        pk, pv = read.pad or (None, None)
        kk, vv = read_context(k, kc, read.ctx, pk), read_context(v, vc, read.ctx, pv)
        return self.causal(q, kk, vv, q_start)
