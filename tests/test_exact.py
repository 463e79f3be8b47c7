"""Lossless means bit-identical, in every compute dtype: a token's logits do not depend on how its
prompt was cut into prefill chunks, on what came from the device prefix cache or a store tier, on
the restore method, or on the other requests of its batch. The oracle is the same engine computing
the prompt afresh in one piece; every comparison is `torch.equal` on the first token's logits and
the identical 32-token greedy continuation. bf16 runs here whether or not this CPU has native bf16
(emulated: slower, still deterministic), with each exact attention kernel: bf16-gemm (oneDNN's
GEMMs, `exact_matmul`, where this CPU's GEMMs pass its check) and bf16-flash (the fused flash kernel)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.models import exact_matmul
from kvtier.models.kernels import Kernels
from kvtier.models.loading import LoadedModel, cpu_has_bf16, load_model
from kvtier.models.presets import PRESETS

GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, first_logits=True)
FEW = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, first_logits=True)
DTYPES = ["bf16-gemm", "bf16-flash", "fp16", "fp32"]
LOSSLESS = ["kv", "hidden", "bubblefree", "cake", "recompute"]

_models: dict[tuple[str, str], LoadedModel] = {}


def model(name: str, dtype: str, monkeypatch: pytest.MonkeyPatch | None = None) -> LoadedModel:
    """`dtype` may name bf16's attention kernel (bf16-gemm, bf16-flash): set for this test only."""
    dtype, _, kernel = dtype.partition("-")
    if (name, dtype) not in _models:
        if name == "smollm2-shape-2":  # two of smollm2-shape's 30 layers: the same kernel calls a layer
            monkeypatch.setitem(PRESETS, name, dataclasses.replace(PRESETS["smollm2-shape"], num_layers=2))
        _models[name, dtype] = load_model(name, dtype=dtype, tokenizer=False)
    m = _models[name, dtype]
    m.module.set_kernels(Kernels(bf16_attention=kernel or "auto"))  # what `engine` builds its engines with
    if kernel:
        c = m.config
        if kernel == "gemm" and not exact_matmul.active(m.dtype, c.num_heads, c.num_kv_heads, c.head_dim, kernel):
            pytest.skip("this CPU's bf16 GEMMs are not row-invariant: exact attention uses the flash kernel")
    return m


def ids_of(m: LoadedModel, n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(m: LoadedModel, chunk: int = 4096, prefix_cache: bool = True, store: str | None = None,
           method: str = "auto", **reuse) -> Engine:
    cfg = EngineConfig(kv_cache_bytes=256 << 20, max_model_len=4096, max_batched_tokens=chunk,
                       bf16_attention=m.module.kernels.bf16_attention,
                       enable_prefix_cache=prefix_cache)
    return Engine(m, cfg, store=store, reuse=ReuseConfig(method=method, chunk_tokens=64, **reuse) if store else None)


def run(e: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[RequestOutput]:
    try:
        return e.generate(prompts, params)
    finally:
        e.close()


def same(a: RequestOutput, b: RequestOutput) -> bool:
    assert a.first_logits is not None and b.first_logits is not None
    return torch.equal(a.first_logits, b.first_logits) and a.output_ids == b.output_ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [100, 1000, 3000])
def test_chunking_and_prefix_cache_do_not_change_a_bit(dtype: str, n: int, monkeypatch):
    m = model("tiny-gqa", dtype, monkeypatch)
    ids = ids_of(m, n, seed=n)
    fresh = run(engine(m, prefix_cache=False), [ids])[0]
    # Prefill chunk sizes that cut the prompt differently, inside 16-token blocks and across the
    # attention's 512-key blocks and 64-key pieces (37-token chunks up to 1000 tokens: at 3000 they
    # are 81 steps, and 100 and 700 already cut there inside blocks).
    for chunk in (37, 100, 512, 700) if n <= 1000 else (100, 512, 700):
        assert same(run(engine(m, chunk=chunk, prefix_cache=False), [ids])[0], fresh), chunk
    # A device prefix-cache hit: the prompt's first part was computed by an earlier request (in
    # other chunks), the rest now.
    e = engine(m, chunk=300)
    try:
        e.generate([ids[: n * 2 // 3]], SamplingParams(max_tokens=1, temperature=0.0))
        hit = e.generate([ids], GREEDY)[0]
    finally:
        e.close()
    assert hit.prompt_tokens_reused > 0 and same(hit, fresh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_batch_does_not_change_a_request(dtype: str, monkeypatch):
    m = model("tiny-gqa", dtype, monkeypatch)
    ids = ids_of(m, 300, seed=1)
    alone = run(engine(m, prefix_cache=False), [ids])[0]
    others = [ids_of(m, 20 + 97 * i, seed=10 + i) for i in range(7)]
    batched = run(engine(m, chunk=1024, prefix_cache=False), others[:3] + [ids] + others[3:])
    assert same(batched[3], alone)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_chat_turn_reuses_decoded_tokens_exactly(dtype: str, monkeypatch):
    """The next turn's prompt holds the previous answer, whose K/V decoding computed one token
    at a time: reusing them gives what a fresh prefill of the whole conversation gives."""
    m = model("tiny-gqa", dtype, monkeypatch)
    first = ids_of(m, 500, seed=2)
    e = engine(m, chunk=256)
    try:
        answer = e.generate([first], GREEDY)[0].output_ids
        turn = first + answer + ids_of(m, 40, seed=3)
        hit = e.generate([turn], GREEDY)[0]
    finally:
        e.close()
    assert hit.prompt_tokens_reused >= 512
    assert same(hit, run(engine(m, prefix_cache=False), [turn])[0])


@pytest.mark.parametrize("dtype", ["bf16-gemm", "bf16-flash", "fp32"])
@pytest.mark.parametrize("tier", ["memory", "disk", pytest.param("redis", marks=pytest.mark.redis)])
def test_every_lossless_restore_is_bit_exact(dtype: str, tier: str, tmp_path, request, monkeypatch):
    """Each exact method brings a 1,000-token history back from the tier (disk: by a new engine
    after the first one closed, as after a restart) and answers as a fresh prefill does."""
    m = model("tiny-gqa", dtype, monkeypatch)
    ids = ids_of(m, 1040, seed=4)
    fresh = run(engine(m, prefix_cache=False), [ids])[0]
    for method in LOSSLESS:
        layout = ("hidden",) * m.config.num_layers if method in ("hidden", "bubblefree") else None
        spec = {"memory": "memory:1GB", "disk": f"disk:{tmp_path}/{method}:1GB"}.get(tier) \
            or request.getfixturevalue("redis_url") + f"-{method}"
        saver = engine(m, chunk=300, prefix_cache=False, store=spec, method=method, layout=layout)
        try:
            saver.generate([ids[:1000]], SamplingParams(max_tokens=1, temperature=0.0))
            assert saver.flush(30)
            if tier == "memory":  # the same engine (no device prefix cache): the memory tier restores
                out = saver.generate([ids], GREEDY)[0]
        finally:
            saver.close()
        if tier != "memory":
            out = run(engine(m, prefix_cache=False, store=spec, method=method, layout=layout), [ids])[0]
        if method != "recompute":
            assert out.prompt_tokens_reused >= 960 and out.restore_method == method, (method, out.restore_method)
        assert same(out, fresh), method


@pytest.mark.skipif(not cpu_has_bf16(), reason="bf16 is emulated on this CPU (no avx512_bf16 / AMX), ~7x slower "
                    "than fp32: checking SmolLM2's linear shapes alone took 70 of CI's 1200 s; the tiny models' bf16 "
                    "exactness tests run here, and `auto` never picks bf16 on such a CPU")
def test_smollm2_shape_bf16_3000_tokens():
    """The real model's shapes (random weights): 30 layers, GQA 9/3, head_dim 64, in bf16."""
    m = model("smollm2-shape", "bf16")
    ids = ids_of(m, 3000, seed=5)
    e = engine(m, chunk=4096)
    try:
        fresh = e.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, first_logits=True))[0]
    finally:
        e.close()
    e = engine(m, chunk=700)
    try:
        e.generate([ids[:1234]], SamplingParams(max_tokens=1, temperature=0.0))
        hit = e.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, first_logits=True))[0]
    finally:
        e.close()
    assert hit.prompt_tokens_reused == 1232 and same(hit, fresh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_shapes_in_steps_of_4096_700_64_and_after_a_hit(dtype: str, monkeypatch):
    """SmolLM2's layer shapes (its linears; GQA 9/3, head_dim 64) in two layers (every kernel call a
    layer makes, at a fifteenth of 30 layers' cost) over a 4,000-token prompt: prefilled in one
    step, in steps of 700 and of 64, and after a 1,232-token prefix-cache hit (the rest in steps of
    700), the first token's logits and 8 greedy tokens are the same bits."""
    if not dtype.startswith("fp32") and not cpu_has_bf16():
        pytest.skip(f"{dtype.split('-')[0]} is emulated on this CPU (it has no AVX-512 bf16 or AMX): SmolLM2's linears "
                    "take a minute and a half a kernel here; tests/test_exact_attention.py checks these attention "
                    "shapes in it, and fp32 runs")
    m = model("smollm2-shape-2", dtype, monkeypatch)
    ids = ids_of(m, 4000, seed=8)
    few = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, first_logits=True)
    fresh = run(engine(m, chunk=4096, prefix_cache=False), [ids], few)[0]
    for chunk in (700, 64):
        assert same(run(engine(m, chunk=chunk, prefix_cache=False), [ids], few)[0], fresh), chunk
    e = engine(m, chunk=700)
    try:
        e.generate([ids[:1234]], SamplingParams(max_tokens=1, temperature=0.0))
        hit = e.generate([ids], few)[0]
    finally:
        e.close()
    assert hit.prompt_tokens_reused == 1232 and same(hit, fresh)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_what_lies_past_a_context_changes_no_bit(dtype: str):
    """Exact attention reads a context as whole 64-key pieces, zero past its end. Whatever the pool
    holds past it (here NaN in every slot no request wrote, which a 0 weight would not cancel) stays
    out, whether the context is read in place or gathered (a prefix-cache hit's blocks)."""
    m = model("tiny-gqa", dtype)
    ids = ids_of(m, 700, seed=6)
    fresh = run(engine(m, prefix_cache=False), [ids])[0]
    e = engine(m, chunk=300)
    try:
        for cache in (e.runner.k_cache, e.runner.v_cache):
            cache.fill_(float("nan"))
        e.generate([ids[:333]], SamplingParams(max_tokens=1, temperature=0.0))
        e.generate([ids_of(m, 40, seed=7)], SamplingParams(max_tokens=1, temperature=0.0))  # takes the next blocks
        hit = e.generate([ids], GREEDY)[0]
    finally:
        e.close()
    assert hit.prompt_tokens_reused == 320 and same(hit, fresh)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_repeated_prompt_restores_all_but_its_last_token(dtype: str, tier: str, tmp_path):
    """The same prompt asked again: the chunk holding its last token (a full chunk at 192 tokens,
    the partial tail at 150) is read whole and restored up to that token, which alone is computed,
    by every exact method; the answer is a fresh prefill's, bit for bit."""
    m = model("tiny-gqa", dtype)
    for n in (192, 150):
        ids = ids_of(m, n, seed=n)
        fresh = run(engine(m, prefix_cache=False), [ids], FEW)[0]
        for method in ("kv", "hidden", "bubblefree", "cake"):
            layout = ("hidden",) * m.config.num_layers if method in ("hidden", "bubblefree") else None
            spec = "memory:1GB" if tier == "memory" else f"disk:{tmp_path}/{n}-{method}:1GB"
            saver = engine(m, chunk=100, prefix_cache=False, store=spec, method=method, layout=layout)
            try:
                saver.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
                assert saver.flush(30)
                if tier == "memory":
                    out = saver.generate([ids], FEW)[0]
            finally:
                saver.close()
            if tier != "memory":
                out = run(engine(m, prefix_cache=False, store=spec, method=method, layout=layout), [ids], FEW)[0]
            assert out.prompt_tokens_reused == n - 1 and out.restore_method == method, \
                (n, method, out.prompt_tokens_reused, out.restore_method)
            assert same(out, fresh), (n, method)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_a_prompt_parting_inside_a_stored_chunk_reuses_its_matching_part(dtype: str, tier: str, tmp_path):
    """A prompt that follows a stored context for 170 tokens, then parts from it inside the chunk
    [128, 192): that chunk is reused up to the last 16-token step that matches (160), by every exact
    method; the save that follows builds its own chunk on that part, and the prompt asked again
    reuses all of it but its last token (it ends on a 16-token step of its stored tail). Every answer is a fresh prefill's, bit for bit."""
    m = model("tiny-gqa", dtype)
    ids = ids_of(m, 192, seed=3)
    q = ids[:170] + ids_of(m, 38, seed=4)  # 208: its stored tail [192, 211) holds 3 answer tokens too
    fresh = run(engine(m, prefix_cache=False), [q], FEW)[0]
    for method in ("kv", "hidden", "bubblefree", "cake"):
        layout = ("hidden",) * m.config.num_layers if method in ("hidden", "bubblefree") else None
        spec = "memory:1GB" if tier == "memory" else f"disk:{tmp_path}/{method}:1GB"
        outs = []
        e = engine(m, chunk=100, prefix_cache=False, store=spec, method=method, layout=layout)
        try:
            e.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))
            for _ in range(2):
                assert e.flush(30)
                if tier == "disk":  # each time from the disk alone, as after a restart
                    e.close()
                    e = engine(m, chunk=100, prefix_cache=False, store=spec, method=method, layout=layout)
                outs.append(e.generate([q], FEW)[0])
        finally:
            e.close()
        assert [o.prompt_tokens_reused for o in outs] == [160, len(q) - 1], (method, outs)
        assert all(o.restore_method == method and same(o, fresh) for o in outs), method


def test_each_model_keeps_its_own_kernels(monkeypatch):
    """Kernels are a model's state, not the process's: an engine on a plain-kernel model
    (--fast-inexact) built beside an exact one leaves the exact one exact (its linears' row-invariant
    calls, its attention, its store namespace), and chunking still leaves its bits alone."""
    from kvtier.engine.runner.backends.cpu_exact import CpuExact
    from kvtier.models import invariant

    exact_m = load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    plain_m = load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    ids = ids_of(exact_m, 700)
    calls: list[int] = []
    row_invariant = invariant._call
    monkeypatch.setattr(invariant, "_call", lambda x, *a: calls.append(x.shape[0]) or row_invariant(x, *a))
    fresh = engine(exact_m, prefix_cache=False)
    plain = Engine(plain_m, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=4096, exact=False),
                   store="memory:64MB", reuse=ReuseConfig(chunk_tokens=64))
    chunked = engine(exact_m, chunk=300, prefix_cache=False, store="memory:64MB")
    try:
        assert exact_m.module.kernels.exact and not plain_m.module.kernels.exact
        assert isinstance(chunked.runner.attention, CpuExact) and not isinstance(plain.runner.attention, CpuExact)
        stores = [e.link.store for e in (chunked, plain)]
        assert stores[0] is not None and stores[1] is not None
        assert "+inexact" not in stores[0].namespace.model_fingerprint
        assert "+inexact" in stores[1].namespace.model_fingerprint
        plain.generate([ids], FEW)
        assert not calls  # the plain model's linears: one F.linear each
        want = run(fresh, [ids], FEW)[0]
        assert calls  # the exact model's: row-invariant calls, after the plain engine was built
        assert same(run(chunked, [ids], FEW)[0], want)
    finally:
        plain.close()
        chunked.close()
