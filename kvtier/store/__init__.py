"""Tiered state store: content-addressed chunks of KV / hidden state across memory, disks and Redis.

Entry point: `TieredStore.open(spec, namespace)`. See docs/store.md. Names are loaded on first
use, so `from kvtier.store import Repr` (or the keys, index and policies) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FormatError": ".format", "LayerState": ".format",
    "ChunkRef": ".index", "PrefixMatch": ".index",
    "chunk_key": ".keys", "chunk_spans": ".keys", "store_digest": ".keys",
    "Repr": ".layout", "StoreNamespace": ".layout",
    "EvictionPolicy": ".policy", "FIFOPolicy": ".policy", "LFUPolicy": ".policy", "LRUPolicy": ".policy",
    "make_policy": ".policy",
    "SpecError": ".spec", "parse_spec": ".spec",
    "TieredStore": ".tiered", "VerifyReport": ".tiered",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kvtier.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
