"""The cost model's inputs as plain values: measured rates, per-tier links and model shape.

No torch here: the planner, the plan and everything that reasons about restore cost load
without it. Measuring these numbers is the engine's job (`engine/profiling.py`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

PROFILE_VERSION = 10  # bump when what a profile measures changes: older files are measured again

# Layer-wise reads fetch this many layers of a chunk per call (layer-major chunks make them one
# contiguous range): a few layers amortize the per-read cost without delaying the first layer.
READ_GROUP_LAYERS = 4


@dataclass(frozen=True)
class TierRates:
    chunk_bps: float  # bytes/s reading whole chunks (before any emulated limit)
    layer_bps: float  # bytes/s reading a layer group of every chunk, as a restore does
    read_latency_s: float  # fixed cost per read call
    # Share of the raw read time that hides under compute running at the same time: near 1 when a
    # device moves the bytes (direct I/O), near 0 when reads are memcpys on the cores the compute
    # uses. Time spent waiting (emulated bandwidth, network) always overlaps. See copy_engine.
    overlap: float = 1.0
    # The host touches none of the bytes: they lie in pinned host memory (the memory tier) and a
    # GPU's copy engine moves them. What a read takes from the compute there is the host's fixed
    # work per call, not a share of its time: with the share the calibration's small reads showed,
    # long restores on a GPU were predicted well above their measured time (docs/benchmarks.md).
    # `overlap` is then only reported. Disk and Redis reads still check and copy every byte.
    copy_engine: bool = False


# Used for a tier the profile never measured (a spec changed since): optimistic, so such a tier
# is tried and the online correction learns its real speed.
UNMEASURED_TIER = TierRates(1e9, 1e9, 1e-5)


@dataclass(frozen=True)
class HardwareProfile:
    model_fingerprint: str
    dtype: str
    threads: int
    # One prefill step computing [start, end) over a history [0, start) in the pool takes
    # a*(end - start) + b*(end^2 - start^2) + g*start + c seconds (b: causal attention among the
    # new tokens; g: attention of a step's rows over the history, beyond what b covers; c: what
    # every step costs whatever its size).
    prefill_a: float
    prefill_b: float
    project_s: float  # hidden -> K/V projection, RoPE and placement: seconds per token per layer
    # Placing stored K/V into the pool as the compute side pays it, seconds per token per layer: the
    # copy where copies are synchronous (the CPU), the scatters out of landed staging on a GPU.
    place_s: float
    tiers: dict[str, TierRates] = field(default_factory=dict)
    points: tuple[tuple[int, int, float], ...] = ()  # measured (start, end, seconds) prefill steps
    prefill_g: float = 0.0
    prefill_c: float = 0.0
    # Where copies are asynchronous (a GPU): copying host K/V to the device, seconds per token per
    # layer. A layer-group read's rate already includes it; a whole-chunk read's does not. 0 on the
    # CPU, where place_s is the copy.
    h2d_s: float = 0.0
    version: int = PROFILE_VERSION

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to compute tokens [start, end) in one step given that [0, start) is in the pool."""
        def f(n: int) -> float:
            return self.prefill_a * n + self.prefill_b * n * n

        if end <= start:
            return 0.0
        return max(f(end) - f(start), 0.0) + self.prefill_g * start + self.prefill_c

    def rates(self, tier: str) -> TierRates:
        return self.tiers.get(tier, UNMEASURED_TIER)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> "HardwareProfile":
        d = json.loads(text)
        d["tiers"] = {k: TierRates(**v) for k, v in d.get("tiers", {}).items()}
        d["points"] = tuple(tuple(p) for p in d.get("points", ()))
        return HardwareProfile(**d)


@dataclass(frozen=True)
class TierLink:
    """Effective read cost of one tier: measured rates plus any emulated bandwidth/latency."""

    rates: TierRates
    emulated_bps: float | None = None
    emulated_latency_s: float = 0.0

    def read_s(self, nbytes: int, whole_chunk: bool) -> float:
        return sum(self.read_parts(nbytes, whole_chunk))

    def read_parts(self, nbytes: int, whole_chunk: bool) -> tuple[float, float]:
        """(busy, waiting) seconds of reading one chunk whole, or one layer of it: the raw read,
        and what an emulated limit adds on top as pure waiting. Layers are read READ_GROUP_LAYERS
        at a time, so a layer pays that share of a call's latency."""
        bps = self.rates.chunk_bps if whole_chunk else self.rates.layer_bps
        calls = 1.0 if whole_chunk else 1.0 / READ_GROUP_LAYERS
        return nbytes / bps + calls * self.rates.read_latency_s, self._emulated_wait(nbytes, calls)

    def grouped_read_s(self, nbytes: int, calls: int) -> float:
        """Seconds to read `nbytes` in `calls` reads of a layer group of one chunk each (a blend
        reads such a group of every document at once), waits for an emulated limit included."""
        return nbytes / self.rates.layer_bps + calls * self.rates.read_latency_s + self._emulated_wait(nbytes, calls)

    def _emulated_wait(self, nbytes: int, calls: float) -> float:
        return calls * self.emulated_latency_s + (nbytes / self.emulated_bps if self.emulated_bps else 0.0)

    def stolen_s(self, nbytes: int, whole_chunk: bool) -> float:
        """Compute time a read takes away from work running beside it: its unhidden busy part, or
        where a copy engine moves the bytes its call's fixed host cost (a layer pays its share of
        one; the copy submissions, one per layer group of every chunk, are in layer_bps)."""
        if self.rates.copy_engine:
            return self.rates.read_latency_s * (1.0 if whole_chunk else 1.0 / READ_GROUP_LAYERS)
        return (1.0 - self.rates.overlap) * self.read_parts(nbytes, whole_chunk)[0]

    @property
    def bandwidth(self) -> float:
        """Bytes/s the ideal bound is computed with."""
        raw = self.rates.chunk_bps
        return raw if not self.emulated_bps else 1.0 / (1.0 / raw + 1.0 / self.emulated_bps)


def links(profile: HardwareProfile, tiers: Iterable[tuple[str, float | None, float]]) -> dict[str, TierLink]:
    """Measured rates of each tier `(name, emulated bytes/s or None, emulated latency s)`."""
    return {name: TierLink(profile.rates(name), bw, lat) for name, bw, lat in tiers}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    kv_bytes_per_token_layer: int  # K and V as stored (storage dtype, int8 scales included)
    hidden_bytes_per_token_layer: int


def read_buffer_layers(load_s_per_token: float, prefill_s_per_token: float, hist: int, new: int,
                       layer_bytes: int, bandwidth: float) -> int:
    """CachedAttention §3.2.1: S_buf = B * (T_load * L_hist - T_pref * L_new), in layers (at least 1)."""
    gap = load_s_per_token * hist - prefill_s_per_token * new
    if gap <= 0 or layer_bytes <= 0:
        return 1
    return max(1, math.ceil(bandwidth * gap / layer_bytes))

