"""The decode step over static buffers: the code CUDA graphs capture.

A step in which every run decodes one token (no restore placing layers, no unslotted or fed
context, no hidden states captured for saving) has shapes set by its batch size and its longest context
alone once its inputs sit in buffers allocated up front: token ids, positions, the pool slot each
token's K/V goes to, the context lengths and the block table. The batch is padded up to a bucket
(1, 2, 4, 8, then steps of 8 up to 32 and of 16 beyond, as nano-vllm buckets); a padding row
decodes token 0 at position 0 into the pool's sink with a context of one, so it writes nowhere a
request owns.

Attention gathers each context through the block table to a common width and makes one SDPA call
with grouped K/V heads and a length mask: on a GPU that beat FlexAttention reading the pool in
place and the packed varlen path (docs/benchmarks.md, "Paged decode attention candidates"). On CUDA the width is
bucketed too (256 tokens, then steps of x1.5 and x4/3 alternately: 256, 384, 512, 768, ...), so a
step reads at most 1.5 times its longest context, and each (batch, width)
bucket's step is captured into a CUDA graph on first use and replayed after: one host-to-device
copy of the inputs and one replay per step; the sampled ids are its one host sync. On the CPU the
step runs eagerly at the exact kernel's width (`models.attention.decode_attention`), so a static
step is the same bits as the engine's dynamic one (tests/test_static_decode.py). `paged = True`
swaps in FlexAttention over the pool in place (`models.paged`), kept for measurement.
"""

from __future__ import annotations

import bisect
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from kvtier.engine.runner.backends.varlen import pack_decodes
from kvtier.engine.runner.batch import RunItem
from kvtier.models.attention import decode_attention, exact_cpu, key_rows
from kvtier.models.llama import LayerAttention
from kvtier.models.paged import PageTable, paged_attention

if TYPE_CHECKING:
    from kvtier.engine.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

_IDS, _POS, _SLOT, _LEN, _TABLE = 0, 1, 2, 3, 4  # columns of the input buffer; the table is the rest


def widths(max_tokens: int) -> tuple[int, ...]:
    """Context widths a CUDA step gathers to: 256, 384, 512, 768, 1024, ... then `max_tokens`."""
    sizes, w = [], 256
    while w < max_tokens:
        sizes += [w, w * 3 // 2]
        w *= 2
    return tuple(x for x in sizes if x < max_tokens) + (max_tokens,)


def buckets(max_seqs: int) -> tuple[int, ...]:
    """Batch sizes a step is padded up to: 1, 2, 4, 8, then every 8 to 32, every 16 after."""
    sizes = [1, 2, 4, 8, 16, 24, 32] + list(range(48, max_seqs + 16, 16))
    return tuple(s for s in sizes if s < max_seqs) + (max_seqs,)


class StaticDecode:
    def __init__(self, runner: ModelRunner, max_seqs: int, max_positions: int, graphs: bool | None = None) -> None:
        # A proxy: the runner holds this decoder, and a strong reference back would be a cycle
        # that keeps a closed engine's pool (and graphs) until a garbage collection.
        self.runner = cast("ModelRunner", weakref.proxy(runner))
        self.bs = bs = runner.block_size
        self.pages = -(-max_positions // bs)
        self.buckets = buckets(max_seqs)
        self.pad_block = runner.sink // bs  # the sink's first block: no request owns it
        dev = runner.device
        self.graphs_on = dev.type == "cuda" if graphs is None else graphs
        if self.graphs_on and dev.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {dev}")
        self.paged = False  # FlexAttention over the pool in place instead of gathering (measured slower)
        self.kernels = runner.model.kernels
        self.exact = exact_cpu(dev, self.kernels)  # the CPU's exact kernel: widths are whole key pieces, not buckets
        self.widths = widths(self.pages * bs)
        cols, size = _TABLE + self.pages, self.buckets[-1]
        # Every input in one buffer [max bucket, 4 + pages] (one upload per step), and its host twin.
        self.inputs = torch.zeros(size, cols, dtype=torch.long, device=dev)
        self.host = torch.zeros(size, cols, dtype=torch.long, pin_memory=dev.type == "cuda")
        self.logits = torch.empty(size, runner.model.cfg.vocab_size, dtype=torch.float32, device=dev)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by (batch, width) bucket
        self._mempool: Any = None  # one memory pool shared by every bucket's graph
        self._lengths: list[int] = []  # the step's context lengths on the host (the CPU kernel's widths)
        self.replays = 0

    def accepts(self, items: Sequence[RunItem]) -> bool:
        """Whether this step is plain decoding this buffer can hold, and not so ragged that the
        runner's packed path (where it has one) reads less."""
        if not 0 < len(items) <= self.buckets[-1] or not all(
                len(it.token_ids) == 1 and it.start > 0 and it.want_logits and not it.all_logits and not it.unslotted
                and not it.context_feed and it.feeds is None and it.start < self.pages * self.bs for it in items):
            return False
        size, width = self._shape(items)  # (the paged kernel gathers nothing: no padding to weigh)
        return self.paged or not pack_decodes(self.runner.attention.can_pack, size * width, sum(it.start + 1 for it in items))

    def _shape(self, items: Sequence[RunItem]) -> tuple[int, int]:
        """The (batch, width) bucket of a step: the exact kernel's whole key pieces (`key_rows`) on the CPU."""
        size = self.buckets[bisect.bisect_left(self.buckets, len(items))]
        longest = max(it.start for it in items) + 1
        if self.exact:
            return size, key_rows(longest)
        return size, self.widths[bisect.bisect_left(self.widths, longest)]

    @torch.inference_mode()
    def run(self, items: Sequence[RunItem]) -> torch.Tensor:
        """One decode step of `items` -> fp32 logits [len(items), vocab] (a fresh tensor)."""
        n = len(items)
        size, width = self._shape(items)
        # The table's columns this step reads: the pages of its width (all of them for the paged
        # kernel, whose block mask maps the whole table).
        cols = _TABLE + (self.pages if self.paged else min(self.pages, -(-width // self.bs)))
        self._fill(items, size, cols)
        self.inputs[:size, :cols].copy_(self.host[:size, :cols], non_blocking=True)
        key = (size, width)
        graph = (self._graphs.get(key) or self._capture(key)) if self.graphs_on else None
        if graph is not None:
            graph.replay()
            self.replays += 1
        else:
            self.step(size, width)
        return self.logits[:n].clone()  # the buffer is the next step's too

    def _fill(self, items: Sequence[RunItem], size: int, cols: int) -> None:
        """The step's inputs into the host buffer (numpy: a few operations per row, not a tensor op
        per field). Padding rows decode token 0 at position 0 into the sink."""
        h, bs = self.host[:size, :cols].numpy(), self.bs  # a view of the (pinned) host buffer
        h[:, _TABLE:] = self.pad_block
        h[:, :_TABLE] = (0, 0, self.pad_block * bs, 1)  # ids, positions, slots, lengths
        for r, it in enumerate(items):
            p, pages = it.start, it.start // bs + 1
            h[r, _TABLE : _TABLE + pages] = it.block_ids[:pages]
            h[r, :_TABLE] = (it.token_ids[0], p, it.block_ids[pages - 1] * bs + p % bs, p + 1)
        self._lengths = [it.start + 1 for it in items] + [1] * (size - len(items))

    def step(self, size: int, width: int) -> None:
        """The captured function: reads inputs[:size], writes the pool and logits[:size]; contexts
        are gathered to `width` tokens."""
        model, inp = self.runner.model, self.inputs[:size]
        pages = PageTable(inp[:, _TABLE:], inp[:, _POS], inp[:, _LEN], self.pad_block)
        attention = _StaticAttention(self, pages, inp[:, _SLOT], width)
        h = model.run_layers(model.embed(inp[:, _IDS]), attention)
        self.logits[:size].copy_(model.logits(h))

    def _capture(self, key: tuple[int, int]) -> torch.cuda.CUDAGraph | None:
        """Warm the step up on a side stream (settles the allocator; compiles a kernel where one
        is compiled), then capture it. The warm-up writes the current inputs' K/V: the same values
        the replay writes. None (and eager decoding from then on) where this torch cannot capture
        the step."""
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.step(*key)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the store's writer and the restore worker keep working during a capture
            # (pinning arena segments, copying on their own streams). Under the default ("global")
            # mode such a call on any thread fails and invalidates the capture: on an H200 a save's
            # pinned allocation failed (the chunk was lost) and decoding fell back to eager for good.
            with torch.cuda.graph(graph, pool=self._mempool, capture_error_mode="thread_local"):
                self.step(*key)
        except Exception as e:  # noqa: BLE001 - an op that cannot be captured: stay correct, eagerly
            log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly", e)
            self.graphs_on = False
            return None
        self._mempool = graph.pool()
        self._graphs[key] = graph
        return graph


class _StaticAttention(LayerAttention):
    """Every layer of a static decode step: write the tokens' K/V at their slots, attend over the
    block table."""

    def __init__(self, sd: StaticDecode, pages: PageTable, slots: torch.Tensor, width: int) -> None:
        self.sd, self.pages, self.slots = sd, pages, slots
        self.cos, self.sin = sd.runner.rope.halves(pages.starts)  # [size, 1, hd/2]: a decode sits at its start
        if not sd.paged:  # the gather's slots and mask: the same for every layer
            bs, dev = sd.bs, slots.device
            n_pages = -(-width // bs)
            table = F.pad(pages.table[:, :n_pages], (0, max(0, n_pages - pages.table.shape[1])), value=sd.pad_block)
            self.gather = (table[:, :, None] * bs + torch.arange(bs, device=dev)).flatten(1)[:, :width]  # [size, width]
            self.valid = torch.arange(width, device=dev)[None, :] < pages.lengths[:, None]  # [size, width]
            self.hide = ~self.valid[:, :, None, None]  # [size, width, 1, 1]

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        r = self.sd.runner
        kc, vc = r.k_cache[li], r.v_cache[li]  # [slots, kv_heads, hd]
        kc.index_copy_(0, self.slots, k)
        vc.index_copy_(0, self.slots, v)
        if self.sd.paged:
            return paged_attention(q[:, None], kc, vc, self.pages, self.sd.bs, compiled=q.is_cuda)[:, 0]
        # Each context gathered to the step's width, zero past its length (a stale slot may hold
        # NaN, which a 0 weight would not cancel): [size, width, kv_heads, hd].
        ks, vs = (c.index_select(0, self.gather.flatten()).view(*self.gather.shape, *c.shape[1:]) for c in (kc, vc))
        ks, vs = (x.masked_fill_(self.hide, 0) for x in (ks, vs))
        if self.sd.exact:
            return decode_attention(q, ks, vs, self.sd._lengths, self.sd.kernels)
        out = F.scaled_dot_product_attention(q[:, :, None], ks.transpose(1, 2), vs.transpose(1, 2),
                                             attn_mask=self.valid[:, None, None, :], enable_gqa=q.shape[1] != kc.shape[1])
        return out[:, :, 0]  # [size, heads, hd]
