"""Helpers for the server tests (a module with its own name: `conftest` is ambiguous when the
whole tests/ tree is collected, since several directories have one).

Sizes are kept small on purpose: a 256-token window makes "prompt too long" cheap to hit and
bounds any generation a fuzzer asks for.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.planning.costs import HardwareProfile, TierRates
from kvtier.serve import create_app
from kvtier.serve.server import ServerThread

TINY = "tiny-gqa"
WINDOW = 256
BODY_LIMIT = 64 * 1024
DEFAULT_MAX_TOKENS = 8


@dataclass
class Served:
    url: str
    engine: Engine
    background: BackgroundEngine
    app: object = None

    @property
    def in_flight(self) -> int:
        """Generation requests the server has admitted and not yet finished."""
        return self.app.state.kvtier.in_flight

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)


def wait_idle(engine: Engine, timeout: float = 20.0) -> None:
    """Until no request is queued or running and every KV block is back in the free list."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sched, pool = engine.scheduler, engine.pool
        if not (sched.waiting or sched.running or sched.requests) and pool.num_free == pool.num_blocks:
            return
        time.sleep(0.02)
    raise AssertionError(
        f"engine not idle after {timeout} s: waiting={len(engine.scheduler.waiting)} "
        f"running={len(engine.scheduler.running)} free={engine.pool.num_free}/{engine.pool.num_blocks}"
    )


def fake_profile(model) -> HardwareProfile:
    """A fixed hardware profile where loading state beats recomputing it (no measuring in tests)."""
    rates = TierRates(1e9, 1e9, 1e-5)
    scale = 50.0
    return HardwareProfile(model.fingerprint, str(model.dtype).removeprefix("torch."), 2, 2e-5 * scale, 1e-9 * scale,
                           5e-7 * scale, 1e-7 * scale, {"memory": rates, "disk": rates, "redis": rates})


def serve(model, window: int = WINDOW, kv_bytes: int = 16 << 20, truncation=None, store: str | None = None,
          prefix_cache: bool = True, max_num_seqs: int = 64, reuse: ReuseConfig | None = None,
          **app_kw) -> Iterator[Served]:
    """Serve `model` (already loaded) with a fresh engine; the tests own the engine loop."""
    config = EngineConfig(kv_cache_bytes=kv_bytes, max_model_len=window, enable_prefix_cache=prefix_cache,
                          max_num_seqs=max_num_seqs)
    reuse = reuse or (ReuseConfig(method="kv", chunk_tokens=16) if store else None)
    engine = Engine(model, config, truncation=truncation, store=store, reuse=reuse,
                    profile=fake_profile(model) if store else None)
    background = BackgroundEngine(engine)
    app_kw = {"default_max_tokens": DEFAULT_MAX_TOKENS, "max_body_bytes": BODY_LIMIT, **app_kw}
    app = create_app(background, **app_kw)
    try:
        with ServerThread(app) as server:
            yield Served(server.url, engine, background, app)
    finally:
        background.close()
        engine.close()


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """A server's /metrics as {(sample name, sorted labels): value}, without the `model_name` label
    every family carries (one model per server here; tests/serve/test_dashboard.py checks it)."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
