"""`kvtier bench impress` goal verdicts from hand-made rows (what the JSON's `goals` report)."""
from __future__ import annotations

from kvtier.bench.impress.goals import ttft_goals


def _row(bw: str, method: str, ttft: float, by: str | None = None) -> dict:
    return dict(bandwidth=bw, method=method, ttft_s=ttft, restored_by=by)


def test_auto_is_faulted_only_where_it_restored_by_importance_and_that_measured_slower():
    rows = [
        _row("none", "kv", 0.6, "kv"), _row("none", "cake", 1.6, "cake"), _row("none", "impress-g", 1.2, "impress"),
        _row("none", "auto-lossy-g", 0.6, "kv"),  # chose exact where exact was faster: fine
        _row("100", "kv", 2.4, "kv"), _row("100", "cake", 2.7, "cake"), _row("100", "impress-g", 1.7, "impress"),
        _row("100", "auto-lossy-g", 1.8, "impress"),  # chose importance where it was faster: fine
        _row("20", "kv", 10.0, "kv"), _row("20", "cake", 4.0, "cake"), _row("20", "impress-g", 5.0, "impress"),
        _row("20", "auto-lossy-g", 5.1, "impress"),  # chose importance although cake was faster: a fault
    ]
    goals = {g["goal"].split(":")[0]: g for g in ttft_goals(rows, 0.25)}
    auto = goals["auto-lossy-g"]
    assert (auto["value"], auto["met"]) == (1, False)
    at100 = [g for g in ttft_goals(rows, 0.25) if g["goal"].startswith("disk at 100 MB/s: impress-g TTFT")]
    assert at100[0]["value"] == 1.7 / 2.4 and not at100[0]["met"]  # 0.71x of kv, goal 0.6x
