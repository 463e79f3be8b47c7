"""CUDA with flash varlen attention (`models.varlen`): a ragged decode batch is packed, its contexts
back to back with no padding; any other batch is padded for SDPA, which reads faster per byte."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.engine.runner.backends.base import AttentionBackend, Gathers, PoolSpec, StepLayout, feed_rows
from kvtier.engine.runner.backends.sdpa import CudaSdpa, PaddedDecodes
from kvtier.engine.runner.batch import Uploads
from kvtier.models import varlen

PACK_DECODES = False  # always pack decodes where usable, not only ragged batches (measurement)
# A decode batch whose padding would read more than this many times its contexts' slots is packed
# instead (one long context among short ones).
RAGGED = 4


def pack_decodes(can_pack: bool, padded_rows: int, context_rows: int) -> bool:
    """Whether a decode batch goes packed to varlen_attn rather than padded to its longest context
    for SDPA: padding reads faster per byte, so it wins unless it reads RAGGED times the contexts' slots."""
    return can_pack and (PACK_DECODES or padded_rows > RAGGED * context_rows)


@dataclass(frozen=True)
class PackedDecodes:
    """The decodes' contexts back to back."""

    slots: torch.Tensor  # [sum of contexts] pool slots
    cu: torch.Tensor  # [decodes + 1] int32 offsets of each context in `slots`
    width: int  # the longest context
    feed_dst: torch.Tensor | None  # [sum of fed positions] rows of the packed contexts


class Varlen(AttentionBackend[PaddedDecodes | PackedDecodes]):
    """Runs attended on their own go through `causal_attention`, which takes varlen_attn for a
    chunk over a history; decodes are packed where ragged, else `CudaSdpa`'s."""

    can_pack = True

    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        self.padded = CudaSdpa(spec)
        self.gathers = Gathers(spec, 2)

    def decodes(self, layout: StepLayout, up: Uploads) -> Callable[[], PaddedDecodes | PackedDecodes]:
        rows, items, ctx_len = layout.decode_rows, layout.items, layout.ctx_len
        width = max(ctx_len)
        if not pack_decodes(self.can_pack, len(rows) * width, sum(ctx_len)):
            return self.padded.decodes(layout, up)
        # each context's slots, back to back; its fed positions first (slot 0 here: filled after the gather)
        slots = torch.cat([F.pad(self.spec.slots(items[i].block_ids, 0, items[i].slot_start + 1),
                                 (items[i].context_feed, 0)) for i in rows])  # [sum ctx_len]
        at_slots, at_len = up.add(slots), up.add(torch.tensor(ctx_len, dtype=torch.long))
        dst = feed_rows(layout, [sum(ctx_len[:r]) for r in range(len(rows))])
        at_dst = None if dst is None else up.add(dst)

        def done() -> PackedDecodes:
            cu = F.pad(up[at_len].cumsum(0), (1, 0)).to(torch.int32)  # [decodes + 1], on the device
            return PackedDecodes(up[at_slots], cu, width, None if at_dst is None else up[at_dst])

        return done

    def attend_decodes(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: PaddedDecodes | PackedDecodes,
                       fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if isinstance(meta, PaddedDecodes):
            return self.padded.attend_decodes(q, kc, vc, meta, fed)
        k, v = (self.gathers.contexts(c, meta.slots, part, meta.feed_dst, fed)
                for part, c in enumerate((kc, vc)))  # [sum of contexts, kv_heads, hd]
        n = q.shape[0]
        cu_q = torch.arange(n + 1, device=q.device, dtype=torch.int32)
        return varlen.attend(q, k, v, cu_q, meta.cu, 1, meta.width)  # [n, heads, hd]
