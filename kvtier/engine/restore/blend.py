"""The blended restore (non-prefix reuse) inside the engine: a `BlendPlan` applied to one request's
blocks, on the restore worker.

1. The exact part [start, exact_end) is read from its planned chunks and copied (K is stored
   rotated at these very positions).
2. Each segment's state is read from the store's blend space, or computed alone and saved
   (segments.py); its rows outside the recomputed runs go to their new positions, K rotated by the
   position difference (`ModelRunner.shift_in`), hidden-state layers projected there.
3. cacheblend only: the layers up to the check layer run for every blended token; the share of
   loaded tokens whose fresh K deviates most from the loaded K there joins the recompute (by
   default each deviation weighed by the attention the prompt's last rows pay the token in the
   later layers, from a pass of the rows no document covers over the loaded state: `_Probe`).
4. The recomputed runs go through the layers in passes of at most `chunk_tokens` rows, in position
   order: a pass of one contiguous run is a runner step (the exact kernels: every token recomputed
   is an exact prefill), a pass of scattered runs goes through the layers as one (`_Scattered`:
   each row attends to the request's keys at or before its position). Either way their rows
   replace the loaded ones in every layer, and residual and MLP run for them only. Loaded rows are
   placed layer by layer just before the first pass reaches each layer; stored documents are read
   a group of layers at a time on a thread of their own meanwhile, holding at most `READ_AHEAD`
   groups (the one placed and the next: `_Loader`). On a device with memory of its own a group of
   every stored document goes over as a copy per chunk, is packed there and placed at once
   (`SegmentReads`' `Packed`).

The recomputed run that continues the exact prefix, up to the first loaded row (the lead), is
computed with the step's kernels over its own keys only: where it fits, as the first rows of the
first pass (row-invariant linears, its attention the step's), else in passes of its own, so its rows
are exact: their whole chunks are saved under the request's exact keys, and a later request that
shares them restores a prefill's bits. Where
rows were loaded, the prompt's last token is a row of the last pass and the request's step takes
its logits to sample (else the step computes it). The rest of its state is approximate: never
saved, published to the device prefix cache or served as exact.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from kvtier.engine.restore.layerwise import RestoreMiss, RestoreStats
from kvtier.engine.restore.prepared import PreparedRestore
from kvtier.engine.restore.segments import (
    Packed,
    Parts,
    Pieces,
    SegmentReads,
    SegmentState,
    SegmentStates,
    joined,
    uploaded,
)
from kvtier.engine.runner.model_runner import CaptureFn, ModelRunner, RunItem
from kvtier.models.attention import ScatteredRows, column_importance, exact_cpu
from kvtier.models.llama import LayerAttention
from kvtier.planning.blend import BlendMode, BlendPlan, BlendScore, merged, pieces, subtract
from kvtier.planning.costs import READ_GROUP_LAYERS
from kvtier.planning.plan import Plan, PlannedChunk
from kvtier.store import format as fmt
from kvtier.store.index import PrefixMatch
from kvtier.store.layout import Repr
from kvtier.store.saving import PendingSave
from kvtier.store.tiered import TieredStore

log = logging.getLogger(__name__)

# The prompt's last rows whose attention weighs cacheblend's deviations (the question after the
# documents, in a RAG prompt).
TAIL_QUERIES = 64


@dataclass
class BlendStats:
    """What a blended restore did, in prompt tokens: exact (from the store's exact chains), loaded
    (segment rows moved to their positions), recomputed (computed here), all before the prompt's
    last token, which is computed always (by the blend's last pass or the request's step)."""

    exact: int = 0
    loaded: int = 0
    recomputed: int = 0
    segments_stored: int = 0  # segments read from the store
    segments_computed: int = 0  # segments computed alone here (and saved)


@dataclass(frozen=True)
class _Source:
    """Rows [`rows`] of one stored or computed state placed at prompt `positions` (pool `slots`),
    K rotated by `rotation` (`rope.delta` of the position shift; None: the exact part, K as
    stored); `layer(l)` gives layer l's parts, in the pieces they were read in."""

    layer: Callable[[int], Pieces]
    rows: torch.Tensor | slice | None  # [n] rows of the state to place (a slice: consecutive; None: all, in order)
    slots: torch.Tensor | slice  # [n] (a slice where consecutive in the pool: placed in place)
    positions: torch.Tensor  # [n] prompt positions
    rotation: tuple[torch.Tensor, torch.Tensor] | None  # cos, sin [1, 1, hd/2] of new - stored position (None: 0)
    # read group g (layers from READ_GROUP_LAYERS * g) as one view per piece (None: no such view of the read)
    stacks: Callable[[int], Stacked | None] | None = None
    packed: bool = False  # its rows are in the loader's packed groups, where a group is packed


class _LoadFailed(RestoreMiss):
    """A stored document's state failed a read or a check while the restore ran."""


class _ReadsTooSlow(_LoadFailed):
    """In the step: the reads were waited for longer than the step may wait for them."""


# Consecutive layers' K and V per piece: k, v [layers, rows, kv_heads, hd].
Stacked = tuple[tuple[torch.Tensor, torch.Tensor], ...]


def _stacked(layers: Sequence[Pieces]) -> Stacked | None:
    """Consecutive layers' K/V pieces as one view per piece and part, where every layer's piece is
    a view of one buffer at an even stride (chunks read as stored: a layer's parts follow the
    layer before's); None where any is not (copied or reordered reads, hidden-state layers)."""
    if any(len(pieces) != len(layers[0]) for pieces in layers):
        return None
    out = []
    for i in range(len(layers[0])):
        k, v = (_even([pieces[i][p] for pieces in layers]) for p in (0, 1))
        if k is None or v is None:
            return None
        out.append((k, v))
    return tuple(out)


def _even(ts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """Views of one buffer, alike and at an even stride, as one view [len(ts), ...]; else None."""
    views = [t for t in ts if t is not None]
    if len(views) != len(ts):
        return None
    t0 = views[0]
    step = views[1].storage_offset() - t0.storage_offset() if len(views) > 1 else 1
    if step <= 0 or any(t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() or t.dtype != t0.dtype
                        or t.shape != t0.shape or t.stride() != t0.stride()
                        or t.storage_offset() != t0.storage_offset() + j * step for j, t in enumerate(views)):
        return None
    return t0.as_strided((len(views), *t0.shape), (step, *t0.stride()), t0.storage_offset())


def _computed(st: SegmentState, li: int) -> Pieces:
    return ((st.k[li], st.v[li], st.h[li]),)


# Read groups the loader holds at once (read and not yet placed): the next one reads while one is
# placed (one group ahead), and a blend's memory for reads stays two groups' whatever the documents' size.
READ_AHEAD = 2


class _Loader:
    """Stored segments read a group of layers at a time on a thread of its own, so that reads from
    a disk or Redis overlap the recompute, which places each layer as it reaches it and then gives
    the group's read memory back (`release`), letting the next group be read (`READ_AHEAD`)."""

    def __init__(self, states: SegmentStates, found: Sequence[tuple[PrefixMatch, int]], layers: int,
                 placed: Sequence[Sequence[tuple[int, int]]] | None = None, wait_s: float | None = None) -> None:
        self.wait_s = wait_s  # the longest the reads are waited for, in all (None: no limit)
        self.waited = 0.0
        self._lock = threading.Lock()
        self._ended = False  # the thread is past its last read
        self._orphaned = False  # closed without waiting for the thread: it gives the staging memory back itself
        self.reads = SegmentReads(states, found, placed)
        self.groups = [range(a, min(a + READ_GROUP_LAYERS, layers)) for a in range(0, layers, READ_GROUP_LAYERS)]
        self.data: list[dict[int, Pieces]] = [{} for _ in found]
        self.stacks: list[dict[int, Stacked | None]] = [{} for _ in found]  # by group
        self.packed: dict[int, Packed | None] = {}  # by group
        self.ready = [threading.Event() for _ in range(layers)]
        self.error: str | None = None
        self.stop = threading.Event()  # the restore was aborted: read no more
        self.window = threading.Semaphore(READ_AHEAD)
        self.thread = threading.Thread(target=self._run, name="kvtier-blend-io", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if not self.reads.open():
                raise _LoadFailed("a stored document's chunk is gone from its tier")
            for gi, g in enumerate(self.groups):
                self.window.acquire()  # an earlier group is placed first (`close` lets a stopped loader through)
                if self.stop.is_set():
                    raise RestoreMiss("aborted")
                read = self.reads.read(g)
                if read is None:
                    raise _LoadFailed("a stored document's state could not be read intact")
                got, self.packed[gi] = read
                for i, layers in enumerate(got):
                    self.data[i].update(layers)
                    self.stacks[i][gi] = None if self.packed[gi] is not None else _stacked([layers[li] for li in g])
                for li in g:
                    self.ready[li].set()
        except Exception as e:  # a layer never read must fail the restore, never pass
            self.error = f"{type(e).__name__}: {e}"
            for ev in self.ready:
                ev.set()
        finally:
            with self._lock:
                self._ended = True
                orphaned = self._orphaned
            if orphaned:
                self.reads.close()

    def _wait(self, li: int) -> None:
        """Until layer li is read; raises _LoadFailed if the reads failed, or if waiting for them
        took over `wait_s` in all."""
        if self.wait_s is None:
            self.ready[li].wait()
        elif not self.ready[li].is_set():
            t = time.perf_counter()
            done = self.ready[li].wait(max(0.0, self.wait_s - self.waited))
            self.waited += time.perf_counter() - t
            if not done:
                raise _ReadsTooSlow(f"the reads of the stored documents were waited for over {self.wait_s} s")
        if self.error is not None:
            raise _LoadFailed(self.error)

    def layer(self, i: int, li: int) -> Pieces:
        self._wait(li)
        return self.data[i][li]

    def stack(self, i: int, g: int) -> Stacked | None:
        self._wait(self.groups[g][0])
        return self.stacks[i][g]

    def packed_group(self, g: int) -> Packed | None:
        """Group g of every document packed on the device (None: placed from views)."""
        self._wait(self.groups[g][0])
        return self.packed[g]

    def release(self, g: int) -> None:
        """Group g is placed: nothing reads its views again, its staging memory goes back."""
        self.ready[self.groups[g][-1]].wait()  # read (or failed) before its memory is touched here
        for data, stacks in zip(self.data, self.stacks):
            for li in self.groups[g]:
                data.pop(li, None)
            stacks.pop(g, None)
        self.packed.pop(g, None)
        self.reads.release(self.groups[g].start)
        self.window.release()

    def close(self, wait: bool = True) -> threading.Thread | None:
        """Stop reading and give the staging memory back. `wait`: for a read in progress to end
        (else, as in the step, which must not wait for a read that hangs, the thread gives the
        memory back when its read ends). -> the thread where it still runs."""
        self.stop.set()
        self.window.release()  # a loader waiting for room wakes, sees the stop and ends
        if wait or all(ev.is_set() for ev in self.ready):  # every layer read or failed: it is ending
            self.thread.join()
        with self._lock:
            if not self._ended:
                self._orphaned = True
                return self.thread
        self.reads.close()
        return None


class _Scattered(LayerAttention):
    """The recomputed runs of a blend as one pass through the layers: their rows at their own
    positions, each layer's K/V written to the request's slots first, then every row attends to
    the request's keys at or before its position (`ScatteredRows`). Only this request's rows and
    keys enter it, so its bits do not depend on what else the engine runs.

    `lead`: the exact run that continues the exact prefix, whose rows come first: the linears,
    norms and MLP take them in the same calls as the others' (row-invariant: `models/invariant.py`),
    and their attention is the step's (`ModelRunner.attend`, over keys before the first loaded row
    only), so they are the bits a pass of their own gives, at the cost of one pass instead of two
    (a pass over a few rows is bound by reading the weights, not by its rows). `capture`: the
    runner callback that keeps the lead's hidden-state layers' inputs."""

    def __init__(self, runner: ModelRunner, block_ids: Sequence[int], runs: Sequence[tuple[int, int]], end: int,
                 place: Callable[[int], None] | None, lead: RunItem | None = None,
                 capture: CaptureFn | None = None) -> None:
        self.runner, self.place, self.capture = runner, place, capture
        self.lead = None if lead is None else runner.prepare([lead])
        self.n_lead = 0 if lead is None else len(lead.token_ids)
        firsts = [] if lead is None else [(lead.start, lead.start + self.n_lead)]
        pos = torch.cat([torch.arange(a, e) for a, e in firsts + list(runs)])  # [m] positions, ascending
        context = runner.slots(block_ids, 0, end)  # [end] pool slot of every position before the last
        self.positions, self.at = pos, pos.tolist()
        scattered = pos[self.n_lead :]  # [m - lead] the rows this pass writes and attends itself
        self.slots, self.context, self.dev_pos = (runner.upload(t) for t in (context.index_select(0, scattered),
                                                                              context, pos))
        # Where the request's blocks lie consecutive in the pool, each layer reads its keys in place
        # (a view) instead of gathering every key of the context (the same values, so the same bits).
        self.in_place = runner.consecutive(block_ids, 0, end)
        self.cos, self.sin = runner.rope.halves(self.dev_pos)  # [m, 1, hd/2]
        # every layer's masks built once; the model's kernels pick the attention's (`scattered_gemm`)
        self.pieces = ScatteredRows.of(self.at[self.n_lead :], runner.k_cache.dtype, runner.device,
                                       kernels=runner.model.kernels)

    def ids(self, token_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor([token_ids[p] for p in self.positions.tolist()], dtype=torch.long)

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def enter(self, li: int, h: torch.Tensor) -> torch.Tensor:
        if self.place is not None:
            self.place(li)
        return h

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n = self.n_lead
        led = None
        if self.lead is not None:  # its K/V written and attended as its own step would: [lead, heads, hd]
            led = self.runner.attend(li, h[:n], q[:n], k[:n], v[:n], self.lead, self.capture)
            q, k, v = q[n:], k[n:], v[n:]
        self.runner.k_cache[li].index_copy_(0, self.slots, k)  # [slots, kv_heads, hd]
        self.runner.v_cache[li].index_copy_(0, self.slots, v)
        keys, values = self.context_kv(li)
        self.observe(li, q, keys)
        out = self.pieces.attend(q, keys, values)  # [m - lead, heads, hd]
        return out if led is None else torch.cat([led, out])

    def observe(self, li: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        """Layer `li`'s queries [m, heads, hd] and the request's keys [end, kv_heads, hd], this
        pass's rows written: for a pass that scores what its rows attend to (none here)."""

    def context_kv(self, li: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `li`'s K and V at the request's positions [0, end) -> 2 x [end, kv_heads, hd]."""
        kc, vc = self.runner.k_cache[li], self.runner.v_cache[li]
        if self.in_place is not None:
            return kc[self.in_place], vc[self.in_place]
        return kc.index_select(0, self.context), vc.index_select(0, self.context)


class _Probe(_Scattered):
    """The last pass of a naive blend's rows (every key it reads is placed or computed before it),
    summing, in the layers past `after`, the attention its last `queries` rows (consecutive
    positions, ending the pass) pay each key before them."""

    def __init__(self, runner: ModelRunner, block_ids: Sequence[int], runs: Sequence[tuple[int, int]], end: int,
                 queries: int, after: int) -> None:
        super().__init__(runner, block_ids, runs, end, None)
        self.queries, self.after = queries, after
        self.first = self.at[-queries]  # the first querying row's position
        self.paid = torch.zeros(self.first, dtype=torch.float32)  # [first] attention paid, summed

    def observe(self, li: int, q: torch.Tensor, keys: torch.Tensor) -> None:
        if li > self.after:
            self.paid += column_importance(q[-self.queries:], keys[: self.first], keys[self.first :]).sum(dim=0)


class BlendRestore(PreparedRestore):
    chose = None  # (RestoreJob) chooses no tokens by importance

    def __init__(self, plan: Plan, blend: BlendPlan, states: SegmentStates, store: TieredStore,
                 runner: ModelRunner, token_ids: Sequence[int], block_ids: Sequence[int], salt: str,
                 chunk_tokens: int = 512, in_step: bool = False, read_wait_s: float | None = None) -> None:
        """`chunk_tokens`: the most rows one pass through the layers computes (bounded activations).
        `in_step`: run by its request's step, on the step thread. Then a read that fails or waits
        past `read_wait_s` in all (None: any time), a document gone from every tier or found in a
        tier read over a network makes the restore a miss at once (the request then prefills in
        chunks: never a prefill's worth of work, a second try or a network read in one step), and
        no read in progress is waited for as it ends (`lingering`). On the restore worker a failed
        read has the documents looked up again once, then computed alone."""
        super().__init__(runner)
        self.in_step, self.read_wait_s = in_step, read_wait_s
        self.reads_too_slow = False  # in the step: the reads took longer than it waits
        self._waited = 0.0  # in the step: seconds waited for the exact prefix's reads
        self._lingering: list[threading.Thread] = []
        self.plan, self.blend, self.states, self.store = plan, blend, states, store
        self.chunk_tokens = chunk_tokens
        self.token_ids, self.block_ids, self.salt = list(token_ids), list(block_ids), salt
        self.layout = tuple(plan.layer_reprs)
        self.start = blend.start  # a failure recomputes from here
        self.blended = BlendStats()
        self._sources: list[_Source] = []
        self._loader: _Loader | None = None
        self._packed_rows: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None  # slots, rotation
        # fp32 [1, vocab]: the logits of the prompt's last token where the blend computed it (`_folds`)
        self.logits: torch.Tensor | None = None

    def _cleanup(self) -> None:
        if self._loader is not None and (thread := self._loader.close(wait=not self.in_step)) is not None:
            self._lingering.append(thread)
        self._sources, self._loader, self._packed_rows = [], None, None

    def lingering(self) -> list[threading.Thread]:
        """Threads of this restore's reads still running (in the step, a read it gave up on)."""
        return [t for t in self._lingering if t.is_alive()]

    def abort(self) -> None:
        super().abort()
        loader = self._loader  # the restore's own thread may clear it meanwhile (`_cleanup`)
        if loader is not None:
            loader.stop.set()

    # ----- the work ---------------------------------------------------------------------------
    def _work(self) -> None:
        # A stored document that fails a read or a check is dropped from its tier (a corrupt copy),
        # or was gone from the tier its lookup named (evicted meanwhile): the documents are looked
        # up again once (another tier may hold a copy), then computed alone.
        for retry in (True, False):
            try:
                self._blend(stored=True)
                break
            except _LoadFailed as e:
                if self._error is not None:  # aborted while waiting for a read: no work after it
                    raise RestoreMiss(self._error) from e
                if self.in_step:
                    self.reads_too_slow = isinstance(e, _ReadsTooSlow)
                    raise RestoreMiss(f"{e}: the request prefills instead") from e
                log.warning("blended restore: %s; %s", e,
                            "looking the documents up again" if retry else "computing the documents alone")
                self._cleanup()
                self.stats, self.blended = RestoreStats(), BlendStats()
        else:
            self._blend(stored=False)
        if self._loader is not None:  # documents read from below the memory tier are copied up, as exact reads are
            self.store.promote(self._loader.reads.chunks)

    def _blend(self, stored: bool) -> None:
        b = self.blend
        if b.exact_end > b.start:
            self._sources.append(self._exact_source())
            self.blended.exact = b.exact_end - b.start
        self._segment_sources(stored)
        layers = len(self.layout)
        runs = list(b.runs)
        placed = 0
        if b.options.mode is BlendMode.CACHEBLEND:  # the check needs every layer up to it placed
            for li in range(layers):
                self._place(li)
            placed = layers
            runs = merged(runs + self._chosen(b.loaded))
        self.blended.loaded = sum(e - a for a, e in subtract(b.loaded, runs))
        self.blended.recomputed = sum(e - a for a, e in runs)
        # The run that continues the exact prefix, up to the first loaded row, is exact state: the
        # step's kernels over its own keys (`_passes`), then its whole chunks saved under the exact keys.
        lead = b.lead(runs)
        fold = self._folds()
        if fold:  # the prompt's last token: a row of the last pass, not a step of its own
            runs = merged(runs + [(b.end, b.end + 1)])
        end = b.end + 1 if fold else b.end  # the keys the passes' rows may attend to
        if not runs:  # every row loaded: place them all
            for li in range(placed, layers):
                self._place(li)
            return
        groups = self._passes(runs, lead)
        hidden: list[torch.Tensor] = []  # the lead's hidden-state layers' inputs, pass by pass
        for i, group in enumerate(groups):  # in position order: each sees those before
            place = self._place if i == 0 and placed < layers else None  # the first pass places every layer
            last = fold and i == len(groups) - 1  # the pass holding the prompt's last token
            if len(group) == 1:  # one run: the step's exact kernels (every token recomputed is a prefill's bits)
                a, e = group[0]
                in_lead = lead is not None and e <= lead[1]
                logits = self.runner.execute([self._item(a, e, last)], before_layer=place,
                                             capture=self._capture(hidden) if in_lead else None)
                if last:
                    self.logits = logits  # [1, vocab]
            else:  # runs scattered across the prompt: one pass over all their rows
                model = self.runner.model
                led = self._item(*lead) if group[0] == lead else None  # riding first (`_passes`)
                scattered = _Scattered(self.runner, self.block_ids, group[1:] if led else group, end, place,
                                       led, self._capture(hidden) if led else None)
                h = model.run_layers(model.embed(self.runner.upload(scattered.ids(self.token_ids))), scattered)
                if last:
                    self.logits = model.logits(h[-1:])  # [1, vocab]
            self._check_abort()
            if lead is not None and any(e == lead[1] for _, e in group):  # the pass that ends the lead
                self._save_exact(*lead, hidden)

    def _passes(self, runs: Sequence[tuple[int, int]], lead: tuple[int, int] | None) -> list[list[tuple[int, int]]]:
        """The recomputed `runs` as passes of at most `chunk_tokens` rows, in position order. The
        exact `lead` (runs[0]) rides whole at the head of the first pass (`_Scattered`: one pass's
        weight reads, not two) where it fits in one and the linears are row-invariant (the CPU's
        exact kernels; elsewhere a row's bits depend on the rows beside it); else it has passes of
        its own."""
        invariant = exact_cpu(self.runner.device, self.runner.model.kernels)
        if lead is None or (invariant and lead[1] - lead[0] <= self.chunk_tokens):
            return pieces(runs, self.chunk_tokens)
        return pieces([lead], self.chunk_tokens) + pieces(runs[1:], self.chunk_tokens)

    def _item(self, a: int, e: int, logits: bool = False) -> RunItem:
        """Positions [a, e) as a run of the step's kernels, off the step thread, over slots past it
        that hold placed rows (never zeroed)."""
        return RunItem(self.token_ids[a:e], a, self.block_ids, want_logits=logits, off_thread=True, placed_ahead=True)

    def _folds(self) -> bool:
        """Whether the blend computes its request's last token as well (`logits`, which the step
        that runs that token takes instead of a pass over the whole context for one row), where
        rows are loaded (lossy state: nothing past the exact lead is saved, whoever computes the
        token) and the token has its slot (the scheduler grows a restoring request's blocks past
        its target). Every token recomputed, the step computes it, as an exact prefill's."""
        return self.blended.loaded > 0 and len(self.block_ids) * self.runner.block_size > self.blend.end

    def _capture(self, into: list[torch.Tensor]) -> CaptureFn | None:
        """The runner callback that keeps a pass's hidden-state layers' inputs (None: no such layer)."""
        h_layers = [li for li, r in enumerate(self.layout) if r is Repr.HIDDEN]
        if not h_layers:
            return None
        step: list[torch.Tensor] = []

        def capture(li: int, offsets: tuple[int, ...], h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            if li in h_layers:
                step.append(h[: offsets[-1]].to("cpu", copy=True))  # [tokens, hidden]
            if li == h_layers[-1]:
                into.append(torch.stack(step))  # [hidden layers, tokens, hidden]

        return capture

    def _save_exact(self, a: int, e: int, hidden: Sequence[torch.Tensor]) -> None:
        """Positions [a, e) were computed exactly after the exact prefix: their whole chunks go to
        the store's writer under the request's exact keys, as any prefill's would."""
        ct = self.store.chunk_tokens  # the store's chunks, not this restore's passes
        cut = e // ct * ct
        if cut <= a:
            return
        kv = [li for li, r in enumerate(self.layout) if r is Repr.KV]
        slots = self.runner.upload(self.runner.slots(self.block_ids, a, cut))
        k = v = h = None
        if kv:
            index = self.runner.upload(torch.tensor(kv, dtype=torch.long))
            # The rows first (a gather of [layers, n, ...]), then the layers: never a copy of the pool.
            k, v = (c.index_select(1, slots).index_select(0, index).to("cpu")  # [kv layers, n, kvh, hd]
                    for c in (self.runner.k_cache, self.runner.v_cache))
        if hidden:
            h = torch.cat(list(hidden), dim=1)[:, : cut - a]  # [hidden layers, n, hidden]
        parts = (k, v, h)
        nbytes = sum(t.nbytes for t in parts if t is not None)
        self.store.save_pending(PendingSave(tuple(self.token_ids[:cut]), a, lambda: parts, nbytes, self.salt))

    def _segment_sources(self, stored: bool) -> None:
        """Each segment's rows the plan loads: computed alone here where the store lacks it (or
        not `stored`: read nothing; saved either way), else read by the loader a group of layers
        at a time."""
        found: list[tuple[PrefixMatch, int]] = []
        placed: list[list[tuple[int, int]]] = []  # per stored segment, the rows of it placed
        pack = self.runner.transfer.is_async  # a device with memory of its own: a group's rows go over packed
        for s in self.blend.segments:
            spans = self._rows_of(s.position, len(s.tokens))
            if not spans:
                continue  # every row of it recomputed: nothing to read or compute alone
            match = self.states.find(s.tokens, self.salt) if stored else None
            if self.in_step:
                if match is None:
                    raise _LoadFailed("a stored document is gone from every tier")
                far = [c.tier for c in match.chunks if not self.store.tier(c.tier).local_reads]
                if far:
                    raise _LoadFailed(f"a stored document is now found in {far[0]}, read over a network")
            if match is None:
                st = self.states.compute(s.tokens, self.salt)
                self.blended.segments_computed += 1
                self._sources.append(self._segment_source(s.position, len(s.tokens), functools.partial(_computed, st)))
                continue
            i = len(found)
            found.append((match, len(s.tokens)))
            placed.append([(a - s.position, e - s.position) for a, e in spans])
            self.blended.segments_stored += 1
            self.stats.chunks_loaded += len(match.chunks)
            self.stats.bytes_read += sum(c.nbytes for c in match.chunks)
            self._sources.append(self._segment_source(s.position, len(s.tokens), functools.partial(self._layer_read, i),
                                                      functools.partial(self._group_read, i), packed=pack))
        if found:
            wait_s = None if self.read_wait_s is None else self.read_wait_s - self._waited
            self._loader = _Loader(self.states, found, len(self.layout), placed if pack else None, wait_s)
            if pack:
                self._packed_rows = self._packed_targets([src for src in self._sources if src.packed])

    def _packed_targets(self, sources: Sequence[_Source]) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The pool slots [rows] of the packed documents' rows, in the packed order (source by
        source), and each row's rotation (cos, sin [rows, 1, hd/2])."""
        up = self.runner.upload
        still = self.runner.rope.delta(up(torch.zeros(1, dtype=torch.long)))  # a shift of 0: cos 1, sin 0
        slots, cos, sin = [], [], []
        for src in sources:
            n = src.positions.numel()
            s = src.slots
            slots.append(up(torch.arange(s.start, s.stop)) if isinstance(s, slice) else s)
            c, si = src.rotation if src.rotation is not None else still
            cos.append(c.expand(n, -1, -1))
            sin.append(si.expand(n, -1, -1))
        return torch.cat(slots), (torch.cat(cos), torch.cat(sin))

    def _layer_read(self, i: int, li: int) -> Pieces:
        assert self._loader is not None  # made with the sources that read through it
        return self._loader.layer(i, li)

    def _group_read(self, i: int, g: int) -> Stacked | None:
        assert self._loader is not None
        return self._loader.stack(i, g)

    def _exact_source(self) -> _Source:
        """[start, exact_end) from the plan's exact chunks, at their own positions: per layer a
        piece per chunk (views of one copy per chunk on a device; placed piece by piece, never
        joined where the slots are consecutive)."""
        b, n = self.blend, len(self.layout)
        dtype = self.runner.k_cache.dtype
        pieces: list[list[Parts]] = [[] for _ in range(n)]  # per layer, per chunk: (k, v, h)
        chunks = [c for c in self.plan.chunks if max(c.start, b.start) < min(c.end, b.exact_end)]
        for c, states in zip(chunks, self._read_exact(chunks)):
            lo, hi = max(c.start, b.start), min(c.end, b.exact_end)
            if states is None:
                raise RestoreMiss(f"chunk {c.key[:12]} could not be read intact")
            self.stats.bytes_read += c.nbytes
            self.stats.chunks_loaded += 1
            for st in states:
                pieces[st.layer].append(cast(Parts, tuple(
                    None if t is None else t[lo - c.start : hi - c.start].to(dtype) for t in (st.k, st.v, st.h))))
        if sum(cast(torch.Tensor, k if k is not None else h).shape[0] for k, _, h in pieces[0]) != b.exact_end - b.start:
            raise RestoreMiss("the exact chunks do not cover the planned prefix")
        # A copy per chunk, not per layer and part; the chunks' bytes may go (evicted) once it is done.
        moved = iter(uploaded(self.runner.transfer, [t for layer in pieces for part in layer for t in part]))
        placed = [tuple(cast(Parts, tuple(next(moved) for _ in part)) for part in layer) for layer in pieces]
        return self._source(lambda li: placed[li], None, [(b.start, b.exact_end)], 0)

    def _read_exact(self, chunks: Sequence[PlannedChunk]) -> list[list[fmt.LayerState] | None]:
        """Every layer of each of the exact prefix's `chunks` (None: not read intact). In the step,
        from the tier the plan names, and where any is below the memory tier's views, on a thread
        of their own, waited for within `read_wait_s` (a read that hangs never holds the step)."""
        layers = range(len(self.layout))
        if not self.in_step:
            return [self.store.read_layers(c.key, layers, copy=False) for c in chunks]

        def read() -> list[list[fmt.LayerState] | None]:
            return [self.store.read_layers(c.key, layers, copy=False, tier=c.tier) for c in chunks]

        if all(self.store.tier(c.tier).zero_copy for c in chunks):
            return read()
        got: list[list[list[fmt.LayerState] | None] | Exception] = []
        done = threading.Event()

        def run() -> None:
            try:
                got.append(read())
            except Exception as e:  # a failed read is a miss, never lost on this thread
                got.append(e)
            finally:
                done.set()

        thread = threading.Thread(target=run, name="kvtier-blend-io", daemon=True)
        t = time.perf_counter()
        thread.start()
        ended = done.wait(self.read_wait_s)
        self._waited += time.perf_counter() - t
        if not ended:
            self._lingering.append(thread)  # it reads into memory of its own: left to end alone
            raise _ReadsTooSlow(f"the exact prefix's reads were waited for over {self.read_wait_s} s")
        if isinstance(got[0], Exception):
            raise _LoadFailed(f"the exact prefix's reads failed: {type(got[0]).__name__}: {got[0]}")
        return got[0]

    def _rows_of(self, position: int, n: int) -> list[tuple[int, int]]:
        """The spans of prompt positions of a segment of `n` tokens at `position` that the plan loads."""
        loaded, end = self.blend.loaded, position + n
        spans = []
        for a, e in loaded[max(bisect.bisect_right(loaded, (position, position)) - 1, 0):]:
            if a >= end:
                break
            if e > position:
                spans.append((max(a, position), min(e, end)))
        return spans

    def _segment_source(self, position: int, n: int, layer: Callable[[int], Pieces],
                        stacks: Callable[[int], Stacked | None] | None = None, packed: bool = False) -> _Source:
        """A segment of `n` tokens at `position`: the rows of it the plan loads (`packed`: in the
        loader's packed groups)."""
        spans = self._rows_of(position, n)
        rows: torch.Tensor | slice = slice(spans[0][0] - position, spans[0][1] - position) if len(spans) == 1 else \
            self.runner.upload(torch.cat([torch.arange(a, e) for a, e in spans]) - position if spans
                               else torch.zeros(0, dtype=torch.long))
        # Stored K is rotated at offset + row: moved to position + row.
        return self._source(layer, rows, spans, position - self.states.offset, stacks, packed)

    def _source(self, layer: Callable[[int], Pieces], rows: torch.Tensor | slice | None,
                spans: Sequence[tuple[int, int]], shift: int,
                stacks: Callable[[int], Stacked | None] | None = None, packed: bool = False) -> _Source:
        """The rows of a state placed at the prompt positions `spans`, K rotated by `shift` more."""
        up = self.runner.upload
        positions = torch.cat([torch.arange(a, e) for a, e in spans]) if spans else torch.zeros(0, dtype=torch.long)
        whole = self.runner.consecutive(self.block_ids, *spans[0]) if len(spans) == 1 else None
        slots = whole if whole is not None else \
            up(self.runner.slots(self.block_ids, 0, self.blend.end + 1).index_select(0, positions))
        rotation = self.runner.rope.delta(up(torch.tensor([shift]))) if shift else None  # made once, for every layer
        return _Source(layer, rows, slots, up(positions), rotation, stacks, packed)

    def _check_abort(self) -> None:
        if self._error is not None:  # aborted meanwhile: stop at the next layer
            raise RestoreMiss(self._error)

    def _place(self, li: int) -> None:
        """Layer `li` of every source's rows into the pool at their positions (a stored document's
        whole read group with the group's first layer, where its reads stack)."""
        self._check_abort()
        g, r = divmod(li, READ_GROUP_LAYERS)  # the loader's groups start at multiples of it
        packed = self._loader.packed_group(g) if self._loader is not None and self._packed_rows is not None else None
        if packed is not None and r == 0:
            assert self._packed_rows is not None
            slots, rotation = self._packed_rows
            self.runner.place_rows(range(li, li + packed.k.shape[0]), packed.k, packed.v, rotation, slots)
        for src in self._sources:
            if not src.positions.numel() or (packed is not None and src.packed):
                continue
            if isinstance(src.slots, slice) and src.stacks is not None and (stack := src.stacks(g)) is not None:
                if r == 0:
                    self._place_run(src, range(li, min(li + READ_GROUP_LAYERS, len(self.layout))), stack)
                continue
            pieces = src.layer(li)
            if isinstance(src.slots, slice) and self.layout[li] is Repr.KV:
                self._place_run(src, range(li, li + 1),
                                tuple((cast(torch.Tensor, k)[None], cast(torch.Tensor, v)[None]) for k, v, _ in pieces))
                continue
            k, v, h = joined(pieces)
            if isinstance(src.rows, slice):
                k, v, h = (None if t is None else t[src.rows] for t in (k, v, h))
            elif src.rows is not None:
                k, v, h = (None if t is None else t.index_select(0, src.rows) for t in (k, v, h))
            if self.layout[li] is Repr.HIDDEN:
                assert h is not None  # the reads checked every layer's part
                self.runner.project_in(li, h, src.positions, src.slots)
            else:
                assert k is not None and v is not None
                self.runner.rotate_in(li, k, v, src.rotation, src.slots)
        if self._loader is not None and (r == READ_GROUP_LAYERS - 1 or li == len(self.layout) - 1):
            self._loader.release(g)

    def _place_run(self, src: _Source, layers: range, stack: Stacked) -> None:
        """`layers` of a source whose rows go to consecutive slots, K/V per piece [layers, rows,
        kv_heads, hd]: each piece rotated and copied straight into its slots, never joined first
        (elementwise: the same bits as joined, or as one layer at a time)."""
        assert isinstance(src.slots, slice)
        want = src.rows if isinstance(src.rows, slice) else slice(0, src.positions.numel())
        at = 0
        for k, v in stack:
            m = k.shape[1]
            lo, hi = max(want.start, at), min(want.stop, at + m)
            if lo < hi:
                first = src.slots.start + lo - want.start
                self.runner.rotate_in_layers(layers, k[:, lo - at : hi - at], v[:, lo - at : hi - at], src.rotation,
                                             slice(first, first + hi - lo))
            at += m

    def _chosen(self, loaded: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """cacheblend: run the layers up to the check layer over the whole blended region, and pick
        the share `ratio` of loaded positions whose fresh K there deviates most from the loaded K
        (ties: the earlier position). -> the picked positions as runs."""
        b = self.blend
        check = min(b.options.check_layer, len(self.layout) - 1)
        lo = max(b.start, b.exact_end)
        positions = torch.cat([torch.arange(a, e) for a, e in loaded]) if loaded else torch.zeros(0, dtype=torch.long)
        want = int(b.options.ratio * positions.numel())
        if want == 0:
            return []
        table = self.runner.slots(self.block_ids, 0, b.end)  # [end] pool slot of each position
        deviation: list[torch.Tensor] = []
        for a in range(lo, b.end, self.chunk_tokens):  # the layers up to the check, a chunk at a time
            e = min(a + self.chunk_tokens, b.end)
            mine = positions[(positions >= a) & (positions < e)]
            slots, rows = self.runner.upload(table.index_select(0, mine)), self.runner.upload(mine - a)

            def capture(li: int, offsets: tuple[int, ...], h: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        slots: torch.Tensor = slots, rows: torch.Tensor = rows) -> None:
                if li == check:  # before the step writes this layer: the pool still holds the loaded K
                    old = self.runner.k_cache[li].index_select(0, slots).float()
                    new = k.index_select(0, rows).float()
                    deviation.append((new - old).square().sum(dim=(1, 2)))  # [loaded positions of the chunk]

            item = self._item(a, e)
            self.runner.execute([item], capture=capture, layers=range(check + 1))
            self._check_abort()
        if len(deviation) != -(-(b.end - lo) // self.chunk_tokens):
            raise RestoreMiss("the check layer's keys were not captured")
        dev = torch.cat([d.cpu() for d in deviation])  # [loaded positions], in position order
        if b.options.score is BlendScore.WEIGHTED:
            paid = self._tail_attention(check)
            if paid is not None:
                dev = dev * paid.index_select(0, positions)
        # Stable sort: equal scores keep position order, so the choice is a function of the bits.
        order = torch.sort(dev, descending=True, stable=True).indices[:want]
        picked = positions.index_select(0, order).sort().values.tolist()
        return merged([(p, p + 1) for p in picked])

    def _tail_attention(self, after: int) -> torch.Tensor | None:
        """The rows no document covers go through every layer over the loaded state (a naive
        blend; the recompute computes them again), in passes of at most `chunk_tokens` rows, the
        last of which holds the prompt's last rows after the last document (at most TAIL_QUERIES);
        the attention those pay each earlier position in the layers past `after`, summed over
        heads -> [positions before them] (None: no row follows the last document)."""
        b = self.blend
        tail = max(s.end for s in b.segments)
        if tail >= b.end:
            return None
        first = b.end - min(TAIL_QUERIES, b.end - tail)  # [tail, end) is uncovered: one of the runs
        groups = pieces(b.runs, self.chunk_tokens)
        if groups[-1][0][0] > first:  # the querying rows would straddle two passes: one of their own
            groups = pieces(subtract(b.runs, [(first, b.end)]), self.chunk_tokens) + [[(first, b.end)]]
        *before, last = groups
        probe = _Probe(self.runner, self.block_ids, last, b.end, b.end - first, after)
        model = self.runner.model
        for attention in [*(_Scattered(self.runner, self.block_ids, g, b.end, None) for g in before), probe]:
            model.run_layers(model.embed(self.runner.upload(attention.ids(self.token_ids))), attention)
            self._check_abort()
        return probe.paid
