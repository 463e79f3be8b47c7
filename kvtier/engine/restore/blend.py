"""The blended restore (non-prefix reuse) inside the engine: a `BlendPlan` applied to one request's
blocks, on the restore worker.

1. The exact part [start, exact_end) is read from its planned chunks and copied (K is stored
   rotated at these very positions).
2. Each segment's state is read from the store's blend space, or computed alone and saved
   (segments.py); its rows outside the recomputed runs go to their new positions, K rotated by the
   position difference (`ModelRunner.shift_in`), hidden-state layers projected there.
3. cacheblend only: the layers up to the check layer run for every blended token; the share of
   loaded tokens whose fresh K deviates most from the loaded K there joins the recompute.
4. The recomputed runs go through one runner step, each run a `RunItem` of the request attending
   to every key before it (loaded, exact or computed in this very layer): the exact causal mask.
   Their rows then replace the loaded ones in every layer; residual and MLP run for them only.
   Loaded rows are placed layer by layer just before the step reaches each layer.

The request's own step then computes the prompt's last token and samples. Its state is
approximate: never saved, published to the device prefix cache or served as exact.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.engine.restore.impress_policy import ImpressStats
from kvtier.engine.restore.layerwise import RestoreMiss, RestoreStats
from kvtier.engine.restore.segments import SegmentState, SegmentStates
from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.planning.blend import BlendMode, BlendPlan, merged, subtract
from kvtier.planning.plan import Plan
from kvtier.store.layout import Repr
from kvtier.store.tiered import TieredStore


@dataclass
class BlendStats:
    """What a blended restore did, in prompt tokens: exact (from the store's exact chains), loaded
    (segment rows moved to their positions), recomputed (computed here; the step's last token apart)."""

    exact: int = 0
    loaded: int = 0
    recomputed: int = 0
    segments_stored: int = 0  # segments read from the store
    segments_computed: int = 0  # segments computed alone here (and saved)


@dataclass(frozen=True)
class _Rows:
    """Stored rows placed at their prompt positions: per layer k/v (or h), the rows' pool slots,
    and how far each row's K is rotated (0 for the exact part)."""

    k: tuple[torch.Tensor | None, ...]  # per layer [rows, kv_heads, hd]
    v: tuple[torch.Tensor | None, ...]
    h: tuple[torch.Tensor | None, ...]  # per layer [rows, hidden]
    slots: torch.Tensor  # [rows]
    positions: torch.Tensor  # [rows] prompt positions
    shift: torch.Tensor  # [rows] new position - stored position


class BlendRestore:
    impress: ImpressStats | None = None  # (RestoreJob) chooses no tokens by importance

    def __init__(self, plan: Plan, blend: BlendPlan, states: SegmentStates, store: TieredStore,
                 runner: ModelRunner, token_ids: Sequence[int], block_ids: Sequence[int], salt: str) -> None:
        self.plan, self.blend, self.states, self.store, self.runner = plan, blend, states, store, runner
        self.token_ids, self.block_ids, self.salt = list(token_ids), list(block_ids), salt
        self.layout = tuple(plan.layer_reprs)
        self.start = blend.start  # a failure recomputes from here
        self.stats = RestoreStats()
        self.blended = BlendStats()
        self._prepared = threading.Event()
        self._error: str | None = None
        self._rows: list[_Rows] = []

    # ----- RestoreJob -------------------------------------------------------------------------
    def prepare(self) -> None:
        t0 = time.perf_counter()
        try:
            if self._error is not None:
                raise RestoreMiss(self._error)
            with torch.inference_mode():
                self._prepare()
            self.runner.transfer.sync_compute()  # done means written
        except (RestoreMiss, OSError, ValueError) as e:
            self._error = str(e) or type(e).__name__
            raise RestoreMiss(self._error) from e
        finally:
            self._rows = []
            self.stats.seconds = time.perf_counter() - t0
            self._prepared.set()

    def ready(self) -> bool:
        return self._prepared.is_set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def place(self, layer: int) -> None:
        """Everything was placed while preparing: nothing to do layer by layer."""

    def finish(self) -> RestoreStats:
        self._prepared.wait()
        if self._error is not None:
            raise RestoreMiss(self._error)
        return self.stats

    def abort(self) -> None:
        self._error = self._error or "aborted"

    # ----- the work ---------------------------------------------------------------------------
    def _prepare(self) -> None:
        b = self.blend
        if b.exact_end > b.start:
            self._rows.append(self._exact_rows())
            self.blended.exact = b.exact_end - b.start
        runs = list(b.runs)
        loaded = b.loaded
        states = [self._segment(s.tokens) for s in b.segments]
        t_read = time.perf_counter()
        self._rows += [self._segment_rows(s.position, st, loaded) for s, st in zip(b.segments, states)]
        self.stats.prepare_s = time.perf_counter() - t_read
        layers = len(self.layout)
        placed = 0
        if b.options.mode is BlendMode.CACHEBLEND:
            for li in range(layers):
                self._place(li)
            placed = layers
            runs = merged(runs + self._chosen(loaded))
        if self._error is not None:
            raise RestoreMiss(self._error)
        self.blended.loaded = sum(e - a for a, e in subtract(loaded, runs))
        self.blended.recomputed = sum(e - a for a, e in runs)
        if not runs:  # every row loaded: place them all
            for li in range(placed, layers):
                self._place(li)
            return
        items = [RunItem(self.token_ids[a:e], a, self.block_ids, want_logits=False, off_thread=True, placed_ahead=True)
                 for a, e in runs]
        self.runner.execute(items, before_layer=None if placed == layers else self._place)

    def _segment(self, tokens: Sequence[int]) -> SegmentState:
        st = self.states.get(tokens, self.salt)
        if st.stored:
            self.blended.segments_stored += 1
            self.stats.chunks_loaded += 1
            self.stats.bytes_read += st.nbytes
        else:
            self.blended.segments_computed += 1
        return st

    def _exact_rows(self) -> _Rows:
        """[start, exact_end) from the plan's exact chunks, at their own positions."""
        b, n = self.blend, len(self.layout)
        parts: list[dict[str, list[torch.Tensor]]] = [{"k": [], "v": [], "h": []} for _ in range(n)]
        for c in self.plan.chunks:
            lo, hi = max(c.start, b.start), min(c.end, b.exact_end)
            if lo >= hi:
                continue
            states = self.store.read_layers(c.key, range(n), copy=False)
            if states is None:
                raise RestoreMiss(f"chunk {c.key[:12]} could not be read intact")
            self.stats.bytes_read += c.nbytes
            self.stats.chunks_loaded += 1
            for s in states:
                for p in ("k", "v", "h"):
                    t = getattr(s, p)
                    if t is not None:
                        parts[s.layer][p].append(t[lo - c.start : hi - c.start])
        if sum(t.shape[0] for t in parts[0]["k"] + parts[0]["h"]) != b.exact_end - b.start:
            raise RestoreMiss("the exact chunks do not cover the planned prefix")
        dev, dtype = self.runner.device, self.runner.k_cache.dtype
        k, v, h = (tuple(torch.cat(parts[li][p]).to(dev, dtype) if parts[li][p] else None for li in range(n))
                   for p in ("k", "v", "h"))
        positions = torch.arange(b.start, b.exact_end)
        return self._rows_at(k, v, h, positions, torch.zeros_like(positions))

    def _segment_rows(self, position: int, st: SegmentState, loaded: Sequence[tuple[int, int]]) -> _Rows:
        """The segment's rows at `position` that the plan loads."""
        n = len(st.k[0]) if st.k[0] is not None else len(st.h[0])  # type: ignore[arg-type]
        spans = [(max(a, position), min(e, position + n)) for a, e in loaded if a < position + n and e > position]
        rows = torch.cat([torch.arange(a, e) for a, e in spans]) - position if spans else torch.zeros(0, dtype=torch.long)
        dev_rows = rows.to(self.runner.device)

        def pick(ts: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
            return tuple(None if t is None else t.index_select(0, dev_rows) for t in ts)

        return self._rows_at(pick(st.k), pick(st.v), pick(st.h), rows + position, torch.full_like(rows, position))

    def _rows_at(self, k, v, h, positions: torch.Tensor, shift: torch.Tensor) -> _Rows:
        slots = self.runner.slots(self.block_ids, 0, self.blend.end + 1).index_select(0, positions)
        up = self.runner.upload
        return _Rows(k, v, h, up(slots), up(positions), up(shift))

    def _place(self, li: int) -> None:
        """Layer `li` of every source's rows into the pool at their positions."""
        runner = self.runner
        for r in self._rows:
            if not r.slots.numel():
                continue
            if self.layout[li] is Repr.HIDDEN:
                h = r.h[li]
                assert h is not None  # SegmentStates / the exact read checked every layer's part
                runner.project_in(li, h, r.positions, r.slots)
            else:
                k, v = r.k[li], r.v[li]
                assert k is not None and v is not None
                runner.shift_in(li, k, v, r.shift, r.slots)

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
        slots = self.runner.upload(self.runner.slots(self.block_ids, 0, b.end).index_select(0, positions))
        rows = self.runner.upload(positions - lo)  # rows of the region run
        deviation: list[torch.Tensor] = []

        def capture(li: int, offsets: tuple[int, ...], h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            if li == check:  # before the step writes this layer: the pool still holds the loaded K
                old = self.runner.k_cache[li].index_select(0, slots).float()
                new = k.index_select(0, rows).float()
                deviation.append((new - old).square().sum(dim=(1, 2)))  # [loaded positions]

        item = RunItem(self.token_ids[lo : b.end], lo, self.block_ids, want_logits=False, off_thread=True,
                       placed_ahead=True)
        self.runner.execute([item], capture=capture, layers=range(check + 1))
        if not deviation:
            raise RestoreMiss("the check layer's keys were not captured")
        # Stable sort: equal deviations keep position order, so the choice is a function of the bits.
        order = torch.sort(deviation[0].cpu(), descending=True, stable=True).indices[:want]
        picked = positions.index_select(0, order).sort().values.tolist()
        return merged([(p, p + 1) for p in picked])
