"""A one-line summary of the server's activity every few seconds, as vLLM logs every 10 s:

    Avg prompt throughput: 512.3 tokens/s, Avg generation throughput: 40.1 tokens/s, Running: 2 reqs,
    Waiting: 0 reqs, KV cache usage: 3.1%, Reuse: device 40% / memory 10% / disk 5% / redis 0% / computed 45%

Throughputs are the interval's prompt tokens (counted at each request's first token) and generated
tokens over its length; the reuse shares are where the prompt tokens of the requests that finished
in the interval came from. Nothing is logged for an idle interval (no tokens, nothing running or
waiting). It reads the plain totals ServerMetrics keeps and the engine's snapshot (`Engine.stats`)
on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.engine.engine import Engine
from kvtier.serve.metrics import ServerMetrics, tier_rank

log = logging.getLogger("kvtier.stats")


@dataclass(frozen=True)
class StatsSnapshot:
    time: float  # monotonic seconds
    prompt_tokens: int
    generation_tokens: int
    running: int
    waiting: int
    kv_usage: float  # 0 to 1
    reused_by_tier: Mapping[str, int]
    computed: int
    tiers: tuple[str, ...] = ("device",)  # always listed in the reuse split, even at 0%


def snapshot(metrics: ServerMetrics, engine: Engine, now: float | None = None) -> StatsSnapshot:
    t, st = metrics.totals, engine.stats(with_store=False)
    return StatsSnapshot(
        time=time.monotonic() if now is None else now, prompt_tokens=t.prompt_tokens,
        generation_tokens=t.generation_tokens, running=st.running, waiting=st.waiting, kv_usage=st.kv_usage,
        reused_by_tier=dict(t.reused_by_tier), computed=t.prompt_tokens_computed, tiers=("device", *st.tiers),
    )


def format_line(prev: StatsSnapshot, cur: StatsSnapshot) -> str | None:
    """The line for the interval from `prev` to `cur`; None when nothing happened in it."""
    prompt = cur.prompt_tokens - prev.prompt_tokens
    generated = cur.generation_tokens - prev.generation_tokens
    if not (prompt or generated or cur.running or cur.waiting):
        return None
    span = max(cur.time - prev.time, 1e-9)
    reused = {tier: n - prev.reused_by_tier.get(tier, 0) for tier, n in cur.reused_by_tier.items()}
    computed = cur.computed - prev.computed
    total = sum(reused.values()) + computed
    if total > 0:
        tiers = sorted(set(cur.tiers) | {t for t, n in reused.items() if n}, key=tier_rank)
        parts = [f"{tier} {100 * reused.get(tier, 0) / total:.0f}%" for tier in tiers]
        reuse = " / ".join([*parts, f"computed {100 * computed / total:.0f}%"])
    else:
        reuse = "-"  # no request finished in the interval
    return (f"Avg prompt throughput: {prompt / span:.1f} tokens/s, "
            f"Avg generation throughput: {generated / span:.1f} tokens/s, "
            f"Running: {cur.running} reqs, Waiting: {cur.waiting} reqs, "
            f"KV cache usage: {100 * cur.kv_usage:.1f}%, Reuse: {reuse}")


async def run_stats_log(metrics: ServerMetrics, engine: Engine, interval_s: float) -> None:
    """Log a line every `interval_s` seconds while something happens; runs until cancelled."""
    prev = snapshot(metrics, engine)
    while True:
        await asyncio.sleep(interval_s)
        try:
            cur = snapshot(metrics, engine)
            line = format_line(prev, cur)
        except Exception:  # a broken summary must not end the server's logging for good
            log.warning("could not summarise the server's stats", exc_info=True)
            continue
        if line is not None:
            log.info(line)
        prev = cur
