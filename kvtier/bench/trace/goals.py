"""`kvtier bench trace`'s goals as data: `Goal` records judged by `kvtier.bench.goals.evaluate`.

Every goal is judged on one figure ({value, target, summary}) computed from the rows; a goal whose
rows were not measured is left out of the report.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.bench.goals import Goal, Item, evaluate, figure, one

WORKLOADS = ("multiturn", "longdoc")


def find_row(rows: Sequence[Item], workload: str, config: str, turns: str) -> Item | None:
    return next((r for r in rows if r["workload"] == workload and r["config"] == config and r["turns"] == turns), None)


# ----- 1. later-turn TTFT p50: reuse >= 5x lower than recompute (multiturn decides; longdoc reported) -----
def _unloaded(rows: Sequence[Item], wl: str) -> str:
    seq = [r for r in rows if r["workload"] == f"{wl}-sequential" and r["turns"] == "later"]
    sb = next((r for r in seq if r["method"] == "recompute"), None)
    sr = next((r for r in seq if r["method"] != "recompute"), None)
    return (f"; unloaded (sequential, batch 1): recompute {sb['ttft_p50_s'] * 1000:.0f} ms vs "
            f"{sr['config']} {sr['ttft_p50_s'] * 1000:.0f} ms ({sb['ttft_p50_s'] / sr['ttft_p50_s']:.1f}x)"
            if sb and sr else "")


def _speedup(wl: str):
    def select(rows: Sequence[Item]) -> list[Item]:
        base = find_row(rows, wl, "recompute", "later")
        reuse = [r for r in rows if r["workload"] == wl and r["turns"] == "later" and r["method"] in ("kv", "auto")
                 and not r["pressure"]]
        if base is None or not reuse:
            return []
        speed = {r["config"]: base["ttft_p50_s"] / r["ttft_p50_s"] for r in reuse if r["ttft_p50_s"]}
        store_only = [v for r in reuse for k, v in speed.items() if k == r["config"] and not r["device_cache"]]
        worst = min(store_only or speed.values())
        return one(dict(met=worst >= 5.0, value=worst, target=5.0,
                        summary=f"recompute p50 {base['ttft_p50_s'] * 1000:.0f} ms; " + ", ".join(
                            f"{k} {base['ttft_p50_s'] / speed[k] * 1000:.0f} ms ({v:.1f}x)" for k, v in speed.items())
                        + _unloaded(rows, wl)))
    return select


# ----- 2. look-ahead raises the memory-tier hit rate by >= 20 points over LRU under memory pressure -----
def _mem_rate(rs: Sequence[Item]) -> float:
    """The memory tier's share of store-served tokens, over all turns of the run."""
    mem = sum(r["hit_rate"]["memory"] * r["tokens_reused"] for r in rs)
    store = sum((r["hit_rate"]["memory"] + r["hit_rate"]["disk"] + r["hit_rate"]["redis"]) * r["tokens_reused"]
                for r in rs)
    return mem / store if store else 0.0


def _pressure_runs(rows: Sequence[Item], wl: str) -> tuple[list[Item], list[Item]]:
    return ([r for r in rows if r["workload"] == wl and r["config"].endswith("pressure-lru")],
            [r for r in rows if r["workload"] == wl and r["config"].endswith("pressure-lookahead")])


def _hit_gain(wl: str):
    def select(rows: Sequence[Item]) -> list[Item]:
        lru, la = _pressure_runs(rows, wl)
        if not lru or not la:
            return []
        a, b = _mem_rate(lru), _mem_rate(la)
        return one(dict(met=(b - a) * 100 >= 20, value=(b - a) * 100, target=20.0,
                        summary=f"memory tier served {a * 100:.1f}% of store-restored tokens with LRU, "
                                f"{b * 100:.1f}% with look-ahead ({(b - a) * 100:+.1f} points)"))
    return select


# ... and it pays in latency: later turns no slower than with LRU (prefetching shares the cores).
def _latency(wl: str):
    def select(rows: Sequence[Item]) -> list[Item]:
        lru, la = _pressure_runs(rows, wl)
        slow = find_row(rows, wl, "kv/memory+disk/pressure-lru", "later")
        fast = find_row(rows, wl, "kv/memory+disk/pressure-lookahead", "later")
        if not lru or not la or not slow or not fast:
            return []
        ratio = max(fast["ttft_p50_s"] / slow["ttft_p50_s"], fast["ttft_p99_s"] / slow["ttft_p99_s"])
        return one(dict(met=ratio <= 1.0, value=ratio, target=1.0,
                        summary=f"p50 {slow['ttft_p50_s'] * 1000:.0f} -> {fast['ttft_p50_s'] * 1000:.0f} ms, "
                                f"p99 {slow['ttft_p99_s'] * 1000:.0f} -> {fast['ttft_p99_s'] * 1000:.0f} ms "
                                f"(LRU -> look-ahead; worst ratio {ratio:.3f})"))
    return select


# ----- 3. greedy outputs identical with and without reuse ------------------------------------------
def _tally(rs: Sequence[Item]) -> tuple[int, int]:
    return sum(r["mismatched_turns"] for r in rs), sum(r["compared_turns"] for r in rs)


def _lossless(rows: Sequence[Item]) -> list[Item]:
    """The sequential check (identical prompts, batch 1) decides; the trace's own comparison is
    reported beside it (batch composition differs run to run)."""
    seq = [r for r in rows if r.get("sequential") and r["method"] in ("kv", "auto")]
    trace = [r for r in rows if not r.get("sequential") and r["method"] in ("kv", "auto")]
    control = [r for r in rows if not r.get("sequential") and r["method"] == "recompute" and r["storage"] != "none"]
    parts = []
    for dt in sorted({r["dtype"] for r in seq}):
        m, n = _tally([r for r in seq if r["dtype"] == dt])
        parts.append(f"sequential {dt}: {m} of {n} turns differ")
    if trace:
        m, n = _tally(trace)
        parts.append(f"trace (batched, timing-dependent): {m} of {n} same-prompt reuse turns differ")
    if control:
        m, n = _tally(control)
        parts.append(f"trace control (store, restore method recompute, i.e. no reuse): {m} of {n} differ")
    decide = seq or trace
    if not decide or not _tally(decide)[1]:
        return []
    m, n = _tally(decide)
    return one(dict(met=m == 0, value=m, target=0, summary="; ".join(parts)))


# ----- 4. decoding does not slow down: mean TBT with saving on within 5% of saving off -------------
def _mean_tbt(rs: Sequence[Item]) -> float:  # request-weighted over both turn groups
    n = sum(r["requests"] for r in rs)
    return sum(r["tbt_mean_s"] * r["requests"] for r in rs) / n


def _tbt(wl: str):
    def select(rows: Sequence[Item]) -> list[Item]:
        on = [r for r in rows if r["workload"] == wl and r["config"].endswith("save-on") and r["tbt_mean_s"]]
        off = [r for r in rows if r["workload"] == wl and r["config"].endswith("save-off") and r["tbt_mean_s"]]
        if not on or not off:
            return []
        a, b = _mean_tbt(off), _mean_tbt(on)
        return one(dict(met=b <= a * 1.05, value=b / a, target=1.05,
                        summary=f"saving off {a * 1000:.1f} ms, on {b * 1000:.1f} ms (ratio {b / a:.3f})"))
    return select


GOALS: tuple[Goal, ...] = (
    *(figure(f"{wl}: later-turn TTFT p50 with reuse >= 5x lower than recompute (every store configuration, "
             f"device prefix cache off)", _speedup(wl)) for wl in WORKLOADS),
    *(g for wl in WORKLOADS for g in (
        figure(f"{wl}: under memory pressure, look-ahead raises the memory-tier hit rate by >= 20 points over LRU",
               _hit_gain(wl)),
        figure(f"{wl}: under memory pressure, later-turn TTFT p50 and p99 with look-ahead no worse than with LRU",
               _latency(wl)))),
    figure("greedy outputs identical with and without reuse (lossless configuration)", _lossless),
    *(figure(f"{wl}: mean TBT with saving on within 5% of saving off", _tbt(wl)) for wl in WORKLOADS),
)


def evaluate_goals(rows: Sequence[Item]) -> list[Item]:
    return evaluate(GOALS, rows)
