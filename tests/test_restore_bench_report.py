"""The restore benchmark's bookkeeping: merging runs and judging the goals, on synthetic rows."""

from __future__ import annotations

from kvtier.bench.restore.goals import evaluate_goals
from kvtier.bench.restore.run import merge_runs


def _row(method: str, ttft: float, model: str = "mha-1b", bw: str = "100MB/s (emulated)", ideal: float | None = None,
         ctx: int = 4096, tier: str = "disk", bpt: int = 0) -> dict:
    return dict(model=model, dtype="bf16", storage="", context_tokens=ctx, tier=tier, bandwidth=bw, method=method,
                ttft_s=ttft, ideal_s=ideal, stored_bytes_per_token=bpt, max_logit_diff=0.0, greedy_match=True)


def _goal(goals: list[dict], prefix: str) -> dict:
    return next(g for g in goals if g["goal"].startswith(prefix))


def test_later_runs_replace_rows_of_the_same_cell_and_method():
    a = {"rows": [_row("kv", 10.0), _row("hidden", 6.0)], "meta": {"profiles": {"m/bf16": {"x": 1}}}}
    b = {"rows": [_row("kv", 9.0), _row("auto", 5.0)], "meta": {"profiles": {"m/bf16": {"x": 2}}}}
    rows, meta = merge_runs([a, b], ["a.json", "b.json"])
    got = {r["method"]: (r["ttft_s"], r["source"]) for r in rows}
    assert got == {"kv": (9.0, "b.json"), "hidden": (6.0, "a.json"), "auto": (5.0, "b.json")}
    assert set(meta["profiles"]) == {"m/bf16 (a.json)", "m/bf16 (b.json)"}


def test_goals_are_judged_from_the_rows():
    rows = [_row("recompute", 13.0), _row("kv", 10.0, bpt=200), _row("hidden", 6.0, bpt=100),
            _row("bubblefree", 5.0, ideal=4.5), _row("cake", 6.5, ideal=5.0), _row("auto", 5.5)]
    goals = evaluate_goals(rows)
    auto = _goal(goals, "auto within 15%")
    assert auto["met"] is True and auto["cells"][0]["best"] == "bubblefree" and auto["cells"][0]["ratio"] == 1.1
    assert _goal(goals, "bubblefree within")["met"] is True  # 5.0 / 4.5 = 1.11
    cake = _goal(goals, "cake within")
    assert cake["met"] is False and "0/1 of the emulated-bandwidth cells" in cake["summary"]  # 1.3
    mixed = _goal(goals, "mha-1b, 4096 tokens, 100 MB/s")
    assert mixed["met"] is True and mixed["cells"][0]["speedup"] == 2.0  # kv 10 / bubblefree 5
    assert _goal(goals, "mha-1b: hidden-state storage")["met"] is True  # 100 / 200
    assert _goal(goals, "smollm2, 4096")["met"] is False  # no such cell: "not measured"
