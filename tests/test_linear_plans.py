"""Row plans (`models/invariant.py`) are checked once per machine and build, then kept under
KVTIER_HOME: a later process takes the plan from the file instead of checking again; another thread
count, another machine or a value that is not one of the candidates is checked afresh."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.models import invariant


@pytest.fixture
def checks(tmp_path, monkeypatch):
    """A fresh home and an empty in-process cache; returns the list of plans `_holds` was asked about."""
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    monkeypatch.setattr(invariant, "_plans", {})
    monkeypatch.setattr(invariant, "_pending", {})
    asked: list[invariant.RowPlan] = []
    plain = invariant._holds

    def counted(plan, *a):
        asked.append(plan)
        return plain(plan, *a)

    monkeypatch.setattr(invariant, "_holds", counted)
    return asked


def _refine_all() -> None:
    for _ in invariant.refine():
        pass


def test_a_plan_checked_once_is_taken_from_the_file_by_the_next_process(tmp_path, monkeypatch, checks):
    w = torch.randn(256, 512)  # above the size checked at all
    invariant._plan_for(w, None)
    assert checks and invariant.has_pending()
    _refine_all()  # the larger calls' checks: then the plan is kept
    plan = invariant._plan_for(w, None)
    assert not invariant.has_pending() and (tmp_path / "linear_plans.json").exists()
    checks.clear()
    monkeypatch.setattr(invariant, "_plans", {})  # a new process
    assert invariant._plan_for(w, None) == plan
    assert checks == []
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # another thread count: other kernels, checked again
        invariant._plan_for(w, None)
    finally:
        torch.set_num_threads(threads)
    assert checks


def test_another_machine_or_a_foreign_value_is_checked_afresh(tmp_path, monkeypatch, checks):
    w = torch.randn(256, 512)
    invariant._plan_for(w, None)
    _refine_all()
    path = tmp_path / "linear_plans.json"
    doc = json.loads(path.read_text())
    (machine, entries), = doc.items()
    for forged in ([4096, 1, 1], "512", None):  # not a candidate plan: never trusted
        path.write_text(json.dumps({machine: {k: forged for k in entries}}))
        checks.clear()
        monkeypatch.setattr(invariant, "_plans", {})
        invariant._plan_for(w, None)
        assert checks, forged
    checks.clear()
    monkeypatch.setattr(invariant, "_plans", {})
    monkeypatch.setattr(invariant, "_machine", lambda: "another cpu")
    invariant._plan_for(w, None)
    assert checks
    path.write_text("{not json")
    monkeypatch.setattr(invariant, "_plans", {})
    checks.clear()
    invariant._plan_for(w, None)  # a torn or foreign file: checked, and the file rewritten whole
    _refine_all()
    assert checks and "another cpu" in json.loads(path.read_text())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_calls_go_unpadded_only_where_the_check_holds(tmp_path, monkeypatch, checks, dtype):
    """A decode of one sequence is a one-row call. It runs unpadded where every row count was
    checked to give a full call's bits (then its row equals that row of a prefill's call), and
    padded where unpadded rows were refused: the padded plan is tried next."""
    w = torch.randn(256, 512).to(dtype)
    plan = invariant._plan_for(w, None)
    assert checks[0].min_rows == 1  # the unpadded plans come first
    lin = invariant.Linear(512, 256, bias=False, dtype=dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(plan.chunk, 512).to(dtype)
    full = lin(x)
    for m in (1, 3, 7, 8, 9):
        assert torch.equal(lin(x[:m]), full[:m]), m
    monkeypatch.setattr(invariant, "_plans", {})  # another machine, whose kernels give short rows other bits
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "another"))
    check = invariant._holds

    def no_unpadded(p, *a):
        return p.min_rows > 1 and check(p, *a)

    monkeypatch.setattr(invariant, "_holds", no_unpadded)
    assert invariant._plan_for(w, None).min_rows == 8


def test_a_quick_plan_first_then_larger_calls_adopted_in_place_with_the_same_bits(tmp_path, monkeypatch, checks):
    """A weight's first call checks calls of up to QUICK rows only (the full check of 512-row calls
    costs 16x more); `refine` checks the larger calls a row count per slice and adopts a larger
    plan with the same padding and pack, which gives every row the bits it had: a Linear's output
    is the same before and after, for every row count tried, and its calls then take more rows."""
    torch.manual_seed(0)
    lin = invariant.Linear(512, 128, bias=False)  # the smallest weight that is checked at all
    x = torch.randn(700, 512)
    before = {m: lin(x[:m]) for m in (1, 7, 128, 129, 300, 700)}
    quick = invariant._plans[next(iter(invariant._plans))]
    assert quick.chunk == invariant.QUICK and checks == [p for p in invariant.CANDIDATES if p.chunk == invariant.QUICK][
        :len(checks)]
    slices = sum(1 for _ in invariant.refine())
    assert slices >= 512  # a slice per row count: an idle engine is never held for a whole check
    final = invariant._plans[next(iter(invariant._plans))]
    assert (final.chunk, final.min_rows, final.pack_hint) == (512, quick.min_rows, quick.pack_hint)
    for m, y in before.items():
        assert torch.equal(lin(x[:m]), y), m
    assert lin._plan == final  # the larger plan is in use
    doc = json.loads((tmp_path / "linear_plans.json").read_text())
    assert [list(v) for v in next(iter(doc.values())).values()] == [[512, quick.min_rows, quick.pack_hint]]


def test_larger_calls_that_do_not_hold_keep_the_quick_plan(tmp_path, monkeypatch, checks):
    monkeypatch.setattr(invariant, "_check", _failing_above(invariant._check, invariant.QUICK))
    w = torch.randn(128, 512)
    quick = invariant._plan_for(w, None)
    _refine_all()
    assert invariant._plan_for(w, None) == quick and not invariant.has_pending()
    monkeypatch.setattr(invariant, "_plans", {})  # the next process takes it from the file, unchecked
    checks.clear()
    assert invariant._plan_for(w, None) == quick and checks == [] and not invariant.has_pending()


def _failing_above(check, rows):
    def failing(plan, *a):
        if plan.chunk <= rows:
            return (yield from check(plan, *a))
        yield
        return False
    return failing


def test_a_short_call_that_rounds_otherwise_on_few_rows_is_refused(monkeypatch):
    """A kernel that sums a short call's rows in another order shows it, once rounded, in few of
    the rows it computes (an fp16 row alone: 2 of 576 outputs). Each row count is checked on
    CHECK_ROWS rows or more, so a one-row call that is off on one input row in 16 is refused,
    where the one offset checked per count would have let it through."""
    w = torch.randn(96, 64)
    plan = invariant.RowPlan(chunk=64, min_rows=1)
    seen: list[int] = []

    def row_by_row(x, weight, packed, bias, p):  # row-invariant by construction
        return torch.cat([torch.nn.functional.linear(x[i : i + 1], weight) for i in range(x.shape[0])])

    def off_on_some_rows(x, weight, packed, bias, p):
        y = row_by_row(x, weight, packed, bias, p)
        if x.shape[0] == 1:
            seen.append(1)
            if len(seen) % 16 == 0:  # one one-row call in 16 rounds another way
                y = y.clone()
                y[0, 0] = torch.nextafter(y[0, 0], torch.tensor(float("inf")))
        return y

    monkeypatch.setattr(invariant, "_call", row_by_row)
    assert invariant._holds(plan, w, None, None)  # every row count holds
    monkeypatch.setattr(invariant, "_call", off_on_some_rows)
    assert not invariant._holds(plan, w, None, None)
    assert len(seen) == 16  # refused at the first call that differed
