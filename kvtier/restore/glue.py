"""Small adapters between a loaded model, its stores and the planner."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.models.loading import LoadedModel
from kvtier.restore.planner import Chunk, ModelShape, TierLink
from kvtier.restore.profile import HardwareProfile, TierRates
from kvtier.store import PrefixMatch, Repr, StoreNamespace, TieredStore


def dtype_name(model: LoadedModel) -> str:
    return str(model.dtype).removeprefix("torch.")


def model_shape(model: LoadedModel) -> ModelShape:
    cfg, width = model.config, model.dtype.itemsize
    return ModelShape(cfg.num_layers, 2 * cfg.kv_dim * width, cfg.hidden_size * width)


def namespace(model: LoadedModel, layout: Sequence[Repr] | None = None, storage_dtype: str = "") -> StoreNamespace:
    cfg = model.config
    return StoreNamespace(model.fingerprint, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                          compute_dtype=dtype_name(model), storage_dtype=storage_dtype,
                          layer_reprs=tuple(layout) if layout else (Repr.KV,) * cfg.num_layers)


def links(store: TieredStore, profile: HardwareProfile) -> dict[str, TierLink]:
    """Measured rates of each tier of `store`, with the emulated limits its spec sets."""
    out = {}
    fallback = next(iter(profile.tiers.values()), TierRates(1e9, 1e9, 1e-5))
    for t in store.tiers:
        rates = profile.tiers.get(t.name, fallback)
        em = t.emulation
        out[t.name] = TierLink(rates, em.bandwidth, em.latency)
    return out


def chunks_of(match: PrefixMatch) -> list[Chunk]:
    return [Chunk(c.start, c.end, c.tier) for c in match.chunks]
