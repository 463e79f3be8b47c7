"""The static-buffer decode step (what CUDA graphs capture, engine/runner/backends/static.py) run
eagerly on the CPU, against the engine's dynamic decode: the same logits, bit for bit, at every
step of a ragged batch (fp32 and bf16); the paged FlexAttention backend CUDA uses, against the
same, to rounding; and the per-device budgets (engine/budget.py)."""

from __future__ import annotations

import pytest
import torch

from kvtier.engine import budget
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.backends.static import StaticDecode, buckets, widths
from kvtier.models.loading import load_model

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    # Ragged: inside a block, at a block edge, over a 512-key block of the exact kernel.
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 32, 530, 95, 300)]


def _record(engine: Engine, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Every step's logits, and the generated ids."""
    steps: list[torch.Tensor] = []
    execute = engine.runner.execute

    def recording(*a, **kw):
        out = execute(*a, **kw)
        steps.append(out.clone())
        return out

    engine.runner.execute = recording  # type: ignore[method-assign]
    try:
        outs = engine.generate(prompts, GREEDY)
    finally:
        engine.close()
    return steps, [o.output_ids for o in outs]


def _engine(m, static: bool, exact: bool = True) -> Engine:
    return Engine(m, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024, max_num_seqs=8, static_decode=static,
                                  exact=exact))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_static_decode_step_equals_dynamic_decode_bit_for_bit(dtype: str):
    m = load_model("tiny-gqa", dtype=dtype, tokenizer=False)
    prompts = _prompts(m.config.vocab_size)
    want, want_ids = _record(_engine(m, static=False), prompts)
    e = _engine(m, static=True)
    sd = e.runner.decoder
    assert isinstance(sd, StaticDecode) and not sd.graphs_on
    calls = []
    run = sd.run
    sd.run = lambda items: calls.append(len(items)) or run(items)  # type: ignore[method-assign]
    got, got_ids = _record(e, prompts)
    assert got_ids == want_ids
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    # Plain decode steps went through the static step: 5 requests (bucket 8), then fewer as they end.
    assert calls and calls[0] == 5 and sum(calls) >= 5 * (GREEDY.max_tokens - 2)


def test_paged_backend_decodes_the_same_tokens():
    """The backend CUDA captures (FlexAttention over the block table, eager here) against the
    dynamic decode: the same greedy tokens, logits to fp32 rounding."""
    m = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    prompts = _prompts(m.config.vocab_size)[:3]
    want, want_ids = _record(_engine(m, static=False), prompts)
    e = _engine(m, static=True)
    assert e.runner.decoder is not None
    e.runner.decoder.paged = True
    e.runner.k_cache.zero_()  # the eager kernel reads the whole pool (weighted 0): no stale NaN
    e.runner.v_cache.zero_()
    got, got_ids = _record(e, prompts)
    assert got_ids == want_ids
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_bucketed_gather_decodes_the_same_tokens():
    """The gathering backend CUDA captures (contexts to a bucketed width, one masked SDPA call),
    run here under --fast-inexact where the CPU takes it too: the dynamic decode's tokens."""
    m = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    prompts = _prompts(m.config.vocab_size)
    want, want_ids = _record(_engine(m, static=False, exact=False), prompts)
    e = _engine(m, static=True, exact=False)
    assert e.runner.decoder is not None and not e.runner.decoder.exact
    got, got_ids = _record(e, prompts)
    assert got_ids == want_ids
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("exact", [True, False])
def test_a_nan_in_a_slot_no_decode_owns_never_reaches_their_logits(static: bool, exact: bool):
    """Whatever slots other requests (or the sink) own hold, even NaN, must not reach a decoding
    request's logits: padding reads the runner's zero slot, or is masked and zeroed. Both decode paths, exact and not (the
    latter is the path CUDA takes)."""
    from kvtier.engine.runner.model_runner import RunItem

    m = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(3, m.config.vocab_size, (n,), generator=g).tolist() for n in (40, 9)]
    tables = [[4, 5, 6], [8]]  # block 0, the sink and everything else owned by no one
    e = _engine(m, static=static, exact=exact)
    try:
        r = e.runner
        for p, t in zip(ids, tables):
            r.execute([RunItem(p, 0, t, want_logits=True)])
        decode = [RunItem([7], len(p), t, want_logits=True) for p, t in zip(ids, tables)]

        def step() -> torch.Tensor:
            return r.execute(decode)

        clean = step()
        for cache in (r.k_cache, r.v_cache):  # every slot the two requests do not own
            owned = torch.zeros(cache.shape[1], dtype=torch.bool)
            for t in tables:
                for b in t:
                    owned[b * 16 : (b + 1) * 16] = True
            owned[r.zero_slot] = True  # the runner's own: zeros, written by no one (what padding reads)
            cache[:, ~owned] = float("nan")
        poisoned = step()
        # The zero slot is no block's, not the sink block's (padding rows write there), and still zeros.
        assert r.zero_slot >= r.sink + 16 and not (r.k_cache[:, r.zero_slot].any() or r.v_cache[:, r.zero_slot].any())
    finally:
        e.close()
    assert torch.isfinite(clean).all() and torch.equal(clean, poisoned)


def test_a_ragged_batch_goes_packed_where_the_runner_can_pack():
    """Padding every decode to the longest context wins (2-7.5x per byte on an H200) until it reads
    RAGGED times the contexts' slots; then, where varlen_attn is usable, the batch is packed."""
    from kvtier.engine.runner.backends.varlen import RAGGED, pack_decodes
    from kvtier.engine.runner.model_runner import RunItem

    assert not pack_decodes(False, 10**9, 1)  # nothing to pack with
    assert not pack_decodes(True, RAGGED * 100, 100) and pack_decodes(True, RAGGED * 100 + 1, 100)
    m = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
    e = _engine(m, static=True, exact=False)
    try:
        sd = e.runner.decoder
        assert sd is not None
        even = [RunItem([5], 700, list(range(50)), True), RunItem([5], 650, list(range(50, 100)), True)]
        ragged = [RunItem([5], 900, list(range(60)), True)] + [RunItem([5], 10, [60 + i], True) for i in range(7)]
        assert sd.accepts(even) and sd.accepts(ragged)  # this CPU cannot pack: the static step takes both
        e.runner.attention.can_pack = True
        assert sd.accepts(even) and not sd.accepts(ragged)  # 8 x 1024 padded rows for 977 of context
    finally:
        e.close()


def test_buckets():
    assert widths(4096) == (256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    assert widths(1000) == (256, 384, 512, 768, 1000)
    assert buckets(64) == (1, 2, 4, 8, 16, 24, 32, 48, 64)
    assert buckets(5) == (1, 2, 4, 5)
    assert buckets(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100)


def test_budgets_per_device():
    cfg = load_model("tiny-gqa", dtype="fp32", tokenizer=False).config
    cpu = budget.choose(EngineConfig(), cfg, torch.float32, torch.device("cpu"), 4096)
    assert (cpu.max_batched_tokens, cpu.kv_cache_bytes, cpu.static_decode, cpu.staging_bytes) == (2048, 4 << 30, False, 0)
    gib = 1 << 30
    mem = budget.DeviceMemory(total=80 * gib, free=70 * gib)  # 10 GiB of weights loaded
    gpu = budget.choose(EngineConfig(), cfg, torch.bfloat16, torch.device("cuda"), 4096, memory=mem)
    act = budget.step_activation_bytes(cfg, 2, 16384, 64)
    # Two ring slots of a whole 4096-token context: groups of max(4, layers / 8) layers, K and V.
    staging = 2 * max(4, -(-cfg.num_layers // 8)) * 2 * cfg.kv_dim * 2 * 4096
    assert gpu.max_batched_tokens == 16384 and gpu.static_decode and gpu.staging_bytes == staging
    assert gpu.kv_cache_bytes == int(0.9 * 80 * gib) - 10 * gib - act - staging - budget.GPU_SLACK_BYTES
    half = budget.choose(EngineConfig(memory_utilization=0.5), cfg, torch.bfloat16, torch.device("cuda"), 4096,
                         memory=mem)
    assert half.kv_cache_bytes == 40 * gib - 10 * gib - act - staging - budget.GPU_SLACK_BYTES
    # What the config sets wins, on either device.
    fixed = budget.choose(EngineConfig(kv_cache_bytes=gib, max_batched_tokens=512, static_decode=False), cfg,
                          torch.bfloat16, torch.device("cuda"), 4096, memory=mem)
    assert (fixed.kv_cache_bytes, fixed.max_batched_tokens, fixed.static_decode) == (gib, 512, False)
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        budget.choose(EngineConfig(memory_utilization=0.1), cfg, torch.bfloat16, torch.device("cuda"), 4096, memory=mem)
    with pytest.raises(ValueError, match="memory_utilization"):
        EngineConfig(memory_utilization=1.5)
    with pytest.raises(ValueError, match="CUDA graphs"):
        m = load_model("tiny-gqa", dtype="fp32", tokenizer=False)
        e = _engine(m, static=True)
        try:
            StaticDecode(e.runner, 4, 1024, graphs=True)
        finally:
            e.close()
