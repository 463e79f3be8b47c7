"""Exact attention on the CPU (`models.exact_attention`): a token's output is the same bits whatever
the chunking, the cache hit or the batch. The kernel reads a context as whole key pieces
(`key_rows`), zero past its end, so a run reads its context in place where the slots past it may be
zeroed (`RunRead.tail`), else through buffers the step fills (`RunRead.pad`). Decodes read their
whole key blocks in place where their blocks are consecutive (`KeyReads`) once the longest context
is long enough, else gather every context to one width and attend in one call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.engine.runner.backends.base import (
    AttentionBackend,
    Clearable,
    Gathers,
    PoolSpec,
    StepLayout,
    feed_rows,
    padded_slots,
)
from kvtier.engine.runner.batch import RunItem, RunRead, Uploads, slot_array, slot_runs
from kvtier.models import exact_attention
from kvtier.models.attention import decode_attention, key_rows
from kvtier.models.exact_attention import split

# Decodes read their whole key blocks in place (one flash call per token) once the longest context
# passes this many keys; shorter ones are gathered and attend in one call, which costs less than a
# call per token there (docs/benchmarks.md).
IN_PLACE_KEYS = 2048


@dataclass(frozen=True)
class KeyReads:
    """Where each decode (none with fed context) reads its keys (`exact_attention.decode`), the same
    for every layer: its whole key blocks in place where its pool slots are consecutive, so a long
    context is never copied; only its piece (at most one key block) and a scattered context's
    whole blocks are gathered."""

    pieces: torch.Tensor  # [decodes, piece width] pool slots of each token's piece from its base on (the zero slot past its context)
    in_place: tuple[range | None, ...]  # per decode: pool slots of its whole key blocks where consecutive
    gathered_rows: tuple[range | None, ...]  # per decode: else their rows in the gather of `scattered`
    scattered: torch.Tensor | None  # pool slots of the scattered decodes' whole key blocks, back to back
    lengths: tuple[int, ...]  # each decode's context length, its token included


@dataclass(frozen=True)
class GatheredDecodes:
    """The decodes' contexts gathered to whole key pieces of the longest."""

    slots: torch.Tensor  # [decodes, key_rows(longest)] pool slots (padding: the zero slot)
    lengths: tuple[int, ...]  # each decode's context length, its token included
    feed_dst: torch.Tensor | None  # [sum of fed positions] flat rows of the gathered contexts


class CpuExact(AttentionBackend[KeyReads | GatheredDecodes]):
    def __init__(self, spec: PoolSpec) -> None:
        super().__init__(spec)
        # contexts or pieces (parts 0, 1), scattered whole key blocks (2, 3)
        self.gathers = Gathers(spec, 4)

    def causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int) -> torch.Tensor:
        return exact_attention.causal(q, k, v, q_start, self.spec.kernels.bf16_attention)

    # ----- metadata ---------------------------------------------------------------------------
    def reads(self, layout: StepLayout) -> list[RunRead]:
        out = []
        for i, (it, n, c) in enumerate(zip(layout.items, layout.lens, layout.ctx)):
            if i in layout.decode_rows:
                out.append(RunRead(c))
                continue
            tail = self._tail(it, c, layout.clearable)
            if tail is not None and isinstance(c, range):  # read in place, over the zeroed tail
                out.append(RunRead(range(c.start, tail.stop), None, tail))
            else:
                out.append(RunRead(c, self._key_pieces(it.slot_start + n if c is not None else n,
                                                       isinstance(c, torch.Tensor))))
        return out

    def _tail(self, it: RunItem, ctx: range | torch.Tensor | None, clearable: Clearable | None) -> range | None:
        """The pool slots [end of `ctx`, its start + key_rows) where the run's context, consecutive in
        the pool and ending inside a key piece, may be read in place with them zeroed; None where
        it may not."""
        if not isinstance(ctx, range) or clearable is None:
            return None
        tail = range(ctx.stop, ctx.start + key_rows(len(ctx)))
        return tail if len(tail) and clearable(it, tail) else None

    def _key_pieces(self, rows: int, gathered: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where a context of `rows` positions is not whole key pieces as it lies (it ends inside a
        piece, or is gathered), two buffers [key_rows(rows), kv_heads, hd] for the step, their tail
        zeroed once: each layer then writes the context into them, one copy, instead of
        allocating, zeroing and filling a padded copy per layer."""
        keys = key_rows(rows)
        if keys == rows and not gathered:
            return None
        spec = self.spec
        k, v = (torch.empty((keys, spec.kv_heads, spec.head_dim), dtype=spec.dtype, device=spec.device)
                for _ in range(2))
        k[rows:].zero_()
        v[rows:].zero_()
        return k, v

    def decodes(self, layout: StepLayout, up: Uploads) -> Callable[[], KeyReads | GatheredDecodes]:
        rows, items, ctx_len = layout.decode_rows, layout.items, layout.ctx_len
        longest = max(ctx_len)
        if not layout.fed and longest > IN_PLACE_KEYS:
            keys = self._key_reads([items[i].block_ids for i in rows], ctx_len)
            return lambda: keys
        width = key_rows(longest)  # exact attention reads whole key pieces: gather them at once
        slots, ctx_at = padded_slots(self.spec, layout, width)
        at_slots = up.add(slots)
        dst = feed_rows(layout, ctx_at)
        at_dst = None if dst is None else up.add(dst)
        lengths = tuple(ctx_len)
        return lambda: GatheredDecodes(up[at_slots].view(len(rows), width), lengths,
                                       None if at_dst is None else up[at_dst])

    def _key_reads(self, tables: Sequence[Sequence[int]], ctx_len: Sequence[int]) -> KeyReads:
        """The decodes' reads (on the host: exact attention runs on the CPU): each token's piece
        slots, and its whole key blocks as a slot range where its blocks are consecutive."""
        bs = self.spec.block_size
        splits = [split(n) for n in ctx_len]
        reach = max(keys for _, keys in splits)
        pieces = np.full((len(ctx_len), reach), self.spec.zero_slot, dtype=np.int64)
        in_place: list[range | None] = []
        gathered_rows: list[range | None] = []
        scattered, at = [], 0
        for r, (table, n, (base, _)) in enumerate(zip(tables, ctx_len, splits)):
            pieces[r, : n - base] = slot_array(table, base, n, bs)
            runs = slot_runs(table, 0, base, bs)
            place = range(runs[0].slot, runs[0].slot + base) if len(runs) == 1 else None
            in_place.append(place)
            gathered_rows.append(range(at, at + base) if base and place is None else None)
            if base and place is None:
                scattered.append(slot_array(table, 0, base, bs))
                at += base
        return KeyReads(torch.from_numpy(pieces), tuple(in_place), tuple(gathered_rows),
                        torch.from_numpy(np.concatenate(scattered)) if scattered else None, tuple(ctx_len))

    # ----- attention --------------------------------------------------------------------------
    def attend_decodes(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: KeyReads | GatheredDecodes,
                       fed: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if isinstance(meta, KeyReads):
            return self._in_place(q, kc, vc, meta)
        n, width = meta.slots.shape
        flat = meta.slots.reshape(-1)
        ks, vs = (self.gathers.contexts(c, flat, part, meta.feed_dst, fed).view(n, width, *c.shape[1:])
                  for part, c in enumerate((kc, vc)))  # [n, width, kv_heads, hd]
        return decode_attention(q, ks, vs, list(meta.lengths), self.spec.kernels)

    def _in_place(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, keys: KeyReads) -> torch.Tensor:
        """q [n, heads, hd], reading each decode's whole key blocks in place where its slots are
        consecutive -> [n, heads, hd]."""
        n, reach = keys.pieces.shape
        pieces = [torch.index_select(cache, 0, keys.pieces.view(-1), out=self.gathers.buffer(part, n * reach))
                  .view(n, reach, *cache.shape[1:]) for part, cache in enumerate((kc, vc))]  # [n, reach, kvh, hd]
        spread = keys.scattered
        gathered = [] if spread is None else \
            [torch.index_select(cache, 0, spread, out=self.gathers.buffer(2 + part, spread.numel()))
             for part, cache in enumerate((kc, vc))]  # [their whole blocks' keys, kvh, hd]
        wholes = [(kc[p.start : p.stop], vc[p.start : p.stop]) if p is not None else
                  (gathered[0][g.start : g.stop], gathered[1][g.start : g.stop]) if g is not None else None
                  for p, g in zip(keys.in_place, keys.gathered_rows)]
        return exact_attention.decode(q, (pieces[0], pieces[1]), wholes, keys.lengths,
                                      self.spec.kernels.bf16_attention)
