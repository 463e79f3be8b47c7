"""Engine configuration: one validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per device KV block
    kv_cache_bytes: int = 4 << 30  # device KV pool budget (host pages are only touched when used)
    max_batched_tokens: int = 2048  # per-step token budget shared by decodes and prefill chunks
    max_num_seqs: int = 64
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_batched_tokens < 1:
            raise ValueError("max_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


METHODS = ("auto", "kv", "hidden", "bubblefree", "cake", "recompute")


@dataclass(frozen=True)
class ReuseConfig:
    method: str = "auto"  # which restore method; auto = the planner's choice per request
    chunk_tokens: int = 64
    save: bool = True
    lookahead: bool = True
    min_restore_tokens: int = 32  # restore only when the store adds at least this much over the device
    storage_dtype: str = ""  # "" = compute dtype (lossless)
    # Recompute device-cached tokens the store lacks so their state is saved and the stored chain
    # has no hole. Off by default: the store matches whole chunks only, so a short prompt that is a
    # prefix of a stored chunk would lose its device reuse (see docs/architecture.md).
    fill_holes: bool = False
    flush_wait_s: float = 1.0  # at admission, how long pending saves may take to land (see probe)
    # Delete what a session saved once it has been idle this long (requests without a session id,
    # and chunks another live session shares, are unaffected). None = keep until evicted.
    session_ttl_s: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"restore method {self.method!r}: use one of {', '.join(METHODS)}")
        if self.session_ttl_s is not None and self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s must be positive seconds (or None to keep state), got {self.session_ttl_s}")
