"""The periodic one-line stats log: its exact text for known snapshots, and silence when idle.
(tests/serve/test_dashboard.py checks the lines a served run logs.)"""

from __future__ import annotations

import pytest

from kvtier.serve.config import ServeConfig
from kvtier.serve.stats_log import StatsSnapshot, format_line

TIERS = ("device", "memory", "disk", "redis")


def _snap(time: float, prompt: int, generated: int, reused: dict[str, int], computed: int, running: int = 0,
          waiting: int = 0, kv: float = 0.0) -> StatsSnapshot:
    return StatsSnapshot(time=time, prompt_tokens=prompt, generation_tokens=generated, running=running,
                         waiting=waiting, kv_usage=kv, reused_by_tier=reused, computed=computed, tiers=TIERS)


def test_line_for_a_busy_interval() -> None:
    prev = _snap(100.0, 1000, 200, {"device": 100, "memory": 50}, 850)
    # 10 s later: 5123 prompt tokens (2000 from the device cache, 500 from memory, 250 from disk,
    # 2250 computed, plus 123 of requests still running), 401 generated tokens.
    cur = _snap(110.0, 6123, 601, {"device": 2100, "memory": 550, "disk": 250}, 3100, running=2, kv=0.0314)
    assert format_line(prev, cur) == (
        "Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 40.1 tokens/s, Running: 2 reqs, "
        "Waiting: 0 reqs, KV cache usage: 3.1%, Reuse: device 40% / memory 10% / disk 5% / redis 0% / computed 45%"
    )


def test_line_without_finished_requests_or_store() -> None:
    prev = StatsSnapshot(0.0, 0, 0, 1, 3, 0.5, {}, 0)
    cur = StatsSnapshot(2.0, 0, 0, 1, 3, 0.5, {}, 0)
    assert format_line(prev, cur) == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 1 reqs, "
        "Waiting: 3 reqs, KV cache usage: 50.0%, Reuse: -"
    )
    done = StatsSnapshot(4.0, 30, 8, 0, 0, 0.0, {"device": 16}, 14)
    assert format_line(cur, done) == (
        "Avg prompt throughput: 15.0 tokens/s, Avg generation throughput: 4.0 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, KV cache usage: 0.0%, Reuse: device 53% / computed 47%"
    )


def test_idle_interval_logs_nothing() -> None:
    prev = _snap(0.0, 500, 50, {"memory": 10}, 490)
    assert format_line(prev, _snap(10.0, 500, 50, {"memory": 10}, 490, kv=0.2)) is None


def test_interval_option() -> None:
    assert ServeConfig().stats_interval_s == 10.0
    assert ServeConfig(stats_interval_s=0).stats_interval_s == 0  # off
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="stats_interval_s"):
            ServeConfig(stats_interval_s=bad)
