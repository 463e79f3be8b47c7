"""Measuring this machine for the planner: compute rates and each tier's read rates, through the
very code paths a restore runs (the runner, `PlannedReads`, the pool placements).

`measure()` times, for one model and dtype: prefill steps of the shapes the engine runs (from
position 0, a chunk continuing a history, a few new tokens on a long history; fitted as
a*n + b*(end^2 - start^2) + g*start + c seconds), copying stored K/V into the pool and projecting
hidden states into it (per token and layer, at restore sizes), and for each tier of a store spec
its read rates (whole chunks, and layer groups of all chunks as a restore reads them) and how
much of its read time hides under compute running beside it.

Nothing here runs unless asked: `kvtier profile` and the engine factory call `load_or_measure`;
an `Engine` built directly uses a saved profile or, without one, a rough estimate, and measures one
a slice at a time while it has nothing to serve (`measure_slices`, `engine/idle.py`). Tiers are
timed on scratch directories beside the store's own.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from tqdm import tqdm

from kvtier.device import describe
from kvtier.dtypes import name_of
from kvtier.engine.block_pool import BlockPool
from kvtier.engine.calibrate import cache
from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.engine.runner.transfer import EqualRuns, span_runs
from kvtier.models import invariant
from kvtier.models.loading import LoadedModel
from kvtier.planning.costs import PROFILE_VERSION, READ_GROUP_LAYERS, HardwareProfile, TierRates
from kvtier.planning.plan import PlannedChunk
from kvtier.progress import heartbeat
from kvtier.store.layout import Repr, StoreNamespace
from kvtier.store.reads import LayerGroup
from kvtier.store.redact import redact
from kvtier.store.spec import parse_spec
from kvtier.store.tiered import TieredStore

log = logging.getLogger(__name__)
T = TypeVar("T")


def _sync() -> None:
    """Wait for every queued kernel and copy: on CUDA a call returns once its work is enqueued."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


# A measurement is a generator that yields between its timed calls and returns its result: `measure`
# runs one through at once, and an engine with nothing to serve runs one a slice at a time while
# it waits (`Slices`), so no slice holds a request back for longer than one timed call.
Slices = Generator[None, None, T]


def drive(slices: Slices[T]) -> T:
    """Run a measurement through and return its result."""
    while True:
        try:
            next(slices)
        except StopIteration as done:
            return done.value


def _timed(fn: Callable[[], object], repeats: int = 3, warm_up: bool = True) -> Slices[float]:
    """Median seconds of `repeats` calls (device work included), after one warm-up call unless
    `warm_up` is False; a slice per call."""

    def run() -> None:
        fn()
        _sync()

    if warm_up:
        run()
        yield
    ts = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t)
        yield
    return float(np.median(ts))


def _time(fn: Callable[[], object], repeats: int = 3, warm_up: bool = True) -> float:
    return drive(_timed(fn, repeats, warm_up))


def _read_back(group: LayerGroup | None) -> LayerGroup:
    """A read of chunks written just before: a failed one would time nothing, so it stops the profile."""
    if group is None:
        raise RuntimeError("a chunk written for profiling could not be read back")
    return group


def _runner(model: LoadedModel, max_len: int) -> tuple[ModelRunner, list[int]]:
    """A bare runner with one sequence's worth of blocks (consecutive, as a fresh engine gives)."""
    block = 16
    n = -(-max_len // block)
    runner = ModelRunner(model.module, n, block, max_len)
    return runner, BlockPool(n, block).allocate(n)


# Prefill steps timed for the compute fit, as (history already in the pool, tokens computed to):
# prefills from position 0, a chunk continuing a history as the engine's chunked prefill runs it,
# and a few new tokens on a history, the shape of a restore's new tokens.
COMPUTE_POINTS = ((0, 256), (0, 1024), (0, 2048), (2048, 4096), (1024, 1088), (2048, 2112))
# On a GPU the points above are mostly kernel launches, and a fit through them alone overestimates
# a long prefill: there the fit also sees the shapes restores are planned for (a long prefill, and
# 64 new tokens on an 8K history).
GPU_POINTS = ((0, 8192), (8192, 8256))
# Beyond its points the fit's quadratic term grows too fast on a GPU, so a longer point anchors it.
# Timed only where the pool it needs fits a quarter of the device's free memory.
GPU_LONG_POINTS = ((0, 16384),)
# Placement and projection are timed at a restore's size on an asynchronous device: at 1024
# tokens their per-token rates there are mostly launch overhead, which would not scale with tokens.
SYNC_PLACEMENT_TOKENS, ASYNC_PLACEMENT_TOKENS = 1024, 8192


def compute_points(device: torch.device, max_positions: int, kv_bytes_per_token: int = 0,
                   free_bytes: int = 0) -> tuple[tuple[int, int], ...]:
    """The prefill steps the compute fit times on `device`, within the model's context (and, for
    the long point, within `free_bytes` of device memory given the pool's `kv_bytes_per_token`)."""
    extra: tuple[tuple[int, int], ...] = ()
    if device.type == "cuda":
        extra = GPU_POINTS + tuple(p for p in GPU_LONG_POINTS if 0 < 4 * p[1] * kv_bytes_per_token <= free_bytes)
    return tuple(p for p in COMPUTE_POINTS + extra if p[1] <= max_positions)


def _placement_tokens(model: LoadedModel, runner: ModelRunner, most: int) -> int:
    """History tokens the placement is timed at (a multiple of 64, at most `most`): a restore's
    size where copies are asynchronous and the staging and hidden states fit a quarter of the
    free device memory, else SYNC_PLACEMENT_TOKENS."""
    n = min(ASYNC_PLACEMENT_TOKENS, most) // 64 * 64
    cfg, width = model.config, model.dtype.itemsize
    need = n * cfg.num_layers * (2 * cfg.kv_dim + cfg.hidden_size) * width  # staging + hidden states
    if runner.transfer.is_async and n > SYNC_PLACEMENT_TOKENS and 4 * need <= _free_bytes(runner.device):
        return n
    return min(SYNC_PLACEMENT_TOKENS, most // 64 * 64)


def _free_bytes(device: torch.device) -> int:
    """Device memory free for the calibration's buffers (blocks the allocator caches count as free)."""
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def fit_compute(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """(a, b, g, c) of seconds(start, end) = a*(end-start) + b*(end^2-start^2) + g*start + c,
    least squares on relative error (so short steps count as much as long ones); a term the data
    would make negative is noise on a near-linear curve and is dropped."""
    x = np.array([[e - s, e * e - s * s, s, 1.0] for s, e, _ in points], dtype=float)
    t = np.array([p[2] for p in points], dtype=float)
    keep = [0, 1, 2, 3]
    while True:
        w = x[:, keep] / t[:, None]  # each row divided by its own time: relative residuals
        coef, *_ = np.linalg.lstsq(w, np.ones(len(t)), rcond=None)
        if all(c >= 0 for c in coef) or len(keep) == 1:
            break
        keep.pop(int(np.argmin(coef)))
    out = [0.0] * 4
    for i, c in zip(keep, coef):
        out[i] = max(float(c), 0.0)
    return out[0], out[1], out[2], out[3]


def _points(model: LoadedModel) -> tuple[tuple[int, int], ...]:
    cfg, device = model.config, model.module.lm_head.weight.device
    return compute_points(device, cfg.max_position_embeddings, 2 * cfg.num_layers * cfg.kv_dim * model.dtype.itemsize,
                          _free_bytes(device))


def measure_compute(model: LoadedModel, points: Sequence[tuple[int, int]] | None = None,
                    tick: Callable[[], object] = lambda: None) -> dict:
    """Prefill steps at `points` (default: `compute_points` for the model's device) and the
    placements (`tick` after each: a progress bar)."""
    return drive(compute_slices(model, points, tick))


def compute_slices(model: LoadedModel, points: Sequence[tuple[int, int]] | None = None,
                   tick: Callable[[], object] = lambda: None) -> Slices[dict]:
    """`measure_compute` a slice at a time."""
    cfg = model.config
    if points is None:
        points = _points(model)
    runner, blocks = _runner(model, max(e for _, e in points))
    timed: list[tuple[int, int, float]] = []
    on_cpu = runner.device.type == "cpu"
    for s, e in points:  # the history's K/V in the pool is whatever is there: timing does not care
        item = RunItem(torch.randint(100, cfg.vocab_size, (e - s,)).tolist(), s, blocks, want_logits=False)
        if not timed:
            # Every linear's first call picks its row plan on a short check; the full checks of
            # larger calls run before anything is timed, so the fit times the plans kept.
            runner.execute([item])
            yield
            yield from invariant.refine()
        if e - s <= 1024 or not on_cpu or not timed:  # medians: one slow run skews the fit
            t = yield from _timed(lambda: runner.execute([item]), repeats=3 if e - s <= 1024 else 2)
        else:
            # On a CPU a step over 1024 tokens takes seconds, so one run times it well, and the
            # points before it have run every kernel it runs (the linears in calls of at most 512
            # rows): no warm-up. Repeating these is most of a small CPU's calibration time.
            t = yield from _timed(lambda: runner.execute([item]), repeats=1, warm_up=False)
        timed.append((s, e, t))
        tick()
    a, b, g, c = fit_compute(timed)
    n = _placement_tokens(model, runner, max(e for _, e in points))
    place, project = yield from _placement_slices(model, runner, blocks, n)
    tick()
    h2d = _h2d_s(model, runner, n)
    yield
    return dict(prefill_a=a, prefill_b=b, prefill_g=g, prefill_c=c, project_s=project, place_s=place,
                h2d_s=h2d, points=tuple(timed))


def _placement_slices(model: LoadedModel, runner: ModelRunner, blocks: list[int], n: int
                      ) -> Slices[tuple[float, float]]:
    """Seconds per token per layer to place stored K/V into the pool and to project stored hidden
    states into it, as a restore of `n` history tokens does on this device."""
    cfg, layers = model.config, model.config.num_layers
    # Made where it is projected: on a GPU 8K tokens of hidden states are a billion values, seconds
    # of the host's random generator.
    h = torch.randn(layers, n, cfg.hidden_size, dtype=model.dtype, device=runner.device)
    slots = runner.upload(runner.slots(blocks, 0, n))
    project = (yield from _timed(lambda: [runner.project_in(li, h[li], (0, n), slots) for li in range(layers)])) \
        / (n * layers)
    place = _place_s(model, runner, n)
    yield
    return place, project


def _h2d_s(model: LoadedModel, runner: ModelRunner, n: int) -> float:
    """Where copies are asynchronous: seconds per token per layer to copy K/V from pinned host
    chunks (64 tokens each, as the memory tier holds them) to the device, one batched submission
    per layer group as a restore's staging does; a plain copy's rate, so `n` is capped at 2048
    tokens of pinned host memory. 0 where copies are synchronous: placing is that copy (place_s)."""
    if not runner.transfer.is_async:
        return 0.0
    cfg, layers, n = model.config, model.config.num_layers, min(n, 2048)
    chunks = n // 64
    per = READ_GROUP_LAYERS * 2 * 64 * cfg.kv_dim * model.dtype.itemsize  # one chunk's K|V of a full group
    host = runner.transfer.host_empty(chunks * layers * 2 * 64 * cfg.kv_dim * model.dtype.itemsize)
    host = host.view(chunks, -1)  # [chunks, layers * K|V * 64 * kv_dim] bytes: one chunk per row, layer-major
    stage = torch.empty(chunks * per, dtype=torch.uint8, device=runner.device)

    def copy_all() -> None:
        for g in range(0, layers, READ_GROUP_LAYERS):
            size = per * (min(layers, g + READ_GROUP_LAYERS) - g) // READ_GROUP_LAYERS
            at = per * g // READ_GROUP_LAYERS
            runner.transfer.wait(runner.transfer.to_stage(stage, [(i * size, host[i, at:at + size])
                                                                  for i in range(chunks)]))

    return _time(copy_all) / (chunks * 64 * layers)


def _place_s(model: LoadedModel, runner: ModelRunner, n: int) -> float:
    """Where copies are synchronous (the CPU), placing is copying each 64-token chunk piece into
    the pool, on the compute's cores: that is timed, from a separate source per chunk so caches are
    as cold as in a restore. On an asynchronous device the host-to-device copies run on the copy
    stream and are the reads' cost (the tier's rates carry them); what the compute stream pays is
    one scatter per layer and part out of the staging buffer, and only that is timed. (Timing the
    copies here too would count them twice, on the compute's critical path, and the planner would
    predict a kv restore well over its time.)"""
    cfg, layers = model.config, model.config.num_layers
    runs = [(s, min(64, n - s)) for s in range(0, n, 64)]
    if not runner.transfer.is_async:
        # One layer-major buffer per 64-token chunk, as the store keeps them: [layers, K|V, tokens, kv_heads, hd].
        chunks = [torch.randn(layers, 2, m, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype) for _, m in runs]

        def copy_all() -> None:
            for g in range(0, layers, READ_GROUP_LAYERS):
                group = range(g, min(layers, g + READ_GROUP_LAYERS))
                runner.copy_in(group, runs, [c[g:group.stop, 0] for c in chunks], [c[g:group.stop, 1] for c in chunks])

        return _time(copy_all) / (n * layers)
    # A restore's staging, already landed: [chunks, layers, K|V, 64, kv_heads, hd] (n % 64 == 0).
    stage = torch.randn(len(runs), layers, 2, 64, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype,
                        device=runner.device)
    grid = runner.upload(torch.arange(len(runs) * 64).view(-1, 64))  # [chunks, 64]: slot of each row

    def place_all() -> None:
        for li in range(layers):
            runner.place_staged(li, grid, stage[:, li, 0], stage[:, li, 1])

    return _time(place_all) / (n * layers)


def _own_stream(device: torch.device) -> AbstractContextManager[object]:
    """The calling thread's device work on a stream of its own (nothing where there are no streams)."""
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else nullcontext()


def _overlap(read: Callable[[], object], compute: Callable[[], object], t_comp: float,
             device: torch.device) -> float:
    """Share of the read time hidden when reads run on a thread beside `compute` (alone: `t_comp`
    seconds). The reads are repeated to last about as long as the compute, so neither side's timing
    noise swamps the difference; median of five trials (two cores shared with a VM's neighbours are noisy).
    On a GPU the reading thread enqueues on its own stream: its copies wait for the current stream
    (as a restore's wait for the compute that frees their ring slot), and on the compute's stream
    that would be the unrelated prefill, timing the two in series (next to nothing hidden where
    restores overlap fully)."""
    t_read = _time(read)
    reps = max(1, round(t_comp / max(t_read, 1e-6)))

    def reads() -> None:
        with _own_stream(device):
            for _ in range(reps):
                read()

    def trial() -> float:
        th = threading.Thread(target=reads)
        t = time.perf_counter()
        th.start()
        compute()
        th.join()
        _sync()
        both = time.perf_counter() - t
        return (reps * t_read + t_comp - both) / min(reps * t_read, t_comp)

    return float(min(1.0, max(0.0, float(np.median([trial() for _ in range(5)])))))


def _spec_parts(spec: str) -> list[str]:
    """A store spec's tiers, one single-tier spec each."""
    return [part.strip() for part in spec.split(",") if part.strip()]


def _tier_name(single: str) -> str:
    return parse_spec(single).tiers()[0][0]


def measure_tiers(model: LoadedModel, spec: str, chunk_tokens: int = 64, chunks: int = 16,
                  compute: Callable[[], object] | None = None,
                  tick: Callable[[], object] = lambda: None) -> dict[str, TierRates]:
    """Write `chunks` KV chunks into a scratch namespace of each tier and time reading them back
    the way a restore does (alone, and beside `compute` for the overlap; `tick` after each tier)."""
    return drive(tier_slices(model, spec, chunk_tokens, chunks, compute, tick))


def tier_slices(model: LoadedModel, spec: str, chunk_tokens: int = 64, chunks: int = 16,
                compute: Callable[[], object] | None = None,
                tick: Callable[[], object] = lambda: None) -> Slices[dict[str, TierRates]]:
    """`measure_tiers` a slice at a time."""
    cfg = model.config
    # A scratch namespace: its keys can never collide with real state of this model.
    ns = StoreNamespace(f"profile-{model.fingerprint}", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                        cfg.hidden_size, compute_dtype=name_of(model.dtype), layer_reprs=(Repr.KV,) * cfg.num_layers)
    n = chunks * chunk_tokens
    ids = list(range(1000, 1000 + n))
    k = torch.randn(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, dtype=model.dtype)
    groups = [range(g, min(g + READ_GROUP_LAYERS, cfg.num_layers)) for g in range(0, cfg.num_layers, READ_GROUP_LAYERS)]
    runner, blocks = _runner(model, n)
    out: dict[str, TierRates] = {}
    t_comp = (yield from _timed(compute)) if compute else 0.0  # once for every tier: on a CPU a second each time
    for single in _spec_parts(spec):
        # Each tier alone, so a disk read is never served by a memory tier above it.
        name = _tier_name(single)
        # Pinned on CUDA, as the engine's store is: pageable chunks would time the driver's staging
        # copies, an order of magnitude slower than a restore's DMA.
        store = TieredStore.open(single, ns, chunk_tokens=chunk_tokens, pin=runner.device.type == "cuda")
        try:
            store.save(ids, 0, k, k, None)
            store.flush()
            yield
            match = store.lookup(ids)
            planned = [PlannedChunk(c.key, c.start, c.end, c.tier, c.nbytes) for c in match.chunks]
            if not planned:
                continue

            # A restore's layer-group reads land straight in pool slots where the tier reads
            # directly (disk, into a CPU pool): time them so, not through staging buffers they never touch.
            targets = ([runner.pool_target(int(runner.slots(blocks, c.start, c.start + 1)[0])) for c in planned]
                       if runner.k_cache.device.type == "cpu" else None)

            read_groups = _group_reads(store, planned, runner, groups, targets, chunk_tokens)

            read_whole, read_small = _chunk_reads(store, planned, cfg.num_layers)
            total = n * ns.bytes_per_token()
            t_group = yield from _timed(read_groups, repeats=2)
            t_whole = yield from _timed(read_whole, repeats=2)
            # A call's fixed cost, net of opening the chunks (header reads), which a restore pays
            # once per chunk and which the per-byte rates below carry.
            lat = max(_time(read_small, repeats=5) - _time(lambda: read_small(False), repeats=5), 0.0) / len(planned)
            yield
            calls = len(planned) * len(groups)
            # Per-byte time net of call latency; the floor keeps timer noise from claiming free reads.
            overlap = _overlap(read_groups, compute, t_comp, runner.device) if compute else 1.0
            yield
            out[name] = TierRates(chunk_bps=total / t_whole,
                                  layer_bps=total / max(t_group - lat * calls, 0.25 * t_group),
                                  read_latency_s=lat, overlap=overlap,
                                  copy_engine=runner.transfer.is_async and name == "memory")
            store.discard(c.key for c in planned)  # only the scratch chunks: the tier may hold real state
        finally:
            store.close()
            tick()
    return out


def _group_reads(store: TieredStore, planned: list[PlannedChunk], runner: ModelRunner, groups: list[range],
                 targets: list | None, chunk_tokens: int) -> Callable[[], None]:
    """A read as a restore reads: layer groups of every chunk, on to the device where copies are
    asynchronous (the memory tier's whole chunks as address arrays, as a restore hands them over)."""

    def read_groups() -> None:
        copies = runner.transfer.is_async
        reads = store.planned_reads(planned)
        reads.open()
        for layers in groups:
            group = _read_back(reads.read(layers, ("k", "v"), into=targets, spans=chunk_tokens if copies else 0))
            if copies:  # no targets there: every part is in a buffer or a span
                # One DMA run per chunk (its layers' K and V lie back to back).
                runs, size = span_runs([x for p in group.parts.values() for x in p if x is not None])
                sp, equal = group.spans, None
                if sp is not None and len(sp.chunks):
                    at = size + np.arange(len(sp.chunks), dtype=np.int64) * sp.nbytes
                    equal = EqualRuns(sp.buffers, sp.buffer, sp.offsets, at, sp.nbytes)
                    size += len(sp.chunks) * sp.nbytes
                stage = torch.empty(size, dtype=torch.uint8, device=runner.device)
                runner.transfer.sync(runner.transfer.to_stage(stage, runs, equal))
            reads.release(group)
        reads.close()

    return read_groups


def _chunk_reads(store: TieredStore, planned: list[PlannedChunk], layers: int
                 ) -> tuple[Callable[[], None], Callable[..., None]]:
    """Reads of each chunk whole, and of one layer's keys (or only opening the chunks: their
    difference is a call's fixed cost)."""

    def read_whole() -> None:
        reads = store.planned_reads(planned)
        reads.open()
        for j in range(len(planned)):
            reads.release(_read_back(reads.read(range(layers), ("k", "v"), only=[j])))
        reads.close()

    def read_small(read: bool = True) -> None:
        reads = store.planned_reads(planned)
        reads.open()
        if read:
            reads.release(_read_back(reads.read([0], ("k",))))
        reads.close()

    return read_whole, read_small


def _busy(model: LoadedModel) -> Callable[[], object]:
    """Compute to overlap reads with: one 256-token prefill."""
    runner, blocks = _runner(model, 256)
    item = RunItem(torch.randint(100, model.config.vocab_size, (256,)).tolist(), 0, blocks, want_logits=False)

    def compute() -> None:
        runner.execute([item])
        _sync()

    return compute


def _spec_slices(model: LoadedModel, spec: str | None, tick: Callable[[], object] = lambda: None
                 ) -> Slices[dict[str, TierRates]]:
    with _scratch_disks(spec) as scratch:
        return (yield from tier_slices(model, scratch, compute=_busy(model), tick=tick))


@contextmanager
def _scratch_disks(spec: str | None) -> Iterator[str]:
    """`spec` with each disk directory replaced by an empty one beside it (the same file system,
    so the same rates), removed after: a store running on the real directories (a server measuring
    while idle, another process) never sees the scratch chunks, nor a scratch tier its files.
    Without a spec: a memory tier and a temporary disk."""
    made: list[str] = []
    try:
        if spec is None:
            made.append(tempfile.mkdtemp(prefix="kvtier-profile-"))
            yield f"memory:1GB,disk:{made[0]}:4GB"
            return
        parts = []
        for part in _spec_parts(spec):
            disk = parse_spec(part).disk
            if disk is None:
                parts.append(part)
                continue
            for path, cap in zip(disk.paths, disk.capacities):
                parent = Path(os.path.abspath(path)).parent  # beside the directory as named, links not followed
                made.append(tempfile.mkdtemp(prefix=".kvtier-profile-", dir=parent if parent.is_dir() else None))
                parts.append(f"disk:{made[-1]}:{cap}B")
        yield ",".join(parts)
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


def _measure_spec(model: LoadedModel, spec: str | None, tick: Callable[[], object] = lambda: None
                  ) -> dict[str, TierRates]:
    return drive(_spec_slices(model, spec, tick))


def measure(model: LoadedModel, spec: str | None = None, progress: bool = False) -> HardwareProfile:
    """Measure compute and every tier of `spec` (a memory and a scratch disk tier without one);
    `progress`: a bar on stderr (where it is a terminal)."""
    points = _points(model)
    steps = len(points) + 1 + (len(_spec_parts(spec)) if spec is not None else 2)
    desc = "measuring this machine for the planner (once)"
    quiet = not progress or sys.stderr.isatty()  # a terminal shows the bar; elsewhere a line every few seconds
    with tqdm(total=steps, desc=desc, unit="step", file=sys.stderr, disable=None if progress else True) as bar, \
            (nullcontext() if quiet else heartbeat(desc)):
        return drive(measure_slices(model, spec, tick=bar.update))


def measure_slices(model: LoadedModel, spec: str | None = None, tick: Callable[[], object] = lambda: None
                   ) -> Slices[HardwareProfile]:
    """`measure` a slice at a time (`tick` after each point and tier)."""
    compute = yield from compute_slices(model, _points(model), tick=tick)
    tiers = yield from _spec_slices(model, spec, tick=tick)
    return HardwareProfile(model.fingerprint, name_of(model.dtype), torch.get_num_threads(), tiers=tiers, **compute)


def estimate(model: LoadedModel) -> HardwareProfile:
    """A profile from the model's shape and round machine rates, without timing anything: what an
    Engine plans with until `kvtier profile` has measured this machine (the online correction
    adapts it meanwhile)."""
    cfg, width = model.config, model.dtype.itemsize
    flops_per_s, copy_bps = 100e9, 5e9
    layer_params = 2 * cfg.hidden_size * (cfg.num_heads * cfg.head_dim) + 2 * cfg.hidden_size * cfg.kv_dim \
        + 3 * cfg.hidden_size * cfg.intermediate_size
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim  # flops per (query, key) pair
    return HardwareProfile(
        model.fingerprint, name_of(model.dtype), torch.get_num_threads(),
        prefill_a=2 * layer_params * cfg.num_layers / flops_per_s, prefill_b=attn / 2 / flops_per_s,
        prefill_g=attn / flops_per_s,
        project_s=4 * cfg.hidden_size * cfg.kv_dim / flops_per_s + 2 * cfg.kv_dim * width / copy_bps,
        place_s=2 * cfg.kv_dim * width / copy_bps,
        tiers={"memory": TierRates(20e9, 20e9, 2e-5, 1.0), "disk": TierRates(1e9, 1e9, 2e-4, 0.8),
               "redis": TierRates(0.5e9, 0.5e9, 2e-4, 0.3)})


def _key(model: LoadedModel) -> str:
    """Keyed by model, dtype and hardware: a CPU's profile is never used on a GPU, nor one GPU's on another."""
    dev = model.module.lm_head.weight.device
    where = f"t{torch.get_num_threads()}" if dev.type == "cpu" else re.sub(r"[^A-Za-z0-9.]+", "_", describe(dev))
    return f"{model.fingerprint}-{name_of(model.dtype)}-{where}-v{PROFILE_VERSION}"


def _decode(doc: dict) -> HardwareProfile:
    return HardwareProfile.from_json(json.dumps(doc))


def profile_path(home: Path, model: LoadedModel) -> Path:
    return cache.cache_path("profiles", _key(model), home)


def load_profile(model: LoadedModel, home: Path) -> HardwareProfile | None:
    """The profile `kvtier profile` saved for this model, dtype and thread count, if any."""
    return cache.load("profiles", _key(model), _decode, home)


def load_or_measure(model: LoadedModel, home: Path, spec: str | None = None) -> HardwareProfile:
    """The saved profile, or measure one now (under a minute) and save it. A saved profile that
    lacks a tier of `spec` gets that tier measured and added (a store spec grew a Redis tier)."""
    prof = load_profile(model, home)
    if prof is None:
        log.warning("no hardware profile for this model, dtype and machine yet: measuring it once (1-3 minutes on "
                    "a 2-core CPU, seconds on a GPU; saved under %s)", home)
        prof = measure(model, spec, progress=True)
    else:
        missing = [part for part in _spec_parts(spec or "") if _tier_name(part) not in prof.tiers]
        if not missing:
            return prof
        log.warning("hardware profile lacks tier(s) %s: measuring them", redact(", ".join(missing)))
        with tqdm(total=len(missing), desc="measuring the new tiers (once)", unit="tier", file=sys.stderr,
                  disable=None) as bar:
            prof = dataclasses.replace(prof, tiers={**prof.tiers, **_measure_spec(model, ",".join(missing),
                                                                                   tick=bar.update)})
    save_profile(prof, profile_path(home, model))
    return prof


def save_profile(prof: HardwareProfile, path: Path) -> None:
    cache.write_json(path, json.loads(prof.to_json()))
