"""Rotary position embeddings (RoPE) in every variant transformers ships for the Llama family.

K is rotated at its token's position once, when it is computed; it is stored and restored that
way. Only a restore that moves tokens (context truncation) rotates again, by the position
difference: rotations compose, R(a)R(b) = R(a+b).

The frequencies of a scaled RoPE (linear, dynamic, yarn, longrope, llama3) come from transformers'
own `ROPE_INIT_FUNCTIONS`, so they are HF's to the bit. Two of them depend in HF on the length of
the batch at hand: dynamic NTK raises the base once a sequence is longer than
max_position_embeddings, LongRoPE switches from its short to its long factors once a sequence is
longer than original_max_position_embeddings. State computed at one length would then be rotated
differently from state computed at another, and a cached prefix could never be reused. kvtier
computes them once, for the model's context window (max_position_embeddings, which the engine
never exceeds; it is part of the config digest, so state is never shared across two choices):
- dynamic: the window is max_position_embeddings itself, where HF's formula leaves the base as it
  is, so kvtier agrees with HF at every length it runs.
- longrope: the long factors iff max_position_embeddings > original_max_position_embeddings (as
  vLLM). kvtier agrees with HF on sequences longer than original_max_position_embeddings; on
  shorter ones HF uses the short factors and kvtier the long ones (set max_position_embeddings to
  original_max_position_embeddings in config.json for the short ones).
"""

from __future__ import annotations

import torch

from kvtier.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> [head_dim // 2] float32 inverse frequencies after the configured scaling, and the factor
    cos/sin are multiplied by (yarn and longrope scale attention logits through it; else 1)."""
    dim = cfg.head_dim
    if cfg.rope_scaling.kind == "default":  # no transformers import for the plain case
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    init = ROPE_INIT_FUNCTIONS[cfg.rope_scaling.kind]
    # seq_len: the context window, the one length kvtier computes dynamic and longrope for.
    inv_freq, scaling = init(cfg.to_hf(), torch.device("cpu"), seq_len=cfg.max_position_embeddings)
    return inv_freq.float(), float(scaling)


class Rope:
    """Caches cos/sin for positions [0, max_positions) and rotates tensors by position."""

    def __init__(self, cfg: ModelConfig, max_positions: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        inv_freq, scaling = inverse_frequencies(cfg)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [positions, head_dim/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [positions, head_dim]
        half = cfg.head_dim // 2
        # Computed in fp32 on the host (the same tables on every device), each moved once. The two
        # halves of cos/sin are equal (half-split layout): rotate_into needs one. The attention
        # scaling multiplies the fp32 values before the cast, as HF does.
        cos, sin = (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
        tables = (cos, sin, cos[:, :half].contiguous(), sin[:, :half].contiguous())
        self.cos, self.sin, self.cos_h, self.sin_h = (t.to(device, non_blocking=True) for t in tables)
        # `delta` rotates K that already carries the scaling: its tables must not scale again.
        self.dcos_h, self.dsin_h = self.cos_h, self.sin_h
        if scaling != 1.0:
            plain = (freqs.cos().to(dtype), freqs.sin().to(dtype))  # [positions, head_dim/2]
            self.dcos_h, self.dsin_h = (t.to(device, non_blocking=True) for t in plain)
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
        sign = (1 - 2 * (shift < 0).to(self.dsin_h.dtype)).unsqueeze(1)  # [tokens, 1]: -1 or 1
        return self.dcos_h.index_select(0, mag).unsqueeze(1), (self.dsin_h.index_select(0, mag) * sign).unsqueeze(1)


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
