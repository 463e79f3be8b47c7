"""Run the engine's step loop on a background thread (for the server and other concurrent callers)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvtier.engine.engine import Engine, RequestOutput
from kvtier.engine.request import SamplingParams
from kvtier.engine.structured import Constraint
from kvtier.planning.blend import BlendOptions

log = logging.getLogger(__name__)


class BackgroundEngine:
    """Callers submit from any thread; `on_output` is called on the engine thread for every update.
    After `idle_after_s` seconds without a request it measures what the engine lacks, a slice at a
    time (`Engine.idle`): the first requests after a start, which come in a burst, find it quiet."""

    def __init__(self, engine: Engine, idle_after_s: float = 5.0):
        self.engine = engine
        self.idle_after_s = idle_after_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.steps = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._loop, name="kvtier-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        on_output: Callable[[RequestOutput], None],
        request_id: str | None = None,
        session_id: str | None = None,
        cache_salt: str | None = None,
        constraint: Constraint | None = None,
        *,
        priority: int = 0,
        cache_prompt: bool = True,
        segments: Sequence[tuple[int, int]] = (),
        blend: bool | BlendOptions | None = None,
    ) -> str:
        rid = self.engine.add_request(prompt, params, request_id, on_output, session_id, cache_salt, constraint,
                                      priority=priority, cache_prompt=cache_prompt, segments=segments, blend=blend)
        self._wake.set()
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            self.engine.idle.close()  # a measurement cut short removes its scratch tiers

    def _serve(self) -> None:
        busy_at = time.monotonic()
        while not self._stop.is_set():
            if not self.engine.has_work():
                # Quiet for a while: a slice of what a first start did not measure (engine/idle.py).
                quiet = time.monotonic() - busy_at >= self.idle_after_s
                if not (quiet and self.engine.idle_slice()):
                    self._wake.wait(0.05)
                    self._wake.clear()
                continue
            busy_at = time.monotonic()
            try:
                self.engine.step()
                self.steps += 1
            except Exception:  # keep serving: fail the requests in flight, not the process
                self.errors += 1
                log.exception("engine step failed; aborting the requests in flight")
                for rid in list(self.engine.scheduler.requests):
                    self.engine.abort(rid)
