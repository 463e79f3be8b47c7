"""The executor: applies a Plan, putting a context's history KV into a request's pool blocks.

Layer-wise methods (kv, hidden, bubble-free) run an IO thread that reads layer after layer of
every chunk into a bounded queue (the read buffer), while this thread places each layer (RoPE
for KV, projection + RoPE for hidden states) right before the new tokens need it. Cake runs an
IO thread loading whole KV chunks from the back while this thread computes chunks from the front
until they meet. The executor never re-decides: a missing chunk aborts the restore (RestoreMiss)
and the caller recomputes.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.engine.runner import ModelRunner, RunItem
from kvtier.restore.plan import READ_GROUP_LAYERS, Method, Plan
from kvtier.store import PrefixMatch, Repr, TieredStore


class RestoreMiss(RuntimeError):
    """A chunk the plan relied on could not be read intact; recompute instead."""


@dataclass
class RestoreStats:
    seconds: float = 0.0
    bytes_read: int = 0
    chunks_loaded: int = 0
    chunks_computed: int = 0
    layers_by_repr: dict[str, int] = field(default_factory=dict)


class Executor:
    def __init__(self, runner: ModelRunner, compute_chunk_tokens: int = 512):
        self.runner = runner
        self.compute_chunk_tokens = compute_chunk_tokens

    # ----- entry points ---------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, plan: Plan, store: TieredStore | None, match: PrefixMatch | None, token_ids: Sequence[int],
            block_ids: Sequence[int], want_logits: bool = True) -> tuple[torch.Tensor, RestoreStats]:
        """Restore [0, plan.history_tokens) and compute the rest of `token_ids` on top of it.

        Returns the next-token logits [vocab] (fp32) and what the restore did.
        """
        stats = RestoreStats()
        t0 = time.perf_counter()
        hist = plan.history_tokens
        assert len(token_ids) > hist, "at least one new token is computed on top of a restore"
        new_item = RunItem(list(token_ids[hist:]), hist, block_ids, want_logits)
        if plan.method is Method.RECOMPUTE or hist == 0:
            self._compute(token_ids[:hist], 0, block_ids, stats)
            logits = self.runner.execute([new_item])
        elif plan.method is Method.CAKE:
            self._cake(plan, store, match, token_ids, block_ids, stats)
            logits = self.runner.execute([new_item])
        else:
            logits = self._layerwise(plan, store, match, token_ids, block_ids, stats, new_item)
        stats.seconds = time.perf_counter() - t0
        return (logits[0] if want_logits else logits), stats

    def restore_history(self, plan: Plan, store: TieredStore, match: PrefixMatch, token_ids: Sequence[int],
                        block_ids: Sequence[int], start: int = 0) -> RestoreStats:
        """Restore [start, plan.history_tokens) only (the engine prefills the new tokens itself)."""
        stats = RestoreStats()
        t0 = time.perf_counter()
        if plan.method is Method.CAKE:
            self._cake(plan, store, match, token_ids, block_ids, stats, start)
        else:
            self._layerwise(plan, store, match, token_ids, block_ids, stats, None, start)
        stats.seconds = time.perf_counter() - t0
        return stats

    @torch.inference_mode()
    def restore_remapped(self, layout: Sequence[Repr], store: TieredStore, match: PrefixMatch,
                         source: Sequence[int], block_ids: Sequence[int]) -> RestoreStats:
        """Place stored tokens `source` (indices into the stored context) at positions 0..len-1.

        Context truncation (CachedAttention §3.4): K is stored before RoPE, so kept tokens take
        their new, compacted positions by rotating them there."""
        stats = RestoreStats()
        t0 = time.perf_counter()
        runner, model = self.runner, self.runner.model
        idx = torch.tensor(list(source))
        slots = runner.slots(block_ids, 0, len(source))
        for li, r in enumerate(layout):
            if r is Repr.NONE:
                raise RestoreMiss(f"layer {li} is not stored; truncated state cannot be rebuilt")
            got = [store.read_layers(c, [li], r.parts(), copy=False) for c in match.chunks]
            if any(g is None for g in got):
                raise RestoreMiss(f"layer {li} of a stored chunk could not be read")
            if r is Repr.KV:
                k = torch.cat([g[0].k for g in got]).index_select(0, idx)  # [kept, kv_heads, hd]
                v = torch.cat([g[0].v for g in got]).index_select(0, idx)
            else:
                k, v = model.layers[li].kv(torch.cat([g[0].h for g in got]).index_select(0, idx).to(model.dtype))
            runner.place_kv(li, slots, 0, k, v)
            stats.bytes_read += sum(x.nbytes for g in got for x in (g[0].k, g[0].v, g[0].h) if x is not None)
        stats.chunks_loaded = len(match.chunks)
        stats.seconds = time.perf_counter() - t0
        return stats

    # ----- recompute --------------------------------------------------------------------------
    def _compute(self, ids: Sequence[int], start: int, block_ids: Sequence[int], stats: RestoreStats,
                 layers: range | None = None) -> None:
        """Chunked prefill of ids placed at [start, start + len(ids)) (optionally a layer prefix only)."""
        step = self.compute_chunk_tokens
        for a in range(0, len(ids), step):
            item = RunItem(list(ids[a : a + step]), start + a, block_ids, want_logits=False)
            self.runner.execute([item], layers=layers)
            stats.chunks_computed += 1

    # ----- layer-wise: kv, hidden, bubble-free ---------------------------------------------------
    def _layerwise(self, plan: Plan, store: TieredStore | None, match: PrefixMatch | None, token_ids: Sequence[int],
                   block_ids: Sequence[int], stats: RestoreStats, new_item: RunItem | None,
                   start: int = 0) -> torch.Tensor:
        assert store is not None and match is not None
        runner, model = self.runner, self.runner.model
        hist = plan.history_tokens
        chunks = [c for c in match.chunks if c.end <= hist and c.end > start]
        lead = plan.recompute_layers
        buf: queue.Queue = queue.Queue(maxsize=max(1, plan.prefetch_layers))
        stop = threading.Event()

        group = READ_GROUP_LAYERS
        lo = chunks[0].start if chunks else start
        slots = runner.slots(block_ids, lo, hist)

        def place_chunks(li: int, got: list) -> None:
            # Chunk by chunk, straight from the read buffers into the pool: concatenating the
            # chunks first would copy the whole layer once more. Positions before `start` are
            # device-cached blocks other requests may share: never written.
            r = plan.layer_reprs[li]
            nbytes = 0
            for c, g in zip(chunks, got):
                a = max(c.start, start)
                if r is Repr.KV:
                    nbytes += g.k.nbytes + g.v.nbytes
                    k, v = g.k[a - c.start :], g.v[a - c.start :]  # [tokens, kv_heads, hd] pre-RoPE
                else:
                    nbytes += g.h.nbytes
                    k, v = model.layers[li].kv(g.h[a - c.start :].to(model.dtype))  # from the layer input
                runner.place_kv(li, slots[a - lo : c.end - lo], a, k, v)
            stats.bytes_read += nbytes
            stats.layers_by_repr[r.value] = stats.layers_by_repr.get(r.value, 0) + 1

        def reader() -> None:
            # One read per chunk and group of layers (layer-major chunks make a group contiguous),
            # handed on layer by layer so placement can start as soon as a layer is complete.
            n = len(plan.layer_reprs)
            for g0 in range(lead, n, group):
                layers = list(range(g0, min(g0 + group, n)))
                parts = tuple({p for li in layers for p in plan.layer_reprs[li].parts()})
                got = []
                for c in chunks:
                    data = None if stop.is_set() else store.read_layers(c, layers, parts, copy=False)
                    if data is None:
                        buf.put((g0, None))
                        return
                    got.append(data)
                for i, li in enumerate(layers):
                    buf.put((li, [d[i] for d in got]))

        io = threading.Thread(target=reader, name="kvtier-restore-io", daemon=True)
        io.start()
        try:
            if lead:  # bubble-free with recompute: the first layers come from tokens (IO already streams)
                self._compute(token_ids[:hist], 0, block_ids, stats, layers=range(lead))

            def place(li: int) -> None:
                if li < lead:
                    return
                got_layer, got = buf.get()
                if got is None:
                    raise RestoreMiss(f"layer {got_layer} of a stored chunk could not be read")
                assert got_layer == li
                place_chunks(li, got)

            if new_item is None:
                for li in range(model.cfg.num_layers):
                    place(li)
                return torch.empty(0)
            return runner.execute([new_item], before_layer=place)
        finally:
            stop.set()
            while io.is_alive():  # unblock a reader waiting on a full buffer
                try:
                    buf.get_nowait()
                except queue.Empty:
                    io.join(0.01)
            stats.chunks_loaded = len(chunks)

    # ----- Cake: bidirectional ------------------------------------------------------------------
    def _cake(self, plan: Plan, store: TieredStore | None, match: PrefixMatch | None, token_ids: Sequence[int],
              block_ids: Sequence[int], stats: RestoreStats, start: int = 0) -> None:
        """[0, start) is already in the pool (device prefix cache): neither side writes there, since
        those blocks may be shared with other requests."""
        assert store is not None and match is not None
        runner = self.runner
        chunks = [c for c in match.chunks if start < c.end <= plan.history_tokens]
        lock = threading.Lock()
        state = {"front": 0, "back": len(chunks) - 1}
        failed: list[str] = []

        def loader() -> None:
            # One intra-op thread (a per-thread setting): a second full team of workers beside the
            # compute side's would oversubscribe the cores both share.
            torch.set_num_threads(1)
            while True:
                with lock:
                    j = state["back"]
                    if j < state["front"]:
                        return
                    state["back"] = j - 1  # claimed: the compute side will stop before it
                c = chunks[j]
                layers = store.read_chunk(c, copy=False)
                if layers is None:
                    failed.append(c.key)
                    return
                lo = max(c.start, start)
                slots = runner.slots(block_ids, lo, c.end)
                with torch.inference_mode():
                    for st in layers:
                        k, v = st.k[lo - c.start :], st.v[lo - c.start :]  # [tokens, kv_heads, hd]
                        runner.place_kv(st.layer, slots, lo, k, v)
                        stats.bytes_read += st.k.nbytes + st.v.nbytes
                stats.chunks_loaded += 1

        io = threading.Thread(target=loader, name="kvtier-cake-io", daemon=True)
        io.start()
        per_step = max(1, self.compute_chunk_tokens // max(1, chunks[0].end - chunks[0].start)) if chunks else 1
        while True:
            with lock:
                i, back = state["front"], state["back"]
                if i > back:
                    break
                n = min(per_step, back - i + 1)
                state["front"] = i + n
            a, b = max(chunks[i].start, start), chunks[i + n - 1].end
            runner.execute([RunItem(list(token_ids[a:b]), a, block_ids, want_logits=False)])
            stats.chunks_computed += n
        io.join()
        if failed:
            raise RestoreMiss(f"chunk {failed[0][:12]} could not be read")
