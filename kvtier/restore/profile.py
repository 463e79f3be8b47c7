"""Hardware profile: measured compute and read rates that the planner's cost model runs on.

`measure()` times, for one model and dtype on this machine: prefill of growing contexts (fitted
as a*L + b*L^2 seconds), the hidden -> K/V projection and the RoPE placement per token and layer,
and for each tier of a store spec its read bandwidth for whole chunks and single layers. It writes
JSON under the cache home; `load_or_measure` reuses it when the model, dtype and spec match.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.engine.runner import RunItem
from kvtier.models.loading import LoadedModel
from kvtier.store import Repr, StoreNamespace, TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierRates:
    chunk_bps: float  # bytes/s reading whole chunks (before any emulated limit)
    layer_bps: float  # bytes/s reading one layer of one chunk at a time
    read_latency_s: float  # fixed cost per read call
    # Share of the raw read time that hides under compute running at the same time. On a host
    # without a copy engine reads are memcpys on the cores the compute uses, so this can be far
    # below 1; time spent waiting (emulated bandwidth, network latency) always overlaps.
    overlap: float = 1.0


@dataclass(frozen=True)
class HardwareProfile:
    model_fingerprint: str
    dtype: str
    threads: int
    prefill_a: float  # prefill seconds ~ a*L + b*L^2 for L tokens from position 0 (b: attention)
    prefill_b: float
    project_s: float  # hidden -> K/V projection, seconds per token per layer
    place_s: float  # RoPE + copy into the pool, seconds per token per layer
    tiers: dict[str, TierRates] = field(default_factory=dict)
    points: tuple[tuple[int, float], ...] = ()  # measured (L, seconds) prefill points
    # Seconds per history token for one step that continues a history: gathering the context
    # from the pool and the masked attention over it (dominant for a few new tokens on a long
    # history, invisible in prefills from position 0).
    prefill_g: float = 0.0

    def prefill_s(self, start: int, end: int) -> float:
        """Seconds to compute tokens [start, end) in one step given that [0, start) is in the pool."""
        f = lambda n: self.prefill_a * n + self.prefill_b * n * n  # noqa: E731
        return max(f(end) - f(start), 0.0) + self.prefill_g * start

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @staticmethod
    def from_json(text: str) -> "HardwareProfile":
        d = json.loads(text)
        d["tiers"] = {k: TierRates(**v) for k, v in d.get("tiers", {}).items()}
        d["points"] = tuple(tuple(p) for p in d.get("points", ()))
        return HardwareProfile(**d)


def _time(fn, repeats: int = 3) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def _engine(model: LoadedModel, max_len: int):
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.engine import Engine  # the engine itself loads profiles: import here, not at the top

    engine = Engine(model, EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max_len,
                                        max_batched_tokens=max_len, enable_prefix_cache=False))
    return engine, engine.pool.allocate(-(-max_len // engine.pool.block_size))


def measure_compute(model: LoadedModel, lengths: tuple[int, ...] = (256, 1024, 2048), new: int = 64) -> dict:
    cfg = model.config
    engine, blocks = _engine(model, max(lengths) + new)
    runner = engine.runner
    points = []
    for n in lengths:
        ids = torch.randint(100, cfg.vocab_size, (n,)).tolist()
        item = RunItem(ids, 0, blocks, want_logits=False)
        points.append((n, _time(lambda: runner.execute([item]), repeats=2 if n > 512 else 3)))
    ls = np.array([p[0] for p in points], dtype=float)
    ts = np.array([p[1] for p in points])
    (a, b), *_ = np.linalg.lstsq(np.stack([ls, ls * ls], 1), ts, rcond=None)
    if b < 0:  # noise on a near-linear curve: keep the linear fit
        a, b = float(np.dot(ls, ts) / np.dot(ls, ls)), 0.0
    # `new` tokens continuing the longest prefill: what they cost beyond a*n + b*n^2 is the
    # per-history-token term g (the shape of a restore's new tokens and of chunked prefill).
    hist = max(lengths)
    cont = RunItem(torch.randint(100, cfg.vocab_size, (new,)).tolist(), hist, blocks, want_logits=False)
    t_cont = _time(lambda: runner.execute([cont]), repeats=3)
    g = max(0.0, float(t_cont - a * new - b * ((hist + new) ** 2 - hist ** 2)) / hist)
    # Projection and placement at restore sizes: a different layer (pool region) and source per
    # layer, so the caches are as cold as in a real restore; timing one small hot tensor
    # under-reads the cost several times.
    n, layers = min(1024, max(lengths)), cfg.num_layers
    h = torch.randn(layers, n, cfg.hidden_size, dtype=model.dtype)
    slots = runner.slots(blocks, 0, n)
    with torch.inference_mode():
        kv = [model.module.layers[li].kv(h[li]) for li in range(layers)]
        project = _time(lambda: [model.module.layers[li].kv(h[li]) for li in range(layers)]) / (n * layers)
        place = _time(lambda: [runner.place_kv(li, slots, 0, *kv[li]) for li in range(layers)]) / (n * layers)
    return dict(prefill_a=float(a), prefill_b=float(b), prefill_g=g, project_s=project + place, place_s=place,
                points=tuple(points))


def _overlap(read, compute) -> float:
    """Share of the read time hidden when `read` runs on a thread beside `compute`."""
    t_read, t_comp = _time(read, repeats=2), _time(compute, repeats=2)
    th = threading.Thread(target=read)
    t = time.perf_counter()
    th.start()
    compute()
    th.join()
    both = time.perf_counter() - t
    return float(min(1.0, max(0.0, (t_read + t_comp - both) / max(min(t_read, t_comp), 1e-9))))


def measure_tiers(model: LoadedModel, spec: str, chunk_tokens: int = 64, chunks: int = 16,
                  compute=None) -> dict[str, TierRates]:
    """Write `chunks` KV chunks into a scratch namespace of each tier and time reading them back
    (alone, and beside `compute` for the overlap)."""
    cfg = model.config
    # A scratch namespace: its keys can never collide with real state of this model.
    ns = StoreNamespace(f"profile-{model.fingerprint}", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                        cfg.hidden_size, compute_dtype=str(model.dtype).removeprefix("torch."),
                        layer_reprs=(Repr.KV,) * cfg.num_layers)
    n = chunks * chunk_tokens
    ids = list(range(1000, 1000 + n))
    k = torch.randn(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    out: dict[str, TierRates] = {}
    for part in spec.split(","):
        single = part.strip()
        if not single:
            continue
        # Each tier alone, so a disk read is never served by a memory tier above it.
        store = TieredStore.open(single, ns, chunk_tokens=chunk_tokens)
        try:
            store.save(ids, 0, k, k, None)
            store.flush()
            match = store.lookup(ids)
            tier = match.chunks[0].tier if match.chunks else None
            if tier is None:
                continue
            total = sum(c.nbytes for c in match.chunks)
            t_chunk = _time(lambda: [store.read_chunk(c) for c in match.chunks], repeats=2)
            t_layer = _time(lambda: [store.read_layers(c, [li], ("k", "v")) for c in match.chunks
                                     for li in range(cfg.num_layers)], repeats=1)
            calls = len(match.chunks) * cfg.num_layers
            t_small = _time(lambda: [store.read_layers(c, [0], ("k",)) for c in match.chunks], repeats=2)
            lat = t_small / len(match.chunks)
            ov = _overlap(lambda: [store.read_chunk(c) for c in match.chunks], compute) if compute else 1.0
            # Per-layer time net of call latency; the floor keeps timer noise from claiming free reads.
            out[tier] = TierRates(chunk_bps=total / t_chunk, layer_bps=total / max(t_layer - lat * calls, 0.25 * t_layer),
                                  read_latency_s=lat, overlap=ov)
            for c in match.chunks:  # remove only the scratch chunks: the tier may hold real state
                for t in store.tiers:
                    t.delete(c.key)
        finally:
            store.close()
    return out


def measure(model: LoadedModel, spec: str | None = None) -> HardwareProfile:
    compute = measure_compute(model)
    engine, blocks = _engine(model, 256)
    item = RunItem(torch.randint(100, model.config.vocab_size, (256,)).tolist(), 0, blocks, want_logits=False)
    busy = lambda: engine.runner.execute([item])  # noqa: E731  (compute to overlap reads with)
    if spec is None:
        with tempfile.TemporaryDirectory() as d:
            tiers = measure_tiers(model, f"memory:1GB,disk:{d}:4GB", compute=busy)
    else:
        tiers = measure_tiers(model, spec, compute=busy)
    return HardwareProfile(model.fingerprint, str(model.dtype).removeprefix("torch."), torch.get_num_threads(),
                           tiers=tiers, **compute)


def profile_path(home: Path, model: LoadedModel) -> Path:
    # v2: placement measured at restore sizes, continuation prefill point, per-tier overlap.
    return home / "profiles" / f"{model.fingerprint}-{str(model.dtype).removeprefix('torch.')}-t{torch.get_num_threads()}-v2.json"


def load_or_measure(model: LoadedModel, home: Path, spec: str | None = None) -> HardwareProfile:
    path = profile_path(home, model)
    if path.exists():
        try:
            return HardwareProfile.from_json(path.read_text())
        except (ValueError, TypeError, KeyError) as e:
            log.warning("ignoring unreadable profile %s (%s); measuring again", path, e)
    log.warning("no hardware profile for this model/dtype yet: measuring (under a minute)")
    prof = measure(model, spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(prof.to_json())
    tmp.replace(path)
    return prof
