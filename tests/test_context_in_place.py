"""Exact CPU attention reads a context as whole 64-key pieces (`key_rows`). Where the pool slots past a
context's end hold nothing anyone reads (`BlockPool.clearable`), the runner zeroes them and reads
the context in place instead of copying it into a padded buffer every layer: the logits must be the
same bits, whatever those slots held before (uninitialised pool memory may be NaN)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import engine as engine_module
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.backends import base, cpu_exact
from kvtier.engine.runner.backends.cpu_exact import GatheredDecodes, KeyReads
from kvtier.engine.runner.model_runner import ModelRunner, RunItem
from kvtier.models.loading import load_model

from kvtier_testlib import first_logits, spy_logits

BS = 16


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_context_read_in_place_past_its_end_gives_the_padded_copys_bits(dtype):
    lm = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    ids = torch.randint(100, lm.config.vocab_size, (600,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = list(range(38))  # 608 slots: the 600 tokens, then own slots no token reached
    out = {}
    for name, clearable in (("copied", None), ("in place", lambda run, slots: True)):
        runner = ModelRunner(lm.module, 72, BS, 1024)  # key_rows(600) = 640 slots: 2 clean blocks past its own
        runner.clearable = clearable
        for cache in (runner.k_cache, runner.v_cache):
            cache[:, : runner.sink] = float("nan")  # what a slot may hold before it is written
        runner.execute([RunItem(ids[:520], 0, blocks, want_logits=False)])
        step = [RunItem(ids[520:], 520, blocks, want_logits=True)]
        batch = runner.prepare(step)
        assert (batch.reads[0].tail is not None) == (clearable is not None)
        assert (batch.reads[0].pad is None) == (clearable is not None)  # no per-layer copy where in place
        if clearable is not None:
            assert batch.reads[0].tail == range(600, 640) and batch.reads[0].ctx == range(0, 640)
        out[name] = runner.execute(step)
        assert torch.isfinite(out[name]).all()
    assert torch.equal(out["copied"], out["in place"])




@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("in_place", [True, False])
def test_a_decode_batch_reads_whole_key_blocks_in_place_and_matches_each_decode_alone(dtype, in_place, monkeypatch):
    """A batch of decodes reads each token's whole key blocks (512 keys here) as a view of the pool
    where its blocks are consecutive, gathers them where they are scattered, and only its piece
    otherwise (or, below `IN_PLACE_KEYS`, gathers every context and attends in one call): each
    row's logits are the bits of that token decoded alone (which reads `causal`'s way), with every
    slot not yet written holding NaN."""
    monkeypatch.setattr(cpu_exact, "IN_PLACE_KEYS", 512 if in_place else 4096)  # the contexts are 100-700
    lm = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    gen = torch.Generator().manual_seed(4)
    runner = ModelRunner(lm.module, 200, BS, 2048)
    for cache in (runner.k_cache, runner.v_cache):
        cache[:, : runner.sink] = float("nan")
    tables = {700: list(range(44)), 600: list(range(87, 49, -1)), 100: list(range(120, 127))}  # in a row, scattered, short
    ids = {n: torch.randint(100, lm.config.vocab_size, (n,), generator=gen).tolist() for n in tables}
    for n, blocks in tables.items():
        runner.execute([RunItem(ids[n][:-1], 0, blocks, want_logits=False)])
    step = [RunItem(ids[n][-1:], n - 1, blocks, want_logits=True) for n, blocks in tables.items()]
    batch = runner.prepare(step)
    keys = batch.decodes
    if in_place:
        assert isinstance(keys, KeyReads)  # no context gathered whole
        assert keys.in_place == (range(0, 512), None, None)
        assert keys.gathered_rows == (None, range(0, 512), None)
    else:
        assert isinstance(keys, GatheredDecodes)
    together = runner.execute(step)
    for r, item in enumerate(step):
        assert torch.equal(together[r], runner.execute([item])[0]), r
    assert torch.isfinite(together).all()

@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_restored_context_is_read_in_place_and_matches_a_fresh_prefill(store, tiny_gqa, tmp_path):
    """Through the engine: the step computing a returning context's new tokens reads it in place
    (a fresh engine's pool hands out consecutive clean blocks), and its logits are a fresh prefill's."""
    ids = torch.randint(100, tiny_gqa.config.vocab_size, (664,), generator=torch.Generator().manual_seed(1)).tolist()
    spec = f"disk:{tmp_path}:1GB" if store == "disk" else "memory:1GB"
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=64 << 20, enable_prefix_cache=False)
    want = first_logits(Engine(tiny_gqa, config), ids, once)[1]
    saver = Engine(tiny_gqa, config, store=spec, reuse=ReuseConfig(method="kv"))
    saver.generate([ids[:600]], once)
    saver.flush()
    if store == "disk":  # a restart: a new engine over the same directory
        saver.close()
    engine = saver if store == "memory" else Engine(tiny_gqa, config, store=spec, reuse=ReuseConfig(method="kv"))
    tails: list[range | None] = []
    prepare = engine.runner.prepare

    def spy(items):
        batch = prepare(items)
        tails.extend(r.tail for r in batch.reads)
        return batch

    engine.runner.prepare = spy  # type: ignore[method-assign]
    out, got = first_logits(engine, ids, once)
    assert out.prompt_tokens_reused == 600
    assert tails == [range(664, 704)]  # one step: the 64 new tokens over 600 restored, read in place
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_decode_after_a_shared_prefix_reads_in_place_and_matches_a_fresh_engine(dtype):
    """A document asked about twice: the second question's blocks follow the document's cached
    ones (the first question's continuation had cached the next blocks; the CPU pool takes them
    back), so every step reads its context in place, never gathered; its logits are those of an
    engine that never saw the document."""
    lm = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    gen = torch.Generator().manual_seed(2)
    doc, q1, q2 = (torch.randint(100, lm.config.vocab_size, (n,), generator=gen).tolist() for n in (192, 20, 20))
    params = SamplingParams(max_tokens=40, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=64 << 20)
    fresh = Engine(lm, config)
    want = spy_logits(fresh)
    expected = fresh.generate([doc + q2], params)[0]
    fresh.close()
    engine = Engine(lm, config)
    engine.generate([doc + q1], params)  # its blocks after the document's 12 are cached when it ends
    seen, reads, blocks = spy_logits(engine), [], []
    prepare = engine.runner.prepare

    def spy(items):
        batch = prepare(items)
        reads.extend(r.ctx for r in batch.reads)
        blocks.append(list(items[0].block_ids))
        return batch

    engine.runner.prepare = spy  # type: ignore[method-assign]
    out = engine.generate([doc + q2], params)[0]
    engine.close()
    assert out.prompt_tokens_reused == 192
    assert blocks[-1] == list(range(blocks[-1][0], blocks[-1][0] + len(blocks[-1])))  # consecutive
    assert len(reads) == 40 and all(isinstance(r, range) for r in reads)  # in place, every step
    assert out.output_ids == expected.output_ids
    assert len(seen) == len(want) and all(torch.equal(a[-1], b[-1]) for a, b in zip(seen, want))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("headroom", [True, False])
def test_a_batch_decoding_past_its_prompts_blocks_still_reads_in_place(headroom, dtype, monkeypatch):
    """Prompts prefilled together lie one after the other in the pool. A decode that grows past its
    prompt's blocks into a new key block reads it in place only if its next blocks were left free:
    each new run leaves one key block of headroom to the run before it. Without that, such a
    context is scattered (gathered whole on every layer) once its decode crosses 512 keys. Either
    way each token is the one its prompt decodes alone, in fp32 and bf16 (the rows' bits are
    `test_a_decode_batch_reads_whole_key_blocks_in_place_and_matches_each_decode_alone`'s)."""
    monkeypatch.setattr(cpu_exact, "IN_PLACE_KEYS", 256)  # the contexts are 470-526
    if not headroom:
        monkeypatch.setattr(engine_module, "KEY_BLOCK", 0)
    lm = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    gen = torch.Generator().manual_seed(5)
    # 470-479 tokens: each decode needs new blocks before 512 keys, which then lie in its first whole key block
    prompts = [torch.randint(100, lm.config.vocab_size, (470 + 3 * r,), generator=gen).tolist() for r in range(4)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)  # every one crosses 512
    config = EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024)
    alone = []
    for p in prompts:
        with Engine(lm, config) as e:
            alone.append(e.generate([p], params)[0].output_ids)
    reads: list[tuple[bool, bool]] = []  # per decode read past 512 keys: (in place, gathered)
    spy = cpu_exact.CpuExact._key_reads

    def counted(self, tables, ctx_len):
        keys = spy(self, tables, ctx_len)
        reads.extend((p is not None, g is not None) for n, p, g in zip(ctx_len, keys.in_place, keys.gathered_rows)
                     if n > 512)
        return keys

    monkeypatch.setattr(cpu_exact.CpuExact, "_key_reads", counted)
    with Engine(lm, config) as engine:
        together = [o.output_ids for o in engine.generate(prompts, params)]
    assert together == alone
    assert len(reads) >= 16
    if headroom:
        assert all(in_place and not gathered for in_place, gathered in reads)
    else:
        assert any(gathered for _, gathered in reads)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_restore_computing_layers_on_its_worker_zeroes_only_its_own_slots(dtype, tmp_path):
    """Bubble-free recomputes the first layers of history [32, 200) ([0, 32) device-cached) on the
    restore worker while the scheduler may hand out blocks: its context reads key_rows(200) = 256
    slots, but the request holds slots up to 208 only, and the clean blocks after them could be
    another request's by the time it zeroes them. So that run never reads in place past its own
    slots (it copies into padded buffers instead), and the output is still a recompute's."""
    tiny_gqa = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    n = tiny_gqa.config.num_layers
    reuse = ReuseConfig(method="bubblefree", chunk_tokens=24, layout=("none",) + ("hidden",) * (n - 1))
    config = EngineConfig(kv_cache_bytes=64 << 20)
    ids = torch.randint(100, tiny_gqa.config.vocab_size, (207,), generator=torch.Generator().manual_seed(3)).tolist()
    once = SamplingParams(max_tokens=1, temperature=0.0)
    want = first_logits(Engine(tiny_gqa, config), ids, once)[1]
    spec = f"disk:{tmp_path}:1GB"
    with Engine(tiny_gqa, config, store=spec, reuse=reuse) as saver:
        saver.generate([ids[:200]], once)
    engine = Engine(tiny_gqa, config, store=spec, reuse=reuse)
    engine.generate([ids[:40]], once)  # device-caches blocks [0, 32)
    seen: list[tuple[RunItem, range | None]] = []
    attention = engine.runner.attention
    assert isinstance(attention, cpu_exact.CpuExact)
    tail = attention._tail

    def spy(it, ctx, clearable):
        got = tail(it, ctx, clearable)
        seen.append((it, got))
        return got

    attention._tail = spy  # type: ignore[method-assign]
    out, got = first_logits(engine, ids, once)
    assert out.reused_by_tier.get("device") == 32 and out.reused_by_tier.get("disk") == 168
    worker = [(it, t) for it, t in seen if it.off_thread]
    assert [(it.start, it.start + len(it.token_ids)) for it, _ in worker] == [(32, 200)]
    assert worker[0][1] is None  # slots past 208 are not its own
    assert torch.equal(got, want)


def test_a_long_prompt_in_a_pool_full_of_cached_prefixes_is_read_in_place(monkeypatch):
    """A server's pool fills with cached prefixes and has no clean block left: a new long prompt
    must still get consecutive blocks (cached ones evicted to open a row), so that its context is a
    view of the pool on every layer, not a gather; and its next turn grows in place after it."""
    lm = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    per_block = ModelRunner.bytes_per_block(lm.module, BS)
    engine = Engine(lm, EngineConfig(kv_cache_bytes=per_block * 160, max_model_len=1024))  # 2560 slots
    reads: list[str] = []
    real = base.read_context

    def spy(new, cache, ctx, pad):
        reads.append("gathered" if isinstance(ctx, torch.Tensor) else "in place")
        return real(new, cache, ctx, pad)

    monkeypatch.setattr(base, "read_context", spy)
    gen = torch.Generator().manual_seed(5)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        for i in range(8):  # 8 x 700 tokens through 160 blocks: from the fourth on, no clean row is left
            ids = torch.randint(100, lm.config.vocab_size, (700,), generator=gen).tolist()
            reads.clear()
            engine.generate([ids], params)  # chunks of 256 (max_batched_tokens): each later one reads its context
            again = engine.generate([ids + [7, 8]], params)[0]  # the next turn: a prefix-cache hit, 2 new tokens
            assert set(reads) == {"in place"}, (i, reads)
            assert again.prompt_tokens_reused >= 688, i
    finally:
        engine.close()
