"""Attention of scattered query rows (`kvtier/models/attention.attention_at`, the blended restore's
recompute): each row attends to the keys at or before its own position and to none after, with
grouped K/V heads. The oracle is the same attention in float64 with an explicit causal mask, each
row alone; bf16 is held to the rounding of its scores and probabilities."""

from __future__ import annotations

import pytest
import torch

from kvtier.models import exact_matmul
from kvtier.models.attention import ScatteredRows, attention_at, scattered_gemm
from kvtier.models.kernels import Kernels

CPU = torch.device("cpu")
GEMM = Kernels(bf16_attention="gemm")  # GEMMs wherever this CPU's pass their check (bf16 only)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Each row alone in float64: softmax(q . k[:p + 1]) v[:p + 1]. -> [m, heads, hd]."""
    g = q.shape[1] // k.shape[1]
    kd, vd = (x.double().repeat_interleave(g, dim=1) for x in (k, v))  # [ctx, heads, hd]
    out = []
    for row, p in zip(q.double(), positions):
        w = torch.einsum("hd,khd->hk", row, kd[: p + 1]) / q.shape[-1] ** 0.5  # [heads, p + 1]
        out.append(torch.einsum("hk,khd->hd", w.softmax(-1), vd[: p + 1]))
    return torch.stack(out)


@pytest.mark.parametrize("kernels", [None, GEMM], ids=["flash", "gemm"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.06)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_scattered_rows_attend_to_their_own_keys_only(dtype, tol, heads, kv_heads, kernels):
    torch.manual_seed(0)
    ctx, hd = 700, 64
    k, v = (torch.randn(ctx, kv_heads, hd).to(dtype) for _ in range(2))
    # the first key, runs at document starts, a lone row, and the last key (pieces of rows cut across them)
    positions = [0, 1, 2, *range(90, 98), 301, *range(480, 505), ctx - 1]
    q = torch.randn(len(positions), heads, hd).to(dtype)
    out = attention_at(q, k, v, positions, kernels=kernels)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double() - _reference(q, k, v, positions)).abs().max().item()
    assert err < tol, err
    # A key after a row's position changes nothing of that row (only the last row sees the last key).
    k2, v2 = k.clone(), v.clone()
    k2[-1], v2[-1] = 100.0, 100.0
    again = attention_at(q, k2, v2, positions, kernels=kernels)
    assert torch.equal(again[:-1], out[:-1]) and not torch.equal(again[-1], out[-1])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 0.06)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
def test_the_grouped_form_cuda_takes_attends_as_the_reference(dtype, tol, heads, kv_heads):
    """CUDA's form (each K/V head's query heads as a batch entry over K and V expanded), run here
    on the CPU: each row sees its own keys only."""
    torch.manual_seed(0)
    ctx, hd = 700, 64
    k, v = (torch.randn(ctx, kv_heads, hd).to(dtype) for _ in range(2))
    positions = [0, 1, 2, *range(90, 98), 301, *range(480, 505), ctx - 1]
    q = torch.randn(len(positions), heads, hd).to(dtype)
    out = ScatteredRows.of(positions, dtype, CPU, rows=16)._grouped(q, k, v)
    assert out.dtype == dtype and out.shape == q.shape
    err = (out.double() - _reference(q, k, v, positions)).abs().max().item()
    assert err < tol, err


def test_the_rows_per_piece_change_no_row_beyond_rounding():
    """The pieces bound each call's keys; the output is the attention however rows are grouped."""
    torch.manual_seed(1)
    k, v = (torch.randn(400, 3, 64) for _ in range(2))
    positions = sorted(torch.randperm(400)[:50].tolist())
    q = torch.randn(50, 9, 64)
    outs = []
    for rows in (1, 16, 64):
        outs.append(attention_at(q, k, v, positions, rows=rows))
    assert torch.allclose(outs[0], outs[1], atol=1e-5) and torch.allclose(outs[0], outs[2], atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_built_once_give_the_bits_of_a_boolean_mask_per_call(dtype, monkeypatch):
    """A pass builds each piece's additive mask once for every layer: the same bits as SDPA called
    with the boolean causal mask of the piece, as it would be per layer."""
    import torch.nn.functional as F

    torch.manual_seed(2)
    ctx = 900
    positions = [*range(5, 13), *range(300, 340), 611, *range(870, 900)]
    k, v = (torch.randn(ctx, 3, 64).to(dtype) for _ in range(2))
    q = torch.randn(len(positions), 9, 64).to(dtype)
    rows = ScatteredRows.of(positions, dtype, q.device, rows=32)
    assert [(a, e) for a, e, _ in rows.pieces] == [(0, 32), (32, 64), (64, len(positions))]
    at = torch.tensor(positions)
    expected = []
    for a, e, n in rows.pieces:
        mask = torch.arange(n)[None, :] <= at[a:e, None]  # [rows, keys]: a key at or before the row's position
        expected.append(F.scaled_dot_product_attention(
            q[a:e].transpose(0, 1)[None], k[:n].transpose(0, 1)[None], v[:n].transpose(0, 1)[None],
            attn_mask=mask, enable_gqa=True)[0].transpose(0, 1))
    for _ in range(2):  # the masks are reused, not consumed
        assert torch.equal(rows.attend(q, k, v), torch.cat(expected))
    # Past the cache's bound each call builds its masks: the same bits.
    monkeypatch.setattr("kvtier.models.attention.MASK_CACHE_BYTES", 1024)
    uncached = ScatteredRows.of(positions, dtype, q.device, rows=32)
    assert uncached.masks is None and rows.masks is not None
    assert torch.equal(uncached.attend(q, k, v), torch.cat(expected))


def test_the_kernel_is_gemms_only_in_bf16_on_a_cpu_whose_gemms_pass_their_check():
    usable = exact_matmul.usable(9, 3, 64)
    assert scattered_gemm(CPU, torch.bfloat16, 9, 3, 64, GEMM) is usable
    assert not scattered_gemm(CPU, torch.float32, 9, 3, 64, GEMM)
    assert not scattered_gemm(CPU, torch.bfloat16, 9, 3, 64, None)  # no model kernels: SDPA's
    assert not scattered_gemm(CPU, torch.bfloat16, 9, 3, 64, Kernels(bf16_attention="flash"))
    assert not scattered_gemm(torch.device("cuda"), torch.bfloat16, 9, 3, 64, GEMM)


def _gemm_here(kernels: Kernels) -> None:
    if not scattered_gemm(CPU, torch.bfloat16, 9, 3, 64, kernels):
        pytest.skip(f"bf16 attention here is the flash kernel: {exact_matmul.why(torch.bfloat16, 9, 3, 64, kernels.bf16_attention)}")


@pytest.mark.parametrize("rows", [32, 64])
def test_gemm_rows_are_hf_eager_attention_but_for_a_probabilitys_rounding(rows):
    """Where the model's default kernels pick GEMMs, each piece of rows is HF transformers' eager
    attention of those rows over the piece's keys with the causal mask. HF rounds an fp32 softmax
    to bf16 where the kernel takes torch's bf16 softmax (as the engine's exact GEMM attention
    does), which can round a probability the other way: an element may then be one bf16 ulp off,
    and few are."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    _gemm_here(Kernels())

    class Module(torch.nn.Module):  # what eager_attention_forward reads of its attention module
        num_key_value_groups, training = 3, False

    torch.manual_seed(1)
    ctx, hd = 2300, 64
    k, v = (torch.randn(ctx, 3, hd).to(torch.bfloat16) for _ in range(2))
    positions = sorted(torch.randperm(ctx)[:150].tolist())
    q = torch.randn(len(positions), 9, hd).to(torch.bfloat16)
    pieces = ScatteredRows.of(positions, torch.bfloat16, CPU, rows, Kernels())
    out = pieces.attend(q, k, v).float()
    differ = 0
    for i, (a, e, n) in enumerate(pieces.pieces):
        want, _ = eager_attention_forward(Module(), q[a:e].transpose(0, 1)[None], k[:n].transpose(0, 1)[None],
                                          v[:n].transpose(0, 1)[None], pieces.mask(i)[None, None], scaling=hd**-0.5)
        want = want[0].float()  # [rows, heads, hd]
        off = (out[a:e] - want).abs()
        assert bool((off <= want.abs() * 2**-7).all()), i  # within one bf16 ulp
        differ += int((off > 0).sum())
    assert differ <= out.numel() // 1000, differ


def test_gemm_bits_depend_on_the_rows_and_keys_alone(monkeypatch):
    """The keys read in place from a wider pool (strided, other values past the last row) give the
    bits of the keys alone; masks kept or built per call, and a second call, the same."""
    _gemm_here(GEMM)
    torch.manual_seed(5)
    ctx = 900
    positions = [*range(5, 13), *range(300, 340), 611, *range(850, 880)]
    pool_k, pool_v = (torch.randn(ctx + 100, 2, 3, 64).to(torch.bfloat16) for _ in range(2))
    k, v = pool_k[:, 1], pool_v[:, 1]  # [ctx + 100, 3, 64], strided views
    q = torch.randn(len(positions), 9, 64).to(torch.bfloat16)
    rows = ScatteredRows.of(positions, torch.bfloat16, CPU, 32, GEMM)
    out = rows.attend(q, k[:ctx].contiguous(), v[:ctx].contiguous())
    assert torch.equal(rows.attend(q, k, v), out) and torch.equal(rows.attend(q, k, v), out)
    monkeypatch.setattr("kvtier.models.attention.MASK_CACHE_BYTES", 1024)
    uncached = ScatteredRows.of(positions, torch.bfloat16, CPU, 32, GEMM)
    assert uncached.masks is None and torch.equal(uncached.attend(q, k, v), out)


@pytest.mark.parametrize("amx", [True, False])
def test_a_piece_holds_256_rows_in_bf16_on_an_amx_cpu_else_64(amx, monkeypatch):
    """Where the fused kernel pays per query block and key block (bf16 on AMX), wider pieces."""
    monkeypatch.setattr("kvtier.models.attention.cpu_has_amx", lambda: amx)
    positions = list(range(40, 340))
    wide = ((0, 256, 296), (256, 300, 340))
    narrow = ((0, 64, 104), (64, 128, 168), (128, 192, 232), (192, 256, 296), (256, 300, 340))
    assert ScatteredRows.of(positions, torch.bfloat16, CPU).pieces == (wide if amx else narrow)
    assert ScatteredRows.of(positions, torch.float32, CPU).pieces == narrow
    assert ScatteredRows.of(positions, torch.bfloat16, CPU, rows=64).pieces == narrow
