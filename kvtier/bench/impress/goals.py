"""`kvtier bench impress`'s goals (accuracy and ttft modes) as data: `Goal` records judged by
`kvtier.bench.goals.evaluate`. Each is judged on one figure ({value, target}); a goal whose rows
were not measured is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtier.bench.goals import Goal, Item, evaluate, figure, one

KINDS = ("impress", "impress-g")


# ----- accuracy ---------------------------------------------------------------------------------
def variant(rows: Sequence[Item], name: str) -> Item | None:
    return next((r for r in rows if r["variant"] == name), None)


def _figure(value: float, target: float, met: bool) -> list[Item]:
    return [dict(met=met, value=value, target=target)]


def _drop(kind: str, ratio: float, limit: float):
    def select(rows: Sequence[Item]) -> list[Item]:
        full, r = variant(rows, "full"), variant(rows, f"{kind}@{ratio:g}")
        if full is None or r is None:
            return []
        drop = (full["accuracy"] - r["accuracy"]) * 100
        return _figure(drop, limit, drop <= limit)
    return select


def _at_quarter(kind: str, key: str, target: float):
    """A figure of the kind's ratio-0.25 row, at most target."""
    def select(rows: Sequence[Item]) -> list[Item]:
        r = variant(rows, f"{kind}@0.25")
        if variant(rows, "full") is None or r is None:
            return []
        return _figure(r[key], target, r[key] <= target)
    return select


def _versus(kind: str, ref: str, target: float, worse: bool):
    """Accuracy points of ref over the kind's ratio-0.25 row (worse: at most target) or of the kind
    over ref (at least target)."""
    def select(rows: Sequence[Item]) -> list[Item]:
        r, b = variant(rows, f"{kind}@0.25"), variant(rows, ref)
        if variant(rows, "full") is None or r is None or b is None:
            return []
        if worse:
            gap = (b["accuracy"] - r["accuracy"]) * 100
            return _figure(gap, target, gap <= target)
        gain = (r["accuracy"] - b["accuracy"]) * 100
        return _figure(gain, target, gain >= target)
    return select


def _accuracy_goals(kind: str) -> list[Goal]:
    h2o = "h2o-g@0.25" if kind.endswith("-g") else "h2o@0.25"
    return [
        *(figure(f"{kind}: needle accuracy drop vs full KV at ratio {ratio:g} <= {limit:g} points",
                 _drop(kind, ratio, limit)) for ratio, limit in ((0.5, 1.0), (0.25, 2.0))),
        figure(f"{kind}: KL(full || variant) at ratio 0.25 <= 0.05", _at_quarter(kind, "kl_mean", 0.05)),
        figure(f"{kind}: bytes read at ratio 0.25 <= 0.45x of full KV", _at_quarter(kind, "bytes_vs_full", 0.45)),
        figure(f"{kind}: identification <= 10% of the restore's time (memory tier)",
               _at_quarter(kind, "identify_share", 0.10)),
        figure(f"{kind}: within 1 point of H2O over all keys at ratio 0.25",
               _versus(kind, h2o, 1.0, worse=True)),
        *(figure(f"{kind}: >= 10 points above {ref}", _versus(kind, ref, 10.0, worse=False))
          for ref in ("random@0.25", "recent@0.25")),
    ]


ACCURACY_GOALS = tuple(g for kind in KINDS for g in _accuracy_goals(kind))


def accuracy_goals(rows: Sequence[Item]) -> list[Item]:
    """The issue's goals, for IMPRESS choosing tokens (the paper) and choosing whole granules."""
    return evaluate(ACCURACY_GOALS, rows)


# ----- TTFT -------------------------------------------------------------------------------------
def _wrong_picks(auto: str, kind: str, picks: Sequence[Item]):
    """Cells where auto restored by importance although an exact method measured faster."""
    def select(rows: Sequence[Item]) -> list[Item]:
        wrong = 0
        for r in picks:
            cell = {x["method"]: x["ttft_s"] for x in rows if x["bandwidth"] == r["bandwidth"]}
            best_exact = min(cell.get("kv", math.inf), cell.get("cake", math.inf))
            if r["restored_by"] == "impress" and cell.get(kind, math.inf) > best_exact:
                wrong += 1
        return one(dict(met=wrong == 0, value=wrong, target=0))
    return select


def _at_100(rows: Sequence[Item], name: str) -> float | None:
    return next((r["ttft_s"] for r in rows if r["bandwidth"] == "100" and r["method"] == name), None)


def _vs_exact(kind: str):
    def select(rows: Sequence[Item]) -> list[Item]:
        imp, exact = _at_100(rows, kind), [x for x in (_at_100(rows, "kv"), _at_100(rows, "cake")) if x]
        if not imp or not exact:
            return []
        v = imp / min(exact)
        return _figure(v, 0.6, v <= 0.6)
    return select


def _vs_h2o(kind: str, ratio: float):
    def select(rows: Sequence[Item]) -> list[Item]:
        a, b = _at_100(rows, f"read:h2o@{ratio:g}"), _at_100(rows, f"read:{kind}@{ratio:g}")
        return _figure(a / b, 1.3, a / b >= 1.3) if a and b else []
    return select


def ttft_goal_records(rows: Sequence[Item], ratio: float, tier: str = "disk") -> list[Goal]:
    """The ttft mode's goals (an auto goal names how many cells it judged, so they follow the rows)."""
    goals = []
    for auto, kind in (("auto-lossy", "impress"), ("auto-lossy-g", "impress-g")):
        picks = [r for r in rows if r["method"] == auto]
        if picks:
            goals.append(figure(f"{auto}: never restores by importance where {kind} measured slower than kv or cake "
                                f"(cells, of {len(picks)})", _wrong_picks(auto, kind, picks)))
    for kind in KINDS:
        goals += [figure(f"{tier} at 100 MB/s: {kind} TTFT <= 0.6x the best exact method (kv, cake)", _vs_exact(kind)),
                  figure(f"{tier} at 100 MB/s: {kind} >= 1.3x faster than H2O-style loading of all keys",
                         _vs_h2o(kind, ratio))]
    return goals


def ttft_goals(rows: Sequence[Item], ratio: float, tier: str = "disk") -> list[Item]:
    return evaluate(ttft_goal_records(rows, ratio, tier), rows)
