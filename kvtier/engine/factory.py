"""Build an Engine from command-line style options (shared by the CLI, the server and benchmarks)."""

from __future__ import annotations

from typing import Any

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.config import ReuseConfig
from kvtier.models.loading import load_model
from kvtier.restore.profile import HardwareProfile


def build_engine(model: str, dtype: str | None = "auto", store: str | None = None, reuse: ReuseConfig | None = None,
                 profile: HardwareProfile | None = None, **config: Any) -> Engine:
    """Load `model` and wrap it in an Engine. `store` is a tier spec (see `kvtier store --help`)."""
    return Engine(load_model(model, dtype=dtype), EngineConfig(**config), store=store, reuse=reuse, profile=profile)
