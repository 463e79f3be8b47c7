"""Reading a stored prefix by token (the importance-only restore, IMPRESS §4.3-4.4).

Chunks stored with the importance layout (`StoreNamespace.probe_kv_heads`, `granule_tokens`) hold
every layer's probe keys together at their start and a checksum per granule of rows in every K/V
segment. `TokenReads` opens a prefix's chunks once (each on the tier the lookup found it in), reads
all layers' probe keys with one ranged read per chunk, then, per layer, only the granules that
hold the tokens the layer keeps: adjacent granules of one segment are one ranged read. Every read
goes through its tier (throttled and counted like a restore's) and is verified granule by granule.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from . import codec
from . import format as fmt
from .format import FormatError, coalesce
from .index import StoredChunk
from .layout import Repr
from .tiered import TieredStore
from .tiers.base import OpenChunk

READ_THREADS = 4  # concurrent ranged reads of one layer's chunks


class TokenReadMiss(RuntimeError):
    """A chunk of the prefix could not be read intact: the caller recomputes instead."""


@dataclass
class ReadCounts:
    nbytes: int = 0
    calls: int = 0  # ranged reads issued
    granules: int = 0  # K/V granules read
    granules_whole: int = 0  # granules the same segments hold in all (a whole-part read)
    # Of those, what reads of chosen tokens (not whole parts) read and could have: how much of
    # the stored state the kept tokens touch (the planner learns it).
    chosen: int = 0
    chosen_of: int = 0


class TokenReads:
    def __init__(self, store: TieredStore, chunks: Sequence[StoredChunk]) -> None:
        ns = store.namespace
        if ns is None or not ns.probe_kv_heads or not ns.granule_tokens:
            raise ValueError("token reads need the importance store layout (probe_kv_heads and granule_tokens "
                             "in the store namespace)")
        self.ns = ns
        self.granule = ns.granule_tokens
        self.chunks = list(chunks)
        self.starts = [c.start - self.chunks[0].start for c in self.chunks]  # offset of each chunk in the prefix
        self.tokens = self.chunks[-1].end - self.chunks[0].start if self.chunks else 0
        self.kv_layers = [li for li, r in enumerate(ns.layer_reprs) if r is Repr.KV]
        self.counts = ReadCounts()
        self._reads = store.planned_reads(self.chunks)
        if not self._reads.open():
            raise TokenReadMiss("a chunk of the prefix is gone from the tier it was found in")
        self.opened: list[OpenChunk] = self._reads.opened
        self._pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="kvtier-token-read")

    def _decode(self, buf: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return codec.decode(buf, self.ns.storage_dtype, shape, self.ns.compute_dtype, copy=False)

    def probe_keys(self) -> dict[int, torch.Tensor]:
        """Every KV layer's probe keys over the prefix: {layer: [tokens, probe kv heads, hd]}."""
        per_layer: dict[int, list[torch.Tensor]] = {li: [] for li in self.kv_layers}
        for oc in self.opened:
            segs = [oc.header.by_part[(li, "kp")] for li in self.kv_layers]
            runs = coalesce(segs)
            got = oc.tier.read_runs([oc], [runs], [None])
            if got is None:
                raise TokenReadMiss(f"probe keys of chunk {oc.expect.key[:12]} unreadable")
            self.counts.nbytes += sum(s.nbytes for s in segs)
            self.counts.calls += len(runs)
            for s in segs:
                per_layer[s.layer].append(self._decode(got[0][(s.layer, "kp")], s.shape))
        return {li: torch.cat(parts) for li, parts in per_layer.items()}

    def rows(self, layer: int, part: str, tokens: torch.Tensor) -> torch.Tensor:
        """`part` ("k" or "v") of prefix tokens `tokens` ([n] ascending indices into the prefix) of
        one layer: [n, kv_heads, hd], reading only the granules that hold them."""
        return self.rows_of(layer, (part,), tokens)[part]

    def rows_of(self, layer: int, parts: tuple[str, ...], tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Several parts of the same tokens of one layer. The chunks are read concurrently (a
        layer's reads depend on its selection, so they cannot start earlier; concurrent ranged reads
        keep the device busy while the others are checked and decoded)."""
        per_chunk: dict[int, list[int]] = {}
        bounds = self.starts[1:] + [self.tokens]
        ci = 0
        for t in tokens.tolist():  # ascending
            while t >= bounds[ci]:
                ci += 1
            per_chunk.setdefault(ci, []).append(t - self.starts[ci])
        jobs = [(ci, local) for ci, local in per_chunk.items()]
        results = list(self._pool.map(lambda job: self._chunk_rows(layer, parts, *job), jobs)) if len(jobs) > 1 \
            else [self._chunk_rows(layer, parts, *job) for job in jobs]
        for _, (nbytes, calls, granules, whole) in results:
            self.counts.nbytes += nbytes
            self.counts.calls += calls
            self.counts.granules += granules
            self.counts.granules_whole += whole
            self.counts.chosen += granules
        # Every chunk holds granules of these parts, read or not.
        self.counts.chosen_of += sum(len(oc.header.by_part[(layer, p)].granules) for oc in self.opened for p in parts)
        empty = torch.empty(0, self.ns.num_kv_heads, self.ns.head_dim)
        return {p: torch.cat([r[0][p] for r in results]) if results else empty for p in parts}

    def _chunk_rows(self, layer: int, parts: tuple[str, ...], ci: int, local: list[int]):
        """Tokens `local` (ascending) of chunk `ci`: ({part: [n, kv_heads, hd]}, (bytes, calls,
        granules read, granules held)). A reordered chunk's tokens sit at other rows (the header's
        row_of): the granules read are those of the rows, the result is in the order asked."""
        oc, g = self.opened[ci], self.granule
        row_of = oc.header.row_of
        rows = local if row_of is None else row_of[layer][local].tolist()
        spans = _spans(sorted({r // g for r in rows}))
        out, nbytes, granules, whole = {}, 0, 0, 0
        for part in parts:
            seg = oc.header.by_part[(layer, part)]
            whole += len(seg.granules)
            pieces = []
            for first, last in spans:
                try:
                    buf = oc.read_granules(seg, first, last, g)
                except FormatError as e:  # corrupt: gone from this tier, as any corrupt read
                    oc.tier.discard_corrupt(oc.expect.key, str(e))
                    raise TokenReadMiss(f"{part} of layer {layer} of chunk {oc.expect.key[:12]}: {e}") from e
                except OSError as e:
                    raise TokenReadMiss(f"{part} of layer {layer} of chunk {oc.expect.key[:12]}: {e}") from e
                nbytes += buf.numel()
                granules += last - first + 1
                pieces.append(self._decode(buf, (buf.numel() // (seg.nbytes // seg.shape[0]), *seg.shape[1:])))
            # Where each wanted row sits among the read granules' rows.
            base, first_row = {}, 0
            for (first, last), piece in zip(spans, pieces):
                for gi in range(first, last + 1):
                    base[gi] = first_row + (gi - first) * g
                first_row += piece.shape[0]
            at = [base[r // g] + r % g for r in rows]
            got = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
            out[part] = got.index_select(0, torch.tensor(at))
        return out, (nbytes, len(spans) * len(parts), granules, whole)

    def whole(self, layer: int, part: str) -> torch.Tensor:
        """All of `part` of one layer over the prefix: [tokens, kv_heads, hd] (a fallback layer's keys)."""
        out = []
        for oc in self.opened:
            seg = oc.header.by_part[(layer, part)]
            got = oc.tier.read_runs([oc], [[[seg]]], [None])
            if got is None:
                raise TokenReadMiss(f"{part} of layer {layer} of chunk {oc.expect.key[:12]} unreadable")
            self.counts.nbytes += seg.nbytes
            self.counts.calls += 1
            self.counts.granules += len(seg.granules)
            self.counts.granules_whole += len(seg.granules)
            out.append(fmt.in_token_order(oc.header, (layer,), part, self._decode(got[0][(layer, part)], seg.shape)[None])[0])
        return torch.cat(out)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._reads.close()


def _spans(sorted_ids: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive integers: [0, 1, 2, 5, 6] -> [(0, 2), (5, 6)]."""
    spans: list[tuple[int, int]] = []
    for i in sorted_ids:
        if spans and i == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], i)
        else:
            spans.append((i, i))
    return spans
