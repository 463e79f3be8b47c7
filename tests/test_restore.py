"""Every restore method against full recompute, on the engine's one restore path: next-token logits
within 1e-4 (fp32) and identical greedy 32-token continuations, per method x tier x model, with a
partial last chunk, store chunks (24 tokens) not aligned to pool blocks (16), and a prefix split
across tiers. Plus the plan as the executor's contract, the device-cached prefix left untouched,
Cake adapting mid-restore and the planner's cost model."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import pytest
import torch

from kvtier.engine.block_pool import block_hashes
from kvtier.engine.calibrate.hardware import COMPUTE_POINTS, GPU_LONG_POINTS, GPU_POINTS, compute_points, fit_compute
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.restore.layerwise import Restore, RestoreMiss
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.planning.costs import READ_GROUP_LAYERS, HardwareProfile, ModelShape, TierLink, TierRates, links
from kvtier.planning.plan import Method, PlannedChunk
from kvtier.planning.planner import MAX_CORRECTION, Planner
from kvtier.store import Repr, StoreNamespace, TieredStore
from kvtier.testing.reference import context_state

from kvtier_testlib import fake_profile, spy_logits

CHUNK = 24  # not a multiple of the 16-token pool block
HIST, NEW = 200, 7  # 200 = 8 full chunks + a partial chunk of 8
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def cases(n: int) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (method, stored layout)."""
    kv, h = ("kv",) * n, ("hidden",) * n
    return {
        "kv": ("kv", kv), "cake": ("cake", kv), "auto": ("auto", kv), "recompute": ("recompute", kv),
        "hidden": ("hidden", h),
        # The two bubble-free shapes of HCache §4.1.2: recompute the first layers, or KV for the last.
        "bubblefree": ("bubblefree", ("none",) + ("hidden",) * (n - 1)),
        "bubblefree-kv": ("bubblefree", ("hidden",) * (n - 1) + ("kv",)),
    }


def _engine(model, spec: str | None, method: str = "auto", layout=None, prefix_cache: bool = False, **kw) -> Engine:
    return Engine(model, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024, enable_prefix_cache=prefix_cache),
                  store=spec, profile=fake_profile(model.fingerprint, compute_scale=50.0) if spec else None,
                  reuse=ReuseConfig(method=method, chunk_tokens=CHUNK, layout=layout, **kw))


def restore_after_saving(engine: Engine, ids: list[int]):
    """Save the state of ids[:HIST], then generate greedily from all of `ids` (restoring that
    history); the engine is closed either way. -> the request's output."""
    try:
        engine.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))
        assert engine.flush(30)
        return engine.generate([ids], GREEDY)[0]
    finally:
        engine.close()


def _ids(model, seed: int = 9) -> list[int]:
    return torch.randint(3, model.config.vocab_size, (HIST + NEW,), generator=torch.Generator().manual_seed(seed)).tolist()


def check_all_methods(model, spec: str, split_tiers: bool = False, greedy: SamplingParams = GREEDY) -> None:
    ids = _ids(model)
    ref_logits = model.module(torch.tensor(ids))[-1]
    ref_tokens = _engine(model, None).generate([ids], greedy)[0].output_ids
    for name, (method, layout) in cases(model.config.num_layers).items():
        engine = _engine(model, spec, method, layout)
        store = engine.link.store
        try:
            engine.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))  # saves the history
            assert engine.flush(30)
            match = store.lookup(ids)
            assert match.num_tokens == HIST and match.chunks[-1].end - match.chunks[-1].start == HIST % CHUNK
            if split_tiers:  # drop every other chunk from memory: the prefix now spans memory and disk
                for c in match.chunks[::2]:
                    store.tier("memory").delete(c.key)
                assert {c.tier for c in store.lookup(ids).chunks} == {"memory", "disk"}
            seen = spy_logits(engine)
            out = engine.generate([ids], greedy)[0]
            diff = (seen[0][0] - ref_logits).abs().max().item()
            assert diff <= 1e-4, f"{name}: logit diff {diff}"
            assert out.output_ids == ref_tokens, name
            if method == "recompute":
                assert out.prompt_tokens_reused == 0 and out.restore_method is None
                continue
            assert out.prompt_tokens_reused == HIST, name
            assert method == "auto" or out.restore_method == method, (name, out.restore_method)
            tiers = {t for t, n in out.reused_by_tier.items() if n}
            assert tiers == ({"memory", "disk"} if split_tiers else {spec.split(":")[0].split("+")[0]}), tiers
            assert engine.stats().counters["restore_failures"] == 0
        finally:
            engine.close()


@pytest.mark.parametrize("model_name", ["tiny_mha", "tiny_gqa"])
def test_every_method_is_exact(model_name, tier_spec, request):
    check_all_methods(request.getfixturevalue(model_name), tier_spec)


def test_prefix_split_across_memory_and_disk(tiny_gqa, tmp_path):
    check_all_methods(tiny_gqa, f"memory:1GB,disk:{tmp_path}/d:1GB", split_tiers=True)


# The real model on the disk tier: the bytes each tier moves (Redis Cluster's included) are checked
# for every tier on the tiny models above; this checks every method on the real model's numerics
# (its first logits against the model's own forward, then 8 greedy tokens: CI's time).
@pytest.mark.slow
@pytest.mark.parametrize("tier_spec", ["disk"], indirect=True)
def test_every_method_is_exact_on_smollm2(smollm2_fp32, tier_spec):
    check_all_methods(smollm2_fp32, tier_spec, greedy=SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))


@pytest.mark.parametrize("name", ["kv", "hidden", "cake", "bubblefree", "bubblefree-kv"])
def test_restore_after_a_device_cached_prefix_never_writes_it(tiny_gqa, tmp_path, name):
    """The device prefix cache holds [0, 32) (two blocks, shared with whoever computed them); the
    store's chunk [24, 48) straddles 32. The restore writes from 32 on only: the cached blocks are
    bit-identical after it, and the output equals a recompute."""
    method, layout = cases(tiny_gqa.config.num_layers)[name]
    spec = f"disk:{tmp_path}/s:1GB"
    ids = _ids(tiny_gqa, seed=4)
    first = _engine(tiny_gqa, spec, method, layout)
    first.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))
    first.close()  # the history is on disk
    engine = _engine(tiny_gqa, spec, method, layout, prefix_cache=True)
    engine.generate([ids[:40]], SamplingParams(max_tokens=1, temperature=0.0))  # caches blocks [0, 32)
    cached = engine.pool.match_prefix(block_hashes(ids[:32], 16))
    engine.pool.release(cached)
    assert len(cached) == 2
    slots = engine.runner.slots(cached, 0, 32)
    before_k, before_v = engine.runner.k_cache[:, slots].clone(), engine.runner.v_cache[:, slots].clone()
    out = engine.generate([ids], GREEDY)[0]
    engine.close()
    assert out.reused_by_tier.get("device") == 32 and out.reused_by_tier.get("disk") == HIST - 32
    assert torch.equal(engine.runner.k_cache[:, slots], before_k) and torch.equal(engine.runner.v_cache[:, slots], before_v)
    assert out.output_ids == _engine(tiny_gqa, None).generate([ids], GREEDY)[0].output_ids


# ----- the plan is the executor's contract ------------------------------------------------------
def _stored(model, spec: str, ids: list[int], layout=None) -> TieredStore:
    cfg = model.config
    layout = layout or (Repr.KV,) * cfg.num_layers
    ns = StoreNamespace(model.fingerprint, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                        compute_dtype="float32", layer_reprs=layout)
    store = TieredStore.open(spec, ns, chunk_tokens=CHUNK)
    st = context_state(model.module, ids)
    store.save(ids, 0, st.k, st.v, st.h)
    assert store.flush(30)
    return store


def _runner(model, tokens: int) -> tuple[ModelRunner, list[int]]:
    n = -(-tokens // 16)
    return ModelRunner(model.module, n, 16, n * 16), list(range(n))


def test_a_chunk_missing_from_its_planned_tier_is_a_miss_not_a_read_elsewhere(tiny_gqa, tmp_path):
    ids = _ids(tiny_gqa)[:HIST]
    store = _stored(tiny_gqa, f"memory:1GB,disk:{tmp_path}/d:1GB", ids)
    match = store.lookup(ids)
    assert all(c.tier == "memory" for c in match.chunks)
    prof = fake_profile(tiny_gqa.fingerprint)
    planner = Planner(prof, _shape(tiny_gqa), links(prof, [("memory", None, 0.0), ("disk", None, 0.0)]))
    plan = planner.plan(Method.KV, match.chunks, NEW)
    assert [c.tier for c in plan.chunks] == ["memory"] * len(match.chunks)
    assert plan.bytes_read == HIST * tiny_gqa.config.num_layers * 2 * tiny_gqa.config.kv_dim * 4
    store.tier("memory").delete(match.chunks[3].key)  # still on disk, but the plan said memory
    runner, blocks = _runner(tiny_gqa, HIST + NEW)
    with pytest.raises(Exception, match="missing or corrupt"):
        Restore(plan, store, runner, ids, blocks).prepare()
    assert store.tier("disk").counters["hits"] == 0
    store.close()


class _ProgressLink:
    """Stands in for the disk tier's read throttle with a link whose speed is set by the restore's
    own progress instead of a clock, so the race between Cake's loader and its compute cannot go
    either way by chance. A fast read returns at once. A slow read returns only once the compute
    side has done every chunk the loader has not claimed: slower than computing, however fast the
    machine computes. `slow(bytes read before this read, chunks computed)` says which it is, and
    is asked again while a slow read waits: the link can speed up under it."""

    def __init__(self, slow: Callable[[int, int], bool]):
        self.slow = slow
        self.restore: Restore | None = None
        self.reads = 0  # reads begun: chunks the loader claimed
        self.bytes = 0  # bytes of the reads finished

    def read(self, nbytes: int) -> None:
        assert self.restore is not None
        self.reads += 1
        stats, total = self.restore.stats, len(self.restore.plan.chunks)
        deadline = time.monotonic() + 60
        while self.slow(self.bytes, stats.chunks_computed) and stats.chunks_computed + self.reads < total:
            assert time.monotonic() < deadline, "the compute side stopped short of the loader's chunks"
            time.sleep(1e-3)
        self.bytes += nbytes


def test_cake_adapts_when_bandwidth_changes_mid_restore(tiny_gqa, tmp_path):
    ids = torch.randint(3, tiny_gqa.config.vocab_size, (640,), generator=torch.Generator().manual_seed(3)).tolist()
    chunk_bytes = 4 * 16 * 2 * 32 * 4  # layers * tokens * (K+V) * kv_dim * fp32 = 16 KiB
    ref = context_state(tiny_gqa.module, ids)

    def loaded(tag: str, slow: Callable[[int, int], bool]) -> int:
        cfg = tiny_gqa.config
        ns = StoreNamespace(tiny_gqa.fingerprint, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size)
        store = TieredStore.open(f"disk:{tmp_path}/{tag}:1GB", ns, chunk_tokens=16)
        store.save(ids, 0, ref.k, ref.v, None)
        store.flush(30)
        link = _ProgressLink(slow)
        store.tier("disk").throttle = link
        prof = fake_profile(tiny_gqa.fingerprint)
        planner = Planner(prof, _shape(tiny_gqa), links(prof, [("disk", None, 0.0)]), compute_chunk_tokens=16)
        plan = planner.plan(Method.CAKE, store.lookup(ids + [1]).chunks, 1)
        runner, blocks = _runner(tiny_gqa, 640)
        restore = link.restore = Restore(plan, store, runner, ids, blocks, compute_chunk_tokens=16)
        restore.prepare()
        stats = restore.finish()
        slots = runner.slots(blocks, 0, 640)
        assert (runner.k_cache[:, slots] - ref.k).abs().max().item() <= 1e-4
        assert (runner.v_cache[:, slots] - ref.v).abs().max().item() <= 1e-4
        assert stats.chunks_loaded + stats.chunks_computed == len(plan.chunks)
        assert link.reads == stats.chunks_loaded and link.bytes == link.reads * chunk_bytes  # one read a chunk
        store.close()
        return stats.chunks_loaded

    steady_fast = loaded("a", lambda read, computed: False)
    fast_then_slow = loaded("b", lambda read, computed: read >= chunk_bytes)  # slow once a chunk is in
    steady_slow = loaded("c", lambda read, computed: True)
    slow_then_fast = loaded("d", lambda read, computed: computed < 1)  # fast once a chunk is computed
    print(f"chunks loaded: fast {steady_fast}, fast then slow {fast_then_slow}, slow {steady_slow}, "
          f"slow then fast {slow_then_fast}")
    assert fast_then_slow < steady_fast
    assert slow_then_fast > steady_slow


# ----- planner -------------------------------------------------------------------------------------
def _chunks(hist: int, tier: str = "disk", size: int = 64) -> list[PlannedChunk]:
    return [PlannedChunk(f"k{a}", a, min(hist, a + size), tier, 0) for a in range(0, hist, size)]


def _shape(model) -> ModelShape:
    cfg = model.config  # fp32 storage
    return ModelShape(cfg.num_layers, 2 * cfg.kv_dim * 4, cfg.hidden_size * 4)


def _planner(model, profile: HardwareProfile, tier: TierLink | None = None) -> Planner:
    return Planner(profile, _shape(model), {"disk": tier or TierLink(profile.tiers["disk"])})


def test_auto_stores_kv_where_cake_beats_the_bubble_free_partition(tiny_gqa):
    """The layout auto stores decides which methods can run later: K/V allows layer-wise loading
    and Cake, so the bubble-free partition is stored only if it beats both (here it beats
    layer-wise loading but not Cake)."""
    pl = _planner(tiny_gqa, fake_profile("x", compute_scale=10.0, io_bps=1e6))  # slow reads: 1 MB/s
    n = tiny_gqa.config.num_layers
    probe = [PlannedChunk(str(a), a, a + 64, "disk", 0) for a in range(0, 1024, 64)]
    partition = pl.partition(probe)
    bf = pl.plan(Method.BUBBLEFREE, probe, 64, partition).predicted_s
    assert pl.plan(Method.CAKE, probe, 64).predicted_s < bf < pl.plan(Method.KV, probe, 64).predicted_s
    assert partition != (Repr.KV,) * n
    assert pl.choose_layout(None, "disk", 64) == (Repr.KV,) * n


# What an H200 measured for llama2-7b in bf16 (docs/gpu/h200-2026-11-27-d/call1_restore_mha.json).
# Its reads' overlap (0.00, taken before the calibration's fix) no longer counts: a copy engine moves
# the bytes, and a read takes its host work per call from the compute.
H200_LLAMA2 = HardwareProfile("llama2-7b", "bfloat16", 16, prefill_a=1.219e-05, prefill_b=1.325e-09,
                              project_s=1.799e-07, place_s=4.195e-08, prefill_g=1.477e-06, prefill_c=0.01755,
                              h2d_s=2.989e-07,
                              tiers={"memory": TierRates(1.31e12, 4.89e10, 8.59e-06, overlap=0.0, copy_engine=True)})
LLAMA2_SHAPE = ModelShape(32, 2 * 32 * 128 * 2, 4096 * 2)  # MHA: hidden states are half of K+V


def test_auto_stores_what_wins_for_the_long_histories_the_model_holds():
    """On an MHA model hidden states (half the bytes) win from about 4K tokens on, while a 1024-token
    history is launch-bound and K/V wins there: the stored layout is chosen for the lengths the
    model holds, the longest weighing most, so auto stores HCache's partition (hidden states, and
    K/V where projecting would outlast the reads) for a model of 32K positions and K/V for one of
    only 1024."""
    pl = Planner(H200_LLAMA2, LLAMA2_SHAPE, links(H200_LLAMA2, [("memory", None, 0.0)]), prefill_chunk_tokens=16384)
    n = LLAMA2_SHAPE.num_layers

    def chunks(h: int) -> list[PlannedChunk]:
        return [PlannedChunk(str(a), a, a + 64, "memory", 0) for a in range(0, h, 64)]

    def best_kv(h: int) -> float:
        return min(pl.plan(m, chunks(h), 64).predicted_s for m in (Method.KV, Method.CAKE))

    part = pl.partition(chunks(16384))
    assert part[0] is Repr.HIDDEN and part.count(Repr.HIDDEN) > n // 2
    assert best_kv(1024) < pl.plan(Method.BUBBLEFREE, chunks(1024), 64, part).predicted_s
    assert best_kv(16384) > pl.plan(Method.BUBBLEFREE, chunks(16384), 64, part).predicted_s
    assert pl.choose_layout(None, "memory", 64, max_tokens=32768) == part  # the presets' context length
    assert pl.choose_layout(None, "memory", 64, max_tokens=1024) == (Repr.KV,) * n
    assert pl.choose_layout(Method.KV, "memory", 64, max_tokens=32768) == (Repr.KV,) * n


def test_cake_pays_the_device_copy_that_whole_chunk_reads_leave_out(tiny_gqa):
    """On a GPU a whole-chunk read stays in host memory and Cake's loader copies it over before
    placing it: its plan charges that copy (h2d_s), which placement, timed as the scatters a step
    pays, no longer holds. Layer-wise loading's rate already includes its copies: unchanged."""
    base = fake_profile("x", io_bps=1e10)
    chunks = [PlannedChunk(str(a), a, a + 64, "memory", 0) for a in range(0, 4096, 64)]
    plans = {h: _planner(tiny_gqa, dataclasses.replace(base, h2d_s=h)) for h in (0.0, 1e-6)}
    cake = {h: pl.plan(Method.CAKE, chunks, 64).predicted_s for h, pl in plans.items()}
    assert cake[1e-6] > cake[0.0]
    assert plans[1e-6].plan(Method.KV, chunks, 64).predicted_s == plans[0.0].plan(Method.KV, chunks, 64).predicted_s


def test_changed_profile_changes_the_plan(tiny_gqa):
    n = tiny_gqa.config.num_layers
    allowed = {Method.KV: (Repr.KV,) * n, Method.CAKE: (Repr.KV,) * n}
    fast_io = _planner(tiny_gqa, fake_profile("x", compute_scale=100.0, io_bps=1e10)).choose(_chunks(512), 8, allowed)
    slow_io = _planner(tiny_gqa, fake_profile("x", compute_scale=0.01, io_bps=1e4)).choose(_chunks(512), 8, allowed)
    assert fast_io.method in (Method.KV, Method.CAKE) and slow_io.method is Method.RECOMPUTE


def test_profile_json_round_trip():
    p = fake_profile("abc", 2.0)
    assert HardwareProfile.from_json(p.to_json()) == p


def test_bubble_free_partition_follows_hcache_formulas(tiny_mha):
    chunks = [PlannedChunk("k", 0, 1024, "disk", 0)]
    n = tiny_mha.config.num_layers
    # IO-bound: slow disk -> recompute the first L_O layers, hidden for the rest.
    pl = _planner(tiny_mha, fake_profile("x", compute_scale=1.0, io_bps=1e6))
    c = pl.layer_costs(chunks)
    assert c.c_h <= c.io_h
    l_h = min(n, math.ceil(n * c.c_token / (c.c_token + c.io_h - c.c_h)))
    assert pl.partition(chunks) == (Repr.NONE,) * (n - l_h) + (Repr.HIDDEN,) * l_h
    # Compute-bound: very slow projection -> hidden for the first L_H layers, KV for the rest.
    pl = _planner(tiny_mha, fake_profile("x", compute_scale=1e4, io_bps=1e12))
    c = pl.layer_costs(chunks)
    assert c.c_h > c.io_h
    l_h = min(n, math.ceil(n * c.io_kv / (c.io_kv + c.c_h - c.io_h)))
    assert pl.partition(chunks) == (Repr.HIDDEN,) * l_h + (Repr.KV,) * (n - l_h)


def test_the_read_buffer_is_the_shallowest_from_which_no_layer_waits():
    """Ten layers, each read in 1 s and computed in 0.8 s: with compute at its own speed the
    formula's 2 layers of buffer are kept (the pipeline would still stall a little there; the
    formula is the upper bound). Reads that take the compute's cores (steal 0.5) slow each layer
    computed beside them to 1.2 s, longer than its read: the new tokens start after one layer, and
    no layer waits."""
    io, comp = [1.0] * 10, [0.8] * 10
    assert Planner._stalls(io, comp, 0.0, 1, 0.0) > 0
    assert Planner._start_depth(io, comp, 0.0, 0.0, 2) == (2, pytest.approx(Planner._run(io, comp, 0.0, 2, 0.0)[0]))
    assert Planner._stalls(io, comp, 0.0, 1, 0.5) == 0
    depth, t = Planner._start_depth(io, comp, 0.0, 0.5, 2)
    # Layers 0-6 take 1.2 s each from t = 1; layer 7 overlaps the reads' last 0.6 s (+0.3 s);
    # layers 8 and 9 run alone.
    assert depth == 1 and t == pytest.approx(1.0 + 7 * 1.2 + 1.1 + 2 * 0.8)
    # A deeper formula buffer is cut to the stall-free depth, found by bisection: 3 layers here.
    assert [Planner._stalls(io, comp, 0.0, d, 0.0) == 0 for d in (2, 3, 4)] == [False, True, True]
    assert Planner._start_depth(io, comp, 0.0, 0.0, 10)[0] == 3
    # Bubble-free (leading layers recomputed): the reads stream through the lead, so the buffer stays.
    assert Planner._start_depth(io, comp, 2.0, 0.5, 5)[0] == 5


def test_reads_that_share_the_cores_are_not_hidden_under_compute(tiny_gqa):
    """overlap = 1: a layer's read goes on under compute; overlap = 0 (reads are memcpys on the
    compute cores): compute that runs while reads still go on is slowed by them, and reads done
    before the compute starts cost it nothing. Emulated waiting overlaps either way. The new
    tokens start once the read buffer holds `read_buffer_layers` layers."""
    prof = fake_profile("x", compute_scale=1.0, io_bps=1e8)
    chunks = [PlannedChunk("k", 0, 2048, "disk", 0)]
    n = tiny_gqa.config.num_layers
    pl = _planner(tiny_gqa, prof)
    read = 2048 * pl.shape.kv_bytes_per_token_layer / 1e8 + 1e-5 / READ_GROUP_LAYERS  # one layer's read
    comp = 2048 * prof.place_s + pl.prefill_chunks_s(2048, 2056) / n  # one layer's placement + new tokens
    assert read > comp
    hidden = pl.plan(Method.KV, chunks, 8)
    assert hidden.read_buffer_layers == n  # IO-bound: CachedAttention's buffer takes every layer
    assert hidden.predicted_s == pytest.approx(_pipeline(read, comp, n, n, 0.0))
    busy_rates = dataclasses.replace(prof.tiers["disk"], overlap=0.0)
    busy = _planner(tiny_gqa, prof, TierLink(busy_rates)).plan(Method.KV, chunks, 8)
    assert busy.read_buffer_layers == n and busy.predicted_s == pytest.approx(hidden.predicted_s)
    # Fast reads (compute-bound): the buffer is one layer, compute runs beside the reads and pays.
    fast = dataclasses.replace(busy_rates, layer_bps=1e11, chunk_bps=1e11)
    quick = _planner(tiny_gqa, prof, TierLink(fast)).plan(Method.KV, chunks, 8)
    read_fast = 2048 * pl.shape.kv_bytes_per_token_layer / 1e11 + 1e-5 / READ_GROUP_LAYERS
    assert quick.read_buffer_layers == 1 and read_fast < comp
    assert quick.predicted_s == pytest.approx(_pipeline(read_fast, comp, n, 1, 1.0))
    assert quick.predicted_s > _pipeline(read_fast, comp, n, 1, 0.0)
    waiting = TierLink(busy_rates, emulated_bps=1e6)
    busy_part, wait_part = waiting.read_parts(10**6, whole_chunk=False)
    assert wait_part == pytest.approx(1.0) and waiting.stolen_s(10**6, False) == pytest.approx(busy_part)


def test_a_copy_engine_s_reads_take_only_their_calls_host_work_from_the_compute(tiny_gqa):
    """Where a copy engine moves the bytes (a GPU), a read steals its host work per call from the
    compute, whatever its size and whatever share the calibration's overlap trial showed: the
    fast-read case above, with the copy engine, is the pipeline at that per-call steal."""
    prof = fake_profile("x", compute_scale=1.0, io_bps=1e11)
    chunks = [PlannedChunk(str(a), a, a + 64, "disk", 0) for a in range(0, 2048, 64)]
    n = tiny_gqa.config.num_layers
    rates = dataclasses.replace(prof.tiers["disk"], overlap=0.0, copy_engine=True)
    link = TierLink(rates)
    assert link.stolen_s(10**3, False) == link.stolen_s(10**9, False) == pytest.approx(1e-5 / READ_GROUP_LAYERS)
    assert link.stolen_s(10**9, True) == pytest.approx(1e-5)
    plans = [_planner(tiny_gqa, prof, TierLink(dataclasses.replace(rates, overlap=o))).plan(Method.KV, chunks, 8)
             for o in (0.0, 1.0)]
    assert plans[0].predicted_s == plans[1].predicted_s
    pl = _planner(tiny_gqa, prof, link)
    c = pl.layer_costs(chunks)
    assert c.steal_kv == pytest.approx(len(chunks) * 1e-5 / READ_GROUP_LAYERS)
    comp = 2048 * prof.place_s + pl.prefill_chunks_s(2048, 2056) / n
    assert c.io_kv < comp and plans[0].read_buffer_layers == 1
    # Every layer's compute runs beside reads still going: it is slowed by the steal's share of them.
    assert plans[0].predicted_s == pytest.approx(_pipeline(c.io_kv, comp, n, 1, c.steal_kv / c.io_kv))
    shared = _planner(tiny_gqa, prof, TierLink(dataclasses.replace(rates, copy_engine=False))).plan(Method.KV, chunks, 8)
    assert shared.predicted_s > plans[0].predicted_s  # overlap 0 without a copy engine: every read pays


def _pipeline(read: float, comp: float, n: int, depth: int, steal: float) -> float:
    """Reads stream from t=0; compute starts after `depth` reads; layer i waits for read i and is
    slowed by `steal` per second of it that overlaps reads still going."""
    t, io_end = depth * read, n * read
    for i in range(n):
        start = max(t, (i + 1) * read)
        t = start + comp + steal * max(0.0, min(io_end, start + comp) - start)
    return t


def test_read_buffer_follows_cached_attention(tiny_gqa):
    """S_buf = B (T_load L_hist - T_pref L_new): more layers ahead when IO is slower than compute."""
    n = tiny_gqa.config.num_layers
    fast = _planner(tiny_gqa, fake_profile("x", compute_scale=1.0, io_bps=1e12)).plan(Method.KV, _chunks(2048), 64)
    slow = _planner(tiny_gqa, fake_profile("x", compute_scale=1.0, io_bps=1e6)).plan(Method.KV, _chunks(2048), 64)
    assert fast.read_buffer_layers == 1 and slow.read_buffer_layers == n


def test_continuing_a_history_costs_its_length():
    p = dataclasses.replace(fake_profile("x"), prefill_g=1e-5)
    assert p.prefill_s(4096, 4160) - fake_profile("x").prefill_s(4096, 4160) == pytest.approx(4096 * 1e-5)
    assert p.prefill_s(0, 64) == fake_profile("x").prefill_s(0, 64)


def test_compute_fit_recovers_the_step_model():
    """The profile's fit over the engine's step shapes gives back the coefficients that made them,
    and drops a term the data would make negative instead of predicting negative time."""
    a, b, g, c = 5e-4, 3e-8, 2e-6, 0.02
    true = dataclasses.replace(fake_profile("x"), prefill_a=a, prefill_b=b, prefill_g=g, prefill_c=c)
    points = [(s, e, true.prefill_s(s, e)) for s, e in COMPUTE_POINTS]
    assert fit_compute(points) == pytest.approx((a, b, g, c), rel=1e-6)
    linear = [(s, e, 1e-3 * (e - s) * (1 - 1e-5 * e)) for s, e in COMPUTE_POINTS]  # slightly sublinear
    assert all(c >= 0 for c in fit_compute(linear)) and fit_compute(linear)[0] > 0


def test_a_gpu_fit_also_times_the_shapes_restores_are_planned_for():
    """On a GPU the short calibration steps are mostly launches: the fit also times an 8K prefill
    and 64 tokens on an 8K history, within the model's context; the CPU keeps its short steps."""
    assert compute_points(torch.device("cpu"), 32768) == COMPUTE_POINTS
    gpu = compute_points(torch.device("cuda"), 32768)
    assert gpu == COMPUTE_POINTS + GPU_POINTS and (0, 8192) in gpu and (8192, 8256) in gpu
    assert compute_points(torch.device("cuda"), 2048) == tuple(p for p in COMPUTE_POINTS if p[1] <= 2048)
    # A 16K prefill too, where its pool fits a quarter of the free device memory (and the context).
    per_token = 1 << 17  # llama3-8b's K/V per token in bf16: its 16K pool is 2 GiB
    assert compute_points(torch.device("cuda"), 32768, per_token, 8 << 30) == gpu + GPU_LONG_POINTS
    assert compute_points(torch.device("cuda"), 32768, per_token, (8 << 30) - 1) == gpu
    assert compute_points(torch.device("cuda"), 8256, per_token, 80 << 30) == gpu
    assert compute_points(torch.device("cpu"), 32768, per_token, 80 << 30) == COMPUTE_POINTS
    true = dataclasses.replace(fake_profile("x"), prefill_a=5e-5, prefill_b=1e-10, prefill_g=1e-7, prefill_c=0.013)
    assert fit_compute([(s, e, true.prefill_s(s, e)) for s, e in gpu]) == \
        pytest.approx((5e-5, 1e-10, 1e-7, 0.013), rel=1e-6)


def test_online_refinement_moves_prediction_toward_observation(tiny_gqa):
    pl = _planner(tiny_gqa, fake_profile("x"))
    chunks = _chunks(512)
    before = pl.plan(Method.KV, chunks, 8).predicted_s
    for _ in range(10):
        pl.observe(Method.KV, pl.plan(Method.KV, chunks, 8).predicted_s, before * 3)
    after = pl.plan(Method.KV, chunks, 8).predicted_s
    assert abs(after - before * 3) < abs(before - before * 3) * 0.1


def test_online_refinement_is_bounded_so_a_method_is_never_locked_out(tiny_gqa):
    """Restores timed under load (waiting for busy steps) must not make the planner drop a method
    for good: the correction stays within MAX_CORRECTION."""
    pl = _planner(tiny_gqa, fake_profile("x"))
    chunks = _chunks(512)
    before = pl.plan(Method.KV, chunks, 8).predicted_s
    for _ in range(20):
        pl.observe(Method.KV, pl.plan(Method.KV, chunks, 8).predicted_s, before * 100)
    assert pl.plan(Method.KV, chunks, 8).predicted_s == pytest.approx(before * MAX_CORRECTION, rel=1e-3)


def test_a_cake_loader_that_dies_fails_the_restore(tiny_gqa, tmp_path):
    """Any error on Cake's loading side (not only a failed read) fails the restore: a chunk claimed
    from the back and never placed must not pass for restored history."""
    ids = _ids(tiny_gqa)[:HIST]
    store = _stored(tiny_gqa, f"disk:{tmp_path}/d:1GB", ids)
    prof = fake_profile(tiny_gqa.fingerprint)
    plan = Planner(prof, _shape(tiny_gqa), links(prof, [("disk", None, 0.0)]), compute_chunk_tokens=24) \
        .plan(Method.CAKE, store.lookup(ids + [1]).chunks, 1)
    runner, blocks = _runner(tiny_gqa, HIST + 1)

    def broken(*a, **kw):
        raise RuntimeError("boom")

    runner.copy_in = broken
    restore = Restore(plan, store, runner, ids, blocks, compute_chunk_tokens=24)
    with pytest.raises(Exception, match="boom"):
        restore.prepare()
    with pytest.raises(RestoreMiss):
        restore.finish()
    store.close()


def test_a_grouped_read_pays_each_calls_latency_and_an_emulated_limits_wait() -> None:
    rates = TierRates(chunk_bps=4e9, layer_bps=2e9, read_latency_s=1e-4)
    assert TierLink(rates).grouped_read_s(10**9, 8) == pytest.approx(0.5 + 8e-4)
    slow = TierLink(rates, emulated_bps=1e8, emulated_latency_s=0.01)
    assert slow.grouped_read_s(10**9, 8) == pytest.approx(0.5 + 8e-4 + 8 * 0.01 + 10.0)
