"""The planner: predict each restore method's time from the profile and pick the fastest.

Pure: ints, floats and plain values in, a frozen Plan out. Per layer it works with four costs
(HCache §4.1 names): IO_KV and IO_H (reading one layer of K/V or of hidden states for the whole
history, summed over the tiers the chunks actually sit in), C_H (projecting one layer's hidden
states to K/V) and C_Token (recomputing one layer from tokens). Online refinement: after a
restore, `observe` folds the measured/predicted ratio into a per-method correction factor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.restore.plan import READ_GROUP_LAYERS, ChunkSource, Method, Plan
from kvtier.restore.profile import HardwareProfile, TierRates
from kvtier.store import Repr


@dataclass(frozen=True)
class TierLink:
    """Effective read cost of one tier: measured rates plus any emulated bandwidth/latency."""

    rates: TierRates
    emulated_bps: float | None = None
    emulated_latency_s: float = 0.0

    def read_s(self, nbytes: int, whole_chunk: bool) -> float:
        return sum(self.read_parts(nbytes, whole_chunk))

    def read_parts(self, nbytes: int, whole_chunk: bool) -> tuple[float, float]:
        """(busy, waiting) seconds of reading one chunk whole, or one layer of it: the raw device
        read, which occupies a core, and what an emulated limit adds on top as pure waiting.
        Layers are read READ_GROUP_LAYERS at a time, so a layer pays that share of a call's latency."""
        bps = self.rates.chunk_bps if whole_chunk else self.rates.layer_bps
        calls = 1.0 if whole_chunk else 1.0 / READ_GROUP_LAYERS
        wait = calls * self.emulated_latency_s + (nbytes / self.emulated_bps if self.emulated_bps else 0.0)
        return nbytes / bps + calls * self.rates.read_latency_s, wait

    def stolen_s(self, nbytes: int, whole_chunk: bool) -> float:
        """Compute time a read takes away from work running beside it (its unhidden busy part)."""
        return (1.0 - self.rates.overlap) * self.read_parts(nbytes, whole_chunk)[0]

    @property
    def bandwidth(self) -> float:
        """Bytes/s the ideal bound is computed with."""
        raw = self.rates.chunk_bps
        return raw if not self.emulated_bps else 1.0 / (1.0 / raw + 1.0 / self.emulated_bps)


@dataclass(frozen=True)
class Chunk:
    """A stored chunk as the planner sees it."""

    start: int
    end: int
    tier: str

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_bytes_per_token_layer: int  # K and V
    hidden_bytes_per_token_layer: int


def read_buffer_layers(load_s_per_token: float, prefill_s_per_token: float, hist: int, new: int,
                       layer_bytes: int, bandwidth: float) -> int:
    """CachedAttention §3.2.1: S_buf = B * (T_load * L_hist - T_pref * L_new), in layers (at least 1)."""
    gap = load_s_per_token * hist - prefill_s_per_token * new
    if gap <= 0 or layer_bytes <= 0:
        return 1
    return max(1, math.ceil(bandwidth * gap / layer_bytes))


class Planner:
    def __init__(self, profile: HardwareProfile, shape: ModelShape, links: Mapping[str, TierLink],
                 compute_chunk_tokens: int = 512):
        self.profile = profile
        self.compute_chunk_tokens = compute_chunk_tokens  # the executor's prefill step (Cake's front)
        self.shape = shape
        self.links = dict(links)
        self.correction: dict[Method, float] = {}

    # ----- per-layer costs ----------------------------------------------------------------
    def _io_layer(self, chunks: Sequence[Chunk], bytes_per_token: int) -> float:
        return sum(self.links[c.tier].read_s(c.tokens * bytes_per_token, whole_chunk=False) for c in chunks)

    def _stolen_layer(self, chunks: Sequence[Chunk], bytes_per_token: int) -> float:
        return sum(self.links[c.tier].stolen_s(c.tokens * bytes_per_token, whole_chunk=False) for c in chunks)

    def layer_costs(self, chunks: Sequence[Chunk]) -> dict[str, float]:
        hist = chunks[-1].end if chunks else 0
        p, s = self.profile, self.shape
        return {
            "io_kv": self._io_layer(chunks, s.kv_bytes_per_token_layer),
            "io_h": self._io_layer(chunks, s.hidden_bytes_per_token_layer),
            # Reading a layer slows the compute beside it by this much (no copy engine: see TierRates).
            "steal_kv": self._stolen_layer(chunks, s.kv_bytes_per_token_layer),
            "steal_h": self._stolen_layer(chunks, s.hidden_bytes_per_token_layer),
            "c_h": p.project_s * hist,
            "place": p.place_s * hist,
            "c_token": p.prefill_s(0, hist) / s.num_layers,
        }

    # ----- HCache §4.1.2 partition ----------------------------------------------------------
    def partition(self, chunks: Sequence[Chunk]) -> tuple[Repr, ...]:
        """L_H hidden layers plus L_O layers of the complementary method, balanced so IO and
        compute finish together: KV load when projection is the bottleneck (C_H > IO_H), token
        recompute of the first layers when IO is."""
        n = self.shape.num_layers
        c = self.layer_costs(chunks)
        c_h = c["c_h"] + c["steal_h"]  # projection slowed by the reads running beside it
        if c_h > c["io_h"]:
            denom = c["io_kv"] + c_h - c["io_h"]
            l_h = min(n, math.ceil(n * c["io_kv"] / denom)) if denom > 0 else n
            return (Repr.HIDDEN,) * l_h + (Repr.KV,) * (n - l_h)
        denom = c["c_token"] + c["io_h"] - c_h
        l_h = min(n, math.ceil(n * c["c_token"] / denom)) if denom > 0 else n
        return (Repr.NONE,) * (n - l_h) + (Repr.HIDDEN,) * l_h

    # ----- predictions ----------------------------------------------------------------------
    def _pipeline(self, io: Sequence[float], comp: Sequence[float], lead_compute: float) -> float:
        """Layer-wise pipeline: IO streams layers in order; layer l's compute starts when its IO
        is done and layer l-1's compute is done. `lead_compute` runs first (recomputed layers),
        while IO already streams the later layers."""
        io_done, t = 0.0, lead_compute
        for i, c in zip(io, comp):
            io_done += i
            t = max(t, io_done) + c
        return t

    def predict(self, method: Method, chunks: Sequence[Chunk], new: int,
                layout: Sequence[Repr] | None = None) -> tuple[float, float, int, float]:
        """-> (predicted seconds, ideal seconds, bytes read, restore compute seconds) to restore
        `chunks` and compute `new` tokens. The last is the compute (recomputed layers, projection,
        placement) the restore runs on the cores the step loop uses, new tokens excluded."""
        p, s = self.profile, self.shape
        hist = chunks[-1].end if chunks else 0
        new_s = p.prefill_s(hist, hist + new)
        if method is Method.RECOMPUTE or not chunks:
            t = p.prefill_s(0, hist + new)
            return t, t, 0, p.prefill_s(0, hist)
        c = self.layer_costs(chunks)
        n = s.num_layers
        bw = self._bandwidth(chunks)
        if method is Method.CAKE:
            t, nbytes, comp = self._cake(chunks)
            # Ideal: the loaded part at full bandwidth, the computed part at full compute rate.
            return t + new_s, max(nbytes / bw, comp + new_s), nbytes, comp + p.place_s * nbytes / max(
                s.kv_bytes_per_token_layer, 1)
        if layout is None:
            layout = {Method.KV: (Repr.KV,) * n, Method.HIDDEN: (Repr.HIDDEN,) * n}.get(method) or self.partition(chunks)
        io, comp, steal, lead, nbytes = [], [], [], 0.0, 0
        for r in layout:
            if r is Repr.NONE:
                lead += c["c_token"]
                io.append(0.0)
                comp.append(new_s / n)
                steal.append(0.0)
            elif r is Repr.KV:
                io.append(c["io_kv"])
                comp.append(c["place"] + new_s / n)
                steal.append(c["steal_kv"])
                nbytes += hist * s.kv_bytes_per_token_layer
            else:
                io.append(c["io_h"])
                comp.append(c["c_h"] + new_s / n)
                steal.append(c["steal_h"])
                nbytes += hist * s.hidden_bytes_per_token_layer
        t = self._pipeline(io, [x + y for x, y in zip(comp, steal)], lead)
        ideal = max(nbytes / bw, lead + sum(comp))
        return t, ideal, nbytes, lead + sum(comp) - new_s

    def _bandwidth(self, chunks: Sequence[Chunk]) -> float:
        tot = sum(ch.tokens for ch in chunks)
        # Token-weighted harmonic mean: time per byte adds up across the tiers the chunks sit in.
        return 1.0 / sum(ch.tokens / tot / self.links[ch.tier].bandwidth for ch in chunks)

    def _cake(self, chunks: Sequence[Chunk]) -> tuple[float, int, float]:
        """Simulate the executor's two pointers: whichever side is free first claims work; the
        compute side takes `compute_chunk_tokens` worth of chunks from the front per step, the IO
        side loads one whole KV chunk from the back at a time."""
        s, p = self.shape, self.profile
        per_step = max(1, self.compute_chunk_tokens // max(1, chunks[0].tokens)) if chunks else 1
        front, back = 0, len(chunks) - 1
        tf = tb = 0.0
        nbytes, comp = 0, 0.0
        while front <= back:
            if tf <= tb:
                n = min(per_step, back - front + 1)
                cf = p.prefill_s(chunks[front].start, chunks[front + n - 1].end)
                tf += cf
                comp += cf
                front += n
            else:
                ch = chunks[back]
                size = ch.tokens * s.kv_bytes_per_token_layer * s.num_layers
                link = self.links[ch.tier]
                place = p.place_s * ch.tokens * s.num_layers
                tb += link.read_s(size, whole_chunk=True) + place
                # The loader's copies and placement run on the compute side's cores too.
                tf += link.stolen_s(size, whole_chunk=True) + (1.0 - link.rates.overlap) * place
                nbytes += size
                back -= 1
        return max(tf, tb), nbytes, comp

    # ----- choosing -------------------------------------------------------------------------
    def plan(self, method: Method, chunks: Sequence[Chunk], new: int,
             layout: Sequence[Repr] | None = None) -> Plan:
        n = self.shape.num_layers
        if method is Method.RECOMPUTE:
            layout = (Repr.NONE,) * n
        elif method is Method.CAKE or method is Method.KV:
            layout = (Repr.KV,) * n
        elif method is Method.HIDDEN:
            layout = (Repr.HIDDEN,) * n
        elif layout is None:
            layout = self.partition(chunks)
        t, ideal, nbytes, compute_s = self.predict(method, chunks, new, layout)
        t *= self.correction.get(method, 1.0)
        hist = chunks[-1].end if chunks else 0
        direction = {Method.RECOMPUTE: "compute", Method.CAKE: "race"}.get(method, "load")
        sources = tuple(ChunkSource(c.start, c.end, c.tier, direction) for c in chunks)
        prefetch = 2
        if chunks and method is not Method.RECOMPUTE:
            per_tok = t / max(hist, 1) / n
            layer_bytes = hist * self.shape.kv_bytes_per_token_layer
            prefetch = read_buffer_layers(per_tok, self.profile.prefill_s(hist, hist + new) / max(new, 1) / n,
                                          hist, new, layer_bytes, self._bandwidth(chunks))
            prefetch = min(max(prefetch, 2), n)
            lead = sum(1 for r in layout if r is Repr.NONE)
            if lead:
                # Bubble-free with recompute is chosen when IO is the bottleneck: the IO thread must
                # keep reading while the first layers are recomputed, so the buffer takes every
                # stored layer (a bounded one would stall IO for the whole lead compute).
                prefetch = max(prefetch, n - lead)
        # The restore's own compute in prefill-token equivalents: what the engine charges to the
        # step budget while it runs (it shares the cores with the step loop).
        compute_tokens = math.ceil(compute_s / self.profile.prefill_a) if self.profile.prefill_a > 0 else 0
        return Plan(method, tuple(layout), hist, sources, t, ideal, prefetch, nbytes, compute_tokens)

    def choose(self, chunks: Sequence[Chunk], new: int, layouts: Mapping[Method, Sequence[Repr]]) -> Plan:
        """The fastest predicted plan among recompute and the methods whose layout is stored."""
        plans = [self.plan(Method.RECOMPUTE, chunks, new)]
        for m, layout in layouts.items():
            if chunks:
                plans.append(self.plan(m, chunks, new, layout))
        best = min(plans, key=lambda pl: pl.predicted_s)
        return best

    def observe(self, method: Method, predicted_s: float, actual_s: float, weight: float = 0.3) -> None:
        """Refine online: move the method's correction factor toward the observed/predicted ratio."""
        if predicted_s <= 0 or actual_s <= 0:
            return
        raw = predicted_s / self.correction.get(method, 1.0)
        ratio = actual_s / raw
        self.correction[method] = (1 - weight) * self.correction.get(method, 1.0) + weight * ratio
