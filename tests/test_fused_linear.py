"""`invariant.Fused`: linears over one input (q, k, v; gate, up) as one kernel call on the exact CPU
path. What must hold: each part's rows come out the same however many rows share the call; K and
V rebuilt without Q (HCache, `tail`) are bit for bit the columns the whole call gives them, whether
the tail runs as its own call or falls back to the whole; a changed weight is repacked; the plain
path (inexact, any other device) is the parts' own calls."""

from __future__ import annotations

import pytest
import torch

from kvtier.dtypes import cpu_has_bf16
from kvtier.models import invariant
from kvtier.models.invariant import Fused, Linear


def _parts(dtype: torch.dtype) -> tuple[Linear, Linear, Linear]:
    torch.manual_seed(0)
    parts = Linear(576, 576, bias=False), Linear(576, 192, bias=False), Linear(576, 192, bias=False)  # smollm2's q, k, v
    for p in parts:
        p.to(dtype)
    return parts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rows_and_tail_are_the_whole_calls_bits(dtype: torch.dtype):
    parts = _parts(dtype)
    fused = Fused(*parts)
    x = torch.randn(200, 576).to(dtype)
    whole = torch.cat(fused(x), dim=-1)  # [200, 960]
    plain = torch.cat([torch.nn.functional.linear(x, p.weight) for p in parts], dim=-1)
    torch.testing.assert_close(whole, plain, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    for a, b in ((0, 1), (3, 70), (100, 200)):  # rows: a decode, a chunk, the tail of a long prompt
        assert torch.equal(torch.cat(fused(x[a:b]), dim=-1), whole[a:b])
        k, v = fused.tail(x[a:b], 1)
        assert torch.equal(torch.cat([k, v], dim=-1), whole[a:b, 576:])


def test_a_tail_that_rounds_otherwise_falls_back_to_the_whole_call(monkeypatch):
    parts = _parts(torch.bfloat16)
    fused = Fused(*parts)
    x = torch.randn(40, 576).to(torch.bfloat16)
    whole = torch.cat(fused(x), dim=-1)
    fused._pack(1)  # the tail's own pack (and its row plan, checked here), built before counting calls
    monkeypatch.setattr(invariant._Packed, "agrees_with", lambda self, other, offset: False)
    calls = []
    plain_call = invariant._call
    monkeypatch.setattr(invariant, "_call", lambda x, w, p, b, plan: calls.append((w, p)) or plain_call(x, w, p, b, plan))
    k, v = fused.tail(x, 1)
    assert torch.equal(torch.cat([k, v], dim=-1), whole[:, 576:])
    pack = fused._packs[0][1]  # the whole weight's (packed for oneDNN only where this CPU packs bf16)
    assert len(calls) == 1 and calls[0][0] is pack.weight and calls[0][1] is pack.packed  # the whole call, once


def test_a_changed_weight_is_repacked():
    parts = _parts(torch.float32)
    fused = Fused(*parts)
    x = torch.randn(16, 576)
    before = fused(x)[1]
    with torch.no_grad():
        parts[1].weight.mul_(2)  # in place: same storage, a new version
    after = fused(x)[1]
    assert torch.equal(after, parts[1](x))
    assert not torch.equal(after, before)


def test_the_plain_path_is_the_parts_own_calls():
    parts = _parts(torch.float32)
    x = torch.randn(8, 576)
    for p in parts:
        p.exact = False  # a model whose kernels are plain (`CausalLM.set_kernels`)
    got = Fused(*parts)(x)
    assert all(torch.equal(g, torch.nn.functional.linear(x, p.weight)) for g, p in zip(got, parts))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_smollm2_linears_give_a_row_its_bits_in_any_call_at_one_and_two_threads(dtype, threads):
    """SmolLM2's linears (q/k/v and gate/up fused, o_proj, down_proj), as a prefill of 4,096 rows
    calls them: in one call, in calls of 700 and of 64, and a row alone (a decode) give a row the
    same bits, with one torch thread (the tests' workers) and with two (a server's); each thread
    count runs the plans checked for it."""
    if dtype != torch.float32 and not cpu_has_bf16():
        pytest.skip(f"{dtype} is emulated on this CPU (it has no AVX-512 bf16 or AMX): checking these shapes' row "
                    "plans takes over a minute here; fp32 (what `auto` picks here) runs")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(1)
        qkv = Fused(Linear(576, 576, bias=False), Linear(576, 192, bias=False), Linear(576, 192, bias=False))
        gate_up = Fused(Linear(576, 1536, bias=False), Linear(576, 1536, bias=False))
        o_proj, down = Linear(576, 576, bias=False), Linear(1536, 576, bias=False)
        for m in (*qkv.parts, *gate_up.parts, o_proj, down):
            m.to(dtype)
        for call, width in ((lambda x: torch.cat(qkv(x), -1), 576), (lambda x: torch.cat(gate_up(x), -1), 576),
                            (o_proj, 576), (down, 1536)):
            x = torch.randn(4096, width).to(dtype)
            whole = call(x)  # [4096, out]
            for size in (700, 64):
                assert torch.equal(torch.cat([call(x[a : a + size]) for a in range(0, 4096, size)]), whole), (width, size)
            for r in (0, 1, 699, 2049, 4095):
                assert torch.equal(call(x[r : r + 1]), whole[r : r + 1]), (width, r)
    finally:
        torch.set_num_threads(before)


def test_a_new_thread_count_takes_the_plans_checked_for_it(monkeypatch):
    """A plan holds for the thread count it was checked at: a Linear (and a Fused) called at one
    count and then at another asks for the other count's plan, and keeps it while the count stays."""
    asked = []
    plain = invariant._plan_for
    monkeypatch.setattr(invariant, "_plan_for", lambda w, b: asked.append(torch.get_num_threads()) or plain(w, b))
    torch.manual_seed(2)
    lin = Linear(64, 32, bias=False)
    fused = Fused(Linear(64, 32, bias=False), Linear(64, 16, bias=False))
    x = torch.randn(5, 64)
    before = torch.get_num_threads()
    try:
        for threads in (1, 1, 2, 2, 1):
            torch.set_num_threads(threads)
            lin(x)
            fused(x)
    finally:
        torch.set_num_threads(before)
    assert asked == [1, 1, 2, 2, 1, 1]  # each count's first call, for the Linear and the Fused
