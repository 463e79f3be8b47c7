"""Exact CPU attention at the kernel level (`kvtier/models/exact_attention.py`, and in bf16
`kvtier/models/exact_matmul.py`): a query's output bits depend on its position, its query and the
keys up to it, never on the call it ran in. The oracle is the same function over the whole prompt
in one call; every comparison is `torch.equal`. bf16 runs with each kernel (bf16-gemm where this
CPU's GEMMs pass `exact_matmul.usable`, and bf16-flash). The engine level (chunked prefill, cache
hits, restores, batches) is tests/test_exact.py."""

from __future__ import annotations

import functools
import logging
import sys

import pytest
import torch
import torch.nn.functional as F

from kvtier.dtypes import cpu_has_bf16
from kvtier.models import exact_attention as X
from kvtier.models import exact_matmul

DTYPES = ["fp32", "bf16-gemm", "bf16-flash", "fp16"]
CTX = 1200  # three key blocks: positions with no whole-block part, one, and two


MODE = "auto"  # the bf16 attention kernel (a model's `Kernels.bf16_attention`) this test's calls ask for


def kernel(spec: str, monkeypatch: pytest.MonkeyPatch, heads: int = 9, kv_heads: int = 3, hd: int = 64) -> torch.dtype:
    """The dtype `spec` names, with bf16's kernel set for this test's calls (bf16-gemm skipped where unusable)."""
    name, _, which = spec.partition("-")
    if which:
        monkeypatch.setattr(sys.modules[__name__], "MODE", "gemm" if which == "gemm" else "flash")
        if which == "gemm" and not exact_matmul.usable(heads, kv_heads, hd):
            pytest.skip("this CPU's bf16 GEMMs are not row-invariant: exact attention uses the flash kernel")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    return X.causal(q, k, v, start, MODE)


def inputs(dtype: torch.dtype, heads: int, kv_heads: int, hd: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(heads)
    q, k, v = (torch.randn(CTX, h, hd, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    return q, k, v


def decode_batch(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Each length's context gathered and zero-padded to the batch's width, as the runner does."""
    width = X.key_rows(max(lengths))
    kb = k.new_zeros(len(lengths), width, *k.shape[1:])
    vb = torch.zeros_like(kb)
    for r, n in enumerate(lengths):
        kb[r, :n], vb[r, :n] = k[:n], v[:n]
    return X.decode_padded(q[[n - 1 for n in lengths]], kb, vb, lengths, MODE)


def decode_in_place(q, k, v, lengths: list[int]) -> torch.Tensor:
    """Each token's whole key blocks read in place (views of k/v, as the runner reads the pool),
    its piece gathered with garbage (finite) past its position."""
    splits = [X.split(n) for n in lengths]
    reach = max(keys for _, keys in splits)
    junk = torch.Generator().manual_seed(7)
    pk, pv = (torch.randn(len(lengths), reach, *k.shape[1:], generator=junk).to(k.dtype) for _ in range(2))
    for r, (n, (base, _)) in enumerate(zip(lengths, splits)):
        pk[r, : n - base], pv[r, : n - base] = k[base:n], v[base:n]
    wholes = [(k[:base], v[:base]) if base else None for base, _ in splits]
    return X.decode(q[[n - 1 for n in lengths]], (pk, pv), wholes, lengths, MODE)


@pytest.mark.parametrize("spec", DTYPES)
@pytest.mark.parametrize("shape", [(9, 3, 64), (4, 2, 16)])
def test_a_querys_bits_do_not_depend_on_its_call(spec, shape, monkeypatch):
    q, k, v = inputs(kernel(spec, monkeypatch, *shape), *shape)
    whole = causal(q, k, v, 0)  # [CTX, heads, hd]
    for chunk in (37, 100, 512, 700):  # cut inside pieces, on them, across key blocks
        parts = [causal(q[a : a + chunk], k[: a + chunk], v[: a + chunk], a) for a in range(0, CTX, chunk)]
        assert torch.equal(torch.cat(parts), whole), chunk
    # One decoding token at a time (in place, and over a context padded past its end), at the
    # edges of pieces and key blocks.
    for p in (0, 5, 63, 64, 511, 512, 513, 1023, 1024, 1199):
        assert torch.equal(causal(q[p : p + 1], k[: p + 1], v[: p + 1], p), whole[p : p + 1]), p
        padded_k, padded_v = (F.pad(x[: p + 1], (0, 0, 0, 0, 0, 100)) for x in (k, v))
        assert torch.equal(causal(q[p : p + 1], padded_k, padded_v, p), whole[p : p + 1]), p
    # Batches of decodes: mixed key blocks (rows with no whole-block part beside rows with one or
    # two), shared and distinct piece lengths, and a batch of one.
    for lengths in ([1, 6, 64, 65, 512, 513, 514, 1024, 1025, 1200], [600, 1100], [1100, 1101], [700], [1025, 3],
                    [700] * 10 + [1100] * 3):  # tokens reading the same keys: the GEMM kernel's calls of 8, then 2
        for batch in (decode_batch, decode_in_place):
            out = batch(q, k, v, lengths)
            for r, n in enumerate(lengths):
                assert torch.equal(out[r], whole[n - 1]), (batch.__name__, lengths, n)


@pytest.mark.parametrize("spec", ["fp32", "bf16-gemm", "bf16-flash"])
def test_the_split_is_as_accurate_as_one_pass(spec, monkeypatch):
    """The flash kernel merging the whole-block part and the piece by their log-sum-exp (in fp32,
    rounded once), and the GEMMs' scores rounded to bf16 with their value blocks summed in block order, stay
    within the dtype's rounding of attention computed in fp64."""
    dtype = kernel(spec, monkeypatch)
    q, k, v = inputs(dtype, 9, 3, 64)
    want = F.scaled_dot_product_attention(*(x.double().transpose(0, 1)[None] for x in (q, k, v)),
                                          is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    err = (causal(q, k, v, 0).double() - want).abs()
    eps = torch.finfo(dtype).eps
    assert err.max() < 16 * eps and err.mean() < eps, (err.max(), err.mean())


def test_no_call_reads_more_than_a_piece_past_its_last_query(monkeypatch):
    """A continuation of 64 tokens after 1,024 reads 1,088 keys (whole blocks alone read 1,536):
    one unmasked call over the two whole blocks, one masked call over the 64-key piece."""
    calls = []
    kernel = X.FLASH_CPU

    def recording(q, k, v, *args, attn_mask=None):
        calls.append((k.shape[2], attn_mask is not None))
        return kernel(q, k, v, *args, attn_mask=attn_mask)

    monkeypatch.setattr(X, "FLASH_CPU", recording)
    q, k, v = inputs(torch.float32, 9, 3, 64)
    causal(q[1024:1088], k[:1088], v[:1088], 1024)
    assert sorted(calls) == [(64, True), (1024, False)]
    calls.clear()
    causal(q[1100:1101], k[:1101], v[:1101], 1100)  # one decode at 1100: its piece ends at 1152
    assert sorted(calls) == [(128, True), (1024, False)]


@pytest.mark.parametrize("spec", ["fp32", "bf16-gemm"])
def test_a_decode_batch_wider_than_its_longest_context_is_refused(spec, monkeypatch):
    q, k, v = inputs(kernel(spec, monkeypatch, 4, 2, 16), 4, 2, 16)
    with pytest.raises(ValueError, match="exact attention reads 128"):
        X.decode_padded(q[:1], k[None, :512], v[None, :512], [100], MODE)


@pytest.mark.parametrize("spec", ["fp32", "bf16-gemm"])
def test_a_decode_without_its_whole_blocks_is_refused(spec, monkeypatch):
    q, k, v = inputs(kernel(spec, monkeypatch, 4, 2, 16), 4, 2, 16)
    pieces = (k[None, 512:640], v[None, 512:640])
    with pytest.raises(ValueError, match="needs its 512 keys"):
        X.decode(q[:1], pieces, [None], [600], MODE)
    with pytest.raises(ValueError, match="needs its 512 keys"):
        X.decode(q[:1], pieces, [(k[:511], v[:511])], [600], MODE)
    with pytest.raises(ValueError, match="pieces of 127 keys; exact attention reads 128"):
        X.decode(q[:1], (k[None, 512:639], v[None, 512:639]), [(k[:512], v[:512])], [600], MODE)


def test_the_gemm_kernel_reads_one_row_of_scores_per_query(monkeypatch):
    """A continuation of 64 tokens after 1,024: one score product over all 1,088 keys (the piece's
    64 queries x 3 grouped heads as rows), then the values: the 64-key piece in one product, the
    two whole key blocks x 3 K/V heads in one batched product of 512 keys each (no product reduces
    over more)."""
    kernel("bf16-gemm", monkeypatch)
    calls = []
    matmul = torch.matmul

    def recording(a, b, **kw):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return matmul(a, b, **kw)

    monkeypatch.setattr(exact_matmul.torch, "matmul", recording)
    q, k, v = inputs(torch.bfloat16, 9, 3, 64)
    causal(q[1024:1088], k[:1088], v[:1088], 1024)
    assert calls == [((3, 192, 64), (3, 64, 1088)), ((1, 3, 192, 64), (1, 3, 64, 64)), ((6, 192, 512), (6, 512, 64))]


def test_gemm_attention_falls_back_to_the_flash_kernel_where_its_check_fails(monkeypatch):
    """Where the GEMMs would give a query different bits in a decode than in a prompt, `usable`
    says so and every bf16 call takes the flash kernel."""
    kernel("bf16-gemm", monkeypatch)
    q, k, v = inputs(torch.bfloat16, 4, 2, 16)
    # A cache of this test's own: the process's verdicts stay as they were after it.
    monkeypatch.setattr(exact_matmul, "_usable", functools.lru_cache(maxsize=16)(exact_matmul._usable.__wrapped__))
    real = exact_matmul.decode
    monkeypatch.setattr(exact_matmul, "decode", lambda *a, **kw: real(*a, **kw) + 1)  # a row-variant GEMM
    assert not exact_matmul.usable(4, 2, 16)
    assert not exact_matmul.active(torch.bfloat16, 4, 2, 16, "gemm")
    assert X.numerics_tag(torch.bfloat16, 4, 2, 16, "gemm") == ""
    got = X.causal(q, k, v, 0, "gemm")  # the GEMMs refused: the flash kernel answers
    assert torch.equal(got, X.causal(q, k, v, 0, "flash"))


@pytest.mark.parametrize("rows,depth,batch", [(36, 512, 2), (2, 512, 32), (128, 512, 24), (10, 64, 2), (2, 16, 14)])
def test_the_check_finds_a_gemm_that_rounds_one_call_shape_otherwise(rows, depth, batch, monkeypatch):
    """A GEMM that gives other bits at one call shape the kernel makes (a row count at a reduction
    length, a batch count): the first-use check finds it, whichever shape it is."""
    matmul = torch.matmul

    def skewed(a, b, **kw):
        out = matmul(a, b, **kw)
        if a.dim() == 3 and a.shape == (batch, rows, depth):
            out[0, 0, 0] = out[0, 0, 0] + 1
        return out

    shapes = exact_matmul.call_shapes(4, 2, 16)
    assert rows in shapes.rows and batch in shapes.batches and depth in (shapes.score_depth, *shapes.value_depths)
    assert exact_matmul._rows_invariant(shapes)
    monkeypatch.setattr(exact_matmul.torch, "matmul", skewed)
    assert not exact_matmul._rows_invariant(shapes)


def test_the_kernel_choice_is_validated_and_tags_stored_state(monkeypatch):
    from kvtier.models.kernels import Kernels

    with pytest.raises(ValueError, match="auto, gemm, flash"):
        Kernels(bf16_attention="fast")
    with pytest.raises(ValueError, match="auto, gemm, flash"):
        exact_matmul.active(torch.bfloat16, 9, 3, 64, "fast")
    for dtype in (torch.float32, torch.float16):  # the GEMM kernel is bf16's only
        assert not exact_matmul.active(dtype, 9, 3, 64, "gemm") and X.numerics_tag(dtype, 9, 3, 64, "gemm") == ""
    assert X.numerics_tag(torch.bfloat16, 9, 3, 64, "flash") == ""
    kernel("bf16-gemm", monkeypatch)
    assert X.numerics_tag(torch.bfloat16, 9, 3, 64, MODE) == "+bf16-gemm-attention-blocked"  # its state never meets the flash kernel's


REAL = (9, 3, 64)  # SmolLM2-135M's heads, KV heads and head_dim
LONG = 4096


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spec", DTYPES)
def test_a_long_context_at_real_shapes_is_exact_however_it_is_called(spec, threads, monkeypatch):
    """SmolLM2's geometry over 4,096 positions, whole blocks up to 3,584 keys (long reductions are
    where a GEMM library's blocking may follow the call's shape, and the earlier tests' contexts
    stop at 1,200): a query's bits are the same prefilled in one call, in chunks of 700 and of 64,
    after a 1,232-token cache hit (the rest in chunks of 700), and as a decode alone or batched
    (sixteen tokens, ten of them reading the same keys), its whole blocks in place or gathered. With one torch thread (the tests' workers) and two (a
    server's)."""
    if spec == "bf16-gemm" and not cpu_has_bf16():
        pytest.skip("bf16 is emulated on this CPU (no avx512_bf16 / amx_bf16), where `auto` never picks the GEMM kernel "
                    "and a 4,096-position pass is slow: its first-use check composes it over 2,600 positions here, "
                    "and the tests above run it over 1,200")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = kernel(spec, monkeypatch, *REAL)
        g = torch.Generator().manual_seed(5)
        q, k, v = (torch.randn(LONG, h, REAL[2], generator=g).to(dtype) for h in (REAL[0], REAL[1], REAL[1]))
        whole = causal(q, k, v, 0)

        def chunked(start: int, size: int) -> torch.Tensor:
            return torch.cat([causal(q[a : a + size], k[: a + size], v[: a + size], a) for a in range(start, LONG, size)])

        for start, size in ((0, 700), (0, 64), (1232, 700)):
            got = chunked(start, size)
            bad = (got != whole[start:]).flatten(1).any(1).nonzero().flatten()
            assert not len(bad), f"chunks of {size} from {start}: {len(bad)} positions differ, first {start + bad[0].item()}"
        lengths = [1, 513, 1232, 1233, 2049, 4096, *range(2950, 2960)]  # ten reading the same keys: two calls
        for batch in (decode_batch, decode_in_place):
            out = batch(q, k, v, lengths)
            lone = [batch(q, k, v, [n])[0] for n in lengths[::3]]
            for r, n in enumerate(lengths):
                assert torch.equal(out[r], whole[n - 1]), (batch.__name__, n)
            for o, n in zip(lone, lengths[::3]):
                assert torch.equal(o, whole[n - 1]), (batch.__name__, "alone", n)
    finally:
        torch.set_num_threads(before)


def test_the_start_says_which_kernel_runs_and_why(monkeypatch, caplog):
    """One line at the engine's start names the exact attention kernel and the reason for it."""
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.engine import Engine
    from kvtier.models.loading import load_model

    assert "flash kernel (float32" in exact_matmul.why(torch.float32, *REAL, "auto")
    assert exact_matmul.why(torch.bfloat16, *REAL, "flash") == "the flash kernel (--bf16-attention flash)"
    monkeypatch.setattr(exact_matmul, "cpu_has_bf16", lambda: False)
    assert "no native bf16" in exact_matmul.why(torch.bfloat16, *REAL, "auto")
    assert not exact_matmul.active(torch.bfloat16, *REAL, "auto")
    monkeypatch.setattr(exact_matmul, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(exact_matmul, "cpu_has_amx", lambda: True)  # auto on AMX: the flash kernel, unasked
    monkeypatch.setattr(exact_matmul, "usable", lambda *geometry: pytest.fail("auto checked the GEMMs on AMX"))
    assert "an AMX CPU" in exact_matmul.why(torch.bfloat16, *REAL, "auto")
    assert not exact_matmul.active(torch.bfloat16, *REAL, "auto")
    # gemm asked for: checked, and used where the check passes
    monkeypatch.setattr(exact_matmul, "usable", lambda *geometry: False)
    assert "did not pass the row-invariance check for 9 heads over 3, head_dim 64" in \
        exact_matmul.why(torch.bfloat16, *REAL, "gemm")
    monkeypatch.setattr(exact_matmul, "usable", lambda *geometry: True)
    assert exact_matmul.why(torch.bfloat16, *REAL, "gemm").startswith("bf16 GEMMs (--bf16-attention gemm; checked row-invariant")
    assert exact_matmul.active(torch.bfloat16, *REAL, "gemm")

    m = load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    with caplog.at_level(logging.INFO, logger="kvtier"):
        Engine(m, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=512, bf16_attention="flash")).close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("exact attention: ")]
    assert lines == ["exact attention: the flash kernel (--bf16-attention flash)"]
