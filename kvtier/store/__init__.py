"""Tiered state store: content-addressed chunks of KV / hidden state across memory, disks and Redis.

Entry point: `TieredStore.open(spec, namespace)`. See docs/store.md.
"""
from .format import FormatError, LayerState
from .index import ChunkRef, PrefixMatch
from .keys import chunk_key, chunk_spans, store_digest
from .layout import Repr, StoreNamespace
from .policy import EvictionPolicy, FIFOPolicy, LFUPolicy, LRUPolicy, make_policy
from .spec import SpecError, parse_spec
from .tiered import TieredStore, VerifyReport

__all__ = [
    "ChunkRef", "EvictionPolicy", "FIFOPolicy", "FormatError", "LFUPolicy", "LRUPolicy",
    "LayerState", "PrefixMatch", "Repr", "SpecError", "StoreNamespace", "TieredStore",
    "VerifyReport", "chunk_key", "chunk_spans", "make_policy", "parse_spec", "store_digest",
]
