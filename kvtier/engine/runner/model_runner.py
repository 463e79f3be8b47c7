"""The model runner: the paged KV tensors and one forward pass over a batch of token runs.

A step's tokens from all requests are concatenated ("varlen"), so the projections and MLP run as
one matmul per layer. The runner builds the step's common metadata (`batch.StepBatch`: ids, RoPE
tables, pool slots, rows wanting logits, how each run reads its context) and writes each layer's
K/V into the pool; the attention backend chosen for the runner (`backends.choose`: exact CPU,
SDPA, flash varlen) lays out the batched decodes and runs the attention. A plain decode step may
go through a whole-step decoder instead (`decoder`: static buffers, CUDA graphs). K enters the pool
rotated at its position; a capture callback can take each layer's input and the K (rotated) and V
computed for every run on the way, which is what the store saves.
A step goes through the model's shared layer loop (`CausalLM.run_layers`) as a `StepAttention`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, cast

import torch

from kvtier.engine.runner.backends import choose
from kvtier.engine.runner.backends.base import AttentionBackend, PoolSpec, StepDecoder, StepLayout
from kvtier.engine.runner.batch import (
    CaptureFn,
    ContextFeed,
    RunItem,
    RunRead,
    SlotRun,
    StepBatch,
    Uploads,
    feeding_rows,
    logit_rows,
    slot_array,
    slot_runs,
)
from kvtier.engine.runner.transfer import Handle, Transfer, make_transfer
from kvtier.models.llama import CausalLM, LayerAttention
from kvtier.models.rope import Rope, rotate_into
from kvtier.store.staging import PAGE, aligned_empty
from kvtier.store.tiers.base import PoolTarget

__all__ = ["CaptureFn", "ContextFeed", "ModelRunner", "RunItem", "SlotRun", "StepAttention", "slot_array"]


class ModelRunner:
    """The worker side of a step: the KV pool, slot math, one forward pass over a batch of runs
    (`execute`), and the placement API restores write the pool through. Attention is its
    backend's (`self.attention`, chosen once from the device, dtype and exact mode)."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, max_positions: int,
                 transfer: Transfer | None = None, *, staging_bytes: int = 0,
                 clearable: Callable[[RunItem, range], bool] | None = None,
                 decoder: Callable[[ModelRunner], StepDecoder] | None = None):
        """`staging_bytes`: device memory a restore's staging ring may take (0: no limit).
        `clearable(run, slots)`: whether the pool slots past a run's context, to its last key
        piece's end, hold nothing anyone reads (`BlockPool.clearable`, the owner of the blocks):
        the step then zeroes them and reads the context in place (exact CPU attention) instead of
        copying it into a padded buffer every layer; None: never. `decoder`: makes the whole-step
        path plain decode steps go through (static buffers; CUDA graphs on CUDA)."""
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
        self.attention: AttentionBackend[Any] = choose(PoolSpec(device, model.dtype, cfg.num_heads, cfg.num_kv_heads,
                                                                cfg.head_dim, block_size, self.zero_slot, model.kernels))
        self._flat: tuple[memoryview, memoryview] | None = None  # the pool as flat uint8 arrays, for direct reads
        self.staging_bytes = staging_bytes
        self.clearable = clearable
        self.decoder: StepDecoder | None = decoder(self) if decoder is not None else None

    def _fault_in(self, slots: int) -> None:
        """Map the host pages of the first `slots` slots of every layer now (one write per page):
        the block pool hands out blocks from the first on, so these are what the first requests
        use. Left to first touch, a restarted engine's first restore paid the kernel's page faults
        and zeroing inside its direct reads, on the cores the new tokens compute on (a large share
        of a cold restore's CPU time). A long context's worth: the rest of the budget still
        becomes resident only when used."""
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
        In numpy: a few small torch CPU ops cost far more each beside a busy step thread (each
        releases the GIL and queues to take it back)."""
        return torch.from_numpy(slot_array(block_ids, start, end, self.block_size))

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host index tensor on the pool's device (asynchronously; no host sync)."""
        return self.transfer.upload(t)

    def slot_runs(self, block_ids: Sequence[int], start: int, end: int) -> list[SlotRun]:
        """[start, end) cut where the request's blocks stop being consecutive in the pool."""
        return slot_runs(block_ids, start, end, self.block_size)

    def consecutive(self, block_ids: Sequence[int], start: int, end: int) -> slice | None:
        """The pool slots of positions [start, end) as one slice, where the request's blocks there
        lie consecutive in the pool (read or written in place); else None."""
        runs = self.slot_runs(block_ids, start, end)
        return slice(runs[0].slot, runs[0].slot + end - start) if len(runs) == 1 else None

    def _context(self, block_ids: Sequence[int], end: int) -> range | torch.Tensor:
        whole = self.consecutive(block_ids, 0, end)
        return range(whole.start, whole.stop) if whole is not None else self.slots(block_ids, 0, end)

    # ----- one step ---------------------------------------------------------------------------
    def prepare(self, items: Sequence[RunItem]) -> StepBatch[Any]:
        """A step's metadata: the common part here, the decodes' layout by the backend; built on
        the host and uploaded in one copy."""
        layout = self._layout(items)
        lens, offsets, rows = layout.lens, layout.offsets, layout.decode_rows
        src, writes = feeding_rows(items, offsets, rows)
        up = Uploads()
        at_ids = up.add(torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long))
        at_pos = up.add(torch.cat([torch.arange(it.start, it.start + n) for it, n in zip(items, lens)]))
        at_new = up.add(torch.cat([self.slots(it.block_ids, it.slot_start, it.slot_start + n)
                                   for it, n in zip(items, lens) if it.feeds is None]))
        at_last = up.add(logit_rows(items, offsets))
        at_q = up.add(torch.tensor([offsets[i] for i in rows], dtype=torch.long))
        at_src, at_writes = up.maybe(src), up.maybe(writes)
        reads = self.attention.reads(layout)
        at_ctx = [up.maybe(r.ctx if isinstance(r.ctx, torch.Tensor) else None) for r in reads]
        decodes = self.attention.decodes(layout, up) if rows else None
        up.send(self.upload)
        cos, sin = self.rope.halves(up[at_pos])
        return StepBatch(
            items=tuple(items),
            ids=up[at_ids],
            offsets=tuple(offsets),
            new_slots=up[at_new],
            write_rows=up.get(at_writes),
            cos=cos,
            sin=sin,
            last_rows=up[at_last],
            reads=tuple(r if at is None else RunRead(up[at], r.pad, r.tail) for r, at in zip(reads, at_ctx)),
            decode_rows=rows,
            decode_q=up[at_q] if rows else None,
            feed_src=up.get(at_src),
            decodes=None if decodes is None else decodes(),
        )

    def _layout(self, items: Sequence[RunItem]) -> StepLayout:
        """The step on the host: which runs decode in one batch (single tokens with history; a
        decode with fed context needs the batch's gather even alone) and where the others' contexts are."""
        feeding = [it.feeds is not None for it in items]
        if any(f and not later for f, later in zip(feeding, feeding[1:])):
            raise ValueError("feeding runs must come after every other run of a step")
        lens = [len(it.token_ids) for it in items]
        # Runs off the step's thread never batch as decodes: the decode batch reads through buffers
        # the backend keeps between steps, which the step thread may be using at the same time.
        rows = tuple(i for i, (it, n) in enumerate(zip(items, lens)) if n == 1 and it.start > 0 and not it.off_thread)
        if len(rows) < 2 and not any(items[i].context_feed for i in rows):
            rows = ()
        ctx = tuple(None if it.start == 0 or i in rows else self._context(it.block_ids, it.slot_start + n)
                    for i, (it, n) in enumerate(zip(items, lens)))
        ctx_len = [items[i].context_feed + items[i].slot_start + 1 for i in rows]
        return StepLayout(items, lens, list(accumulate(lens, initial=0)), rows, ctx_len, ctx, self.clearable)

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: StepBatch[Any],
               capture: CaptureFn | None = None, feed: ContextFeed | None = None) -> torch.Tensor:
        """Layer `li`'s attention for every run in the batch (q, k rotated): writes its K/V into the
        pool, -> [tokens, heads, hd]. `feed`: the fed context of this layer comes from it, not
        from feeding runs."""
        if capture is not None:
            capture(li, b.offsets, h, k, v)  # feeding runs come last: the capture's requests stop before them
        kc, vc = self.k_cache[li], self.v_cache[li]  # [slots, kv_heads, hd]
        if b.write_rows is None:
            kc.index_copy_(0, b.new_slots, k)
            vc.index_copy_(0, b.new_slots, v)
        else:  # feeding runs' rows stay out of the pool
            kc.index_copy_(0, b.new_slots, k.index_select(0, b.write_rows))
            vc.index_copy_(0, b.new_slots, v.index_select(0, b.write_rows))
        outs: list[torch.Tensor | None] = [None] * len(b.items)
        if b.decode_q is not None:
            fed = None
            if b.feed_src is not None:
                fed = k.index_select(0, b.feed_src), v.index_select(0, b.feed_src)
            elif feed is not None:
                fed = feed.kv(li)
            batched = self.attention.attend_decodes(q.index_select(0, b.decode_q), kc, vc, b.decodes, fed)
            for r, i in enumerate(b.decode_rows):  # [decodes, heads, hd]
                outs[i] = batched[r : r + 1]
        for i, it in enumerate(b.items):
            if outs[i] is None:
                lo, hi = b.offsets[i], b.offsets[i + 1]
                read = b.reads[i]
                outs[i] = self.attention.attend_run(q[lo:hi], k[lo:hi], v[lo:hi], kc, vc, read,
                                                    0 if read.ctx is None else it.slot_start)
        done = cast("list[torch.Tensor]", outs)  # every run has its output by now
        return torch.cat(done) if len(done) > 1 else done[0]

    @torch.inference_mode()
    def execute(
        self,
        items: Sequence[RunItem],
        capture: CaptureFn | None = None,
        layers: range | None = None,
        before_layer: Callable[[int], None] | None = None,
        every_token: bool = False,
        feed: ContextFeed | None = None,
    ) -> torch.Tensor:
        """Run one step. Returns fp32 logits [rows, vocab]: the last token of each item with
        want_logits, every token of each item with all_logits, in item order (
        with `every_token`, [tokens, vocab] for every token of the step: scoring a continuation).

        `layers` limits the pass to a prefix of the layers (restoring by recomputing the first
        layers only; no logits then). `before_layer(l)` runs before layer l, which is how a restore
        puts a layer's history into the pool just in time for the new tokens (layer-wise overlap).
        Feeding runs come after every other run; with `feed` they leave the batch at its boundary
        and the fed context's remaining layers come from it.
        """
        hooked = capture is not None or before_layer is not None or feed is not None or any(it.off_thread for it in items)
        if self.decoder is not None and not hooked and layers is None and not every_token and self.decoder.accepts(items):
            return self.decoder.run(items)
        model = self.model
        layers = layers if layers is not None else range(model.cfg.num_layers)
        step = StepAttention(self, items, capture, before_layer, feed)
        h = model.run_layers(model.embed(step.batch.ids), step, layers)  # [tokens, hidden]
        if every_token and layers.stop == model.cfg.num_layers:
            return model.logits(h)  # [tokens, vocab]
        b = step.batch
        if not b.last_rows.numel() or layers.stop != model.cfg.num_layers:
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
                   slots: torch.Tensor | slice) -> None:
        """Rebuild K/V of `layer` from stored layer inputs h [n, hidden], rotate K at
        `positions` (a tensor, or a (start, end) span) and write both into the pool at `slots`
        (an index tensor, or a slice where they are consecutive). h and the index tensors are on
        the pool's device."""
        k, v = self.model.layers[layer].kv(h.to(self.k_cache.dtype))  # [n, kv_heads, hd] before RoPE
        cos, sin = self.rope.span(*positions) if isinstance(positions, tuple) else self.rope.halves(positions)
        self._write(layer, slots, k, v, cos, sin)

    @torch.inference_mode()
    def shift_in(self, layer: int, k: torch.Tensor, v: torch.Tensor, shift: torch.Tensor | None,
                 slots: torch.Tensor | slice) -> None:
        """Place stored K rotated by `shift` more positions (context truncation or a blend moved its
        tokens): [n] per row, or [1] for every row; None: K as stored. `slots`: an index tensor, or
        a slice where they are consecutive (written in place, no scatter)."""
        self.rotate_in(layer, k, v, self.rope.delta(shift) if shift is not None else None, slots)

    @torch.inference_mode()
    def rotate_in(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                  rotation: tuple[torch.Tensor, torch.Tensor] | None, slots: torch.Tensor | slice) -> None:
        """`shift_in` with its rotation's tables made once (`rope.delta(shift)`: a caller placing
        many layers or pieces by the same shift)."""
        k, v = k.to(self.k_cache.dtype), v.to(self.v_cache.dtype)
        self._write(layer, slots, k, v, *(rotation if rotation is not None else (None, None)))

    @torch.inference_mode()
    def rotate_in_layers(self, layers: range, k: torch.Tensor, v: torch.Tensor,
                         rotation: tuple[torch.Tensor, torch.Tensor] | None, slots: slice) -> None:
        """`rotate_in` of consecutive `layers` at once into consecutive `slots`: k, v [layers, n,
        kv_heads, hd] (one call for the layers: the same elementwise bits as one a layer)."""
        kc, vc = (c[layers.start : layers.stop, slots] for c in (self.k_cache, self.v_cache))  # [layers, n, kvh, hd]
        k, v = k.to(kc.dtype), v.to(vc.dtype)
        if rotation is None:
            kc.copy_(k)
        else:
            rotate_into(k, rotation[0], rotation[1], kc)
        vc.copy_(v)

    @torch.inference_mode()
    def place_rows(self, layers: range, k: torch.Tensor, v: torch.Tensor,
                   rotation: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> None:
        """Rows of consecutive `layers` into the pool's `slots` [n]: k, v [layers, n, kv_heads,
        hd], K rotated row by row (cos, sin [n, 1, hd/2]); one rotation and two scatters for the
        layers (elementwise: the bits of `rotate_in_layers` piece by piece, where a row of no
        shift, rotated by cos 1 and sin 0, is a copy up to the sign of a zero)."""
        kc, vc = (c[layers.start : layers.stop] for c in (self.k_cache, self.v_cache))  # [layers, slots, kvh, hd]
        kc.index_copy_(1, slots, rotate_into(k, rotation[0], rotation[1], torch.empty_like(k)))
        vc.index_copy_(1, slots, v)

    def _write(self, layer: int, slots: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor,
               cos: torch.Tensor | None, sin: torch.Tensor | None) -> None:
        """K (rotated by cos/sin [n or 1, 1, hd/2] unless None) and V [n, kv_heads, hd] into the pool."""
        rotation = None if cos is None or sin is None else (cos, sin)
        if isinstance(slots, slice):  # consecutive slots: rotate straight into the pool's rows
            self.rotate_in_layers(range(layer, layer + 1), k[None], v[None], rotation, slots)
            return
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        kc.index_copy_(0, slots, k if cos is None or sin is None else rotate_into(k, cos, sin, torch.empty_like(k)))
        vc.index_copy_(0, slots, v)


class StepAttention(LayerAttention):
    """One engine step through the shared layer loop: the restore's `before_layer` hook, feeding
    runs leaving the batch at the feed's boundary (their rows are the last ones), and each layer's
    pool writes and attention (`ModelRunner.attend`)."""

    def __init__(self, runner: ModelRunner, items: Sequence[RunItem], capture: CaptureFn | None,
                 before_layer: Callable[[int], None] | None, feed: ContextFeed | None) -> None:
        self.runner, self.items, self.capture, self.before_layer, self.feed = runner, items, capture, before_layer, feed
        self.batch = runner.prepare(items)

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch.cos, self.batch.sin  # [tokens, 1, hd/2]

    def enter(self, li: int, h: torch.Tensor) -> torch.Tensor:
        if self.before_layer is not None:
            self.before_layer(li)
        if self.feed is not None and li == self.feed.boundary and self.batch.feed_src is not None:
            kept = [it for it in self.items if it.feeds is None]
            h = h[: sum(len(it.token_ids) for it in kept)]  # feeding runs' rows are the last ones
            self.batch = self.runner.prepare(kept)
        return h

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        feed = self.feed if self.feed is not None and li >= self.feed.boundary else None
        return self.runner.attend(li, h, q, k, v, self.batch, self.capture, feed)
