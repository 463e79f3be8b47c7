"""SDPA attention: decodes gathered to the longest context, padding masked, one call for the batch.
Runs attended on their own go through `models.attention.causal_attention`."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.engine.runner.backends.base import AttentionBackend, Gathers, PoolSpec, StepLayout, feed_rows, padded_slots
from kvtier.engine.runner.batch import Uploads
from kvtier.models.attention import masked_decode_sdpa


@dataclass(frozen=True)
class PaddedDecodes:
    """The decodes' contexts gathered to the longest."""

    slots: torch.Tensor  # [decodes, width] pool slots (padding: the zero slot)
    mask: torch.Tensor  # [decodes, 1, 1, width] True where a key is real
    feed_dst: torch.Tensor | None  # [sum of fed positions] flat rows of the gathered contexts


class Sdpa(AttentionBackend[PaddedDecodes]):
    """Padded, masked SDPA with grouped K/V heads (the CPU's inexact mode, devices without CUDA)."""

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.gathers = Gathers(spec, 2)
        # the plain path's masks: an import of seconds, here, not in a step
        importlib.import_module("torch.nn.attention.bias")

    def decodes(self, layout: StepLayout, up: Uploads) -> Callable[[], PaddedDecodes]:
        n, width = len(layout.decode_rows), max(layout.ctx_len)
        slots, ctx_at = padded_slots(self.spec, layout, width)
        at_slots, at_len = up.add(slots), up.add(torch.tensor(layout.ctx_len, dtype=torch.long))
        dst = feed_rows(layout, ctx_at)
        at_dst = None if dst is None else up.add(dst)

        def done() -> PaddedDecodes:
            mask = torch.arange(width, device=self.spec.device)[None, :] < up[at_len][:, None]  # [n, width]
            return PaddedDecodes(up[at_slots].view(n, width), mask[:, None, None, :],
                                 None if at_dst is None else up[at_dst])

        return done

    def attend_decodes(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: PaddedDecodes,
                       fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        n, width = meta.slots.shape
        flat = meta.slots.reshape(-1)
        ks, vs = (self.gathers.contexts(c, flat, part, meta.feed_dst, fed).view(n, width, *c.shape[1:])
                  for part, c in enumerate((kc, vc)))  # [n, width, kv_heads, hd]
        return self.masked(q, ks.transpose(1, 2), vs.transpose(1, 2), meta.mask)

    def masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [n, heads, hd] over k/v [n, kv_heads, width, hd] where mask [n, 1, 1, width] -> [n, heads, hd]."""
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask,
                                             enable_gqa=q.shape[1] != k.shape[1])  # [n, heads, 1, hd]
        return out.squeeze(2)


class CudaSdpa(Sdpa):
    """On CUDA: a token's query heads sharing a K/V head are one query matrix, so the
    memory-efficient kernel takes the masked call with no K/V copy per head (never cuDNN's)."""

    def masked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_decode_sdpa(q, k, v, mask)  # [n, heads, hd]
