"""Rotary position embeddings (RoPE), including linear and Llama-3 frequency scaling.

RoPE is applied to K only when K enters the device pool, at the position it takes there
(DESIGN invariant 1), so everything here works on explicit position tensors.
"""

from __future__ import annotations

import math

import torch

from kvtier.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after the configured scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend the band in between.
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
        smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
            s.high_freq_factor - s.low_freq_factor
        )
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(middle, blended, scaled)
    return inv_freq


class Rope:
    """Caches cos/sin for positions [0, max_positions) and rotates tensors by position."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype):
        inv_freq = inverse_frequencies(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [positions, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin shaped [tokens, 1, head_dim] for broadcasting over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin of the contiguous positions [start, end), as views (no gather)."""
        return self.cos[start:end].unsqueeze(1), self.sin[start:end].unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] (half-split layout, as HF Llama) rotated by cos/sin [tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
