"""Saving: every computed token's state goes to the store, chunk by chunk, off the step's path.

K (rotated) and V of every computed token are in the device pool already, so saving reads them from
there: once a step's forward is enqueued, and before the host waits for its tokens (the step's one
device sync), the pool blocks every request of the step filled are gathered on the compute stream
into one fresh device buffer [2, kv layers, tokens, kv_heads, hd] and copied to pinned host memory
on the transfer's device-to-host stream: one gather per part and one copy per step that filled a
block, never one per request, layer or token; that host work runs while the device computes, and
the pool block may be reused at once (the snapshot is a copy, ordered before any later write). A
request's partial last block is snapshotted when it finishes. Hidden states (HCache
layers) are not in the pool: the runner's capture callback gathers them per step into one device
buffer [hidden layers, tokens, hidden], copied out once at the step's last layer.

Whenever a request's snapshots cross a chunk boundary (and at its end) they go to the store's
bounded background writer as a pending save: the writer thread waits for the copies and
concatenates them (HCache §4.2.2's two stages). The step thread never waits on a save copy and never
concatenates. Approximate state (a truncated context) is never saved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.engine.request import Request
from kvtier.engine.runner.model_runner import CaptureFn, ModelRunner
from kvtier.engine.runner.transfer import Handle, Transfer
from kvtier.store.layout import Repr
from kvtier.store.saving import PendingSave
from kvtier.store.tiered import TieredStore

# A host snapshot of positions [a, b): K/V [2, kv layers, b - a, kv_heads, hd] or h [hidden layers,
# b - a, hidden], a view of a buffer whose device-to-host copy is `handle`.
Piece = tuple[int, int, torch.Tensor, Handle]


@dataclass
class _Buffer:
    start: int  # first position not yet handed to the writer
    upto: int  # the pool holds this request's computed state up to here
    snapped: int  # K/V of [start, snapped) are in `kv`
    kv: list[Piece] = field(default_factory=list)
    h: list[Piece] = field(default_factory=list)  # hidden states of [start, upto)


class Saver:
    def __init__(self, store: TieredStore, layout: Sequence[Repr], chunk_tokens: int, runner: ModelRunner) -> None:
        self.store, self.runner = store, runner
        self.transfer: Transfer = runner.transfer
        self.layout = tuple(layout)
        self.chunk_tokens = chunk_tokens
        self.kv_layers = [li for li, r in enumerate(self.layout) if r is Repr.KV]
        self.h_layers = [li for li, r in enumerate(self.layout) if r is Repr.HIDDEN]
        # Index of the KV layers in the pool (None: every layer, gathered in one index_select).
        self._kv_index = None if len(self.kv_layers) == len(self.layout) else \
            runner.upload(torch.tensor(self.kv_layers, dtype=torch.long))
        self.buffers: dict[str, _Buffer] = {}
        self.saves = 0

    def capture_for(self, reqs: Sequence[Request]) -> CaptureFn | None:
        """Note where each request's new state starts; the runner callback for the step's hidden
        states (None when no layer stores them)."""
        bufs: list[_Buffer | None] = []
        for r in reqs:
            # Approximate state is never saved as if it were exact; cache_prompt false saves nothing.
            if r.approximate or not r.cache_prompt:
                bufs.append(None)
                continue
            b = self.buffers.get(r.request_id)
            if b is None or b.upto != r.num_computed:  # new, or a gap (preemption): start here
                b = self.buffers[r.request_id] = _Buffer(r.num_computed, r.num_computed, r.num_computed)
            bufs.append(b)
        if not self.h_layers or all(b is None for b in bufs):
            return None
        row = {li: i for i, li in enumerate(self.h_layers)}
        step: list[torch.Tensor] = []  # the step's device buffer [hidden layers, tokens, hidden]

        def capture(layer: int, offsets: tuple[int, ...], h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            if layer not in row:
                return
            if not step:
                step.append(torch.empty(len(self.h_layers), offsets[-1], h.shape[-1], dtype=h.dtype, device=h.device))
            step[0][row[layer]].copy_(h[: offsets[-1]])  # the captured requests' rows come first
            if row[layer] < len(self.h_layers) - 1:
                return
            (host,), handle = self.transfer.to_host(step)
            for i, b in enumerate(bufs):
                lo, hi = offsets[i], offsets[i + 1]
                if b is not None and hi > lo:  # this step's tokens of the request start where its state ends
                    b.h.append((b.upto, b.upto + hi - lo, host[:, lo:hi], handle))

        return capture

    def before_sample(self, reqs: Sequence[Request]) -> None:
        """The step's requests (their positions advanced, the forward enqueued, the tokens not yet
        waited for): snapshot the blocks they filled, all in one gather and one copy."""
        if not self.kv_layers:
            return
        bs, ct = self.runner.block_size, self.chunk_tokens
        spans = []
        for req in reqs:
            b = self.buffers.get(req.request_id)
            end = req.num_computed
            snap = max(end // bs * bs, end // ct * ct)
            if b is not None and snap > b.snapped:
                spans.append((b, req.block_ids, b.snapped, snap))
        for (b, *_, snap), piece in zip(spans, self._snapshot([s[1:] for s in spans])):
            b.kv.append(piece)
            b.snapped = snap

    def after_step(self, req: Request, finished: bool) -> None:
        """Snapshot a finished request's last partial block (`before_sample` took the filled
        ones); hand full chunks (or, at the end, everything) to the writer."""
        b = self.buffers.get(req.request_id)
        if b is not None:
            end = b.upto = req.num_computed
            bs, ct = self.runner.block_size, self.chunk_tokens
            snap = end if finished else max(end // bs * bs, end // ct * ct)
            if self.kv_layers and snap > b.snapped:
                b.kv += self._snapshot([(req.block_ids, b.snapped, snap)])
                b.snapped = snap
            cut = end if finished else end // ct * ct
            if cut > b.start:
                self._save(req, b, cut)
        if finished:
            self.buffers.pop(req.request_id, None)

    def drop(self, request_id: str) -> None:
        """Forget what was captured for a request (aborted, or its step's result was void)."""
        self.buffers.pop(request_id, None)

    @torch.inference_mode()
    def _snapshot(self, spans: Sequence[tuple[Sequence[int], int, int]]) -> list[Piece]:
        """K/V of positions [a, b) of each (block ids, a, b) out of the pool: one gather per part
        into one device buffer, one device-to-host copy; each piece a view of its tokens."""
        if not spans:
            return []
        r = self.runner
        slots = r.upload(torch.cat([r.slots(ids, a, b) for ids, a, b in spans]))
        pools = (r.k_cache, r.v_cache)  # [layers, slots, kv_heads, hd]
        if self._kv_index is not None:
            out = torch.stack([p.index_select(1, slots).index_select(0, self._kv_index) for p in pools])
        else:
            out = torch.empty((2, pools[0].shape[0], len(slots), *pools[0].shape[2:]), dtype=pools[0].dtype,
                              device=pools[0].device)
            for p, dst in zip(pools, out):
                torch.index_select(p, 1, slots, out=dst)
        (host,), handle = self.transfer.to_host([out])  # [2, kv layers, tokens of every span, kvh, hd]
        pieces, at = [], 0
        for _, a, b in spans:
            pieces.append((a, b, host.narrow(2, at, b - a), handle))
            at += b - a
        return pieces

    def _save(self, req: Request, b: _Buffer, cut: int) -> None:
        """Tokens [b.start, cut) to the writer, as views of the snapshots (nothing copied here)."""
        kv, b.kv = _split(b.kv, cut)
        h, b.h = _split(b.h, cut)
        transfer, has_h, has_kv = self.transfer, bool(self.h_layers), bool(self.kv_layers)

        def assemble() -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
            # On the writer thread: wait for the copies, then join the pieces along tokens.
            for *_, handle in kv + h:
                transfer.sync(handle)
            k = _cat([p[2][0] for p in kv]) if has_kv else None  # [kv layers, tokens, kvh, hd]
            v = _cat([p[2][1] for p in kv]) if has_kv else None
            hh = _cat([p[2] for p in h]) if has_h else None  # [hidden layers, tokens, hidden]
            return k, v, hh

        nbytes = sum(p[2].nbytes for p in kv + h)
        self.store.save_pending(PendingSave(tuple(req.all_ids[:cut]), b.start, assemble, nbytes, req.cache_salt))
        self.saves += 1
        b.start = cut


def _cat(pieces: list[torch.Tensor]) -> torch.Tensor:
    """Host tensors [layers, tokens, ...] joined along tokens, by numpy: a torch op parallel over
    OpenMP threads, run on the writer thread, leaves the step thread's own parallel ops on one core
    afterwards, which slows the restores and steps that follow on a small CPU."""
    if len(pieces) == 1:
        return pieces[0]
    joined = np.concatenate([p.view(torch.uint8).numpy() for p in pieces], axis=1)  # bytes: any dtype
    return torch.from_numpy(joined).view(pieces[0].dtype)


def _split(pieces: list[Piece], cut: int) -> tuple[list[Piece], list[Piece]]:
    """Pieces before `cut` and from it on (a piece across it becomes two views)."""
    before, after = [], []
    for a, b, t, handle in pieces:
        dim = 2 if t.dim() == 5 else 1  # K/V snapshots [2, layers, tokens, ...]; h [layers, tokens, hidden]
        if b <= cut:
            before.append((a, b, t, handle))
        elif a >= cut:
            after.append((a, b, t, handle))
        else:
            before.append((a, cut, t.narrow(dim, 0, cut - a), handle))
            after.append((cut, b, t.narrow(dim, cut - a, b - cut), handle))
    return before, after
