"""`kvtier bench e2e`'s goals as data: `Goal` records judged by `kvtier.bench.goals.evaluate`.

The goals are a pure function of the rows, so `report` re-judges a saved JSON. Per dtype measured:
one goal per ratio goal below (met when every measured H meets the target; an H missing a peer is
listed as not measured; met=None when no H of this dtype has both sides; value = the worst ratio),
and an exactness goal (value = rows whose first tokens differ). A ratio is the median of the
per-context ratios where both peers timed the same contexts (`bench e2e` runs every peer on a
context before the next), so the VM's drift between contexts cancels. Each such ratio also gets a
90% interval for its median (`median_interval`, from 5 contexts on); a goal lists under
`unresolved` the H whose interval holds the target: there the run cannot say which side it is on.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.bench.e2e.peers import LONG_H
from kvtier.bench.goals import Empty, Goal, Item, evaluate
from kvtier.bench.stats import median_interval


def cells_of(rows: Sequence[Item]) -> dict[tuple[str, int], dict[str, Item]]:
    """(dtype, history) -> {peer: row}, in the order rows were measured."""
    cells: dict[tuple[str, int], dict[str, Item]] = {}
    for r in rows:
        cells.setdefault((r["dtype"], r["history"]), {})[r["peer"]] = r
    return cells


def ttft_of(cell: dict[str, Item], peer: str) -> float | None:
    t = (cell.get(peer) or {}).get("ttft_s")
    return None if t is None or t != t else t  # NaN (no sample) counts as not measured


def read_bound(cell: dict[str, Item]) -> float | None:
    """Bytes restored / raw cold disk bandwidth: no restore from disk can beat it."""
    d = cell.get("kvtier_disk_cold")
    if not d or not d.get("disk_read_bps") or d.get("bytes_restored") is None:
        return None
    return d["bytes_restored"] / d["disk_read_bps"]


# ratio column -> (numerator peer, denominator peer); disk/bound's denominator is max(floor, read_bound)
RATIOS: dict[str, tuple[str, str]] = {
    "mem/floor": ("kvtier_memory", "hf_floor"),
    "disk/floor": ("kvtier_disk_cold", "hf_floor"),
    "disk/cold_file": ("kvtier_disk_cold", "hf_load_cold_file"),
    "disk/bound": ("kvtier_disk_cold", "hf_floor"),
    "redis/hf_redis": ("kvtier_redis", "hf_load_redis"),
    "recompute/hf": ("kvtier_recompute", "hf_recompute"),
}


def _per_context(cell: dict[str, Item], peer: str) -> list[float]:
    return list((cell.get(peer) or {}).get("ttft_all_s") or [])


def paired(cell: dict[str, Item], name: str) -> list[float] | None:
    """The per-context ratios numerator / denominator, where both peers timed the same contexts
    (disk/bound's denominator raised to the read bound); None where they did not."""
    peer, den_peer = RATIOS[name]
    bound = read_bound(cell) if name == "disk/bound" else 0.0
    xs, ys = _per_context(cell, peer), _per_context(cell, den_peer)
    if bound is None or not xs or len(xs) != len(ys) or None in (ttft_of(cell, peer), ttft_of(cell, den_peer)):
        return None
    return [x / max(y, bound) for x, y in zip(xs, ys)]


def ratio(cell: dict[str, Item], name: str) -> float | None:
    """Numerator / denominator: the median of the per-context ratios where both peers timed the
    same contexts (one VM hour's drift cancels within a context), else the ratio of the medians."""
    peer, den_peer = RATIOS[name]
    num, den = ttft_of(cell, peer), ttft_of(cell, den_peer)
    bound = read_bound(cell) if name == "disk/bound" else 0.0
    if num is None or den is None or bound is None:
        return None
    rs = paired(cell, name)
    return statistics.median(rs) if rs is not None else num / max(den, bound)


def interval(cell: dict[str, Item], name: str) -> tuple[float, float] | None:
    """A 90% interval for the median per-context ratio (`median_interval`): on a noisy machine a
    goal whose interval holds its target is not resolved by the run, whichever side the median is."""
    rs = paired(cell, name)
    return None if rs is None else median_interval(rs)


@dataclass(frozen=True)
class RatioGoal:
    """One ratio goal, judged per dtype at every history length H it applies to."""

    text: str
    ratio: str  # a RATIOS key
    target: float
    applies: Callable[[int], bool] = lambda h: True


RATIO_GOALS = (
    RatioGoal("from the memory tier: TTFT <= 1.10 x hf_floor at every H", "mem/floor", 1.10),
    RatioGoal(f"from disk after a restart, cold, H >= {LONG_H}: TTFT <= 0.8 x hf_load_cold_file", "disk/cold_file",
              0.8, lambda h: h >= LONG_H),
    RatioGoal(f"from disk after a restart, cold, H >= {LONG_H}: TTFT <= 1.15 x max(hf_floor, bytes/disk_read_bps)",
              "disk/bound", 1.15, lambda h: h >= LONG_H),
    RatioGoal(f"from disk after a restart, cold, H < {LONG_H}: TTFT <= 1.0 x hf_load_cold_file", "disk/cold_file",
              1.0, lambda h: h < LONG_H),
    RatioGoal("from Redis: TTFT <= 0.9 x hf_load_redis", "redis/hf_redis", 0.9),
    RatioGoal("kvtier_recompute <= 1.0 x hf_recompute", "recompute/hf", 1.0),
    # The CPU stretch goals: at or under HF's floor, stricter than the ones above.
    RatioGoal("stretch, memory: TTFT <= 0.9 x hf_floor at every H", "mem/floor", 0.9),
    RatioGoal("stretch, cold disk after a restart: TTFT <= 1.0 x hf_floor at every H", "disk/floor", 1.0),
)


def _shown(r: float | None) -> str:
    return "not measured" if r is None else f"{r:.3f}"


def _ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f" (90% CI {ci[0]:.2f}-{ci[1]:.2f})"


def _ratio_goal(dtype: str, spec: RatioGoal) -> Goal:
    def select(rows: Sequence[Item]) -> list[Item]:  # one item per H: {h, r, ci} (r None: not measured)
        cells = cells_of(rows)
        return [dict(h=h, r=ratio(cells[(dtype, h)], spec.ratio), ci=interval(cells[(dtype, h)], spec.ratio))
                for h in sorted(h for d, h in cells if d == dtype) if spec.applies(h)]

    def fields(pts: list[Item]) -> dict[str, Any]:
        worst = max((p["r"] for p in pts if p["r"] is not None), default=None)
        unresolved = [p["h"] for p in pts if p["ci"] is not None and p["ci"][0] <= spec.target < p["ci"][1]]
        return dict(dtype=dtype, ratio=spec.ratio, target=spec.target, value=None if worst is None else round(worst, 4),
                    unresolved=unresolved,
                    detail=", ".join(f"H={p['h']}: {_shown(p['r'])}{_ci(p['ci'])}" for p in pts)
                    or "no such history length measured")

    return Goal(f"{dtype}: {spec.text}", select, lambda p: None if p["r"] is None else bool(p["r"] <= spec.target),
                fields, Empty.UNJUDGED)


def _exactness_goal(dtype: str) -> Goal:
    def fields(judged: list[Item]) -> dict[str, Any]:
        bad = [f"{r['peer']}@H={r['history']}" for r in judged if r["first_token_match"] is False]
        return dict(dtype=dtype, ratio=None, target=0, value=len(bad),
                    detail=", ".join(bad) or f"{len(judged)} rows match")

    return Goal(f"{dtype}: exactness: first token equals the recompute's (kvtier vs kvtier_recompute, "
                "HF vs hf_recompute)",
                lambda rows: [r for r in rows if r["dtype"] == dtype and r.get("first_token_match") is not None],
                lambda r: r["first_token_match"] is not False, fields, Empty.UNJUDGED)


def goals_for(rows: Sequence[Item]) -> list[Goal]:
    """The goals of every dtype the rows measured, in the order measured."""
    return [g for dtype in dict.fromkeys(r["dtype"] for r in rows)
            for g in (*(_ratio_goal(dtype, spec) for spec in RATIO_GOALS), _exactness_goal(dtype))]


def evaluate_goals(rows: Sequence[Item]) -> list[Item]:
    return evaluate(goals_for(rows), rows)
