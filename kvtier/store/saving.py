"""Turning a host snapshot into per-chunk, per-layer tensors (first half of the writer's work)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .layout import Repr, StoreNamespace


@dataclass(frozen=True)
class SaveJob:
    token_ids: tuple[int, ...]  # the whole context [0, end)
    start: int  # the tensors cover tokens [start, end)
    k: torch.Tensor | None  # [layers or kv_layers, end-start, kv_heads, head_dim], pre-RoPE
    v: torch.Tensor | None  # same as k
    h: torch.Tensor | None  # [layers or hidden_layers, end-start, hidden]
    salt: str = ""  # the request's cache partition (keys.salted_root)
    space: str = ""  # a key space apart from the exact chains (keys.salted_root); "" for them

    @property
    def end(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PendingSave:
    """A save whose tensors are still being copied off the device: `assemble` (run on the writer
    thread) waits for the copies and returns (k, v, h) as a SaveJob holds them."""

    token_ids: tuple[int, ...]
    start: int
    assemble: Callable[[], tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]]
    nbytes: int
    salt: str = ""

    def job(self) -> SaveJob:
        return SaveJob(self.token_ids, self.start, *self.assemble(), self.salt)


def _layer_slots(ns: StoreNamespace, rep: Repr) -> dict[int, int]:
    """Layer -> row of a tensor that holds only the layers stored as `rep`."""
    rows = [l for l, r in enumerate(ns.layer_reprs) if r == rep]
    return {l: i for i, l in enumerate(rows)}


def check_job(ns: StoreNamespace, job: SaveJob) -> None:
    """Shapes are checked on the caller's thread: a wrong shape is a bug to report, not to drop."""
    n = job.end - job.start
    if not 0 <= job.start < job.end:
        raise ValueError(f"save: start={job.start} outside the context of {job.end} tokens")
    for part, rep in (("k", Repr.KV), ("v", Repr.KV), ("h", Repr.HIDDEN)):
        t = getattr(job, part)
        needed = rep in ns.layer_reprs
        if t is None:
            if needed:
                raise ValueError(f"save: the namespace stores {rep.value} layers but {part} is None")
            continue
        rows = (ns.num_layers, sum(r == rep for r in ns.layer_reprs))
        want = ns.part_shape(part, n)
        if t.dim() != 1 + len(want) or t.shape[0] not in rows or tuple(t.shape[1:]) != want:
            raise ValueError(f"save: {part} has shape {tuple(t.shape)}, expected "
                             f"[{rows[0]} (or {rows[1]}), {', '.join(map(str, want))}]")


def job_nbytes(job: SaveJob) -> int:
    return sum(t.numel() * t.element_size() for t in (job.k, job.v, job.h) if t is not None)


def chunk_layers(ns: StoreNamespace, job: SaveJob, lo: int, hi: int,
                 prefix: dict[int, dict[str, torch.Tensor]] | None = None
                 ) -> dict[int, dict[str, torch.Tensor]]:
    """Per-layer parts for context tokens [lo, hi), all in the job's range except an optional
    `prefix` (already-stored tokens just before job.start, read back from the store)."""
    kv_rows = _layer_slots(ns, Repr.KV)
    h_rows = _layer_slots(ns, Repr.HIDDEN)
    a, b = lo - job.start, hi - job.start
    out: dict[int, dict[str, torch.Tensor]] = {}
    for layer, rep in enumerate(ns.layer_reprs):
        parts: dict[str, torch.Tensor] = {}
        for part in rep.parts():
            t = getattr(job, part)
            full = t.shape[0] == ns.num_layers
            row = layer if full else (kv_rows if rep == Repr.KV else h_rows)[layer]
            piece = t[row, max(a, 0):b]  # [tokens, kv_heads, head_dim] or [tokens, hidden]
            if prefix is not None:
                piece = torch.cat([prefix[layer][part].to(piece.dtype), piece], dim=0)
            parts[part] = piece
        out[layer] = parts
    return out
