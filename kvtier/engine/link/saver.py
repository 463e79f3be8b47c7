"""Saving: every computed token's state goes to the store, chunk by chunk, off the step's path.

Two stages (HCache §4.2.2). First, once per layer per step, the runner's capture callback takes the
whole batch's layer input and K (rotated)/V: on the CPU as views of the step's own tensors (which
nothing modifies afterwards), on CUDA as one device-to-host copy per part into pinned memory on the
transfer's own stream, so no device tensor outlives the step. Then, per request, whenever its
buffer crosses a chunk boundary (and at its end, for the partial tail), the host pieces are
stacked into one snapshot per part and handed to the store's bounded background writer; the
copies are waited on first. Approximate state (a truncated context) is never captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.engine.request import Request
from kvtier.engine.runner.model_runner import CaptureFn
from kvtier.engine.runner.transfer import Handle, Transfer
from kvtier.store.layout import Repr
from kvtier.store.tiered import TieredStore


@dataclass
class _Buffer:
    start: int  # first position held
    h: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][piece] -> [tokens, hidden]
    k: list[list[torch.Tensor]] = field(default_factory=list)  # [layer][piece] -> [tokens, kv_heads, hd]
    v: list[list[torch.Tensor]] = field(default_factory=list)
    tokens: int = 0


class Saver:
    def __init__(self, store: TieredStore, layout: Sequence[Repr], chunk_tokens: int,
                 transfer: Transfer | None = None) -> None:
        self.store = store
        self.transfer = transfer or Transfer()
        self._copies: list[Handle] = []  # device-to-host copies not yet waited on
        self.layout = tuple(layout)
        self.chunk_tokens = chunk_tokens
        self.kv_layers = [li for li, r in enumerate(self.layout) if r is Repr.KV]
        self.h_layers = [li for li, r in enumerate(self.layout) if r is Repr.HIDDEN]
        self.buffers: dict[str, _Buffer] = {}
        self.saves = 0

    def capture_for(self, reqs: Sequence[Request]) -> CaptureFn | None:
        """The runner callback for one step over `reqs` (in the step's run order)."""
        bufs: list[_Buffer | None] = []
        for r in reqs:
            if r.approximate:  # approximate state: never saved as if it were exact
                bufs.append(None)
                continue
            b = self.buffers.get(r.request_id)
            if b is None or b.start + b.tokens != r.num_computed:  # new, or a gap (preemption): start here
                b = self.buffers[r.request_id] = _Buffer(r.num_computed)
            bufs.append(b)
        n = len(self.layout)
        if all(b is None for b in bufs):
            return None

        def capture(layer: int, offsets: tuple[int, ...], h: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            r = self.layout[layer]
            if r is Repr.NONE:
                parts: list[torch.Tensor] = []
            else:
                parts, handle = self.transfer.to_host([h] if r is Repr.HIDDEN else [k, v])  # the whole batch
                if not self.transfer.done(handle):
                    self._copies.append(handle)
            for i, b in enumerate(bufs):
                if b is None:
                    continue
                if not b.h:
                    b.h, b.k, b.v = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
                lo, hi = offsets[i], offsets[i + 1]
                if r is Repr.HIDDEN:
                    b.h[layer].append(parts[0][lo:hi])
                elif r is Repr.KV:
                    b.k[layer].append(parts[0][lo:hi])
                    b.v[layer].append(parts[1][lo:hi])
                if layer == n - 1:
                    b.tokens += hi - lo

        return capture

    def after_step(self, req: Request, finished: bool) -> None:
        """Hand full chunks (or, at the end, everything) of the request's buffer to the writer."""
        b = self.buffers.get(req.request_id)
        if b is not None and b.tokens:
            end = b.start + b.tokens
            cut = end if finished else (end // self.chunk_tokens) * self.chunk_tokens
            if cut > b.start:
                self._save(req, b, cut)
        if finished:
            self.buffers.pop(req.request_id, None)

    def drop(self, request_id: str) -> None:
        """Forget what was captured for a request (aborted, or its step's result was void)."""
        self.buffers.pop(request_id, None)

    def _save(self, req: Request, b: _Buffer, cut: int) -> None:
        take = cut - b.start
        for handle in self._copies:  # the host pieces hold their data once their copies are done
            self.transfer.sync(handle)
        self._copies.clear()

        def stack(parts: list[list[torch.Tensor]], layers: list[int]) -> torch.Tensor | None:
            if not layers:
                return None
            whole = [torch.cat(parts[li]) for li in layers]  # [tokens held, ...] per layer
            for li, w in zip(layers, whole):
                parts[li] = [w[take:]] if w.shape[0] > take else []
            return torch.stack([w[:take] for w in whole])  # [layers, take, ...]: a fresh host tensor

        k, v, h = stack(b.k, self.kv_layers), stack(b.v, self.kv_layers), stack(b.h, self.h_layers)
        self.store.save(req.all_ids[:cut], b.start, k, v, h, req.cache_salt)
        self.saves += 1
        b.start, b.tokens = cut, b.tokens - take
