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
