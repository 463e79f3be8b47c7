"""What every handler needs: the engine, its background loop, settings and metrics."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from fastapi import Request

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.engine import Engine
from kvtier.serve.config import ServeConfig
from kvtier.serve.errors import APIError, quoted
from kvtier.serve.metrics import ServerMetrics


@dataclass
class ServerContext:
    engine: Engine
    config: ServeConfig
    metrics: ServerMetrics
    background: BackgroundEngine | None = None  # started by the app's lifespan (or on first use)
    owns_background: bool = True  # close it at shutdown only if we started it
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0  # generation requests admitted and not yet finished or cancelled
    _admission: threading.Lock = field(default_factory=threading.Lock)

    def admit(self) -> None:
        """Take a slot for one generation request, or answer 429 when the running batch and the
        queue behind it are full (the engine would only make the request wait)."""
        limit = self.config.max_queued_requests
        with self._admission:
            if limit is not None and self.in_flight >= self.engine.config.max_num_seqs + limit:
                self.metrics.count_rejected("queue_full")
                raise APIError(429, f"the server is at capacity ({self.in_flight} requests running or queued); "
                                    "retry after a second", code="too_many_requests", headers={"Retry-After": "1"})
            self.in_flight += 1

    def release(self) -> None:
        with self._admission:
            self.in_flight -= 1

    @property
    def model_name(self) -> str:
        return self.config.served_model_name or self.engine.model.name

    @property
    def system_fingerprint(self) -> str:
        # Changes when the weights or config change, as OpenAI's does for a backend change.
        return "fp_" + self.engine.model.fingerprint[:12]

    def start(self) -> BackgroundEngine:
        if self.background is None:
            self.background = BackgroundEngine(self.engine)
            self.owns_background = True
            self.metrics.attach(self.background)
        return self.background

    def running(self) -> BackgroundEngine:
        """The engine loop, or a 503 when it has stopped (a request would never finish)."""
        bg = self.start()
        if not bg.alive:
            raise APIError(503, "the engine is not running; restart the server", code="engine_stopped")
        return bg

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.engine.model.name):
            raise APIError(
                404, f"the model {quoted(name)} does not exist; this server serves '{self.model_name}'",
                param="model", code="model_not_found",
            )


def get_context(request: Request) -> ServerContext:
    return request.app.state.kvtier
