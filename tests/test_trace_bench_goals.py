"""The trace benchmark's look-ahead goals are judged from its rows: hit rate and latency."""
from kvtier.bench.trace.goals import evaluate_goals


def _row(config: str, p50: float, p99: float, memory: float) -> dict:
    return dict(workload="multiturn", config=config, turns="later", method="kv", pressure=True, device_cache=False,
                ttft_p50_s=p50, ttft_p99_s=p99, tokens_reused=1000, mismatched_turns=0, compared_turns=0,
                hit_rate=dict(memory=memory, disk=0.9 - memory, redis=0.0))


def _goals(lru: tuple[float, float], lookahead: tuple[float, float]) -> dict[str, dict]:
    rows = [_row("kv/memory+disk/pressure-lru", *lru, memory=0.1),
            _row("kv/memory+disk/pressure-lookahead", *lookahead, memory=0.6)]
    return {g["goal"]: g for g in evaluate_goals(rows)}


def test_lookahead_must_pay_in_latency_at_p50_and_p99():
    name = "multiturn: under memory pressure, later-turn TTFT p50 and p99 with look-ahead no worse than with LRU"
    better = _goals((1.0, 3.0), (0.9, 2.5))[name]
    assert better["met"] and better["value"] == 0.9
    tail_worse = _goals((1.0, 3.0), (0.9, 3.3))[name]  # a better median does not excuse a worse tail
    assert not tail_worse["met"] and abs(tail_worse["value"] - 1.1) < 1e-9
    hits = _goals((1.0, 3.0), (0.9, 2.5))["multiturn: under memory pressure, look-ahead raises the memory-tier hit "
                                         "rate by >= 20 points over LRU"]
    assert hits["met"] and abs(hits["value"] - 500 / 9) < 1e-9
