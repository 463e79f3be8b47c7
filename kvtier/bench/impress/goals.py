"""`kvtier bench impress`'s goals (accuracy and ttft modes) as data: `Goal` records judged by
`kvtier.bench.goals.evaluate`. Each is judged on one figure ({value, target}); a goal whose rows
were not measured is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtier.bench.goals import Goal, Item, evaluate, figure, one

KINDS = ("impress", "impress-g")  # the probes' majority vote, single tokens or whole granules, no pooling
TODAY = "impress"  # the earlier defaults: single tokens, the majority vote, no pooling


def kind_name(selection: str, granule: bool = False, window: int = 1) -> str:
    """impress, impress-g (whole granules), impress-g-w9 (scores pooled over 9 tokens): a row is kind@ratio."""
    return f"{selection}{'-g' if granule else ''}{f'-w{window}' if window > 1 else ''}"


def default_kind() -> str:
    """The kind of row the engine's defaults restore with (`ImpressConfig()`)."""
    from kvtier.engine.config import ImpressConfig
    from kvtier.engine.impress.policy import ImpressPolicy

    p = ImpressPolicy.of(ImpressConfig())
    return kind_name(p.selection.value + ("-sum" if p.vote == "sum" else ""), p.unit > 1, p.window)


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


def _versus(kind: str, ref: str, target: float, worse: bool, key: str = "accuracy", scale: float = 100.0):
    """`key` of ref over the kind's ratio-0.25 row (worse: at most target) or of the kind over ref
    (at least target); accuracy in points."""
    def select(rows: Sequence[Item]) -> list[Item]:
        r, b = variant(rows, f"{kind}@0.25"), variant(rows, ref)
        if variant(rows, "full") is None or r is None or b is None or r is b:
            return []
        if worse:
            gap = (b[key] - r[key]) * scale
            return _figure(gap, target, gap <= target)
        gain = (r[key] - b[key]) * scale
        return _figure(gain, target, gain >= target)
    return select


def _worst_slice(kind: str, ratio: float, limit: float):
    """The largest accuracy drop against full KV over the row's slices (haystacks), in points."""
    def select(rows: Sequence[Item]) -> list[Item]:
        full, r = variant(rows, "full"), variant(rows, f"{kind}@{ratio:g}")
        if full is None or r is None:
            return []
        drops = {s: (a["accuracy"] - r["by_slice"][s]["accuracy"]) * 100 for s, a in full["by_slice"].items()}
        worst = max(drops, key=drops.__getitem__)
        # Rounded: 3 of 60 items is 5 points, which a float difference of shares may put a hair above.
        return [dict(met=round(drops[worst], 6) <= limit, value=drops[worst], target=limit, slice=worst)]
    return select


def _kind_goals(task: str, kind: str) -> list[Goal]:
    """The importance restore's goals on the needle multiple choice (the first issue's)."""
    h2o = "h2o" + kind.removeprefix("impress-sum").removeprefix("impress") + "@0.25"  # the same unit and window
    return [
        *(figure(f"{task}: {kind}: accuracy drop vs full KV at ratio {ratio:g} <= {limit:g} points",
                 _drop(kind, ratio, limit)) for ratio, limit in ((0.5, 1.0), (0.25, 2.0))),
        figure(f"{task}: {kind}: KL(full || variant) at ratio 0.25 <= 0.05", _at_quarter(kind, "kl_mean", 0.05)),
        figure(f"{task}: {kind}: bytes read at ratio 0.25 <= 0.45x of full KV", _at_quarter(kind, "bytes_vs_full", 0.45)),
        figure(f"{task}: {kind}: identification <= 10% of the restore's time (memory tier)",
               _at_quarter(kind, "identify_share", 0.10)),
        figure(f"{task}: {kind}: within 1 point of H2O over all keys at ratio 0.25", _versus(kind, h2o, 1.0, worse=True)),
        *(figure(f"{task}: {kind}: >= 10 points above {ref}", _versus(kind, ref, 10.0, worse=False))
          for ref in ("random@0.25", "recent@0.25")),
    ]


def _default_goals(task: str, kind: str) -> list[Goal]:
    """The defaults' goals: within 5 points of full KV on free-form retrieval at 0.25, not worse than
    today's defaults on multiple choice, no higher summary perplexity, bytes within the ratio."""
    today = f"{TODAY}@0.25"
    goals = [figure(f"{task}: {kind} (default): bytes read at ratio 0.25 <= 0.45x of full KV",
                    _at_quarter(kind, "bytes_vs_full", 0.45))]
    if task == "haystacks":
        goals += [figure(f"{task}: {kind} (default): every slice within 5 points of full KV at ratio {r:g} "
                         "(the worst slice's drop)", _worst_slice(kind, r, 5.0)) for r in (0.25, 0.5)]
    elif task == "retrieval":
        goals += [figure(f"{task}: {kind} (default): accuracy drop vs full KV at ratio 0.25 <= 5 points",
                         _drop(kind, 0.25, 5.0)),
                  figure(f"{task}: {kind} (default): summary perplexity at 0.25 no higher than {today}'s (its minus ours)",
                         _versus(kind, today, 0.0, worse=False, key="perplexity", scale=-1.0))]
    else:
        goals.append(figure(f"{task}: {kind} (default): accuracy at 0.25 not below {today}'s (points below)",
                            _versus(kind, today, 0.0, worse=True)))
    return goals


def kinds() -> tuple[str, ...]:
    """Today's kinds of rows (single tokens, whole granules) and the defaults' where it differs."""
    return tuple(dict.fromkeys((*KINDS, default_kind())))


def accuracy_goal_records(task: str) -> list[Goal]:
    goals = [g for kind in kinds() for g in _kind_goals(task, kind)] if task == "choice" else []
    return goals + _default_goals(task, default_kind())


def accuracy_goals(rows: Sequence[Item]) -> list[Item]:
    """Each task's goals judged on its own rows."""
    out: list[Item] = []
    for task in dict.fromkeys(r.get("task", "choice") for r in rows):
        out += evaluate(accuracy_goal_records(task), [r for r in rows if r.get("task", "choice") == task])
    return out


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
    for auto, kind in (("auto-lossy", "impress"), ("auto-lossy-g", "impress-g"), (f"auto-lossy-{default_kind()}", default_kind())):
        picks = [r for r in rows if r["method"] == auto]
        if picks:
            goals.append(figure(f"{auto}: never restores by importance where {kind} measured slower than kv or cake "
                                f"(cells, of {len(picks)})", _wrong_picks(auto, kind, picks)))
    for kind in kinds():
        goals += [figure(f"{tier} at 100 MB/s: {kind} TTFT <= 0.6x the best exact method (kv, cake)", _vs_exact(kind)),
                  figure(f"{tier} at 100 MB/s: {kind} >= 1.3x faster than H2O-style loading of all keys",
                         _vs_h2o(kind, ratio))]
    return goals


def ttft_goals(rows: Sequence[Item], ratio: float, tier: str = "disk") -> list[Item]:
    return evaluate(ttft_goal_records(rows, ratio, tier), rows)
