"""Every restore method against full recompute: next-token logits within 1e-4 (fp32) and identical
greedy 32-token continuations, per method x tier x model, with a partial last chunk, store chunks
(24 tokens) not aligned to pool blocks (16), and a prefix split across tiers."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner import RunItem
from kvtier.restore.executor import Executor
from kvtier.restore.glue import chunks_of, links, model_shape, namespace
from kvtier.restore.plan import READ_GROUP_LAYERS, Method
from kvtier.restore.planner import Planner
from kvtier.restore.profile import HardwareProfile
from kvtier.restore.state import context_state
from kvtier.store import Repr, TieredStore
from kvtier.store.throttle import Emulation

from kvtier_testlib import fake_profile

CHUNK = 24  # not a multiple of the 16-token pool block
HIST, NEW = 200, 7  # 200 = 8 full chunks + a partial chunk of 8


def layouts(n: int) -> dict[Method, tuple[Repr, ...]]:
    return {
        Method.KV: (Repr.KV,) * n,
        Method.HIDDEN: (Repr.HIDDEN,) * n,
        Method.CAKE: (Repr.KV,) * n,
        # The two bubble-free shapes of HCache §4.1.2: recompute the first layers, or KV for the last.
        Method.BUBBLEFREE: (Repr.NONE,) + (Repr.HIDDEN,) * (n - 2) + (Repr.HIDDEN,),
        "bubblefree-kv": (Repr.HIDDEN,) * (n - 1) + (Repr.KV,),
    }


def greedy_after(runner, logits: torch.Tensor, length: int, blocks, n: int = 32) -> list[int]:
    out = []
    for i in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        logits = runner.execute([RunItem([tok], length + i, blocks, True)])[0]
    return out


def check_all_methods(model, spec: str, split_tiers: bool = False) -> None:
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (HIST + NEW,), generator=torch.Generator().manual_seed(9)).tolist()
    ref_logits = model.module(torch.tensor(ids))[-1]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    ref_tokens = Engine(model, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024)).generate([ids], params)[0].output_ids
    state = context_state(model.module, ids[:HIST])
    prof = fake_profile(model.fingerprint)
    for name, layout in layouts(cfg.num_layers).items():
        method = Method.BUBBLEFREE if name == "bubblefree-kv" else name
        store = TieredStore.open(spec, namespace(model, layout), chunk_tokens=CHUNK)
        try:
            store.save(ids[:HIST], 0, state.k, state.v, state.h)
            assert store.flush(30)
            if split_tiers:  # drop every other chunk from memory: the prefix now spans memory and disk
                for c in store.lookup(ids).chunks[::2]:
                    store.tier("memory").delete(c.key)
            match = store.lookup(ids)
            assert match.num_tokens == HIST and match.chunks[-1].end - match.chunks[-1].start == HIST % CHUNK
            if split_tiers:
                assert {c.tier for c in match.chunks} == {"memory", "disk"}
            planner = Planner(prof, model_shape(model), links(store, prof))
            plans = [planner.plan(method, chunks_of(match), NEW, layout)]
            if name == Method.KV:  # recompute and auto once per store
                plans += [planner.plan(Method.RECOMPUTE, chunks_of(match), NEW),
                          planner.choose(chunks_of(match), NEW, {Method.KV: layout, Method.CAKE: layout})]
            for plan in plans:
                engine = Engine(model, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024))
                blocks = engine.pool.allocate(-(-(HIST + NEW + 32) // 16))
                logits, stats = Executor(engine.runner, compute_chunk_tokens=48).run(plan, store, match, ids, blocks)
                diff = (logits - ref_logits).abs().max().item()
                assert diff <= 1e-4, f"{name} {plan.method}: logit diff {diff}"
                assert greedy_after(engine.runner, logits, len(ids), blocks) == ref_tokens, f"{name} {plan.method}"
                if plan.method not in (Method.RECOMPUTE,):
                    assert stats.bytes_read > 0 or plan.method is Method.CAKE
        finally:
            store.close()


@pytest.mark.parametrize("model_name", ["tiny_mha", "tiny_gqa"])
def test_every_method_is_exact(model_name, tier_spec, request):
    check_all_methods(request.getfixturevalue(model_name), tier_spec)


def test_prefix_split_across_memory_and_disk(tiny_gqa, tmp_path):
    check_all_methods(tiny_gqa, f"memory:1GB,disk:{tmp_path}/d:1GB", split_tiers=True)


@pytest.mark.slow
def test_every_method_is_exact_on_smollm2(smollm2_fp32, tier_spec):
    check_all_methods(smollm2_fp32, tier_spec)


# ----- planner -------------------------------------------------------------------------------------
def _plan_for(model, profile: HardwareProfile, tmp_path, hist: int = 512):
    ids = list(range(100, 100 + hist + 8))
    store = TieredStore.open(f"disk:{tmp_path}/p:1GB", namespace(model), chunk_tokens=64)
    state = context_state(model.module, ids[:hist])
    store.save(ids[:hist], 0, state.k, state.v, state.h)
    store.flush(30)
    match = store.lookup(ids)
    planner = Planner(profile, model_shape(model), links(store, profile))
    n = model.config.num_layers
    plan = planner.choose(chunks_of(match), 8, {Method.KV: (Repr.KV,) * n, Method.CAKE: (Repr.KV,) * n})
    store.close()
    return plan


def test_changed_profile_changes_the_plan(tiny_gqa, tmp_path):
    fast_io = _plan_for(tiny_gqa, fake_profile(tiny_gqa.fingerprint, compute_scale=100.0, io_bps=1e10), tmp_path)
    slow_io = _plan_for(tiny_gqa, fake_profile(tiny_gqa.fingerprint, compute_scale=0.01, io_bps=1e4), tmp_path)
    assert fast_io.method in (Method.KV, Method.CAKE) and slow_io.method is Method.RECOMPUTE
    assert fast_io.predicted_s < _plan_for(tiny_gqa, fake_profile(tiny_gqa.fingerprint, 100.0, 1e10), tmp_path).predicted_s * 1.01


def test_profile_json_round_trip():
    p = fake_profile("abc", 2.0)
    assert HardwareProfile.from_json(p.to_json()) == p


def test_bubble_free_partition_follows_hcache_formulas(tiny_mha):
    from kvtier.restore.planner import Chunk, TierLink
    import math

    shape = model_shape(tiny_mha)
    chunks = [Chunk(0, 1024, "disk")]
    n = shape.num_layers
    # IO-bound: slow disk -> recompute the first L_O layers, hidden for the rest.
    prof = fake_profile("x", compute_scale=1.0, io_bps=1e6)
    pl = Planner(prof, shape, {"disk": TierLink(prof.tiers["disk"])})
    c = pl.layer_costs(chunks)
    assert c["c_h"] <= c["io_h"]
    l_h = min(n, math.ceil(n * c["c_token"] / (c["c_token"] + c["io_h"] - c["c_h"])))
    assert pl.partition(chunks) == (Repr.NONE,) * (n - l_h) + (Repr.HIDDEN,) * l_h
    # Compute-bound: very slow projection -> hidden for the first L_H layers, KV for the rest.
    prof = fake_profile("x", compute_scale=1e4, io_bps=1e12)
    pl = Planner(prof, shape, {"disk": TierLink(prof.tiers["disk"])})
    c = pl.layer_costs(chunks)
    assert c["c_h"] > c["io_h"]
    l_h = min(n, math.ceil(n * c["io_kv"] / (c["io_kv"] + c["c_h"] - c["io_h"])))
    assert pl.partition(chunks) == (Repr.HIDDEN,) * l_h + (Repr.KV,) * (n - l_h)


def test_reads_that_share_the_cores_are_not_hidden_under_compute(tiny_gqa):
    """overlap = 1: a layer's read pipelines under the previous layer's compute; overlap = 0 (no
    copy engine, reads are memcpys on the compute cores): the read time adds to compute. Emulated
    waiting overlaps either way."""
    import dataclasses

    from kvtier.restore.planner import Chunk, TierLink

    prof = fake_profile("x", compute_scale=1.0, io_bps=1e8)
    shape = model_shape(tiny_gqa)
    chunks = [Chunk(0, 2048, "disk")]
    n = shape.num_layers
    read = 2048 * shape.kv_bytes_per_token_layer / 1e8 + 1e-5 / READ_GROUP_LAYERS  # one layer's read (busy part)
    comp = 2048 * prof.place_s + prof.prefill_s(2048, 2056) / n  # one layer's placement + new tokens
    hidden = Planner(prof, shape, {"disk": TierLink(prof.tiers["disk"])}).plan(Method.KV, chunks, 8)
    assert read > comp and hidden.predicted_s == pytest.approx(n * read + comp)  # IO-bound pipeline
    busy_rates = dataclasses.replace(prof.tiers["disk"], overlap=0.0)
    busy = Planner(prof, shape, {"disk": TierLink(busy_rates)}).plan(Method.KV, chunks, 8)
    # The first read, then every layer's compute carrying its own read: fully serial.
    assert busy.predicted_s == pytest.approx(read + n * (comp + read))
    waiting = TierLink(busy_rates, emulated_bps=1e6)
    busy_part, wait_part = waiting.read_parts(10**6, whole_chunk=False)
    assert wait_part == pytest.approx(1.0) and waiting.stolen_s(10**6, False) == pytest.approx(busy_part)


def test_continuing_a_history_costs_its_length():
    p = dataclasses.replace(fake_profile("x"), prefill_g=1e-5)
    assert p.prefill_s(4096, 4160) - fake_profile("x").prefill_s(4096, 4160) == pytest.approx(4096 * 1e-5)
    assert p.prefill_s(0, 64) == fake_profile("x").prefill_s(0, 64)


def test_online_refinement_moves_prediction_toward_observation(tiny_gqa):
    from kvtier.restore.planner import Chunk, TierLink

    prof = fake_profile("x")
    pl = Planner(prof, model_shape(tiny_gqa), {"disk": TierLink(prof.tiers["disk"])})
    chunks = [Chunk(0, 512, "disk")]
    before = pl.plan(Method.KV, chunks, 8).predicted_s
    for _ in range(10):
        pl.observe(Method.KV, pl.plan(Method.KV, chunks, 8).predicted_s, before * 3)
    after = pl.plan(Method.KV, chunks, 8).predicted_s
    assert abs(after - before * 3) < abs(before - before * 3) * 0.1


# ----- Cake adapts while it runs -----------------------------------------------------------------------
def _cake_loaded(model, tmp_path, tag: str, start_bps: float, switch_bps: float | None, after_s: float) -> int:
    ids = torch.randint(3, model.config.vocab_size, (640 + 4,), generator=torch.Generator().manual_seed(3)).tolist()
    store = TieredStore.open(f"disk:{tmp_path}/{tag}:1GB", namespace(model), chunk_tokens=16)
    state = context_state(model.module, ids[:640])
    store.save(ids[:640], 0, state.k, state.v, None)
    store.flush(30)
    disk = store.tier("disk")
    disk.throttle.emulation = Emulation(bandwidth=start_bps)
    match = store.lookup(ids)
    prof = fake_profile(model.fingerprint)
    plan = Planner(prof, model_shape(model), links(store, prof)).plan(Method.CAKE, chunks_of(match), 4)
    engine = Engine(model, EngineConfig(kv_cache_bytes=64 << 20))
    blocks = engine.pool.allocate(-(-len(ids) // 16))
    timer = None
    if switch_bps is not None:
        timer = threading.Timer(after_s, lambda: setattr(disk.throttle, "emulation", Emulation(bandwidth=switch_bps)))
        timer.start()
    logits, stats = Executor(engine.runner, compute_chunk_tokens=16).run(plan, store, match, ids, blocks)
    if timer:
        timer.cancel()
    assert (logits - model.module(torch.tensor(ids))[-1]).abs().max().item() <= 1e-4
    assert stats.chunks_loaded + stats.chunks_computed == len(match.chunks)
    store.close()
    return stats.chunks_loaded


def test_cake_adapts_when_bandwidth_changes_mid_restore(tiny_gqa, tmp_path):
    chunk_bytes = 4 * 16 * 2 * 32 * 4  # layers * tokens * (K+V) * kv_dim * fp32 = 16 KiB
    fast, slow = chunk_bytes / 1e-4, chunk_bytes / 0.03  # 0.1 ms vs 30 ms per chunk
    steady_fast = _cake_loaded(tiny_gqa, tmp_path, "a", fast, None, 0)
    fast_then_slow = _cake_loaded(tiny_gqa, tmp_path, "b", fast, slow, 0.0)
    steady_slow = _cake_loaded(tiny_gqa, tmp_path, "c", slow, None, 0)
    slow_then_fast = _cake_loaded(tiny_gqa, tmp_path, "d", slow, fast, 0.01)
    assert fast_then_slow < steady_fast
    assert slow_then_fast > steady_slow


@pytest.mark.parametrize("name", [Method.KV, Method.HIDDEN, Method.CAKE, "bubblefree-kv"])
def test_restore_after_a_device_cached_prefix_never_writes_it(tiny_gqa, name):
    """restore_history(start=40): [0, 40) are device-cached blocks (maybe shared with other
    requests) and stay untouched even though the stored chunk [24, 48) straddles 40; everything
    from 40 on equals a recompute."""
    model, n = tiny_gqa, tiny_gqa.config.num_layers
    ids = torch.randint(3, model.config.vocab_size, (HIST + NEW,), generator=torch.Generator().manual_seed(4)).tolist()
    layout = layouts(n)[name]
    method = Method.BUBBLEFREE if name == "bubblefree-kv" else name
    state = context_state(model.module, ids[:HIST])
    engine = Engine(model, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024))
    runner = engine.runner
    ref_blocks = engine.pool.allocate(-(-HIST // 16))
    runner.execute([RunItem(ids[:HIST], 0, ref_blocks, False)])
    with TieredStore.open("memory:1GB", namespace(model, layout), chunk_tokens=CHUNK) as store:
        store.save(ids[:HIST], 0, state.k, state.v, state.h)
        assert store.flush(30)
        match = store.lookup(ids)
        prof = fake_profile(model.fingerprint)
        plan = Planner(prof, model_shape(model), links(store, prof)).plan(method, chunks_of(match), NEW, layout)
        blocks = engine.pool.allocate(-(-HIST // 16))
        cached, ref_cached = runner.slots(blocks, 0, 40), runner.slots(ref_blocks, 0, 40)
        # The "device-cached" prefix: true values (Cake computes on top of them) marked by a tiny
        # offset, so any write from the restore would show.
        mark_k = runner.k_cache[:, ref_cached] + 1e-6
        mark_v = runner.v_cache[:, ref_cached] + 1e-6
        runner.k_cache[:, cached], runner.v_cache[:, cached] = mark_k, mark_v
        Executor(runner, compute_chunk_tokens=48).restore_history(plan, store, match, ids, blocks, start=40)
    assert torch.equal(runner.k_cache[:, cached], mark_k) and torch.equal(runner.v_cache[:, cached], mark_v)
    got, ref = runner.slots(blocks, 40, HIST), runner.slots(ref_blocks, 40, HIST)
    assert (runner.k_cache[:, got] - runner.k_cache[:, ref]).abs().max().item() <= 1e-4
    assert (runner.v_cache[:, got] - runner.v_cache[:, ref]).abs().max().item() <= 1e-4
