"""How long the event loop goes without running while some work is awaited: a task that wakes
every `tick_s` measures the longest gap between its wakes, the stall every other request and
stream on that loop would see (scripts/json_answer_stall.py, scripts/body_parse_stall.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def loop_stall(work: Callable[[], Awaitable[T]], tick_s: float = 0.001,
                     settle_s: float = 0.02) -> tuple[T, float, float]:
    """Await `work()` while a task ticks on the loop -> (its result, seconds it took, the longest
    gap in seconds between ticks, `settle_s` before and after it included)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(tick_s)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(settle_s)
    t0 = time.perf_counter()
    result = await work()
    took = time.perf_counter() - t0
    await asyncio.sleep(settle_s)
    done.set()
    await ticker
    return result, took, max(gaps)
