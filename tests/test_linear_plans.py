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
    asked: list[invariant.RowPlan] = []
    plain = invariant._holds

    def counted(plan, *a):
        asked.append(plan)
        return plain(plan, *a)

    monkeypatch.setattr(invariant, "_holds", counted)
    return asked


def test_a_plan_checked_once_is_taken_from_the_file_by_the_next_process(tmp_path, monkeypatch, checks):
    w = torch.randn(256, 512)  # above the size checked at all
    plan = invariant._plan_for(w, None)
    assert checks and (tmp_path / "linear_plans.json").exists()
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
