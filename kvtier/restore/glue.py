"""Small adapters between a loaded model, its stores and the planner."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.models.loading import LoadedModel
from kvtier.restore.planner import Chunk, ModelShape, TierLink
from kvtier.restore.profile import HardwareProfile, TierRates
from kvtier.store import PrefixMatch, Repr, StoreNamespace, TieredStore


def dtype_name(model: LoadedModel) -> str:
    return str(model.dtype).removeprefix("torch.")


# Bytes per stored value; int8 adds one fp32 scale per row (head_dim values for K/V, hidden for h).
_WIDTH = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0}


def model_shape(model: LoadedModel, storage_dtype: str = "") -> ModelShape:
    """Stored bytes per token and layer, in the storage dtype (the planner's IO cost)."""
    cfg = model.config
    storage = storage_dtype or dtype_name(model)
    width = _WIDTH[storage]
    kv = 2 * cfg.kv_dim * width + (2 * cfg.num_kv_heads * 4 if storage == "int8" else 0)
    h = cfg.hidden_size * width + (4 if storage == "int8" else 0)
    return ModelShape(cfg.num_layers, int(kv), int(h))


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
