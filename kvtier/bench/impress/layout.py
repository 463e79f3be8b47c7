"""The importance layout `kvtier bench impress` stores documents in: the engine's, with its
calibrated probe head per layer unless one head is given for every layer."""

from __future__ import annotations

from kvtier.dtypes import name_of
from kvtier.engine.calibrate.probes import calibrate
from kvtier.engine.impress.policy import PROBE_GRANULE_TOKENS, probe_kv_heads_for
from kvtier.models.loading import LoadedModel
from kvtier.store import StoreNamespace

CHUNK = 64


def namespace(loaded: LoadedModel, granule_tokens: int = PROBE_GRANULE_TOKENS, probes: int = 0,
              probe_first: int = -1) -> StoreNamespace:
    """The importance layout the engine would open (its calibrated probe heads per layer, unless
    `probe_first` >= 0 names the first probe KV head of every layer)."""
    c = loaded.config
    probes = probes or probe_kv_heads_for(c.num_kv_heads)
    first = (probe_first,) * c.num_layers if probe_first >= 0 else calibrate(loaded, probes).first
    return StoreNamespace(loaded.fingerprint, c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size,
                          compute_dtype=name_of(loaded.dtype), probe_kv_heads=probes, probe_first=first,
                          granule_tokens=granule_tokens)
