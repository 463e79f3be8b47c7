"""A restore's reads: the chunks a plan names, opened once each on the tier the plan names.

`PlannedReads` opens every chunk of a restore up front (one header read and check per chunk),
then reads one layer group of all of them per call: one batched call per tier (strided views of
the memory tier's bytes; disk reads straight into the chunks' pool slots where direct I/O allows,
else into a reused staging buffer; a Redis pipeline whose replies are viewed in place). A chunk
missing from its planned tier is a miss: nothing is read from another tier behind the plan's back.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from . import format as fmt
from .index import StoredChunk
from .staging import Staging
from .tiers.base import Expect, OpenChunk, PoolTarget, Tier


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under `t`, as a flat uint8 tensor."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@dataclass(frozen=True, eq=False)  # arrays: compared by identity
class Spans:
    """K/V (or hidden states) of a layer group of chunks the tier holds in memory, as one byte span
    per chunk: the chunk's layers lie [layers, 2 (K, V), T, kv_heads, hd] (or [layers, T, hidden])
    in it (every whole chunk stored in the compute dtype and token order). Arrays, not a view per
    chunk: a group costs the host the same few operations however many chunks a restore has (256
    at 16K tokens, in each of 8 groups)."""

    chunks: np.ndarray  # int64 [n]: indices (in the read's chunk order) of the chunks covered
    buffers: list[torch.Tensor]  # uint8 host storages the spans lie in (the tier's; alive while open)
    buffer: np.ndarray  # int64 [n]: index into `buffers` of each span
    offsets: np.ndarray  # int64 [n]: byte offset of each span in its buffer
    nbytes: int  # bytes of every span


@dataclass
class LayerGroup:
    """Consecutive layers read for every chunk: parts[p][c] is part p ("k", "v" or "h") of those
    layers of chunk c, shaped [len(layers), tokens, ...] (a strided view of the read bytes where
    they allow it), or None where the read put it straight into its pool slots or `spans` has it.
    Read `raw`, a chunk stored in another dtype has its parts as stored, and int8 ones
    "<part>.scale" too."""

    layers: tuple[int, ...]
    parts: dict[str, list[torch.Tensor | None]]
    nbytes: int
    buffers: list[torch.Tensor] = field(default_factory=list)  # staging memory the parts view
    spans: Spans | None = None  # read with `spans=T`: the K/V or h of the chunks lying whole in memory


@dataclass(frozen=True, eq=False)
class _SpanTable:
    """Per opened chunk, where its K/V (or h) of every stored layer lie as one [layers, 2, T, ...]
    (or [layers, T, hidden]) run in memory the tier holds (built once per restore and part; `ok`
    False where they do not)."""

    ok: np.ndarray  # bool [chunks]
    buffers: list[torch.Tensor]
    buffer: np.ndarray  # int64 [chunks]
    base: np.ndarray  # int64 [chunks]: byte offset of the first stored layer's K
    first: np.ndarray  # int64 [chunks]: that layer
    end: np.ndarray  # int64 [chunks]: one past the last stored layer
    layer_bytes: int  # K and V (or h) of one layer of a chunk


class PlannedReads:
    def __init__(self, tiers: Sequence[Tier], expect: Callable[[StoredChunk], Expect], chunks: Sequence[StoredChunk],
                 staging: Staging) -> None:
        by_name = {t.name: t for t in tiers}
        missing = {c.tier for c in chunks} - set(by_name)
        if missing:
            raise ValueError(f"the plan reads from tiers this store does not have: {sorted(missing)}")
        self.chunks = list(chunks)
        self.tiers = [by_name[c.tier] for c in chunks]
        self._expect = expect
        self.staging = staging
        self.opened: list[OpenChunk] = []
        self._tables: dict[tuple[str, ...], _SpanTable] = {}

    def open(self) -> bool:
        """Open every planned chunk on its planned tier; False (all closed) if any is missing."""
        opened: dict[int, OpenChunk | None] = {}
        for tier in dict.fromkeys(self.tiers):
            idx = [i for i, t in enumerate(self.tiers) if t is tier]
            opened.update(zip(idx, tier.open_chunks([self._expect(self.chunks[i]) for i in idx])))
        self.opened = [oc for _, oc in sorted(opened.items()) if oc is not None]
        if len(self.opened) < len(self.chunks):
            self.close()
            return False
        return True

    def read(self, layers: Sequence[int], parts: Sequence[str], only: Sequence[int] | None = None,
             into: Sequence[PoolTarget | None] | None = None, raw: bool = False, spans: int = 0) -> LayerGroup | None:
        """`parts` of consecutive `layers` (each stored with every one of `parts`) of every chunk,
        or of the chunks at indices `only`, in the compute dtype. None if any read fails (the
        chunk is then removed from its tier as corrupt).

        `into[c]` may offer chunk c's pool slots: a tier that can read K/V straight there does
        (direct I/O, or a copy of what its opening read ahead), and that part of the group is then
        None.

        `raw`: a chunk stored in another dtype (lossy storage) in token order comes as stored
        (`fmt.stored_run`: int8 values with their "<part>.scale" rows, or the storage dtype), for
        the caller to decode on its device after copying the smaller bytes over.

        `spans=T`: K/V (or h) of the chunks whose layers lie whole ([layers, 2, T, ...], or
        [layers, T, hidden]) in memory the tier holds come as `group.spans` (their parts None)
        instead of views."""
        layers = tuple(layers)
        wanted = range(len(self.opened)) if only is None else only
        decoded: dict[int, dict[str, torch.Tensor | None]] = {}
        group = LayerGroup(layers, {}, 0)
        rest: Sequence[int] = wanted
        kind = tuple(sorted(parts))
        try:
            if spans and kind in SPAN_PARTS and self.opened:
                group.spans, rest = self._spans(layers, wanted, spans, kind)
                group.nbytes += len(group.spans.chunks) * group.spans.nbytes
                for i in group.spans.chunks.tolist():
                    decoded[i] = dict.fromkeys(parts)
            for tier in dict.fromkeys(self.tiers[i] for i in rest):
                idx = [i for i in rest if self.tiers[i] is tier]
                if self._views(tier, idx, layers, parts, decoded, group):
                    continue
                if not self._read_tier(tier, idx, layers, parts, into, raw, decoded, group):
                    self.release(group)
                    return None
        except BaseException:  # a read or a decode raised: the group's staging goes back all the same
            self.release(group)
            raise
        names = list(parts) + sorted({q for d in decoded.values() for q in d} - set(parts))  # + raw chunks' scales
        group.parts = {p: [decoded[i].get(p) for i in wanted] for p in names}
        return group

    def _read_tier(self, tier: Tier, idx: list[int], layers: tuple[int, ...], parts: Sequence[str],
                   into: Sequence[PoolTarget | None] | None, raw: bool, decoded: dict, group: LayerGroup) -> bool:
        """Read `layers` of the chunks `idx` from `tier` in one batched call (into their pool slots
        where allowed, else staging) and decode them into `decoded`. False if a header's plan or the
        read fails (a chunk whose plan fails is discarded from the tier as corrupt)."""
        opened = [self.opened[i] for i in idx]
        runs = []
        for oc in opened:
            try:
                runs.append(oc.plan_read(layers, parts))
            except fmt.FormatError as e:
                tier.discard_corrupt(oc.expect.key, str(e))
                return False
        outs = self._staging_for(tier, opened, runs, group)
        # Straight into the pool only where the stored rows are the pool's (token order, compute dtype).
        dests = [into[i] if into and oc.header.storage_dtype == oc.header.compute_dtype and oc.header.order is None
                 else None for i, oc in zip(idx, opened)]
        got = tier.read_runs(opened, runs, outs, dests)
        if got is None:
            return False
        for i, oc, segs, r in zip(idx, opened, got, runs):
            group.nbytes += sum(s.nbytes for run in r for s in run)
            h = oc.header
            if raw and h.storage_dtype != h.compute_dtype and h.order is None:
                decoded[i] = {q: fmt.stored_run(h, segs, layers, q)
                              for q in (p + s for p in parts for s in ("", ".scale")) if (layers[0], q) in segs}
                continue
            decoded[i] = {p: fmt.in_token_order(h, layers, p, fmt.decode_run(h, segs, layers, p))
                          if (layers[0], p) in segs else None for p in parts}
        return True

    def _spans(self, layers: tuple[int, ...], wanted: Sequence[int], width: int,
               kind: tuple[str, ...]) -> tuple[Spans, list[int]]:
        """The chunks of `wanted` whose `kind` parts of `layers` lie whole in memory, as spans;
        -> (spans, the other chunks)."""
        t = self._tables.get(kind)
        if t is None:
            t = self._tables[kind] = self._span_table(width, kind)
        want = np.asarray(wanted, dtype=np.int64)
        ok = t.ok[want] & (t.first[want] <= layers[0]) & (t.end[want] >= layers[-1] + 1)
        covered = want[ok]
        n = len(layers) * t.layer_bytes
        found = Spans(covered, t.buffers, t.buffer[covered], t.base[covered] + (layers[0] - t.first[covered]) * t.layer_bytes, n)
        for tier in dict.fromkeys(self.tiers[i] for i in covered.tolist()):  # counted per tier, not per chunk
            count = sum(1 for i in covered.tolist() if self.tiers[i] is tier)
            tier._count_reads(count, count * n)
        return found, want[~ok].tolist()

    def _span_table(self, width: int, kind: tuple[str, ...]) -> _SpanTable:
        """Walk every opened chunk once (the restore's first group of `kind`): where its runs lie.
        A chunk qualifies when its tier holds it in memory in the compute dtype and token order,
        every stored layer's K then V back to back (or its h layers back to back), `width` tokens
        each."""
        n = len(self.opened)
        ok, buffer, base, first, end = (np.zeros(n, dtype=t) for t in (bool, np.int64, np.int64, np.int64, np.int64))
        buffers: dict[int, int] = {}
        storages: list[torch.Tensor] = []
        layer_bytes = 0
        for i, oc in enumerate(self.opened):
            runs = getattr(oc.reader, "runs", None) if oc.tier.zero_copy else None
            got = SPAN_PARTS[kind](oc, runs, width) if runs else None
            if got is None:
                continue
            k, lo = got  # the first part over every stored layer, and the first of those layers
            lb = len(kind) * k[0].nbytes
            if layer_bytes and lb != layer_bytes:
                continue
            layer_bytes = lb
            ptr = k.untyped_storage().data_ptr()
            if ptr not in buffers:
                buffers[ptr] = len(storages)
                storages.append(storage_bytes(k))
            ok[i], buffer[i], base[i] = True, buffers[ptr], k.storage_offset() * k.element_size()
            first[i], end[i] = lo, lo + k.shape[0]
            oc.tier.touch(oc.expect.key)
        return _SpanTable(ok, storages, buffer, base, first, end, layer_bytes)

    def _views(self, tier: Tier, idx: list[int], layers: tuple[int, ...], parts: Sequence[str],
               decoded: dict, group: LayerGroup) -> bool:
        """Memory the tier holds: each part of the layer range of a chunk is one strided view of its
        stored bytes, built from the header alone. False when the tier or the bytes do not allow it."""
        if not tier.zero_copy:
            return False
        views: dict[int, dict[str, torch.Tensor]] = {}
        for i in idx:
            oc = self.opened[i]
            blob = getattr(oc.reader, "blob", None)
            if blob is None:
                return False
            parts_i = {p: _run(oc, blob, layers, p) for p in parts}
            if any(v is None for v in parts_i.values()):
                return False
            # No None left. A reordered chunk's K/V become token-ordered copies.
            views[i] = {p: fmt.in_token_order(oc.header, layers, p, cast(torch.Tensor, v)) for p, v in parts_i.items()}
        for i, v in views.items():
            decoded[i] = v
            nbytes = sum(t.nbytes for t in v.values())
            group.nbytes += nbytes
            tier._count_read(self.chunks[i].key, nbytes)
        return True

    def _staging_for(self, tier: Tier, opened: list[OpenChunk], runs: list, group: LayerGroup) -> Sequence[torch.Tensor | None]:
        """Staging for this tier's part of the group, one page-multiple cut per chunk, taken only
        if a chunk's read asks for its cut: reads that go straight into the pool need none."""
        if not tier.stages_reads:
            return [None] * len(opened)  # the read's own memory serves (views of RAM, or a reply's bytes)
        return _StagingCuts(self.staging, [oc.staging_bytes(r) for oc, r in zip(opened, runs)], group)

    def release(self, group: LayerGroup) -> None:
        """The group's states are placed: its staging memory may be reused."""
        for b in group.buffers:
            self.staging.give(b)
        group.buffers.clear()
        group.parts = {}

    def close(self) -> None:
        for oc in self.opened:
            oc.close()
        self.opened = []


class _StagingCuts(Sequence[torch.Tensor]):
    """Per-chunk cuts of one staging buffer, taken (and held by the group) at the first cut asked
    for; the tier's IO threads may ask at once."""

    def __init__(self, staging: Staging, sizes: list[int], group: LayerGroup) -> None:
        self.staging, self.sizes, self.group = staging, sizes, group
        self._cuts: list[torch.Tensor] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):  # ints only: read_runs indexes by chunk
        with self._lock:
            if self._cuts is None:
                buf = self.staging.take(sum(self.sizes))
                self.group.buffers.append(buf)
                ends = np.cumsum(self.sizes).tolist()
                self._cuts = [buf[e - n:e] for e, n in zip(ends, self.sizes)]
            return self._cuts[i]


def kv_back_to_back(k: torch.Tensor, v: torch.Tensor, width: int) -> bool:
    """K and V views [layers, width, kv_heads, hd] of one buffer lying as [layers, 2 (K, V), width,
    kv_heads, hd]: the layout a restore's staging slot has, so a chunk's layers go over in one run."""
    row = k[0, 0].numel()
    return k.shape == v.shape and k.shape[1] == width and k.dtype == v.dtype \
        and k.stride() == (2 * width * row, row, k.shape[3], 1) and v.stride() == k.stride() \
        and v.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() \
        and v.storage_offset() - k.storage_offset() == width * row


def _whole_kv(oc: OpenChunk, runs: dict, width: int) -> tuple[torch.Tensor, int] | None:
    """A chunk's K over every stored layer, [layers, width, kv_heads, hd], and its first layer,
    where K and V of each layer lie back to back in the compute dtype and token order; else None."""
    k, v, h = runs.get("k"), runs.get("v"), oc.header
    if k is None or v is None or k[1] != v[1] or h.row_of is not None or h.storage_dtype != h.compute_dtype \
            or not kv_back_to_back(k[0], v[0], width):
        return None
    return k[0], k[1]


def _whole_h(oc: OpenChunk, runs: dict, width: int) -> tuple[torch.Tensor, int] | None:
    """A chunk's hidden states over every stored layer, [layers, width, hidden], and its first
    layer, where the layers lie back to back in the compute dtype; else None."""
    h, hd = runs.get("h"), oc.header
    if h is None or hd.storage_dtype != hd.compute_dtype:
        return None
    hr = h[0]
    if hr.shape[1] != width or not hr.is_contiguous():
        return None
    return hr, h[1]


# The part sets a restore reads as spans, and how to find a chunk's all-layer run of them.
SPAN_PARTS: dict[tuple[str, ...], Callable[[OpenChunk, dict, int], tuple[torch.Tensor, int] | None]] = {
    ("k", "v"): _whole_kv, ("h",): _whole_h}


def _run(oc: OpenChunk, blob: torch.Tensor, layers: tuple[int, ...], part: str) -> torch.Tensor | None:
    """`part` of consecutive `layers` of a chunk held in memory: a slice of the chunk's all-layer
    view (a restore asks for every group of every chunk: one header walk per chunk, not per group).
    The views are the tier entry's (`runs`: part -> (view, first layer) or None, built when the
    chunk came in), so a group costs one slice per chunk."""
    runs: dict = getattr(oc.reader, "runs", {})
    got = runs.get(part)
    if got is None:
        return fmt.strided_run(oc.header, blob, layers, part)
    run, first = got
    a = layers[0] - first
    if a < 0 or a + len(layers) > run.shape[0]:
        return fmt.strided_run(oc.header, blob, layers, part)
    return run[a:a + len(layers)]
