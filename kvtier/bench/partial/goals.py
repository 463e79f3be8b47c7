"""`kvtier bench partial`'s goals as data: `Goal` records judged by `kvtier.bench.goals.evaluate`.

Three throughput goals per (model, rate) measured, each judged on one figure (a ratio of tok/s),
and the cost model's held-out error when it was measured.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.bench.goals import Goal, Item, evaluate, figure, one


def _slo_tag(rows: Sequence[Item], model: str, rate: float) -> str:
    r = next(r for r in rows if r["model"] == model and r["rate"] == rate)
    return f"{r['slo_x']:g}x ({r['slo_s'] * 1e3:.0f} ms)"


def _goodput(row: Item) -> str:
    g = row.get("goodput_tok_s")
    return "-" if g is None else f"{g:.1f}"


def _policies(rows: Sequence[Item], model: str, rate: float) -> dict[str, Item]:
    return {r["policy"]: r for r in rows if r["model"] == model and r["rate"] == rate}


def _optimizer(model: str, rate: float):
    def select(rows: Sequence[Item]) -> list[Item]:
        by = _policies(rows, model, rate)
        if not {"recompute", "swap", "optimizer"} <= by.keys():
            return []
        base = max(by["recompute"]["tok_s"], by["swap"]["tok_s"])
        best = max((by[p] for p in by if p.startswith("optimizer")), key=lambda r: r["tok_s"])
        x = best["tok_s"] / base
        att = best["slo_attainment"] or 0.0
        return one(dict(met=x >= 1.3 and att >= 0.9, value=round(x, 3), target=1.3,
                        summary=f"{best['policy']} {best['tok_s']:.1f} tok/s = {x:.2f}x of "
                                f"{base:.1f}; SLO attainment {att:.0%}; goodput "
                                f"{_goodput(best)} vs {_goodput(by['recompute'])} (recompute), "
                                f"{_goodput(by['swap'])} (swap) tok/s"))
    return select


def _versus(model: str, rate: float, policy: str, ref: str):
    """policy's tok/s over ref's, >= 0.95 (5% noise)."""
    def select(rows: Sequence[Item]) -> list[Item]:
        by = _policies(rows, model, rate)
        if not {ref, policy} <= by.keys():
            return []
        x = by[policy]["tok_s"] / by[ref]["tok_s"]
        return one(dict(met=x >= 0.95, value=round(x, 3), target=0.95,
                        summary=f"{by[policy]['tok_s']:.1f} vs {by[ref]['tok_s']:.1f} tok/s"))
    return select


def _mape(mape: float | None):
    def select(rows: Sequence[Item]) -> list[Item]:
        return one(None if mape is None else dict(met=mape <= 0.15, value=round(mape, 4), target=0.15,
                                                   summary=f"{mape:.1%}"))
    return select


def goals_for(rows: Sequence[Item], mape: float | None) -> list[Goal]:
    """Every (model, rate) measured, in the order measured, then the cost model's error."""
    goals = []
    for model in dict.fromkeys(r["model"] for r in rows):
        for rate in dict.fromkeys(r["rate"] for r in rows if r["model"] == model):
            tag = f"{model} @ {rate:g} req/s, SLO {_slo_tag(rows, model, rate)}"
            goals += [figure(f"{tag}: optimizer throughput >= 1.3x the better of recompute and swap, >= 90% of "
                             f"requests within the SLO", _optimizer(model, rate)),
                      figure(f"{tag}: fronts from the unthrottled memory tier no more than 5% below swap",
                             _versus(model, rate, "optimizer+swap", "swap")),
                      figure(f"{tag}: ample memory: the optimizer (no SLO cap) no worse than full caching (5% noise)",
                             _versus(model, rate, "full+optimizer-noslo", "full"))]
    return goals + [figure("cost model error (MAPE) on held-out (b, u) points <= 15%", _mape(mape))]


def evaluate_goals(rows: Sequence[Item], mape: float | None) -> list[Item]:
    return evaluate(goals_for(rows, mape), rows)
