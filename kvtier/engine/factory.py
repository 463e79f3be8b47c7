"""Build an Engine for the CLI, the server and benchmarks: the one place that measures the machine.

`Engine(...)` never times anything (it plans with what was measured and cached before, or an
estimate). `make_engine` first measures what is missing for the engine it builds, once, and caches
it under KVTIER_HOME: the hardware profile (with a store), the importance restore's probe heads
(with impress or --allow-lossy), partial caching's step model (with --partial-caching).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvtier import paths
from kvtier.device import resolve_device
from kvtier.engine.calibrate import fronts, hardware
from kvtier.engine.calibrate.probes import ProbeCalibration, calibrate
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.impress.policy import probe_kv_heads_for
from kvtier.models.loading import LoadedModel, load_model, resolve
from kvtier.planning.costs import HardwareProfile
from kvtier.store.preflight import check_store


def make_engine(loaded: LoadedModel, config: EngineConfig | None = None, store: str | None = None,
                reuse: ReuseConfig | None = None, profile: HardwareProfile | None = None,
                measure_profile: bool = True, **kw: Any) -> Engine:
    """An Engine over `loaded`, with every calibration it uses measured (or read from the cache).
    `measure_profile=False`: a machine without a saved hardware profile is planned for on an
    estimate (the engine says so) instead of measured now, which takes minutes on a small CPU;
    `kvtier profile` measures it for the next start."""
    config = config or EngineConfig()
    reuse = reuse or ReuseConfig()
    probes: ProbeCalibration | None = None
    if store and profile is None and measure_profile:
        profile = hardware.load_or_measure(loaded, paths.home(), store)
    if store and reuse.importance:
        probes = calibrate(loaded, probe_kv_heads_for(loaded.config.num_kv_heads))
    if config.partial is not None and config.partial.cost is None:
        config = dataclasses.replace(config, partial=dataclasses.replace(config.partial,
                                                                         cost=fronts.cost_model(loaded)))
    return Engine(loaded, config, store=store, reuse=reuse, profile=profile, probes=probes, **kw)


def build_engine(model: str, dtype: str | None = "auto", store: str | None = None, reuse: ReuseConfig | None = None,
                 profile: HardwareProfile | None = None, device: str = "auto", measure_profile: bool = True,
                 **config: Any) -> Engine:
    """Load `model` on `device` and build its engine. `store` is a tier spec (see `kvtier store --help`).
    The device, the store's tiers and the model's name are checked first: a mistake in any of them
    is one error in a second, not after the (slow) model load."""
    dev = resolve_device(device)  # a DeviceError
    if store:
        check_store(store)  # StoreUnusable / ConnectionError naming the tier and the fix
    resolve(model)  # ModelLoadError listing what a model may be
    loaded = load_model(model, dtype=dtype, device=dev)
    return make_engine(loaded, EngineConfig(device=str(dev), **config), store=store, reuse=reuse, profile=profile,
                       measure_profile=measure_profile)
