"""The one restore path: a `Restore` applies a Plan to one request's pool blocks.

Its life is the engine's (tests and benchmarks drive it through the engine too):

    prepare()   open the plan's chunks on their planned tiers and start the LayerReader (the IO
                side, on its own thread); recompute the leading layers of a bubble-free plan, or
                run Cake's race to the end. Runs on the engine's restore worker.
    ready()     the read buffer holds `plan.read_buffer_layers` layers (CachedAttention §3.2.1):
                the request's new tokens may now be scheduled.
    place(l)    called by the runner right before the new tokens' layer l: copy (or project)
                layer l's history into the pool, waiting for its read if it is not in yet.
    finish()    the reader is done; raises RestoreMiss if anything failed (the request is then
                recomputed and nothing it computed on top is kept).

Reads land where they are needed with as few copies as the tier allows: memory-tier reads are
strided views of the stored bytes; disk reads go straight into the pool slots by direct I/O where
alignment allows (else into reused staging buffers); Redis replies are viewed in place. K is stored
rotated at its position, so placing it is a copy; only a truncated context rotates it again.

On the CPU a K/V layer group is copied into the pool at once, one strided copy per chunk. On an
asynchronous device (CUDA) host work must not grow with chunks x layers: each layer group of every
chunk (K and V of consecutive layers lie back to back in a stored chunk) goes over in one DMA run
into a slot of a device staging ring, all of a group's runs in one batched submission; then one
scatter kernel per layer and part puts every chunk's rows into the pool. A restore issues
groups + 2 x layers host operations, whatever its chunk count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.engine.runner.transfer import (
    DONE,
    EqualRuns,
    Handle,
    Timeline,
    Transfer,
    byte_range,
    byte_view,
    joined,
    storage_bytes,
)
from kvtier.planning.costs import READ_GROUP_LAYERS
from kvtier.planning.plan import Method, Plan
from kvtier.store import codec
from kvtier.store.layout import Repr
from kvtier.store.reads import LayerGroup, PlannedReads, kv_back_to_back
from kvtier.store.tiered import TieredStore
from kvtier.store.tiers.base import PoolTarget


class RestoreMiss(RuntimeError):
    """A chunk the plan relied on could not be read intact; recompute instead."""


@dataclass
class RestoreStats:
    seconds: float = 0.0  # prepare() start to finish(): the restore's own time
    bytes_read: int = 0
    chunks_loaded: int = 0
    chunks_computed: int = 0  # Cake's front chunks computed from tokens
    prepare_s: float = 0.0  # time prepare() took (opening the chunks, starting the reads; Cake's race)
    wait_s: float = 0.0  # time place() waited for reads (IO not hidden under compute)
    place_s: float = 0.0  # time place() spent copying or projecting into the pool
    timeline: Timeline | None = None  # device copy/compute spans (CUDA events), layer-wise restores
    prefix_attended: int | None = None  # importance-only: prefix tokens each layer kept (None: all)


@dataclass(frozen=True)
class Piece:
    """Rows [offset, offset + length) of planned chunk `chunk` go to pool slots [slot, slot + length)."""

    chunk: int
    offset: int
    slot: int
    length: int


def pieces(chunk_spans: Sequence[tuple[int, int]], runs: Sequence, start: int) -> list[Piece]:
    """Cut chunks [a, b) at `start` and at the request's block runs (runner.slot_runs)."""
    out = []
    for ci, (a, b) in enumerate(chunk_spans):
        for r in runs:
            lo, hi = max(a, start, r.pos), min(b, r.pos + r.length)
            if lo < hi:
                out.append(Piece(ci, lo - a, r.slot + lo - r.pos, hi - lo))
    return out


def layer_groups(layout: Sequence[Repr], first: int, size: int, cuts: Sequence[int] = ()) -> list[tuple[int, ...]]:
    """Consecutive layers from `first` on, cut every `size` layers, wherever the stored
    representation changes (a group is read, and placed, as one strided block per chunk) and
    before each layer in `cuts`."""
    groups: list[list[int]] = []
    for li in range(first, len(layout)):
        if groups and len(groups[-1]) < size and layout[groups[-1][-1]] is layout[li] and li not in cuts:
            groups[-1].append(li)
        else:
            groups.append([li])
    return [tuple(g) for g in groups]


class LayerReader:
    """The IO side of a layer-wise restore: layer groups of every planned chunk, in layer order,
    at most `depth` layers ahead of placement (the read buffer, never under two groups so reading
    goes on while a group is placed). On its own thread, unless every read is a view of memory
    the tier holds: then reading is instant, needs no thread, and one group takes every layer."""

    def __init__(self, reads: PlannedReads, layout: Sequence[Repr], first: int, depth: int, threaded: bool,
                 into: Callable[[tuple[int, ...]], list[PoolTarget | None] | None] | None = None,
                 transfer: Transfer | None = None, raw: bool = False, spans: int = 0) -> None:
        """`raw`: K/V groups of chunks stored in another dtype come undecoded (PlannedReads.read),
        for the device to decode; `spans=T`: K/V or hidden states of chunks lying whole in memory
        come as byte spans (PlannedReads.read), not a view per chunk."""
        self.reads, self.layout, self.into, self.raw, self.spans = reads, tuple(layout), into, raw, spans
        self.transfer = transfer or Transfer()
        # Groups of layers: on an asynchronous device each group is one batch of copies with its
        # event, so compute starts on layer 0 while later groups are in flight; memory it holds
        # needs no IO thread, so there groups are larger (fewer copy calls: the host enqueues them).
        if threaded:
            size = READ_GROUP_LAYERS
        else:
            # Eight groups: the first group's copy is the only one not hidden under compute.
            size = max(READ_GROUP_LAYERS, -(-len(layout) // 8)) if self.transfer.is_async else len(layout)
        self.ready_layers = depth  # what the new tokens wait for (at least the first group)
        self.depth = max(depth, 2 * size)  # how far reading may run ahead of placement
        # A read from a device (disk, Redis) is a wait: the new tokens start once the read buffer
        # is in, so a group ends there, and the first layer is read alone (compute on it starts
        # while the next group is read, not after a whole group).
        cuts = (first + 1, first + depth) if threaded else ()
        self.groups = layer_groups(self.layout, first, size, cuts)
        self._got: dict[int, LayerGroup] = {}  # group index -> data
        self._held: list[tuple[Handle, LayerGroup]] = []  # placed, but copies from it may be in flight
        self._read_layers = first  # layers read so far (leading recomputed layers count as read ...)
        self._placed = first  # ... and as placed: both count from layer 0
        self._error: str | None = None
        self._closed = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvtier-restore-io", daemon=True) if threaded else None
        self.nbytes = 0

    def start(self) -> None:
        if self._thread is not None:
            self._thread.start()
        else:
            self._run()

    def _run(self) -> None:
        for gi, layers in enumerate(self.groups):
            with self._cv:
                # The read buffer: stay at most `depth` layers ahead of placement.
                while not self._closed and self._thread is not None and \
                        self._read_layers - self._placed >= self.depth:
                    self._cv.wait()
                if self._closed:
                    return
            parts = tuple(dict.fromkeys(p for li in layers for p in self.layout[li].parts()))
            try:
                kv = self.layout[layers[0]] is Repr.KV
                group = self.reads.read(layers, parts, into=self.into(layers) if self.into else None,
                                        raw=self.raw and kv, spans=self.spans)
            except Exception as e:  # any failure is a miss for this restore, never a dead thread
                group, why = None, f"{type(e).__name__}: {e}"
            else:
                why = f"layers {layers[0]}-{layers[-1]} of a stored chunk could not be read intact"
            with self._cv:
                if group is None:
                    self._error = why
                else:
                    self._got[gi] = group
                    self._read_layers += len(layers)
                    self.nbytes += group.nbytes
                self._cv.notify_all()
                if group is None:
                    return

    def primed(self) -> bool:
        """The read buffer holds `ready_layers` (or everything is read, or a read failed)."""
        with self._cv:
            first = self.groups[0][0] if self.groups else 0
            total = sum(len(g) for g in self.groups)
            return self._error is not None or self._read_layers - first >= min(self.ready_layers, total)

    @property
    def error(self) -> str | None:
        return self._error

    def group_of(self, layer: int) -> int:
        return next(i for i, g in enumerate(self.groups) if layer in g)

    def has(self, gi: int) -> bool:
        with self._cv:
            return gi in self._got

    def take(self, gi: int) -> LayerGroup:
        """Group `gi` (waits for its read). Raises RestoreMiss."""
        with self._cv:
            while gi not in self._got and self._error is None:
                self._cv.wait()
            if gi not in self._got:
                raise RestoreMiss(self._error)
            return self._got[gi]

    def placed(self, layer: int, handle: Handle = DONE) -> None:
        """Layer `layer` is in the pool (or its copies are enqueued under `handle`): its group's
        buffers are reused once that is done."""
        gi = self.group_of(layer)
        with self._cv:
            self._placed = layer + 1
            if layer == self.groups[gi][-1]:
                self._held.append((handle, self._got.pop(gi)))
            self._cv.notify_all()
        self._release(block=False)

    def _release(self, block: bool) -> None:
        with self._cv:
            held, self._held = self._held, []
        for handle, group in held:
            if block:
                self.transfer.sync(handle)
            if block or self.transfer.done(handle):
                self.reads.release(group)
            else:
                with self._cv:
                    self._held.append((handle, group))

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join()
        self._release(block=True)  # no staging buffer is reused while a copy may still read it
        for g in self._got.values():
            self.reads.release(g)
        self._got.clear()
        self.reads.close()
        # The restore's callback (a bound method of the restore, which holds this reader): kept,
        # the pair is a cycle, and the restore's runner and KV pool would wait for a garbage
        # collection, whose freeing of them lands as a pause in some later request.
        self.into = None


@dataclass
class TwoEndedCursor:
    """Cake's two pointers over the plan's chunks: compute claims from the front, loading from
    the back, until they meet (each chunk is claimed by exactly one side)."""

    front: int
    back: int
    lock: threading.Lock = field(default_factory=threading.Lock)

    def claim_front(self, tokens: Sequence[int], budget: int) -> range:
        """Chunks from the front worth up to `budget` tokens (at least one), or an empty range."""
        with self.lock:
            i, taken = self.front, 0
            while i <= self.back and (i == self.front or taken + tokens[i] <= budget):
                taken += tokens[i]
                i += 1
            claimed = range(self.front, i)
            self.front = i
            return claimed

    def claim_back(self) -> int | None:
        with self.lock:
            if self.back < self.front:
                return None
            self.back -= 1
            return self.back + 1


class Restore:
    """Restore [start, plan.history_tokens) of a request into its blocks (see the module docstring).
    `source`, for a truncated context, maps each restored position to the stored token it takes."""

    chose = None  # (RestoreJob) an exact restore chooses no tokens
    blended = None  # (RestoreJob) nor blends
    placed_to: int | None = None  # (RestoreJob) its state ends where the plan's history does

    def __init__(self, plan: Plan, store: TieredStore, runner: ModelRunner, token_ids: Sequence[int],
                 block_ids: Sequence[int], start: int = 0, source: Sequence[int] | None = None,
                 compute_chunk_tokens: int = 512) -> None:
        if plan.method is Method.RECOMPUTE:
            raise ValueError("a recompute plan restores nothing: prefill the tokens instead")
        self.plan, self.store, self.runner = plan, store, runner
        self.token_ids, self.block_ids, self.start = list(token_ids), list(block_ids), start
        self.source = list(source) if source is not None else None
        self.compute_chunk_tokens = compute_chunk_tokens
        self.stats = RestoreStats()
        self.reads = store.planned_reads(plan.chunks)
        self.reader: LayerReader | None = None
        self._prepared = threading.Event()
        self._error: str | None = None
        self._stop = threading.Event()
        self._t0 = 0.0
        self.transfer = runner.transfer
        # Groups sent to the device: group index -> (the copies' handle, staged device tensors by part)
        self._sent: dict[int, tuple[Handle, dict[str, list[torch.Tensor]]]] = {}
        # Asynchronous K/V placement (module docstring): the staging ring (the slot grid: _lay_out).
        self._ring: list[torch.Tensor] = []
        self._keep: list[torch.Tensor] = []  # host copies made for a staging run (rare)
        self._buffers: dict[int, torch.Tensor] = {}  # host buffer address -> its bytes (staging runs slice them)
        self._next_send = 0
        self._marks: dict[str, torch.cuda.Event | None] = {}  # copy_start/copy_end/compute_start

    # Where the restored rows go, worked out by _lay_out at the start of prepare(): on the restore
    # worker where the restore has a RESTORING phase, so a decoding batch's step thread never pays it.
    slots: torch.Tensor  # [hist - start] pool slots of the projected or remapped layers (on the device)
    pieces: list[Piece]
    rows: torch.Tensor  # truncation: the stored row each restored position takes
    rotation: tuple[torch.Tensor, torch.Tensor]  # truncation: cos, sin [rows, 1, hd/2] of how far each position moved
    # The pool slot of row t of planned chunk c as a [chunks, chunk tokens] grid on the device (the
    # sink where none): asynchronous K/V placement's one scatter per layer.
    _grid: torch.Tensor | None
    _lo: int  # first position placed from chunks
    _targets: list[PoolTarget | None]  # per chunk, its pool slots when a direct read may land there

    def _lay_out(self) -> None:
        runner, start, hist = self.runner, self.start, self.plan.history_tokens
        spans = [(c.start, c.end) for c in self.plan.chunks]
        host_slots = runner.slots(self.block_ids, start, hist)  # [hist - start], on the host
        self.slots = runner.upload(host_slots)
        self.pieces = []
        if self.source is None:
            self.pieces = pieces(spans, runner.slot_runs(self.block_ids, start, hist), start)
        else:  # truncation: stored rows source[i] (taken from the concatenated chunks) go to position i
            first = spans[0][0] if spans else 0
            self.rows = runner.upload(torch.tensor(self.source[start:hist]) - first)
            shift = runner.upload(torch.arange(start, hist) - torch.tensor(self.source[start:hist]))
            self.rotation = runner.rope.delta(shift)  # made once, for every layer
        self._grid = None
        if self.transfer.is_async and self.source is None and spans:
            self._grid = runner.upload(self._slot_grid(spans, start, hist, host_slots.numpy()))
        self._lo = max(spans[0][0], start) if spans else start
        whole = {p.chunk: p for p in self.pieces if p.offset == 0}
        direct = any(t.stages_reads for t in self.reads.tiers) and runner.k_cache.device.type == "cpu"
        self._targets = [runner.pool_target(whole[i].slot) if direct and i in whole and whole[i].length == b - a
                         else None for i, (a, b) in enumerate(spans)]

    def _slot_grid(self, spans: Sequence[tuple[int, int]], start: int, hist: int, slots: np.ndarray) -> torch.Tensor:
        """[chunks, T] pool slots of the chunks' rows: position a + t of chunk [a, b), for
        start <= a + t < min(b, hist); every other cell the runner's sink (rows never placed)."""
        width = max(b - a for a, b in spans)
        pos = np.array([a for a, _ in spans])[:, None] + np.arange(width)[None, :]  # [chunks, T]
        ends = np.array([min(b, hist) for _, b in spans])[:, None]
        keep = (pos >= start) & (pos < ends)
        grid = np.full(pos.shape, self.runner.sink, dtype=np.int64)
        grid[keep] = slots[pos[keep] - start]  # slots: [hist - start], the pool slot of each position
        return torch.from_numpy(grid)  # numpy, not torch CPU ops: see ModelRunner.slots

    # ----- background part --------------------------------------------------------------------
    def prepare(self) -> None:
        """Open the chunks and start reading; recompute leading layers or run Cake. Raises RestoreMiss."""
        self._t0 = time.perf_counter()
        try:
            if self._stop.is_set():
                raise RestoreMiss("aborted before it started")
            self._lay_out()
            if not self.reads.open():
                raise RestoreMiss("a planned chunk is missing or corrupt on its planned tier")
            self.stats.chunks_loaded = len(self.plan.chunks)
            if self.plan.method is Method.CAKE:
                self._cake()
                return
            lead = self.plan.recompute_layers
            zero_copy = all(t.zero_copy for t in self.reads.tiers)
            self.reader = LayerReader(self.reads, self.plan.layer_reprs, lead, self.plan.read_buffer_layers,
                                      threaded=not zero_copy, into=self._into, transfer=self.transfer,
                                      raw=self._grid is not None,
                                      spans=self._grid.shape[1] if self._grid is not None else 0)
            self.reader.start()
            if lead:  # bubble-free with recompute: the first layers from tokens while IO streams
                self._compute(0, self.plan.history_tokens, layers=range(lead))
                self.transfer.sync_compute()  # done means written: the leading layers are in the pool
        except BaseException as e:
            self._error = str(e) or type(e).__name__
            raise RestoreMiss(self._error) from e
        finally:
            self.stats.prepare_s = time.perf_counter() - self._t0
            self._prepared.set()

    def _into(self, layers: tuple[int, ...]) -> list[PoolTarget | None] | None:
        """Where each chunk's K/V of `layers` may be read straight into: its pool slots, for
        chunks that lie whole, after `start`, in consecutive slots (placement then copies nothing)."""
        if self.source is not None or self.plan.layer_reprs[layers[0]] is not Repr.KV:
            return None
        return self._targets

    def ready(self) -> bool:
        """The new tokens may start: prepared, and the read buffer primed (or no reader)."""
        return self._prepared.is_set() and (self.reader is None or self.reader.primed())

    @property
    def failed(self) -> bool:
        """Already known to fail (no need to run the new tokens on it first)."""
        return self._error is not None or (self.reader is not None and self.reader.error is not None)

    # ----- the new tokens' forward ------------------------------------------------------------
    def place(self, layer: int) -> None:
        """The runner's before_layer hook. Never raises: a failure is kept for finish()."""
        if self.reader is None or layer < self.plan.recompute_layers or self._error is not None:
            return
        t = time.perf_counter()
        try:
            if "compute_start" not in self._marks:
                self._marks["compute_start"] = self.transfer.mark(copy=False)
            gi = self.reader.group_of(layer)
            self._send(gi)
            t1 = time.perf_counter()
            self.stats.wait_s += t1 - t
            handle, staged = self._sent[gi]
            self.transfer.wait(handle)  # the compute stream waits for this group's copies, the host does not
            self._place(layer, staged, self.reader.groups[gi].index(layer))
            if layer == self.reader.groups[gi][-1]:
                del self._sent[gi]
            self.reader.placed(layer, handle)
            self.stats.place_s += time.perf_counter() - t1
        except Exception as e:  # the step goes on for every other request in it
            self._error = str(e) or type(e).__name__

    def _send(self, gi: int) -> None:
        """Enqueue the copies of every group up to `gi` (waiting for their reads), and of the next
        ones that are read, as far as the staging ring allows: copies run ahead of compute, and the
        host interleaves their enqueueing with the layers' kernels instead of enqueueing every copy
        before layer 0."""
        reader = self.reader
        assert reader is not None  # place() returns early without one
        groups = reader.groups
        ahead = max(1, self._ring_slots() - 1)  # a ring slot is reused only once its group is placed
        while self._next_send < len(groups) and (self._next_send <= gi or (
                self._next_send <= gi + ahead and reader.has(self._next_send))):
            j = self._next_send
            group = reader.take(j)
            if j == 0:
                self._marks["copy_start"] = self.transfer.mark(copy=True)
            self._sent[j] = self._copy(groups[j], group, j)
            self._next_send += 1
            if self._next_send == len(groups):
                self._marks["copy_end"] = self.transfer.mark(copy=True)

    def _ring_slots(self) -> int:
        """Staging slots: the read buffer's layers (CachedAttention's formula, in the plan) in
        groups, at least two (one copying while one is placed), and no more than the device
        memory the engine's budget set aside for staging holds."""
        groups = self.reader.groups if self.reader is not None and self.reader.groups else [()]
        slots = max(2, -(-self.plan.read_buffer_layers // max(1, len(groups[0]))))
        cap, grid = self.runner.staging_bytes, self._grid
        if cap and grid is not None:
            slot_bytes = max(len(g) for g in groups) * self._ring_bytes_per_layer()
            slots = min(slots, max(2, cap // max(1, slot_bytes)))
        return slots

    @torch.inference_mode()
    def _copy(self, layers: tuple[int, ...], group: LayerGroup, gi: int) -> tuple[Handle, dict[str, list[torch.Tensor]]]:
        """One copy per chunk and part for the whole group: K/V straight into their pool slots,
        anything that is transformed on the way (hidden states, remapped rows) into device staging."""
        if self.source is None and self.plan.layer_reprs[layers[0]] is Repr.KV:
            ks, vs = group.parts["k"], group.parts["v"]
            if any((k is None) != (v is None) for k, v in zip(ks, vs)):
                raise RestoreMiss("K and V of a chunk were read differently")  # never half-placed
            if self._grid is not None:
                return self._stage_kv(len(layers), ks, vs, gi, group)
            ps = [p for p in self.pieces if ks[p.chunk] is not None]  # the rest landed in the pool
            # Only ps's chunks are indexed: they were read (not None). Each slice is [layers, n, kv_heads, hd].
            kr, vr = cast("list[torch.Tensor]", ks), cast("list[torch.Tensor]", vs)
            handle = self.runner.copy_in(range(layers[0], layers[-1] + 1), [(p.slot, p.length) for p in ps],
                                         [kr[p.chunk][:, p.offset:p.offset + p.length] for p in ps],
                                         [vr[p.chunk][:, p.offset:p.offset + p.length] for p in ps])
            return handle, {}
        if self.source is None and self._grid is not None and self.plan.layer_reprs[layers[0]] is Repr.HIDDEN:
            return self._stage_h(len(layers), group.parts["h"], gi, group)
        names = list(group.parts)
        # No part is None: reads land in the pool only for plain K/V groups (see _into).
        flat = cast("list[torch.Tensor]", [x for n in names for x in group.parts[n]])  # [layers, tokens, ...] each
        staged, handle = self.transfer.stage(flat)
        per = len(flat) // max(len(names), 1)
        return handle, {n: list(staged[i * per:(i + 1) * per]) for i, n in enumerate(names)}

    def _stage_kv(self, n_layers: int, ks: Sequence[torch.Tensor | None], vs: Sequence[torch.Tensor | None],
                  gi: int, group: LayerGroup) -> tuple[Handle, dict[str, list[torch.Tensor]]]:
        """K/V of a layer group of every chunk into a staging ring slot laid out
        [chunks, layers, 2 (K, V), T, kv_heads, hd]: one DMA run per chunk where its stored bytes
        have that layout (every whole chunk; those the tier holds in memory come as `group.spans`,
        arrays rather than views), one per layer and part otherwise (a partial tail, a reordered
        chunk), all in one batched submission. Chunks stored in another dtype go over as stored
        (`_stage_stored`) and are decoded on the device."""
        parts = group.parts
        grid = self._grid
        assert grid is not None
        chunks, width = grid.shape
        pool = self.runner.k_cache
        kvh, hd, dtype = pool.shape[2], pool.shape[3], pool.dtype
        row = kvh * hd  # elements of one token of one part
        part_bytes = width * row * dtype.itemsize  # [T, kvh, hd] of one layer and part
        chunk_bytes = n_layers * 2 * part_bytes
        stage = self._ring_slot(gi, n_layers)
        runs: list[tuple[int, torch.Tensor]] = []
        lossy = [c for c, k in enumerate(ks) if k is not None and k.dtype != dtype]  # as stored
        raw_handle, staged, ks, vs = self._stage_stored(lossy, parts, list(ks), list(vs)) if lossy else \
            (DONE, {}, ks, vs)
        for c, (k, v) in enumerate(zip(ks, vs)):
            if k is None or v is None or k.dtype != dtype:  # in the pool already (a CPU direct read), or staged as stored
                continue
            base = c * chunk_bytes
            run = self._whole_run(k, v, n_layers, width, part_bytes)
            if run is not None:
                runs.append((base, run))  # the layers' K, V back to back: one run
                continue
            for i in range(n_layers):
                for p, t in enumerate((k[i], v[i])):  # [n, kvh, hd]
                    if not t.is_contiguous():  # rare: kept until finish(), the copy reads it
                        t = t.contiguous()
                        self._keep.append(t)
                    runs.append((base + (2 * i + p) * part_bytes, byte_view(t)))
        handle = joined(raw_handle, self.transfer.to_stage(stage, runs, self._equal_runs(group, chunk_bytes)))
        view = stage[: chunks * chunk_bytes].view(dtype).view(chunks, n_layers, 2, width, kvh, hd)
        spanned = set(group.spans.chunks.tolist()) if group.spans is not None else set()
        skipped = [c for c, k in enumerate(ks) if k is None and c not in spanned]
        grid = grid if not skipped else grid.index_fill(0, self.runner.upload(torch.tensor(skipped)), self.runner.sink)
        return handle, {"kv": [view], "grid": [grid], **staged}

    def _stage_h(self, n_layers: int, hs: Sequence[torch.Tensor | None], gi: int,
                 group: LayerGroup) -> tuple[Handle, dict[str, list[torch.Tensor]]]:
        """Hidden states of a layer group of every chunk into a staging ring slot laid out
        [chunks, layers, T, hidden], as `_stage_kv` does K/V: one DMA run per chunk whose layers
        lie back to back (the memory tier's whole chunks come as `group.spans`), one per layer
        otherwise (a partial tail, a layout mixing K/V and hidden layers), all in one submission.
        `_place` then projects a layer of every chunk from one view of the slot, with no
        concatenation of per-chunk pieces."""
        grid = self._grid
        assert grid is not None
        chunks, width = grid.shape
        dtype = self.runner.k_cache.dtype
        hidden = self.runner.model.cfg.hidden_size
        part_bytes = width * hidden * dtype.itemsize  # [T, hidden] of one layer
        chunk_bytes = n_layers * part_bytes
        stage = self._ring_slot(gi, n_layers)
        runs: list[tuple[int, torch.Tensor]] = []
        for c, h in enumerate(hs):  # [layers, n, hidden] each, or None (in the spans)
            if h is None:
                continue
            if h.dtype != dtype:  # reads decode lossy chunks to the compute dtype: never in practice
                h = h.to(dtype)
                self._keep.append(h)  # the copy reads it: kept until finish()
            if h.shape[1] == width and h.is_contiguous():
                runs.append((c * chunk_bytes, byte_view(h)))
                continue
            for i in range(n_layers):
                t = h[i]  # [n, hidden]
                if not t.is_contiguous():  # rare (a layout mixing K/V and hidden layers keeps rows whole)
                    t = t.contiguous()
                    self._keep.append(t)
                runs.append((c * chunk_bytes + i * part_bytes, byte_view(t)))
        handle = self.transfer.to_stage(stage, runs, self._equal_runs(group, chunk_bytes))
        return handle, {"h_ring": [stage[: chunks * chunk_bytes].view(dtype).view(chunks, n_layers, width, hidden)]}

    def _ring_slot(self, gi: int, n_layers: int) -> torch.Tensor:
        """Group `gi`'s staging ring slot (the ring is allocated once per restore, for the largest
        group of either kind)."""
        slot = gi % self._ring_slots()
        while len(self._ring) <= slot:
            largest = max(len(g) for g in self.reader.groups) if self.reader is not None else n_layers
            self._ring.append(torch.empty(largest * self._ring_bytes_per_layer(), dtype=torch.uint8,
                                          device=self.runner.k_cache.device))
        return self._ring[slot]

    def _ring_bytes_per_layer(self) -> int:
        """A ring slot's bytes per layer: every chunk's K and V, or its hidden states where the
        plan restores any and they are larger."""
        grid, pool = self._grid, self.runner.k_cache  # pool: [layers, slots, kv_heads, hd]
        assert grid is not None
        reprs = set(self.plan.layer_reprs[self.plan.recompute_layers:])
        rows = {Repr.KV: 2 * pool[0, 0].numel(), Repr.HIDDEN: self.runner.model.cfg.hidden_size}
        return grid.numel() * max((n for r, n in rows.items() if r in reprs), default=1) * pool.element_size()

    def _equal_runs(self, group: LayerGroup, chunk_bytes: int) -> EqualRuns | None:
        """The group's in-memory spans as runs into a ring slot of `chunk_bytes` per chunk."""
        sp = group.spans
        if sp is None or not len(sp.chunks):
            return None
        if sp.nbytes != chunk_bytes:
            raise RestoreMiss(f"stored spans of {sp.nbytes} bytes where the ring holds {chunk_bytes} per chunk")
        return EqualRuns(sp.buffers, sp.buffer, sp.offsets, sp.chunks * chunk_bytes, chunk_bytes)

    def _stage_stored(self, lossy: list[int], parts: dict[str, list[torch.Tensor | None]],
                      ks: list[torch.Tensor | None], vs: list[torch.Tensor | None]
                      ) -> tuple[Handle, dict[str, list[torch.Tensor]], list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Chunks `lossy` (stored in another dtype, read as stored) go over undecoded: int8 values
        and their scales, or the storage dtype (int8 is half of bf16's bytes). Each chunk's stored
        layer group is one contiguous span of its read buffer: one DMA run per chunk, all in one
        batched submission, at a fixed stride in a device buffer, so each part of every chunk laid
        out alike (every whole chunk) is one strided device view [chunks, layers, T, ...] that
        `_place` decodes a layer at a time. A chunk laid out otherwise (a partial tail) is decoded
        on the host and staged like a lossless one. -> (handle, staged views, ks, vs with those
        decoded chunks in place)."""
        names = [n for n in ("k", "v", "k.scale", "v.scale") if n in parts]
        ts = {c: [cast(torch.Tensor, parts[n][c]) for n in names] for c in lossy}  # [layers, T, ...] each
        spans = {c: (min(byte_range(t)[0] for t in x), max(byte_range(t)[1] for t in x)) for c, x in ts.items()}

        # Where each part lies in its chunk's span, and whether the span holds them all (one buffer).
        layouts = {c: tuple((byte_range(t)[0] - spans[c][0], tuple(t.shape), t.stride(), t.dtype,
                             t.untyped_storage().data_ptr() == x[0].untyped_storage().data_ptr()) for t in x)
                   for c, x in ts.items()}
        common = layouts[lossy[0]]
        alike = [c for c in lossy if layouts[c] == common and all(one for *_, one in common)]
        for c in lossy:
            if c not in alike:
                stored: dict[str, torch.Tensor] = dict(zip(names, ts[c]))
                k, v = (codec.to_compute(stored[p], stored.get(p + ".scale"), self.runner.k_cache.dtype) for p in ("k", "v"))
                ks[c], vs[c] = k, v
                self._keep += [k, v]  # the copy reads them: kept until finish()
        if not alike:
            return DONE, {}, ks, vs
        stride = -(-(spans[alike[0]][1] - spans[alike[0]][0]) // 512) * 512  # bytes per chunk (alike: one size), aligned for every dtype
        raw = torch.empty(len(alike) * stride, dtype=torch.uint8, device=self.runner.k_cache.device)
        handle = self.transfer.to_stage(raw, [(j * stride, storage_bytes(ts[c][0])[spans[c][0]:spans[c][1]])
                                              for j, c in enumerate(alike)])
        staged = {"lossy": [self.runner.upload(torch.tensor(alike))]}
        for name, (offset, shape, strides, dt, _) in zip(names, common):
            base = raw.view(dt)  # offsets and the stride are multiples of every dtype's width
            staged[name] = [base.as_strided((len(alike), *shape), (stride // dt.itemsize, *strides),
                                            offset // dt.itemsize)]
        return handle, staged, ks, vs

    def _whole_run(self, k: torch.Tensor, v: torch.Tensor, n_layers: int, width: int,
                   part_bytes: int) -> torch.Tensor | None:
        """The bytes of a chunk's K/V of a group's layers as one run, where they lie as the staging
        slot does ([layers, 2, T, kv_heads, hd]: whole chunks as stored, whatever the tier), else None."""
        if k.dtype != self.runner.k_cache.dtype or not kv_back_to_back(k, v, width):
            return None
        ptr = k.untyped_storage().data_ptr()
        buf = self._buffers.get(ptr)
        if buf is None:  # one byte view per host buffer (a stored chunk, a staging buffer), not per group
            buf = self._buffers[ptr] = storage_bytes(k)
        at, n = int(k.storage_offset()) * k.element_size(), n_layers * 2 * part_bytes
        return buf[at:at + n] if at + n <= buf.numel() else None  # never a short run from a short buffer

    @torch.inference_mode()
    def _place(self, layer: int, staged: dict[str, list[torch.Tensor]], i: int) -> None:
        """Layer `layer` (row i of its group) from the group's staged device tensors; K/V of a
        plain group are in the pool already."""
        rep = self.plan.layer_reprs[layer]
        if "kv" in staged:  # [chunks, layers, 2, T, kvh, hd] in the staging ring
            kv, grid = staged["kv"][0], staged["grid"][0]
            if "lossy" in staged:  # decode the chunks copied as stored into their rows of the ring slot
                lossy = staged["lossy"][0]
                for p, part in enumerate(("k", "v")):
                    scale = staged.get(part + ".scale")
                    x = codec.to_compute(staged[part][0][:, i], None if scale is None else scale[0][:, i], kv.dtype)
                    self.transfer.scatter(kv[:, i, p], lossy, x)  # [lossy, T, kvh, hd] into [chunks, T, kvh, hd]
            self.runner.place_staged(layer, grid, kv[:, i, 0], kv[:, i, 1])
        elif "h_ring" in staged:  # [chunks, layers, T, hidden]: this layer of every chunk, one projection
            x = staged["h_ring"][0][:, i]  # [chunks, T, hidden]
            skip = self._lo - self.plan.chunks[0].start
            h = x.reshape(-1, x.shape[-1])[skip:skip + self.plan.history_tokens - self._lo]  # [hist - lo, hidden]
            self.runner.project_in(layer, h, (self._lo, self.plan.history_tokens), self.slots[self._lo - self.start:])
        elif self.source is not None:
            self._place_remapped(layer, rep, staged, i)
        elif rep is not Repr.KV:  # hidden: project this layer's inputs over every chunk in one matmul
            skip = self._lo - self.plan.chunks[0].start
            hs = [h[i] for h in staged["h"]]  # [tokens, hidden] per chunk
            hs[-1] = hs[-1][:self.plan.history_tokens - self.plan.chunks[-1].start]  # the last chunk may hold more
            h = hs[0][skip:] if len(hs) == 1 else torch.cat([hs[0][skip:]] + hs[1:])  # [hist - lo, hidden]
            self.runner.project_in(layer, h, (self._lo, self.plan.history_tokens), self.slots[self._lo - self.start:])

    def _place_remapped(self, layer: int, rep: Repr, staged: dict[str, list[torch.Tensor]], i: int) -> None:
        if rep is Repr.KV:
            k = torch.cat([k[i] for k in staged["k"]]).index_select(0, self.rows)  # [kept, kv_heads, hd]
            v = torch.cat([v[i] for v in staged["v"]]).index_select(0, self.rows)
            self.runner.rotate_in(layer, k, v, self.rotation, self.slots)
        else:
            h = torch.cat([h[i] for h in staged["h"]]).index_select(0, self.rows)
            self.runner.project_in(layer, h, (self.start, self.plan.history_tokens), self.slots)

    def finish(self) -> RestoreStats:
        """End the restore; raises RestoreMiss if any part failed. Called once the new tokens' step is
        enqueued: on CUDA it waits for the device, so the seconds it reports (and the planner
        learns from) are the device's, not the enqueue's."""
        self._prepared.wait()
        self.transfer.sync_compute()
        if self.reader is not None:
            if self._marks and self._error is None:  # called after the new tokens' step was enqueued
                m = self._marks
                self.stats.timeline = Timeline.of(m.get("copy_start"), m.get("copy_end"), m.get("compute_start"),
                                                  self.transfer.mark(copy=False))
            self.stats.bytes_read += self.reader.nbytes
            self.reader.close()
        else:
            self.reads.close()
        self.stats.seconds = time.perf_counter() - self._t0
        if self._error is not None:
            raise RestoreMiss(self._error)
        self.store.promote(self.plan.chunks)
        return self.stats

    def abort(self) -> None:
        """Stop reading (the restore is then finished by whoever waits on prepare)."""
        self._stop.set()
        self._error = self._error or "aborted"
        if self.reader is not None:
            self.reader.close()

    # ----- compute from tokens -----------------------------------------------------------------
    def _compute(self, a: int, b: int, layers: range | None = None) -> None:
        step = self.compute_chunk_tokens
        for x in range(max(a, self.start), b, step):
            item = RunItem(self.token_ids[x:min(b, x + step)], x, self.block_ids, want_logits=False, off_thread=True)
            self.runner.execute([item], layers=layers)

    # ----- Cake: bidirectional ------------------------------------------------------------------
    def _cake(self) -> None:
        """Compute chunks from the front while a loader thread reads whole chunks from the back,
        until they meet. Positions before `start` (device-cached, maybe shared) are never written."""
        chunks = self.plan.chunks
        tokens = [c.end - c.start for c in chunks]
        cursor = TwoEndedCursor(0, len(chunks) - 1)
        failed: list[str] = []
        loaded = threading.Thread(target=self._cake_loader, args=(cursor, failed), name="kvtier-cake-io", daemon=True)
        loaded.start()
        try:
            while not failed and not self._stop.is_set():
                claimed = cursor.claim_front(tokens, self.compute_chunk_tokens)
                if not claimed:
                    break
                self._compute(chunks[claimed.start].start, min(chunks[claimed.stop - 1].end, self.plan.history_tokens))
                self.transfer.sync_compute()  # claim the next chunk once this one is really computed
                self.stats.chunks_computed += len(claimed)
        finally:
            loaded.join()
        self.stats.chunks_loaded = len(chunks) - self.stats.chunks_computed
        if failed:
            raise RestoreMiss(failed[0])

    def _cake_loader(self, cursor: TwoEndedCursor, failed: list[str]) -> None:
        try:
            self._load_from_back(cursor, failed)
        except Exception as e:  # a chunk claimed and not loaded must fail the restore, never pass
            failed.append(f"{type(e).__name__}: {e}")
            self._stop.set()

    def _load_from_back(self, cursor: TwoEndedCursor, failed: list[str]) -> None:
        n = len(self.plan.layer_reprs)
        while not self._stop.is_set():
            j = cursor.claim_back()
            if j is None:
                return
            c = self.plan.chunks[j]
            group = self.reads.read(range(n), ("k", "v"), only=[j])
            if group is None:
                failed.append(f"chunk {c.key[:12]} could not be read intact")
                return
            end = min(c.end, self.plan.history_tokens)  # the last chunk may hold more than the plan restores
            ps = pieces([(c.start, end)], self.runner.slot_runs(self.block_ids, max(c.start, self.start), end), self.start)
            k, v = group.parts["k"][0], group.parts["v"][0]  # [layers, tokens, kv_heads, hd]
            assert k is not None and v is not None  # read without `into`: nothing went straight to the pool
            handle = self.runner.copy_in(range(n), [(p.slot, p.length) for p in ps],
                                         [k[:, p.offset:p.offset + p.length] for p in ps],
                                         [v[:, p.offset:p.offset + p.length] for p in ps])
            self.transfer.sync(handle)  # in the pool before the next claim, and before its buffer is reused
            self.stats.bytes_read += group.nbytes
            self.reads.release(group)
