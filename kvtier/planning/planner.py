"""The planner: predict each restore method's time from the profile and pick the fastest.

Pure: ints, floats and plain values in, a frozen Plan out (no torch). Per layer it works with four
costs (HCache §4.1 names): IO_KV and IO_H (reading one layer of K/V or of hidden states for the
whole history, summed over the tiers the chunks actually sit in), C_H (projecting one layer's
hidden states to K/V) and C_Token (recomputing one layer from tokens).

What it predicts is the engine's own path: the plan's first `read_buffer_layers` layers are read
while the request waits (plus any recomputed leading layers or Cake's race), then the new tokens
run layer by layer, each layer's history placed just before that layer needs it. Online
refinement: after a restore, `observe` folds the measured/predicted ratio into a per-method factor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvtier.planning.costs import HardwareProfile, ModelShape, TierLink, read_buffer_layers
from kvtier.planning.plan import Method, Plan, PlannedChunk
from kvtier.store.index import StoredChunk
from kvtier.store.layout import Repr

MAX_CORRECTION = 4.0  # the most online refinement may scale a method's predicted time, either way
LOSSY_MARGIN = 0.85  # a lossy plan must be predicted at least 15% faster than the best exact one
LAYOUT_PROBES = (1024, 4096, 16384)  # history lengths (tokens) auto's stored layout is chosen for


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per layer for the whole history (HCache §4.1 names)."""

    io_kv: float  # reading one layer of K/V (busy + waiting)
    io_h: float  # reading one layer of hidden states
    steal_kv: float  # compute time a K/V layer read takes from the compute beside it
    steal_h: float
    c_h: float  # projecting one layer of hidden states to K/V (with RoPE and placement)
    place: float  # copying one layer of K/V into the pool
    c_token: float  # recomputing one layer from tokens


@dataclass
class ImportanceReads:
    """What an importance-only restore reads (IMPRESS), for its prediction. The two shares are
    learned from restores (`observe_importance`)."""

    ratio: float  # share of the prefix each layer keeps
    probe_share: float  # the probe keys' share of a layer's stored K/V: probe KV heads / (2 x KV heads)
    granule_share: float  # share of the stored K/V granules the kept tokens touch
    pass_rate: float  # share of layers whose probe heads agree (the others read every key)

    @staticmethod
    def initial(ratio: float, probe_kv_heads: int, kv_heads: int, granule_tokens: int, unit: int,
                pass_rate: float = 0.8) -> "ImportanceReads":
        """Before any restore was seen: whole granules read what they keep; single tokens scattered
        at random touch a granule unless all of its tokens were left out. The pass rate comes from
        the probe calibration (0.8, the paper's "under 20% fall back", without one)."""
        share = ratio if unit > 1 else 1.0 - (1.0 - ratio) ** granule_tokens
        return ImportanceReads(ratio, probe_kv_heads / (2 * kv_heads), share, pass_rate)


def _tokens(chunks: Sequence[StoredChunk]) -> int:
    return chunks[-1].end if chunks else 0


class Planner:
    def __init__(self, profile: HardwareProfile, shape: ModelShape, links: Mapping[str, TierLink],
                 compute_chunk_tokens: int = 512, prefill_chunk_tokens: int = 2048,
                 importance: ImportanceReads | None = None):
        self.profile = profile
        self.importance = importance  # set where importance-only restores may be planned
        self.shape = shape
        self.links = dict(links)
        self.compute_chunk_tokens = compute_chunk_tokens  # Cake's front step (the executor's)
        self.prefill_chunk_tokens = prefill_chunk_tokens  # the engine's per-step token budget
        self.correction: dict[Method, float] = {}

    def adopt(self, profile: HardwareProfile) -> None:
        """Predict with `profile` from now on (each tier's emulated limits stay); the online
        correction learnt against the previous profile starts afresh."""
        self.profile = profile
        self.links = {name: dataclasses.replace(link, rates=profile.rates(name)) for name, link in self.links.items()}
        self.correction = {}

    # ----- per-layer costs ----------------------------------------------------------------
    def _link(self, tier: str) -> TierLink:
        link = self.links.get(tier)
        if link is None:
            link = self.links[tier] = TierLink(self.profile.rates(tier))
        return link

    def grouped_read_s(self, tier: str, nbytes: int, calls: int) -> float:
        """Predicted seconds to read `nbytes` from `tier` in `calls` batched reads."""
        return self._link(tier).grouped_read_s(nbytes, calls)

    def _per_layer(self, chunks: Sequence[StoredChunk], bytes_per_token: int) -> tuple[float, float]:
        io = steal = 0.0
        for c in chunks:
            link, nbytes = self._link(c.tier), (c.end - c.start) * bytes_per_token
            io += link.read_s(nbytes, whole_chunk=False)
            steal += link.stolen_s(nbytes, whole_chunk=False)
        return io, steal

    def layer_costs(self, chunks: Sequence[StoredChunk]) -> LayerCosts:
        p, s, hist = self.profile, self.shape, _tokens(chunks)
        io_kv, steal_kv = self._per_layer(chunks, s.kv_bytes_per_token_layer)
        io_h, steal_h = self._per_layer(chunks, s.hidden_bytes_per_token_layer)
        return LayerCosts(io_kv, io_h, steal_kv, steal_h, c_h=p.project_s * hist, place=p.place_s * hist,
                          c_token=self.prefill_chunks_s(0, hist) / s.num_layers)

    def prefill_chunks_s(self, start: int, end: int) -> float:
        """Seconds to compute [start, end) as the engine does: in steps of the token budget."""
        step, t = self.prefill_chunk_tokens, 0.0
        for a in range(start, end, step):
            t += self.profile.prefill_s(a, min(end, a + step))
        return t

    # ----- HCache §4.1.2 partition ----------------------------------------------------------
    def partition(self, chunks: Sequence[StoredChunk]) -> tuple[Repr, ...]:
        """L_H hidden layers plus L_O layers of the complementary method, balanced so IO and
        compute finish together: KV load when projection is the bottleneck (C_H > IO_H), token
        recompute of the first layers when IO is."""
        n, c = self.shape.num_layers, self.layer_costs(chunks)
        c_h = c.c_h + c.steal_h  # projection slowed by the reads running beside it
        if c_h > c.io_h:
            denom = c.io_kv + c_h - c.io_h
            l_h = min(n, math.ceil(n * c.io_kv / denom)) if denom > 0 else n
            return (Repr.HIDDEN,) * l_h + (Repr.KV,) * (n - l_h)
        denom = c.c_token + c.io_h - c_h
        l_h = min(n, math.ceil(n * c.c_token / denom)) if denom > 0 else n
        return (Repr.NONE,) * (n - l_h) + (Repr.HIDDEN,) * l_h

    # ----- predictions ----------------------------------------------------------------------
    @classmethod
    def _start_depth(cls, io: Sequence[float], comp: Sequence[float], lead: float, steal: float,
                     buffer: int) -> tuple[int, float]:
        """(depth, predicted seconds): the shallowest read buffer, at most CachedAttention's
        `buffer` layers, from which the new tokens' layers never wait for a read (a wait inside
        the step stalls every request batched with it). The formula sizes the buffer as if the
        compute ran at its own speed; where reads take the compute's cores (`steal`), it slows
        while they run, more of them hide, and a shallower buffer suffices. Stalls only get
        fewer as the buffer grows, so the depth is found by bisection. A plan that recomputes
        leading layers keeps its buffer: the reader reads only that far ahead of placement, and
        nothing is placed during the lead, which the reads must stream through."""
        buffer = max(buffer, 1)
        if lead == 0 and buffer > 1:
            lo, hi = 0, buffer  # stalls at lo (0: none tried yet); hi is the formula's, kept even if it stalls
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if cls._stalls(io, comp, lead, mid, steal) == 0 else (mid, hi)
            buffer = hi
        return buffer, cls._run(io, comp, lead, buffer, steal)[0]

    @classmethod
    def _stalls(cls, io: Sequence[float], comp: Sequence[float], lead: float, depth: int, steal: float) -> float:
        """Seconds the new tokens' layers wait for reads once started, in `_run`'s model."""
        return cls._run(io, comp, lead, depth, steal)[1]

    @staticmethod
    def _run(io: Sequence[float], comp: Sequence[float], lead: float, depth: int, steal: float) -> tuple[float, float]:
        """The engine's restore: IO streams the stored layers in order from t=0 while `lead`
        (recomputed layers) computes; the new tokens start once `depth` stored layers are read
        (the read buffer) and the lead is done; then layer l computes once its IO is done. Compute
        that runs while reads are still going is slowed by `steal` seconds per second of it (the
        reads' unhidden share of the same cores); reads already done steal nothing.
        -> (seconds to the end of the new tokens' layers, seconds they waited for reads)."""
        done = list(itertools.accumulate(io))
        io_end = done[-1] if done else 0.0
        stored = [i for i, x in enumerate(io) if x > 0]
        ready = done[stored[min(depth, len(stored)) - 1]] if stored else 0.0
        t, waited = max(lead + steal * min(lead, io_end), ready), 0.0
        for d, c in zip(done, comp):
            waited += max(0.0, d - t - 1e-12)
            start = max(t, d)
            t = start + c + steal * max(0.0, min(io_end, start + c) - start)
        return t, waited

    def predict(self, method: Method, chunks: Sequence[StoredChunk], new: int,
                layout: Sequence[Repr]) -> tuple[float, float, float, float, int]:
        """-> (predicted seconds to the first token, ideal seconds, background compute seconds,
        attach compute seconds, read-buffer depth) to restore `chunks` and compute `new` tokens."""
        s, hist = self.shape, _tokens(chunks)
        new_s = self.prefill_chunks_s(hist, hist + new)
        if method is Method.RECOMPUTE or not chunks:
            t = self.prefill_chunks_s(0, hist + new)
            return t, t, 0.0, 0.0, 0
        bw = self._bandwidth(chunks)
        if method is Method.IMPRESS:
            return self._impress(chunks, new, bw)
        if method is Method.CAKE:
            t, nbytes, cake_comp = self._cake(chunks)
            return t + new_s, max(nbytes / bw, cake_comp + new_s), cake_comp, 0.0, 0
        c, n = self.layer_costs(chunks), s.num_layers
        io, comp, lead, nbytes = [], [], 0.0, 0
        for r in layout:
            if r is Repr.NONE:
                lead += c.c_token
                io.append(0.0)
                comp.append(new_s / n)
            elif r is Repr.KV:
                io.append(c.io_kv)
                comp.append(c.place + new_s / n)
                nbytes += hist * s.kv_bytes_per_token_layer
            else:
                io.append(c.io_h)
                comp.append(c.c_h + new_s / n)
                nbytes += hist * s.hidden_bytes_per_token_layer
        stolen, io_total = sum(c.steal_kv if r is Repr.KV else c.steal_h for r in layout if r is not Repr.NONE), sum(io)
        steal = stolen / io_total if io_total > 0 else 0.0
        depth, t = self._start_depth(io, comp, lead, steal, self._read_buffer(chunks, layout, new, c))
        attach = sum(comp) - new_s
        return t, max(nbytes / bw, lead + sum(comp)), lead, attach, depth

    def _read_buffer(self, chunks: Sequence[StoredChunk], layout: Sequence[Repr], new: int, c: LayerCosts) -> int:
        """CachedAttention §3.2.1 in layers: S_buf = B (T_load L_hist - T_pref L_new) bytes are what
        loading the whole history takes beyond computing the new tokens; read that much before the
        new tokens start and the rest hides under them. A plan that recomputes leading layers reads
        every stored layer ahead: IO must keep streaming through the whole lead compute."""
        n, hist = self.shape.num_layers, _tokens(chunks)
        stored = sum(1 for r in layout if r is not Repr.NONE)
        if stored < n:
            return stored
        io = sum(c.io_kv if r is Repr.KV else c.io_h for r in layout)  # the whole history, every layer
        sizes = {Repr.KV: self.shape.kv_bytes_per_token_layer, Repr.HIDDEN: self.shape.hidden_bytes_per_token_layer}
        layer_bytes = hist * sum(sizes[r] for r in layout) // n
        pref = self.prefill_chunks_s(hist, hist + new) / max(new, 1)
        depth = read_buffer_layers(io / max(hist, 1), pref, hist, new, layer_bytes, self._bandwidth(chunks))
        return min(n, depth)

    def _bandwidth(self, chunks: Sequence[StoredChunk]) -> float:
        tot = sum(ch.end - ch.start for ch in chunks)
        # Token-weighted harmonic mean: time per byte adds up across the tiers the chunks sit in.
        return 1.0 / sum((ch.end - ch.start) / tot / self._link(ch.tier).bandwidth for ch in chunks)

    def _impress(self, chunks: Sequence[StoredChunk], new: int, bw: float) -> tuple[float, float, float, float, int]:
        """The importance-only restore as the executor runs it, all in series (its reads of a layer
        wait for that layer's choice, and compute waits for them): every layer's probe keys in one
        read per chunk; then per layer scoring the prefix with the probe heads and one ranged read
        per chunk of the kept granules (K and V of every head); a layer whose probes disagree also
        reads all of K and scores with every head first. Then the new tokens over the kept tokens."""
        imp = self.importance
        if imp is None:
            raise ValueError("importance-only restores are not planned here (no importance layout)")
        s, p, hist, n = self.shape, self.profile, _tokens(chunks), self.shape.num_layers
        kv, passed = s.kv_bytes_per_token_layer, imp.pass_rate

        def per_chunk_calls(share: float) -> float:  # one read call per chunk (each paying a call's latency)
            return sum(self._link(c.tier).read_s(int((c.end - c.start) * kv * share), whole_chunk=True) for c in chunks)

        probe = sum(self._link(c.tier).read_s(int((c.end - c.start) * kv * n * imp.probe_share), whole_chunk=True)
                    for c in chunks)
        kept = imp.granule_share
        dep = n * (passed * per_chunk_calls(kept) + (1 - passed) * (per_chunk_calls(0.5) + per_chunk_calls(0.5 * kept)))
        k = math.ceil(imp.ratio * hist)
        attention = max(0.0, p.prefill_s(hist, hist + new) - p.prefill_s(0, new))  # the new rows over the prefix
        identify = attention * (2 * imp.probe_share + (1 - passed))  # the probe heads; every head where they disagree
        compute = p.prefill_s(k, k + new) + (p.place_s + p.h2d_s) * k * n  # whole-chunk reads: host side
        nbytes = hist * n * kv * (imp.probe_share + passed * kept + (1 - passed) * 0.5 * (1 + kept))
        t = probe + dep + identify + compute
        return t, max(nbytes / bw, compute), identify + compute, 0.0, 0

    def observe_importance(self, granule_share: float, pass_rate: float, weight: float = 0.3) -> None:
        """Learn from an importance-only restore: the share of the stored granules it read (fewer
        once chunks are reordered) and of layers whose probes agreed."""
        imp = self.importance
        if imp is not None and 0.0 <= granule_share <= 1.0 and 0.0 <= pass_rate <= 1.0:
            imp.granule_share += weight * (granule_share - imp.granule_share)
            imp.pass_rate += weight * (pass_rate - imp.pass_rate)

    def _cake(self, chunks: Sequence[StoredChunk]) -> tuple[float, int, float]:
        """Simulate the executor's two pointers: whichever side is free first claims work; the
        compute side takes `compute_chunk_tokens` worth of chunks from the front per step, the IO
        side loads one whole KV chunk from the back at a time."""
        s, p = self.shape, self.profile
        front, back = 0, len(chunks) - 1
        tf = tb = 0.0
        nbytes, comp = 0, 0.0
        while front <= back:
            if tf <= tb:
                b, taken = front, 0
                while b <= back and (taken == 0 or taken + chunks[b].end - chunks[b].start <= self.compute_chunk_tokens):
                    taken += chunks[b].end - chunks[b].start
                    b += 1
                cf = p.prefill_s(chunks[front].start, chunks[b - 1].end)
                tf += cf
                comp += cf
                front = b
            else:
                ch = chunks[back]
                tokens = ch.end - ch.start
                size = tokens * s.kv_bytes_per_token_layer * s.num_layers
                link = self._link(ch.tier)
                place = p.place_s * tokens * s.num_layers
                # A whole-chunk read stays on the host: on a GPU the loader copies it over first.
                tb += link.read_s(size, whole_chunk=True) + p.h2d_s * tokens * s.num_layers + place
                # The loader's placement runs on the cores (or the device) the compute side runs
                # on, as does the unhidden part of its read.
                tf += link.stolen_s(size, whole_chunk=True) + place
                nbytes += size
                back -= 1
        return max(tf, tb), nbytes, comp

    # ----- choosing -------------------------------------------------------------------------
    def layout_for(self, method: Method, chunks: Sequence[StoredChunk], stored: Sequence[Repr] | None) -> tuple[Repr, ...]:
        """What `method` reads per layer given the stored layout (None: what it would prefer)."""
        n = self.shape.num_layers
        if method is Method.RECOMPUTE:
            return (Repr.NONE,) * n
        if method in (Method.KV, Method.CAKE):
            return (Repr.KV,) * n
        if method is Method.HIDDEN:
            return (Repr.HIDDEN,) * n
        return tuple(stored) if stored is not None else self.partition(chunks)

    def plan(self, method: Method, chunks: Sequence[StoredChunk], new: int,
             stored: Sequence[Repr] | None = None, upto: int | None = None) -> Plan:
        """The plan for `method` over `chunks` (each read from the tier named on it). `upto`: restore
        [0, upto) only, inside the last chunk (a prompt's last token is computed, not restored);
        the chunk is still read whole, as stored. Default: to the last chunk's end."""
        layout = self.layout_for(method, chunks, stored)
        t, ideal, background, attach, depth = self.predict(method, chunks, new, layout)
        t *= self.correction.get(method, 1.0)
        per_token = {Repr.KV: self.shape.kv_bytes_per_token_layer, Repr.HIDDEN: self.shape.hidden_bytes_per_token_layer}
        if method is Method.RECOMPUTE:
            planned: tuple[PlannedChunk, ...] = ()
        else:
            row = sum(per_token.get(r, 0) for r in layout)  # bytes of one token over the layers read
            planned = tuple(PlannedChunk(c.key, c.start, c.end, c.tier, (c.end - c.start) * row) for c in chunks)
        a = self.profile.prefill_a
        # The restore's compute in prefill-token equivalents: what the engine charges to the step
        # budgets while it runs, since it shares the cores with the step loop.
        return Plan(method, tuple(layout), _tokens(chunks) if upto is None else upto, planned, t, ideal,
                    read_buffer_layers=max(depth, 1),
                    background_tokens=math.ceil(background / a) if a > 0 else 0,
                    attach_tokens=math.ceil(attach / a) if a > 0 else 0)

    def choose(self, chunks: Sequence[StoredChunk], new: int, allowed: Mapping[Method, Sequence[Repr]],
               upto: int | None = None) -> Plan:
        """The fastest predicted plan among recompute and the methods the stored layout allows
        (`allowed` maps each method to the stored layout it would read). A lossy method must be
        predicted at most LOSSY_MARGIN of the fastest exact plan's time: it costs accuracy, and its
        prediction has been off by up to a quarter (docs/benchmarks.md)."""
        plans = [self.plan(Method.RECOMPUTE, chunks, new)]
        if chunks:
            plans += [self.plan(m, chunks, new, layout, None if m is Method.IMPRESS else upto)
                      for m, layout in allowed.items()]
        exact = min((pl for pl in plans if pl.method.exact), key=lambda pl: pl.predicted_s)
        lossy = min((pl for pl in plans if not pl.method.exact), key=lambda pl: pl.predicted_s, default=None)
        return lossy if lossy is not None and lossy.predicted_s <= LOSSY_MARGIN * exact.predicted_s else exact

    def choose_layout(self, method: Method | None, tier: str, chunk_tokens: int,
                      max_tokens: int | None = None) -> tuple[Repr, ...]:
        """What to store per layer. Fixed by the method when there is one; else decided once, for
        histories of LAYOUT_PROBES tokens (at most `max_tokens`: the model's context length, not an
        engine's, since the layout is part of the store's namespace and servers of one model that
        share a store must agree) on `tier` (the slowest of the stack): the layout whose restores
        of them all take the least predicted time in sum, among stored K/V (layer-wise loading, or
        Cake) and HCache's bubble-free partition for each of those lengths. The long histories
        weigh most, as they do in what restores cost; a single 1024-token probe let launch-bound
        steps hide that hidden states win on an MHA model at longer histories (docs/benchmarks.md,
        "On an NVIDIA H200")."""
        n = self.shape.num_layers
        if method is Method.HIDDEN:
            return (Repr.HIDDEN,) * n
        if method in (Method.KV, Method.CAKE, Method.RECOMPUTE, Method.IMPRESS):
            return (Repr.KV,) * n
        lengths = dict.fromkeys(max(chunk_tokens, min(h, max_tokens or h)) for h in LAYOUT_PROBES)
        probes = [[PlannedChunk(str(a), a, a + chunk_tokens, tier, 0) for a in range(0, h, chunk_tokens)]
                  for h in lengths]
        kv = (Repr.KV,) * n

        def total(layout: tuple[Repr, ...]) -> float:
            if layout == kv:
                return sum(min(self.plan(m, p, 64).predicted_s for m in (Method.KV, Method.CAKE)) for p in probes)
            return sum(self.plan(Method.BUBBLEFREE, p, 64, layout).predicted_s for p in probes)

        partitions = list(dict.fromkeys(self.partition(p) for p in probes))  # distinct, in probe order
        return min(partitions if method is Method.BUBBLEFREE else [kv, *partitions], key=total)  # ties: the first

    def prefetch_pays(self, tier: str, nbytes: int, memory: str = "memory") -> bool:
        """Whether copying a chunk up into the memory tier ahead of its request saves more time
        than it costs (CachedAttention §3.3 prefetching, judged on this machine): the restore
        later saves what reading it from `tier` would not hide under compute (the unhidden busy
        part and any waiting); the copy-up takes a read plus a write into memory on the cores the
        step loop computes on. On a CPU whose disk reads mostly hide under compute, it does not."""
        src, mem = self._link(tier), self._link(memory)
        busy, wait = src.read_parts(nbytes, whole_chunk=True)
        saved = src.stolen_s(nbytes, whole_chunk=True) + wait - mem.stolen_s(nbytes, whole_chunk=True)
        cost = busy + mem.read_s(nbytes, whole_chunk=True)
        return saved > cost

    def observe(self, method: Method, predicted_s: float, actual_s: float, weight: float = 0.3) -> None:
        """Refine online: move the method's correction factor toward the observed/predicted ratio.

        The factor stays within [1/MAX_CORRECTION, MAX_CORRECTION]: an observed restore's wall time
        includes waiting for busy steps under load, and an unbounded factor once made a method look
        so slow that the planner never chose it again, so it was never observed again either."""
        if predicted_s <= 0 or actual_s <= 0:
            return
        raw = predicted_s / self.correction.get(method, 1.0)
        ratio = min(max(actual_s / raw, 1 / MAX_CORRECTION), MAX_CORRECTION)
        self.correction[method] = (1 - weight) * self.correction.get(method, 1.0) + weight * ratio
