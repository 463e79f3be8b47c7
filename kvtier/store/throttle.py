"""Emulated device read bandwidth and latency, so a benchmark can model a slower disk or link."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Emulation:
    bandwidth: float | None = None  # bytes per second
    latency: float = 0.0  # seconds per read request

    @property
    def active(self) -> bool:
        return self.bandwidth is not None or self.latency > 0

    def describe(self) -> str:
        if not self.active:
            return ""
        bits = []
        if self.bandwidth is not None:
            bits.append(f"bw={self.bandwidth / 1e6:g}MB/s")
        if self.latency:
            bits.append(f"lat={self.latency * 1e3:g}ms")
        return "emulated " + " ".join(bits)


class Throttle:
    """A token bucket with a one-request burst: reads queue behind each other at `bandwidth`.

    Each read waits for the latency and for its bytes to drain through a shared virtual link, so
    concurrent readers share the emulated bandwidth as they would a real device.
    """

    def __init__(self, emulation: Emulation) -> None:
        self.emulation = emulation
        self._lock = threading.Lock()
        self._free_at = 0.0  # monotonic time the virtual link becomes idle

    def read(self, nbytes: int) -> None:
        em = self.emulation
        if not em.active:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._free_at)
            done = start + (nbytes / em.bandwidth if em.bandwidth else 0.0)
            self._free_at = done
        wait = done + em.latency - time.monotonic()
        if wait > 0:
            time.sleep(wait)
