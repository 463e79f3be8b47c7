"""What the host issues to move state between the pool and host memory, counted by a recording
transfer back end (the CUDA back end's operations, on a CPU-only machine): a K/V restore is
O(chunks + layers) operations of whole-chunk DMA runs, saving is at most one device-to-host copy
per filled pool block, and the step thread never waits on a save copy."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.transfer import LazyTransfer, Transfer, span_runs
from kvtier.models.llama import CausalLM
from kvtier.models.loading import load_model
from kvtier.models.presets import PRESETS, random_state_dict
from kvtier.testing.transfers import RecordingTransfer, StepWaitedOnSave

from kvtier_testlib import fake_profile, loaded

# llama3-8b's layer count and the chunk count of its 8K history (64-token chunks), scaled down in
# width and chunk length so it runs in seconds: 32 layers, 128 whole chunks and a partial tail.
LAYERS, CHUNK, WHOLE, TAIL = 32, 16, 128, 8
HIST = WHOLE * CHUNK + TAIL


def _deep(dtype: torch.dtype = torch.float32):
    cfg = dataclasses.replace(PRESETS["tiny-gqa"], num_layers=LAYERS, vocab_size=512)
    module = CausalLM(cfg)
    module.load_state_dict(random_state_dict(cfg, 0))
    return loaded(cfg, module.to(dtype).eval(), f"deep-gqa-{dtype}")


@pytest.fixture(scope="module")
def deep():
    return _deep()


@pytest.fixture
def rec(monkeypatch) -> RecordingTransfer:
    rec = RecordingTransfer()
    monkeypatch.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda device: rec)
    return rec


def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _restore(model, rec: RecordingTransfer, seed: int, staging_bytes: int = 0, method: str = "kv"):
    """Save HIST tokens, then restore them by `method` for HIST + 5 (the recording cleared in
    between): the restore must reuse all of them and give recompute's token."""
    config = EngineConfig(kv_cache_bytes=64 << 20, max_model_len=4096, enable_prefix_cache=False)
    ids = _ids(HIST + 5, seed)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    fresh = Engine(model, config)
    try:
        ref = fresh.generate([ids], once)[0].output_ids  # recomputed: the oracle
    finally:
        fresh.close()
    engine = Engine(model, config, store="memory:1GB", profile=fake_profile(model.fingerprint),
                    reuse=ReuseConfig(method=method, chunk_tokens=CHUNK))
    engine.runner.staging_bytes = staging_bytes
    try:
        engine.generate([ids[:HIST]], once)
        assert engine.flush(60)
        rec.ops.clear()
        rec.stages.clear()
        rec.equal_runs = 0
        out = engine.generate([ids], once)[0]
    finally:
        engine.close()
    assert out.prompt_tokens_reused == HIST and out.output_ids == ref
    return out


def test_a_kv_restore_is_whole_chunk_runs_and_two_scatters_per_layer(deep, rec):
    out = _restore(deep, rec, 0)
    cfg = deep.config
    h2d, scatters = rec.of("h2d"), rec.of("scatter")
    chunks = WHOLE + 1
    assert len(scatters) == 2 * LAYERS  # one placement per layer and part, over every chunk
    assert len(h2d) + len(scatters) <= chunks + 2 * LAYERS + 8, [len(h2d), len(scatters)]
    # Every whole chunk goes over as one run per layer group (its K and V of those layers lie back to
    # back); only the partial tail goes layer by layer. On llama3-8b (64-token chunks, 8 KV heads of
    # 128, bf16, groups of 4 layers) such a run is 1 MiB.
    group = LAYERS // len(h2d)
    whole_run = 2 * group * CHUNK * cfg.num_kv_heads * cfg.head_dim * 4  # fp32
    runs = [r for op in h2d for r in op.runs]
    assert sorted(set(runs))[-1] == whole_run and runs.count(whole_run) == WHOLE * len(h2d)
    # The memory tier's whole chunks are handed over as address arrays, not a tensor view each: the
    # host's work per group does not grow with the chunk count.
    assert rec.equal_runs == WHOLE * len(h2d)
    tail_runs = [r for r in runs if r != whole_run]
    assert tail_runs == [TAIL * cfg.num_kv_heads * cfg.head_dim * 4] * (2 * LAYERS)
    assert sum(runs) == 2 * LAYERS * HIST * cfg.num_kv_heads * cfg.head_dim * 4  # every byte once
    assert out.restore.bytes_read == sum(runs)  # the spans' bytes are counted as read too


def test_a_hidden_state_restore_is_whole_chunk_runs_and_no_per_chunk_copies(deep, rec):
    """HCache's restore moves hidden states as K/V go: one run per whole chunk and layer group
    (handed over as address arrays), per-layer runs for the partial tail only, and no device copy
    or concatenation per chunk (one projection per layer reads a view of the staging slot)."""
    out = _restore(deep, rec, 2, method="hidden")
    assert out.restore.method == "hidden"
    cfg = deep.config
    h2d = rec.of("h2d")
    assert not rec.of("scatter")  # before: a device copy per chunk and group (129 x groups)
    group = LAYERS // len(h2d)
    whole_run = group * CHUNK * cfg.hidden_size * 4  # fp32
    runs = [r for op in h2d for r in op.runs]
    assert runs.count(whole_run) == WHOLE * len(h2d) and rec.equal_runs == WHOLE * len(h2d)
    assert sorted(r for r in runs if r != whole_run) == [TAIL * cfg.hidden_size * 4] * LAYERS
    assert sum(runs) == out.restore.bytes_read == LAYERS * HIST * cfg.hidden_size * 4  # every byte once


def test_the_calibration_times_the_restores_own_copies(tiny_gqa, rec, tmp_path):
    """Where copies are asynchronous, the hardware profile times a memory tier's layer groups as a
    restore moves them: whole chunks handed over as address arrays, one submission per group. The
    copy engine moves those bytes, so the planner charges the reads their host work per call; a
    disk tier's reads still check and copy every byte on the host."""
    from kvtier.engine.calibrate.hardware import measure_tiers
    from kvtier.planning.costs import READ_GROUP_LAYERS

    tiers = measure_tiers(tiny_gqa, f"memory:64MB,disk:{tmp_path}:64MB", chunk_tokens=16, chunks=8)
    rates = tiers["memory"]
    groups = -(-tiny_gqa.config.num_layers // READ_GROUP_LAYERS)
    assert rates.layer_bps > 0 and rates.chunk_bps > 0
    assert rec.equal_runs >= 8 * groups and len(rec.of("h2d")) >= groups
    assert rates.copy_engine and not tiers["disk"].copy_engine


def test_the_calibration_times_only_the_placements_a_step_pays(tiny_gqa, rec):
    """Where copies are asynchronous the host-to-device copies are the reads' cost (the tier's
    rates carry them, on the copy stream): placement is timed as the compute stream pays it, one
    scatter per layer and part out of a landed staging buffer, and no copy. (Timing both put a kv
    restore on an H200 at 1.8x its time.) The scatters land each staged row at its slot."""
    from kvtier.engine.calibrate.hardware import _h2d_s, _place_s, _runner
    from kvtier.planning.costs import READ_GROUP_LAYERS

    runner, _ = _runner(tiny_gqa, 256)
    runner.k_cache.zero_()
    rec.ops.clear()
    assert _place_s(tiny_gqa, runner, 256) > 0
    layers = tiny_gqa.config.num_layers
    assert not rec.of("h2d") and len(rec.of("scatter")) == 4 * 2 * layers  # a warm-up, three timed runs
    # Random rows were placed: every one of the 256 slots is no longer zeros.
    assert bool((runner.k_cache[layers - 1, :256].abs().flatten(1).sum(1) > 0).all())
    # The copies are timed apart (Cake's loader and importance reads pay them beside whole-chunk
    # reads): one batched submission per layer group of whole 64-token chunk runs, no scatter.
    rec.ops.clear()
    assert _h2d_s(tiny_gqa, runner, 256) > 0
    groups = -(-layers // READ_GROUP_LAYERS)
    assert not rec.of("scatter") and len(rec.of("h2d")) == 4 * groups
    run = 2 * 64 * tiny_gqa.config.kv_dim * 4  # fp32 K|V of one layer of a chunk
    assert sorted({r for op in rec.of("h2d") for r in op.runs}) == sorted({run * min(READ_GROUP_LAYERS, layers - g)
                                                                            for g in range(0, layers, READ_GROUP_LAYERS)})
    runner.transfer = Transfer(runner.device)  # synchronous copies: placing is the copy, timed as place_s
    assert _h2d_s(tiny_gqa, runner, 256) == 0.0


@pytest.mark.parametrize("cap", [False, True])
def test_the_staging_ring_stays_within_the_budget(deep, rec, cap):
    """The device memory the engine's budget sets aside for a restore's staging bounds its ring
    (two slots here), and the restore still equals recompute."""
    cfg = deep.config
    slot = (WHOLE + 1) * CHUNK * 4 * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # every chunk, a group of 4, K and V
    _restore(deep, rec, 1, 2 * slot + slot // 2 if cap else 0)
    assert len(rec.stages) == 2 if cap else len(rec.stages) > 2


def test_saving_copies_each_filled_block_once_and_never_waits_on_the_step(tiny_gqa, rec):
    """64 decode steps at batch 32: one device-to-host copy per step that filled blocks (every
    request's together), plus each request's partial last block; every token's state copied
    once; none waited on by the step thread (the recording back end raises); and the saved state
    restores to the same continuation."""
    prompt, steps, bs = 20, 64, 16
    reuse = ReuseConfig(method="kv", chunk_tokens=64)
    config = EngineConfig(kv_cache_bytes=64 << 20, max_model_len=512, max_num_seqs=32, enable_prefix_cache=False)
    prompts = [_ids(prompt, 100 + i, tiny_gqa.config.vocab_size) for i in range(32)]
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    engine = Engine(tiny_gqa, config, store="memory:256MB", profile=fake_profile(tiny_gqa.fingerprint), reuse=reuse)
    try:
        outs = engine.generate(prompts, params)
        assert engine.flush(60)
        d2h = rec.of("d2h")
        per_request = prompt + steps  # tokens computed (the last sampled one never is)
        assert len(d2h) <= math.ceil(per_request / bs) + 32, len(d2h)  # not one per request and block
        assert sum(r for op in d2h for r in op.runs) == 32 * 2 * per_request * tiny_gqa.config.num_layers * \
            tiny_gqa.config.kv_dim * 4  # every computed token's K and V, once
        rec.ops.clear()
        ids = prompts[3] + outs[3].output_ids
        again = engine.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    finally:
        engine.close()
    fresh = Engine(tiny_gqa, config)
    try:
        ref = fresh.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].output_ids
    finally:
        fresh.close()
    assert again.prompt_tokens_reused == per_request and again.output_ids == ref


def test_the_guard_catches_a_step_thread_waiting_on_a_save_copy(rec):
    (_,), handle = rec.to_host([torch.ones(4)])
    with pytest.raises(StepWaitedOnSave):
        rec.sync(handle)


def test_span_runs_move_every_byte_under_the_views_once():
    """The calibration's runs (one per host buffer, the span its views cover) land where the views
    say: a strided layer group of K and V of two chunks, through the lazy back end."""
    chunks = [torch.randn(6, 2, 4, 3) for _ in range(2)]  # [layers, K|V, tokens, dim]
    views = [c[1:4, p] for c in chunks for p in (0, 1)]  # [3 layers, tokens, dim], strided
    runs, size = span_runs(views)
    assert len(runs) == 2 and all(r.numel() == 3 * 2 * 4 * 3 * 4 for _, r in runs)
    stage = torch.zeros(size, dtype=torch.uint8)
    lazy = LazyTransfer()
    lazy.wait(lazy.to_stage(stage, runs))
    for (off, r), c in zip(runs, chunks):
        assert torch.equal(stage[off:off + r.numel()].view(torch.float32).view(3, 2, 4, 3), c[1:4])


def test_uploaded_views_read_what_the_host_views_read():
    """`upload_views` off the CPU (the lazy back end: nothing arrives until waited on): one run per
    host buffer, and device views of the copied spans with the host views' values, shapes and
    strides; a chunk's K and V of a layer group stay views of one buffer at the host's distance
    (a blend places a group's layers in one call from them); int8 values and fp32 scales of one
    buffer at odd places land aligned."""
    chunks = [torch.randn(6, 2, 5, 3).to(dt) for dt in (torch.bfloat16, torch.float32)]  # [layers, K|V, T, dim]
    views = [c[1:4, p] for c in chunks for p in (0, 1)]  # [3 layers, T, dim], strided
    raw = torch.zeros(200, dtype=torch.uint8)
    raw[3:43] = torch.arange(40, dtype=torch.uint8)
    raw[52:68] = torch.tensor([0.5, -2.0, 3.25, 8.0]).view(torch.uint8)
    views += [raw[3:43].view(torch.int8).view(8, 5)[::2], raw[52:68].view(torch.float32)]
    lazy = LazyTransfer()
    got, handle = lazy.packed_upload(views)
    assert not lazy.done(handle)
    lazy.wait(handle)
    for g, v in zip(got, views, strict=True):
        assert g.dtype == v.dtype and g.shape == v.shape and g.stride() == v.stride() and torch.equal(g, v)
        assert g.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    for c in range(2):
        k, v = got[2 * c], got[2 * c + 1]
        assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
        assert v.storage_offset() - k.storage_offset() == views[2 * c + 1].storage_offset() - views[2 * c].storage_offset()
    assert Transfer("cpu").upload_views(views)[0][0] is views[0]  # on the CPU: the views themselves


@pytest.mark.parametrize("method", ["kv", "hidden"])
def test_staged_restore_and_pool_saving_are_bit_identical_in_bf16(rec, method):
    """bf16 through the staged path (the lazy back end's async placement; hidden states through
    their ring and one projection per layer) and the pool-snapshot saver: the restored request's
    first logits equal a fresh engine's recompute bit for bit."""
    model = load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    ids = _ids(200 + 7, 5, model.config.vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0.0, first_logits=True)
    config = EngineConfig(kv_cache_bytes=16 << 20, max_model_len=512, enable_prefix_cache=False)
    with Engine(model, config) as fresh:
        ref = fresh.generate([ids], params)[0].first_logits
    with Engine(model, config, store="memory:256MB", profile=fake_profile(model.fingerprint),
                reuse=ReuseConfig(method=method, chunk_tokens=24)) as engine:
        engine.generate([ids[:200]], SamplingParams(max_tokens=1, temperature=0.0))
        assert engine.flush(60)
        rec.equal_runs = 0
        out = engine.generate([ids], params)[0]
    assert out.prompt_tokens_reused == 200 and out.restore.method == method
    assert rec.equal_runs > 0 and (rec.of("scatter") or method == "hidden")  # restored through the staged path
    assert ref is not None and out.first_logits is not None and torch.equal(out.first_logits, ref)


def _lossy_restore(model, storage: str, seed: int, rec: RecordingTransfer | None = None) -> list:
    """Save HIST tokens stored as `storage`, restore them by kv for HIST + 5 in a second request
    of the same engine (the recording cleared in between): -> the restored request's logprobs
    (the sampled token's and the top 5)."""
    config = EngineConfig(kv_cache_bytes=64 << 20, max_model_len=4096, enable_prefix_cache=False)
    ids = _ids(HIST + 5, seed)
    params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=5)
    engine = Engine(model, config, store="memory:1GB", profile=fake_profile(model.fingerprint),
                    reuse=ReuseConfig(method="kv", chunk_tokens=CHUNK, storage_dtype=storage))
    try:
        engine.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))
        assert engine.flush(60)
        if rec is not None:
            rec.ops.clear()
        out = engine.generate([ids], params)[0]
    finally:
        engine.close()
    assert out.prompt_tokens_reused == HIST
    return [(lp.token, lp.logprob, lp.top) for lp in out.logprobs]


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("storage", ["int8", "float16"])
def test_lossy_chunks_go_over_as_stored_and_decode_on_the_device(deep, monkeypatch, storage, compute):
    """K/V stored in another dtype cross to the device as stored (int8 values and their float32
    row scales, or float16) and are decoded there: the bytes copied are the stored ones, at most
    half of fp32's, in O(chunks + layers) host operations, and the restore's logprobs are the
    host-decoding CPU path's, bit for bit, in fp32 and in bf16."""
    if compute is not torch.float32:
        deep = _deep(compute)
    on_host = _lossy_restore(deep, storage, 2)  # the synchronous back end: decoded by the reads
    rec = RecordingTransfer()
    monkeypatch.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda device: rec)
    assert _lossy_restore(deep, storage, 2, rec) == on_host
    # Per layer group: one batched submission of the whole chunks as stored (one DMA run each,
    # the span of its stored group) and one of the partial tail, decoded on the host, layer by
    # layer. Per layer and part: one scatter decodes every whole chunk, one places all chunks.
    h2d = rec.of("h2d")
    groups = len(h2d) // 2
    assert len(h2d) == 2 * groups and LAYERS % groups == 0
    assert [len(op.runs) for op in h2d] == [WHOLE, 2 * LAYERS // groups] * groups
    cfg = deep.config
    values = 2 * LAYERS * WHOLE * CHUNK * cfg.num_kv_heads * cfg.head_dim  # the whole chunks' K and V elements
    stored = values * {"int8": 1, "float16": 2}[storage] + (values // cfg.head_dim * 4 if storage == "int8" else 0)
    copied = sum(r for op in h2d[::2] for r in op.runs)
    assert stored <= copied <= values * 2  # what is stored (with its alignment): at most half of fp32
    assert sum(r for op in h2d[1::2] for r in op.runs) == \
        2 * LAYERS * TAIL * cfg.num_kv_heads * cfg.head_dim * compute.itemsize  # the tail, decoded on the host
    assert len(rec.of("scatter")) == 2 * 2 * LAYERS
