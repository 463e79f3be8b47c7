"""The model runner: the paged KV tensors and one forward pass over a batch of token runs.

A step's tokens from all requests are concatenated ("varlen"), so the projections and MLP run as
one matmul per layer; attention runs per request over that request's blocks in the pool (straight
from the pool when its blocks are consecutive, else gathered), or, for decoding requests, in one
batch (on the CPU's exact path each reads its whole key blocks in place where its blocks are
consecutive, `KeyReads`; elsewhere gathered and padded to the longest). K enters the pool rotated
at its position; a capture callback can take each layer's input and the K (rotated) and V computed
for every run on the way, which is what the store saves.
A step goes through the model's shared layer loop (`CausalLM.run_layers`) as a `StepAttention`.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F

from kvtier.engine.runner.transfer import Handle, Transfer, make_transfer
from kvtier.models import varlen
from kvtier.models.attention import causal_attention, decode_attention, exact_cpu, key_rows, masked_decode_sdpa
from kvtier.models.exact_attention import decode as exact_decode
from kvtier.models.exact_attention import split
from kvtier.models.llama import CausalLM, LayerAttention
from kvtier.models.rope import Rope, rotate_into
from kvtier.store.staging import PAGE, aligned_empty
from kvtier.store.tiers.base import PoolTarget

if TYPE_CHECKING:
    from kvtier.engine.runner.static_decode import StaticDecode

PACK_DECODES = False  # always pack decodes for varlen_attn where usable, not only ragged batches (see ModelRunner)
# Exact CPU decodes read their whole key blocks in place (one flash call per token) once the longest
# context passes this many keys; shorter ones are gathered and attend in one call. Per token, SmolLM2's
# 3 K/V heads leave one of 2 cores idle a third of a call: at 8 x 1024 that cost about what the gather
# saved (0.96x the step time, median of 5 pairs), at 8 x 4096 in place took 0.72-0.83x (docs/benchmarks.md).
IN_PLACE_KEYS = 2048
# A decode batch whose padding would read more than this many times its contexts' slots is packed
# instead, where varlen_attn is usable (one long context among short ones).
RAGGED = 4


def _context(new: torch.Tensor, cache: torch.Tensor, ctx: range | torch.Tensor | None,
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


def pack_decodes(can_pack: bool, padded_rows: int, context_rows: int) -> bool:
    """Whether a decode batch goes packed to varlen_attn rather than padded to its longest context
    for SDPA: padding is 2-7.5x faster per byte on an H200, so it wins unless it reads RAGGED times
    the contexts' slots."""
    return can_pack and (PACK_DECODES or padded_rows > RAGGED * context_rows)

# capture(layer, offsets, h [tokens, hidden], k [tokens, kv_heads, hd] rotated, v [tokens, kv_heads, hd]):
# once per layer for the whole step; run i is rows offsets[i]:offsets[i+1].
CaptureFn = Callable[[int, tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class RunItem:
    """One request's run of tokens in a step: positions [start, start + len(token_ids))."""

    token_ids: Sequence[int]
    start: int
    block_ids: Sequence[int]
    want_logits: bool
    # Logits of every token of the run, not just the last (prompt logprobs); they come first among
    # its rows, the last token's (when want_logits) among them.
    all_logits: bool = False
    # Prefix tokens not in the request's slots (importance-only restore): position p sits in slot
    # p - dropped; RoPE still rotates at p. 0 for every exact request.
    dropped: int = 0
    # Partial caching (eLLM): a decoding run's first `front` positions are not in its slots either
    # (position p sits in slot p - front) but, unlike dropped ones, are attended: their K/V come
    # from the step itself (a front run recomputing them) or from a FrontFeed. A multiple of the
    # block size.
    front: int = 0
    # A front run: positions [0, n) of decoding run `front_of`, recomputed from its ids. Its K/V
    # serve that run's attention in this step only: never written to the pool nor captured.
    front_of: int | None = None
    # Run off the scheduler's thread (a restore computing layers on its worker): past its context
    # only its own slots may be zeroed for an in-place read, never a clean block, which the
    # scheduler may meanwhile hand to a request whose step writes it.
    off_thread: bool = False

    @property
    def slot_start(self) -> int:
        return self.start - self.dropped - self.front


@dataclass(frozen=True)
class FrontFeed:
    """Where the fronts of a step's decoding runs come from, layer by layer: layers below
    `boundary` from front runs recomputed in the batch (they leave it there: a layer's recompute
    needs every layer before it), layers from `boundary` on from `kv(layer)` (K rotated at its
    positions and V, [sum of fronts, kv_heads, hd], fronts back to back in decoding-run order)."""

    boundary: int
    kv: Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class SlotRun:
    """Positions [pos, pos + length) of a request sit in consecutive pool slots from `slot`."""

    pos: int
    slot: int
    length: int


@dataclass(frozen=True)
class KeyReads:
    """Exact CPU attention of a step's decodes (none with a front): where each token reads its keys
    (`exact_attention.decode`), the same for every layer. Its whole key blocks are read in place
    where its pool slots are consecutive, so a long context is never copied; only its piece (at
    most one key block) and a scattered context's whole blocks are gathered."""

    pieces: torch.Tensor  # [decodes, piece width] pool slots of each token's piece from its base on (the zero slot past its context)
    in_place: tuple[range | None, ...]  # per decode: pool slots of its whole key blocks where consecutive
    gathered_rows: tuple[range | None, ...]  # per decode: else their rows in the gather of `scattered`
    scattered: torch.Tensor | None  # pool slots of the scattered decodes' whole key blocks, back to back


@dataclass(frozen=True)
class StepBatch:
    """Index tensors for one step, built once and shared by every layer (on the model's device:
    built on the host and uploaded in one asynchronous copy)."""

    items: tuple[RunItem, ...]
    ids: torch.Tensor  # [tokens]
    offsets: tuple[int, ...]  # run i is rows offsets[i]:offsets[i+1]
    new_slots: torch.Tensor  # [tokens] pool slot of each token computed now
    # Per run, where its context [0, end) is read from: a slot range (consecutive blocks: a view of
    # the pool, no copy), a slot index tensor (gathered), or None (a fresh run attends to itself).
    ctx: tuple[range | torch.Tensor | None, ...]
    # Per run, exact CPU attention only: K and V buffers [key_rows(context), kv_heads, hd], zero past
    # the context, that each layer writes the run's context into (see `_key_pieces`); None where the
    # context is read as it is (whole pieces as it lies, or read in place over its `tails`).
    pads: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]
    cos: torch.Tensor  # [tokens, 1, head_dim/2] RoPE half tables
    sin: torch.Tensor
    # Single-token runs with history (decodes) attend in one batch instead of one by one.
    decode_rows: tuple[int, ...] = ()  # run indices
    decode_slots: torch.Tensor | None = None  # [decodes, max_ctx] pool slots (padding: the zero slot)
    decode_mask: torch.Tensor | None = None  # [decodes, 1, 1, max_ctx] True where a key is real
    decode_q: torch.Tensor | None = None  # [decodes] row of each decoding run's token
    # On CUDA with flash varlen attention: the decodes' contexts packed, no padding (then
    # decode_slots/decode_mask are None): pool slots [sum ctx] and int32 offsets [decodes + 1].
    decode_pack: torch.Tensor | None = None
    decode_cu: torch.Tensor | None = None
    decode_width: int = 0  # the longest decoding context
    decode_lengths: tuple[int, ...] = ()  # each decode's context length (its token included)
    decode_keys: KeyReads | None = None  # exact CPU attention's reads (then decode_slots/decode_mask are None)
    last_rows: torch.Tensor | None = None  # [rows wanting logits]: each run's last token, every token of all_logits runs
    # Partial caching: where front K/V go in the decodes' gathered contexts (flat rows of the
    # padded [decodes * width] or packed layout), from which step rows (front runs; None: a FrontFeed),
    # and which rows' K/V enter the pool (None: all; front rows never do).
    front_dst: torch.Tensor | None = None
    front_src: torch.Tensor | None = None
    write_rows: torch.Tensor | None = None
    # Per run, exact CPU attention only: the pool slots past its context up to its last key piece's
    # end (`key_rows`), zeroed by each layer so that `ctx` (extended over them) is read in place
    # instead of copied into `pads` (see `ModelRunner.clearable`); None elsewhere.
    tails: tuple[range | None, ...] = ()


@dataclass(frozen=True)
class _DecodeLayout:
    """The decodes of a step batched: which runs, and their contexts' pool slots (host tensors)."""

    rows: tuple[int, ...]  # run indices
    ctx_len: list[int]  # per decode: front + cached positions + its token
    width: int  # the longest context
    slots: torch.Tensor  # [sum ctx_len] packed or [decodes * width] padded, flat
    ctx_at: list[int]  # where each decode's context starts in `slots`
    fronted: bool  # some decode has an uncached front
    packed: bool  # contexts back to back for varlen_attn, else padded to the longest
    keys: KeyReads | None = None  # exact CPU attention without fronts: the contexts are not gathered (`slots` empty)


@dataclass(frozen=True)
class _FrontLayout:
    """Partial caching on the host: where the decodes' front K/V go in their gathered contexts,
    from which step rows (front runs), and which rows' K/V enter the pool."""

    dst: torch.Tensor  # [sum of fronts] flat rows of the decodes' contexts
    src: torch.Tensor  # [sum of fronts computed by front runs] step rows
    writes: torch.Tensor  # [rows entering the pool] every row but the front runs'
    from_runs: bool  # some front is computed by a front run of this step


def _front_layout(items: Sequence[RunItem], offsets: Sequence[int], dec: _DecodeLayout) -> _FrontLayout:
    empty = torch.zeros(0, dtype=torch.long)
    dst = [torch.arange(at, at + items[i].front) for at, i in zip(dec.ctx_at, dec.rows)]
    front_run = {it.front_of: j for j, it in enumerate(items) if it.front_of is not None}
    src = [torch.arange(offsets[front_run[i]], offsets[front_run[i]] + items[i].front)
           for i in dec.rows if items[i].front and i in front_run]
    writes = [torch.arange(offsets[j], offsets[j + 1]) for j, it in enumerate(items) if it.front_of is None]
    return _FrontLayout(torch.cat(dst) if dst else empty, torch.cat(src) if src else empty, torch.cat(writes),
                        bool(src))


def slot_array(block_ids: Sequence[int], start: int, end: int, block_size: int) -> np.ndarray:
    """int64 pool slot of every position in [start, end) for a request owning `block_ids`."""
    pos = np.arange(start, end, dtype=np.int64)
    table = np.asarray(block_ids, dtype=np.int64)
    return table[pos // block_size] * block_size + pos % block_size


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_positions: int,
                 transfer: Transfer | None = None):
        cfg = model.cfg
        self.model = model
        self.block_size = block_size
        self.max_positions = max_positions
        # The pool, the RoPE tables and every index tensor of a step live where the weights are.
        self.device = device = model.lm_head.weight.device
        self.transfer = transfer if transfer is not None else make_transfer(device)
        self.rope = Rope(cfg, max_positions, model.dtype, device)
        # Past the blocks' slots, a sink no block owns: a restore's placement writes there the staged
        # rows it must not place (one kernel over a regular [chunks, tokens] grid, not one per run).
        # Whole pages, so every layer's slots stay as aligned as the blocks' (direct-I/O reads).
        # Its last slot holds zeros and nothing writes it: a batched decode's padding reads it (masked;
        # a 0 weight cancels only a finite value, so not another request's slot, which may hold NaN).
        slot_bytes = cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
        self.sink = num_blocks * block_size
        unit = block_size * (4096 // math.gcd(4096, block_size * slot_bytes))  # whole pages, whole blocks
        sink_slots = unit * 2 if unit == block_size else unit  # the zero slot past the sink's first block
        self.zero_slot = self.sink + sink_slots - 1
        shape = (cfg.num_layers, self.sink + sink_slots, cfg.num_kv_heads, cfg.head_dim)
        # On the CPU uninitialised, not zeros: zeros writes every page, while a slot is always written before
        # it is read, so an unused part of the budget never becomes resident memory. Page-aligned,
        # so a block-aligned run of slots can be the target of a direct-I/O disk read.

        def pool() -> torch.Tensor:
            if device.type != "cpu":  # allocated at once anyway; zeroed, as paged attention reads
                # the stale tail of a context's last page (weighted 0, which NaN would survive)
                return torch.zeros(shape, dtype=model.dtype, device=device)
            return aligned_empty(math.prod(shape) * model.dtype.itemsize).view(model.dtype).view(shape)

        self.k_cache = pool()  # [layers, slots, kv_heads, hd]
        self.v_cache = pool()
        for cache in (self.k_cache, self.v_cache):
            cache[:, self.zero_slot].zero_()
        if device.type == "cpu":
            self._fault_in(min(self.sink, -(-max_positions // block_size) * block_size))
        # Batched decodes gather their contexts to the longest and make one masked SDPA call with
        # grouped K/V heads; packing them for varlen_attn instead measured 2-7.5x slower on an
        # H200 (torch 2.11's has no grouped heads: K/V repeated per query head; docs/benchmarks.md),
        # so only a ragged batch is packed (`pack_decodes`).
        self.can_pack = varlen.usable(device, model.dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        if not exact_cpu(device):  # the plain path's masks: an import of seconds, here, not in a step
            importlib.import_module("torch.nn.attention.bias")
        self._flat: tuple[memoryview, memoryview] | None = None  # the pool as flat uint8 arrays, for direct reads
        # The decodes' gathered K and V (CPU): contexts or pieces (parts 0, 1), scattered whole key blocks (2, 3)
        self._gathered: list[torch.Tensor | None] = [None] * 4
        # Plain decode steps through static buffers (CUDA graphs on CUDA): set by the engine.
        self.decoder: StaticDecode | None = None
        # Device memory a restore's staging ring may take (0: no limit): set by the engine's budget.
        self.staging_bytes = 0
        # Whether a run's context may be read in place past its end (exact CPU attention): given the
        # run and the pool slots past its context to its last key piece's end, True where nothing
        # anyone reads lies there (`BlockPool.clearable`): the step zeroes them instead of copying
        # the whole context into a padded buffer every layer. Set by the engine, which owns the blocks.
        self.clearable: Callable[[RunItem, range], bool] | None = None

    def _fault_in(self, slots: int) -> None:
        """Map the host pages of the first `slots` slots of every layer now (one write per page):
        the block pool hands out blocks from the first on, so these are what the first requests
        use. Left to first touch, a restarted engine's first restore paid the kernel's page faults
        and zeroing inside its direct reads, on the cores the new tokens compute on (kernel time
        was 18% of a cold 4096-token restore's CPU samples, against 0.5% from memory). A long
        context's worth: the rest of the budget still becomes resident only when used."""
        for cache in (self.k_cache, self.v_cache):
            for layer in cache:  # [slots, kv_heads, hd]
                layer.view(-1).view(torch.uint8)[: layer[:slots].nbytes : PAGE].zero_()

    @staticmethod
    def bytes_per_block(model: CausalLM, block_size: int) -> int:
        cfg = model.cfg
        return 2 * cfg.num_layers * block_size * cfg.kv_dim * model.dtype.itemsize

    # ----- slots ------------------------------------------------------------------------------
    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Pool slot of every position in [start, end) for a request owning `block_ids` (on the host).
        In numpy: a few small torch CPU ops cost ~0.3-0.8 ms each beside a busy step thread (each
        releases the GIL and queues to take it back), numpy's ~10 us."""
        return torch.from_numpy(slot_array(block_ids, start, end, self.block_size))

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host index tensor on the pool's device (asynchronously; no host sync)."""
        return self.transfer.upload(t)

    def slot_runs(self, block_ids: Sequence[int], start: int, end: int) -> list[SlotRun]:
        """[start, end) cut where the request's blocks stop being consecutive in the pool."""
        bs, runs = self.block_size, []
        pos = start
        while pos < end:
            b = pos // bs
            last = b
            while (last + 1) * bs < end and block_ids[last + 1] == block_ids[last] + 1:
                last += 1
            stop = min(end, (last + 1) * bs)
            runs.append(SlotRun(pos, block_ids[b] * bs + pos % bs, stop - pos))
            pos = stop
        return runs

    def _context(self, block_ids: Sequence[int], end: int) -> range | torch.Tensor:
        runs = self.slot_runs(block_ids, 0, end)
        if len(runs) == 1:
            return range(runs[0].slot, runs[0].slot + end)
        return self.slots(block_ids, 0, end)

    # ----- one step ---------------------------------------------------------------------------
    def prepare(self, items: Sequence[RunItem]) -> StepBatch:
        """A step's index tensors: where each run's context is read from, the decodes' batched
        layout and the partially cached decodes' fronts, built on the host and uploaded at once."""
        fronts = [it.front_of is not None for it in items]
        if any(f and not later for f, later in zip(fronts, fronts[1:])):
            raise ValueError("front runs must come after every other run of a step")
        lens = [len(it.token_ids) for it in items]
        offsets = [0]
        for n in lens:
            offsets.append(offsets[-1] + n)
        dec = self._decode_layout(items, lens)
        front = _front_layout(items, offsets, dec)
        ctx = tuple(None if it.start == 0 or i in dec.rows else self._context(it.block_ids, it.slot_start + n)
                    for i, (it, n) in enumerate(zip(items, lens)))
        return self._upload(items, lens, offsets, dec, front, ctx)

    def _decode_layout(self, items: Sequence[RunItem], lens: Sequence[int]) -> _DecodeLayout:
        """Which runs decode in one batch (single tokens with history), and their contexts' pool
        slots: packed back to back (flash varlen) or padded to the longest (padding: the zero slot, masked).
        A decode's context is its front (slot 0 here: filled after the gather), then its slots."""
        rows = tuple(i for i, (it, n) in enumerate(zip(items, lens)) if n == 1 and it.start > 0)
        fronted = any(items[i].front for i in rows)
        if len(rows) < 2 and not fronted:  # a partially cached decode needs the batched path's gather
            rows = ()
        ctx_len = [items[i].front + items[i].slot_start + 1 for i in rows]
        width = max(ctx_len, default=0)
        if exact_cpu(self.device) and rows and not fronted and width > IN_PLACE_KEYS:
            keys = self._key_reads([items[i].block_ids for i in rows], ctx_len)
            return _DecodeLayout(rows, ctx_len, width, slots=torch.zeros(0, dtype=torch.long), ctx_at=[],
                                 fronted=False, packed=False, keys=keys)
        if exact_cpu(self.device):  # exact attention reads whole key pieces (`key_rows`): gather them at once
            width = key_rows(width)
        cached = [self.slots(items[i].block_ids, 0, items[i].slot_start + 1) for i in rows]
        packed = pack_decodes(self.can_pack, len(rows) * width, sum(ctx_len))
        if packed:  # each context's slots, back to back
            slots = torch.cat([F.pad(c, (items[i].front, 0)) for i, c in zip(rows, cached)]) \
                if rows else torch.zeros(0, dtype=torch.long)  # [sum ctx_len]
            ctx_at = [sum(ctx_len[:r]) for r in range(len(rows))]
        else:  # padded to the longest
            slots = torch.full((len(rows), width), self.zero_slot, dtype=torch.long)  # [decodes, width]
            for r, (i, c) in enumerate(zip(rows, cached)):
                slots[r, items[i].front : ctx_len[r]] = c
            ctx_at = [r * width for r in range(len(rows))]
        return _DecodeLayout(rows, ctx_len, width, slots.view(-1), ctx_at, fronted, packed)

    def _key_reads(self, tables: Sequence[Sequence[int]], ctx_len: Sequence[int]) -> KeyReads:
        """Exact CPU decodes' reads (on the host: exact attention runs on the CPU): each token's
        piece slots, and its whole key blocks as a slot range where its blocks are consecutive."""
        splits = [split(n) for n in ctx_len]
        reach = max(keys for _, keys in splits)
        pieces = np.full((len(ctx_len), reach), self.zero_slot, dtype=np.int64)
        in_place: list[range | None] = []
        gathered_rows: list[range | None] = []
        scattered, at = [], 0
        for r, (table, n, (base, _)) in enumerate(zip(tables, ctx_len, splits)):
            pieces[r, : n - base] = slot_array(table, base, n, self.block_size)
            runs = self.slot_runs(table, 0, base)
            place = range(runs[0].slot, runs[0].slot + base) if len(runs) == 1 else None
            in_place.append(place)
            gathered_rows.append(range(at, at + base) if base and place is None else None)
            if base and place is None:
                scattered.append(slot_array(table, 0, base, self.block_size))
                at += base
        return KeyReads(torch.from_numpy(pieces), tuple(in_place), tuple(gathered_rows),
                        torch.from_numpy(np.concatenate(scattered)) if scattered else None)

    def _upload(self, items: Sequence[RunItem], lens: Sequence[int], offsets: list[int], dec: _DecodeLayout,
                front: _FrontLayout, ctx: tuple[range | torch.Tensor | None, ...]) -> StepBatch:
        """Every index tensor of the step in one host buffer, uploaded in one copy, then split."""
        writing = [(it, n) for it, n in zip(items, lens) if it.front_of is None]
        last = [r for i, it in enumerate(items) for r in (range(offsets[i], offsets[i + 1]) if it.all_logits
                                                           else [offsets[i + 1] - 1] if it.want_logits else [])]
        host = [
            torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long),  # ids
            torch.cat([torch.arange(it.start, it.start + n) for it, n in zip(items, lens)]),  # positions
            torch.cat([self.slots(it.block_ids, it.slot_start, it.slot_start + n) for it, n in writing]),  # new slots
            dec.slots,
            torch.tensor(dec.ctx_len, dtype=torch.long),
            torch.tensor([offsets[i] for i in dec.rows], dtype=torch.long),  # decode q rows
            torch.tensor(last, dtype=torch.long),
            front.dst,
            front.src,
            front.writes,
        ] + [c for c in ctx if isinstance(c, torch.Tensor)]
        sizes = [t.numel() for t in host]
        dev = self.upload(torch.cat(host)).split(sizes)
        ids, positions, new_slots, dec_flat, dec_len, dec_q, last_rows, f_dst, f_src, write_rows = dev[:10]
        gathered = iter(dev[10:])
        cos, sin = self.rope.halves(positions)
        rows, width = dec.rows, dec.width
        dec_mask = dec_cu = None
        if rows and dec.packed:
            dec_cu = F.pad(dec_len.cumsum(0), (1, 0)).to(torch.int32)  # [decodes + 1], on the device
        elif rows and dec.keys is None:
            dec_mask = (torch.arange(width, device=self.device)[None, :] < dec_len[:, None])[:, None, None, :]
        tails = tuple(None if i in rows else self._tail(it, c) for i, (it, c) in enumerate(zip(items, ctx)))
        read = tuple(c if t is None else range(cast(range, c).start, t.stop) for c, t in zip(ctx, tails))
        return StepBatch(
            items=tuple(items),
            ids=ids,
            offsets=tuple(offsets),
            new_slots=new_slots,
            ctx=tuple(next(gathered) if isinstance(c, torch.Tensor) else c for c in read),
            pads=tuple(None if i in rows or t is not None else
                       self._key_pieces(it.slot_start + n if c is not None else n, isinstance(c, torch.Tensor))
                       for i, (it, n, c, t) in enumerate(zip(items, lens, ctx, tails))),
            tails=tails,
            cos=cos,
            sin=sin,
            decode_rows=rows,
            decode_slots=dec_flat.view(len(rows), width) if rows and not dec.packed and dec.keys is None else None,
            decode_mask=dec_mask,
            decode_pack=dec_flat if rows and dec.packed else None,
            decode_cu=dec_cu,
            decode_width=width,
            decode_lengths=tuple(dec.ctx_len),
            decode_keys=dec.keys,
            decode_q=dec_q if rows else None,
            last_rows=last_rows,
            front_dst=f_dst if dec.fronted else None,
            front_src=f_src if front.from_runs else None,
            write_rows=write_rows if len(writing) < len(items) else None,
        )

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: StepBatch,
               capture: CaptureFn | None = None, fed: FrontFeed | None = None) -> torch.Tensor:
        """Layer `li`'s attention for every run in the batch (q, k rotated): writes its K/V into the
        pool, -> [tokens, heads, hd]. `fed`: the fronts of this layer come from it, not from front runs."""
        if capture is not None:
            capture(li, b.offsets, h, k, v)  # front runs come last: the capture's requests stop before them
        kc, vc = self.k_cache[li], self.v_cache[li]
        if b.write_rows is None:
            kc.index_copy_(0, b.new_slots, k)
            vc.index_copy_(0, b.new_slots, v)
        else:  # front rows stay out of the pool
            kc.index_copy_(0, b.new_slots, k.index_select(0, b.write_rows))
            vc.index_copy_(0, b.new_slots, v.index_select(0, b.write_rows))
        outs: list[torch.Tensor | None] = [None] * len(b.items)
        if b.decode_rows:
            front = None
            if b.front_src is not None:
                front = k.index_select(0, b.front_src), v.index_select(0, b.front_src)
            elif fed is not None:
                front = fed.kv(li)
            batched = self._decode_attention(q, kc, vc, b, front)  # [decodes, heads, hd]
            for r, i in enumerate(b.decode_rows):
                outs[i] = batched[r : r + 1]
        for i, it in enumerate(b.items):
            if outs[i] is not None:
                continue
            lo, hi = b.offsets[i], b.offsets[i + 1]
            ctx, pad, tail = b.ctx[i], b.pads[i] or (None, None), b.tails[i] if b.tails else None
            if tail is not None:  # whole key pieces in place: zeros past the context, this layer's
                kc[tail.start : tail.stop].zero_()
                vc[tail.start : tail.stop].zero_()
            kk, vv = (_context(new[lo:hi], cache, ctx, p) for new, cache, p in ((k, kc, pad[0]), (v, vc, pad[1])))
            outs[i] = causal_attention(q[lo:hi], kk, vv, 0 if ctx is None else it.slot_start)
        done = cast("list[torch.Tensor]", outs)  # every run has its output by now
        return torch.cat(done) if len(done) > 1 else done[0]

    def _tail(self, it: RunItem, ctx: range | torch.Tensor | None) -> range | None:
        """The pool slots [end of `ctx`, its start + key_rows) where the run's context, consecutive in
        the pool and ending inside a key piece, may be read in place with them zeroed; None where
        it may not (see `clearable`)."""
        if not isinstance(ctx, range) or self.clearable is None or not exact_cpu(self.device):
            return None
        tail = range(ctx.stop, ctx.start + key_rows(len(ctx)))
        return tail if len(tail) and self.clearable(it, tail) else None

    def _key_pieces(self, rows: int, gathered: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Exact CPU attention reads a context of `rows` positions as whole key pieces (`key_rows`),
        zero past its end. Where the context is not that as it lies (it ends inside a piece, or is
        gathered), two buffers [key_rows(rows), kv_heads, hd] for the step, their tail zeroed once:
        each layer then writes the context into them, one copy, instead of allocating, zeroing and
        filling a padded copy per layer (and, gathered, copying it twice)."""
        keys = key_rows(rows)
        if not exact_cpu(self.device) or (keys == rows and not gathered):
            return None
        k, v = (torch.empty((keys, *self.k_cache.shape[2:]), dtype=self.k_cache.dtype, device=self.device)
                for _ in range(2))
        k[rows:].zero_()
        v[rows:].zero_()
        return k, v

    def _gather_buffer(self, part: int, rows: int) -> torch.Tensor:
        """Where the decodes' contexts of K (part 0) or V (1) are gathered, [rows, kv_heads, hd]
        (exact CPU decodes: their pieces, and 2 and 3 their scattered whole key blocks). On
        the CPU one buffer per part, kept between steps and grown as needed: a fresh one of tens
        of MB is page-faulted in on every allocation, 4-5x the cost of gathering into one reused
        (batch 32 x 4K). A device's caching allocator already reuses its blocks."""
        shape = (rows, *self.k_cache.shape[2:])
        if self.device.type != "cpu":
            return torch.empty(shape, dtype=self.k_cache.dtype, device=self.device)
        buf = self._gathered[part]
        if buf is None or buf.shape[0] < rows:
            buf = self._gathered[part] = torch.empty(shape, dtype=self.k_cache.dtype)
        return buf[:rows]

    def _decode_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: StepBatch,
                          front: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One attention call for every decoding run: flash varlen over the packed contexts (CUDA),
        else one SDPA call over contexts padded to the longest and masked. `front`: K/V of the
        decodes' uncached fronts, put in place in the gathered contexts (one copy each)."""

        def gather(cache: torch.Tensor, slots: torch.Tensor, part: int) -> torch.Tensor:
            out = self._gather_buffer(part, slots.numel())  # [contexts' slots, kv_heads, hd]
            torch.index_select(cache, 0, slots, out=out)
            if front is not None and b.front_dst is not None:
                out.index_copy_(0, b.front_dst, front[part])
            return out

        if b.decode_pack is not None and b.decode_cu is not None and b.decode_q is not None:
            n = len(b.decode_rows)
            cu_q = torch.arange(n + 1, device=q.device, dtype=torch.int32)
            return varlen.attend(q.index_select(0, b.decode_q), gather(kc, b.decode_pack, 0),
                                 gather(vc, b.decode_pack, 1), cu_q, b.decode_cu, 1, b.decode_width)  # [n, heads, hd]
        if b.decode_keys is not None and b.decode_q is not None:
            return self._exact_decode(q.index_select(0, b.decode_q), kc, vc, b.decode_keys, b.decode_lengths)
        if b.decode_slots is None or b.decode_mask is None or b.decode_q is None:
            raise RuntimeError("decode attention without decode rows")
        n, width = b.decode_slots.shape
        kv_heads = kc.shape[1]
        qd = q.index_select(0, b.decode_q).unsqueeze(2)  # [n, heads, 1, hd]
        flat = b.decode_slots.reshape(-1)
        ks = gather(kc, flat, 0).view(n, width, kv_heads, -1)  # [n, width, kv_heads, hd]
        vs = gather(vc, flat, 1).view(n, width, kv_heads, -1)
        if exact_cpu(q.device):
            return decode_attention(q.index_select(0, b.decode_q), ks, vs, list(b.decode_lengths))
        ks, vs = ks.transpose(1, 2), vs.transpose(1, 2)  # [n, kv_heads, width, hd]
        if q.is_cuda:
            return masked_decode_sdpa(qd.squeeze(2), ks, vs, b.decode_mask)  # [n, heads, hd]
        out = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=b.decode_mask,
                                             enable_gqa=q.shape[1] != kv_heads)  # [n, heads, 1, hd]
        return out.squeeze(2)

    def _exact_decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, keys: KeyReads,
                      lengths: Sequence[int]) -> torch.Tensor:
        """Exact CPU attention of the decodes, q [n, heads, hd], reading each one's whole key
        blocks in place where its slots are consecutive -> [n, heads, hd]."""
        n, reach = keys.pieces.shape
        pieces = [torch.index_select(cache, 0, keys.pieces.view(-1), out=self._gather_buffer(part, n * reach))
                  .view(n, reach, *cache.shape[1:]) for part, cache in enumerate((kc, vc))]  # [n, reach, kvh, hd]
        spread = keys.scattered
        gathered = [] if spread is None else \
            [torch.index_select(cache, 0, spread, out=self._gather_buffer(2 + part, spread.numel()))
             for part, cache in enumerate((kc, vc))]  # [their whole blocks' keys, kvh, hd]
        wholes = [(kc[p.start : p.stop], vc[p.start : p.stop]) if p is not None else
                  (gathered[0][g.start : g.stop], gathered[1][g.start : g.stop]) if g is not None else None
                  for p, g in zip(keys.in_place, keys.gathered_rows)]
        return exact_decode(q, (pieces[0], pieces[1]), wholes, lengths)

    @torch.inference_mode()
    def execute(
        self,
        items: Sequence[RunItem],
        capture: CaptureFn | None = None,
        layers: range | None = None,
        before_layer: Callable[[int], None] | None = None,
        every_token: bool = False,
        fed: FrontFeed | None = None,
    ) -> torch.Tensor:
        """Run one step. Returns fp32 logits [rows, vocab]: the last token of each item with
        want_logits, every token of each item with all_logits, in item order (
        with `every_token`, [tokens, vocab] for every token of the step: scoring a continuation).

        `layers` limits the pass to a prefix of the layers (restoring by recomputing the first
        layers only; no logits then). `before_layer(l)` runs before layer l, which is how a restore
        puts a layer's history into the pool just in time for the new tokens (layer-wise overlap).
        Front runs (partial caching) come after every other run; with `fed` they leave the batch
        at its boundary and the fronts' remaining layers come from it.
        """
        if (self.decoder is not None and capture is None and before_layer is None and fed is None and layers is None
                and not every_token and self.decoder.accepts(items)):
            return self.decoder.run(items)
        model = self.model
        layers = layers if layers is not None else range(model.cfg.num_layers)
        step = StepAttention(self, items, capture, before_layer, fed)
        h = model.run_layers(model.embed(step.batch.ids), step, layers)  # [tokens, hidden]
        if every_token and layers.stop == model.cfg.num_layers:
            return model.logits(h)  # [tokens, vocab]
        b = step.batch
        if b.last_rows is None or not b.last_rows.numel() or layers.stop != model.cfg.num_layers:
            return torch.empty(0, model.cfg.vocab_size, device=self.device)
        return model.logits(h.index_select(0, b.last_rows))  # [requests sampling, vocab]

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int, tokens: int) -> None:
        """Copy the first `tokens` slots of block `src` to block `dst`, every layer (the other
        samples of an n > 1 request take the prompt's partial last block this way). Stream-ordered
        before the next step's kernels, which are the first to read or overwrite either block."""
        a, b = src * self.block_size, dst * self.block_size
        for cache in (self.k_cache, self.v_cache):  # [layers, slots, kv_heads, hd]
            cache[:, b : b + tokens] = cache[:, a : a + tokens]

    # ----- placing restored state -----------------------------------------------------------
    @torch.inference_mode()
    def copy_in(self, layers: range, runs: Sequence[tuple[int, int]], k: Sequence[torch.Tensor],
                v: Sequence[torch.Tensor]) -> Handle:
        """Copy stored K (already rotated at these positions) and V into the pool for consecutive
        `layers`: piece i ([len(layers), n_i, kv_heads, hd], any strides) goes to slots
        [runs[i][0], runs[i][0] + runs[i][1]) of every one of them. Each piece is one strided copy
        covering every layer (no Python loop of kernels); on CUDA they run on the copy stream and
        the returned handle must be waited on before the layers are read."""
        a, b = layers.start, layers.stop
        dst = [self.k_cache[a:b, s : s + n] for s, n in runs] + [self.v_cache[a:b, s : s + n] for s, n in runs]
        return self.transfer.to_device(dst, list(k) + list(v))

    @torch.inference_mode()
    def place_staged(self, layer: int, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Staged K/V rows of one layer into the pool: k, v [chunks, tokens, kv_heads, hd] (strided
        views of a restore's staging buffer) go to slots `index` [chunks, tokens] (`self.sink` for
        rows that must not be placed). One kernel per part, on the compute stream."""
        self.transfer.scatter(self.k_cache[layer], index, k)
        self.transfer.scatter(self.v_cache[layer], index, v)

    def pool_target(self, slot: int) -> PoolTarget:
        """Where a direct read may land a stored chunk whose tokens take slots from `slot` on."""
        if self._flat is None:
            k, v = (c.view(-1).view(torch.uint8).numpy().data for c in (self.k_cache, self.v_cache))
            self._flat = (k, v)
        align = math.gcd(4096, self.k_cache.data_ptr(), self.v_cache.data_ptr())
        return PoolTarget(*self._flat, align=align, layer_bytes=self.k_cache[0].nbytes,
                          slot_bytes=self.k_cache[0, 0].nbytes, slot=slot)

    @torch.inference_mode()
    def project_in(self, layer: int, h: torch.Tensor, positions: torch.Tensor | tuple[int, int],
                   slots: torch.Tensor) -> None:
        """Rebuild K/V of `layer` from stored layer inputs h [n, hidden] (HCache), rotate K at
        `positions` (a tensor, or a (start, end) span) and write both into the pool at `slots`.
        h and the index tensors are on the pool's device."""
        k, v = self.model.layers[layer].kv(h.to(self.k_cache.dtype))  # [n, kv_heads, hd] before RoPE
        cos, sin = self.rope.span(*positions) if isinstance(positions, tuple) else self.rope.halves(positions)
        self.k_cache[layer].index_copy_(0, slots, rotate_into(k, cos, sin, torch.empty_like(k)))
        self.v_cache[layer].index_copy_(0, slots, v)

    @torch.inference_mode()
    def shift_in(self, layer: int, k: torch.Tensor, v: torch.Tensor, shift: torch.Tensor, slots: torch.Tensor) -> None:
        """Place stored K rotated by `shift` more positions (context truncation moved its tokens)."""
        cos, sin = self.rope.delta(shift)
        k = k.to(self.k_cache.dtype)
        self.k_cache[layer].index_copy_(0, slots, rotate_into(k, cos, sin, torch.empty_like(k)))
        self.v_cache[layer].index_copy_(0, slots, v.to(self.v_cache.dtype))


class StepAttention(LayerAttention):
    """One engine step through the shared layer loop: the restore's `before_layer` hook, front runs
    leaving the batch at the feed's boundary (their rows are the last ones), and each layer's pool
    writes and per-run attention (`ModelRunner.attend`)."""

    def __init__(self, runner: ModelRunner, items: Sequence[RunItem], capture: CaptureFn | None,
                 before_layer: Callable[[int], None] | None, fed: FrontFeed | None) -> None:
        self.runner, self.items, self.capture, self.before_layer, self.fed = runner, items, capture, before_layer, fed
        self.batch = runner.prepare(items)

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch.cos, self.batch.sin  # [tokens, 1, hd/2]

    def enter(self, li: int, h: torch.Tensor) -> torch.Tensor:
        if self.before_layer is not None:
            self.before_layer(li)
        if self.fed is not None and li == self.fed.boundary and self.batch.front_src is not None:
            kept = [it for it in self.items if it.front_of is None]
            h = h[: sum(len(it.token_ids) for it in kept)]  # front rows are the last ones
            self.batch = self.runner.prepare(kept)
        return h

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        fed = self.fed if self.fed is not None and li >= self.fed.boundary else None
        return self.runner.attend(li, h, q, k, v, self.batch, self.capture, fed)
