"""Build an Engine from command-line style options (shared by the CLI, the server and benchmarks).

Unlike `Engine(...)`, this is where a missing hardware profile gets measured (once, saved under
KVTIER_HOME): commands that serve users should plan with this machine's real numbers.
"""

from __future__ import annotations

from typing import Any

from kvtier import paths
from kvtier.device import resolve_device
from kvtier.engine.calibrate.hardware import load_or_measure
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.models.loading import load_model
from kvtier.planning.costs import HardwareProfile


def build_engine(model: str, dtype: str | None = "auto", store: str | None = None, reuse: ReuseConfig | None = None,
                 profile: HardwareProfile | None = None, device: str = "auto", **config: Any) -> Engine:
    """Load `model` on `device` and wrap it in an Engine. `store` is a tier spec (see `kvtier store --help`)."""
    dev = resolve_device(device)  # a DeviceError before the (slow) model load
    loaded = load_model(model, dtype=dtype, device=dev)
    if store and profile is None:
        profile = load_or_measure(loaded, paths.home(), store)
    return Engine(loaded, EngineConfig(device=str(dev), **config), store=store, reuse=reuse, profile=profile)
