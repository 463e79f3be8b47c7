"""Rotary position embeddings (RoPE), including linear and Llama-3 frequency scaling.

K is rotated at its token's position once, when it is computed; it is stored and restored that
way. Only a restore that moves tokens (context truncation) rotates again, by the position
difference: rotations compose, R(a)R(b) = R(a+b).
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

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        inv_freq = inverse_frequencies(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [positions, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        half = cfg.head_dim // 2
        # Computed in fp32 on the host (the same tables on every device), each moved once. The two
        # halves of cos/sin are equal (half-split layout): rotate_into needs one.
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        tables = (cos, sin, cos[:, :half].contiguous(), sin[:, :half].contiguous())
        self.cos, self.sin, self.cos_h, self.sin_h = (t.to(device, non_blocking=True) for t in tables)
        self.max_positions = max_positions

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin shaped [tokens, 1, head_dim] for broadcasting over heads (for `rotate`)."""
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    def halves(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half tables [tokens, 1, head_dim/2] at `positions` (for `rotate_into`)."""
        return self.cos_h.index_select(0, positions).unsqueeze(1), self.sin_h.index_select(0, positions).unsqueeze(1)

    def span(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`halves` of the contiguous positions [start, end), as views (no gather)."""
        return self.cos_h[start:end].unsqueeze(1), self.sin_h[start:end].unsqueeze(1)

    def delta(self, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half tables [tokens, 1, head_dim/2] for rotating by `shift` positions (may be negative):
        cos is even and sin odd in the angle, so R(-d) uses cos(d) and -sin(d)."""
        mag = shift.abs()
        sign = (1 - 2 * (shift < 0).to(self.sin_h.dtype)).unsqueeze(1)  # [tokens, 1]: -1 or 1
        return self.cos_h.index_select(0, mag).unsqueeze(1), (self.sin_h.index_select(0, mag) * sign).unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim] (half-split layout, as HF Llama) rotated by cos/sin [tokens, 1, head_dim].
    The plain form HF uses; the engine uses `rotate_into`."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_into(x: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`rotate` written straight into `out` (which must not alias x), with no temporaries:
    out1 = x1*c - x2*s, out2 = x2*c + x1*s per half. x, out: [tokens, heads, head_dim];
    cos_h/sin_h: [tokens, 1, head_dim/2]."""
    half = x.shape[-1] // 2
    x1, x2, o1, o2 = x[..., :half], x[..., half:], out[..., :half], out[..., half:]
    torch.mul(x1, cos_h, out=o1)
    o1.addcmul_(x2, sin_h, value=-1)
    torch.mul(x2, cos_h, out=o2)
    o2.addcmul_(x1, sin_h)
    return out
