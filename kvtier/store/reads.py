"""A restore's reads: the chunks a plan names, opened once each on the tier the plan names.

`PlannedReads` opens every chunk of a restore up front (one header read and check per chunk),
then reads one layer group of all of them per call: one batched call per tier (a Redis pipeline,
direct-I/O reads of every file into one staging buffer, views of the memory tier's bytes). A
chunk missing from its planned tier is a miss: nothing is read from another tier behind the
plan's back.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from . import format as fmt
from .staging import Staging
from .tiers.base import Expect, OpenChunk, Tier


class PlannedChunkRef(Protocol):
    @property
    def key(self) -> str: ...
    @property
    def tier(self) -> str: ...


@dataclass
class LayerGroup:
    """One layer group read for every chunk: states[c][i] is layer layers[i] of chunk c."""

    layers: tuple[int, ...]
    states: list[list[fmt.LayerState]]
    nbytes: int
    buffers: list[torch.Tensor] = field(default_factory=list)  # staging memory the states view


class PlannedReads:
    def __init__(self, tiers: Sequence[Tier], expect: Callable[[str], Expect], chunks: Sequence[PlannedChunkRef],
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

    def open(self) -> bool:
        """Open every planned chunk on its planned tier; False (all closed) if any is missing."""
        for c, t in zip(self.chunks, self.tiers):
            oc = t.open_chunk(self._expect(c.key))
            if oc is None:
                self.close()
                return False
            self.opened.append(oc)
        return True

    def read(self, layers: Sequence[int], parts: Sequence[str], only: Sequence[int] | None = None) -> LayerGroup | None:
        """`parts` of `layers` of every chunk (or of the chunks at indices `only`), decoded to the
        compute dtype (views where the bytes allow). None if any read fails (the chunk is then
        removed from its tier as corrupt)."""
        layers = tuple(layers)
        wanted = range(len(self.opened)) if only is None else only
        states: dict[int, list[fmt.LayerState]] = {}
        group = LayerGroup(layers, [], 0)
        for tier in dict.fromkeys(self.tiers[i] for i in wanted):
            idx = [i for i in wanted if self.tiers[i] is tier]
            opened = [self.opened[i] for i in idx]
            try:
                runs = [oc.plan_read(layers, parts) for oc in opened]
            except fmt.FormatError as e:
                tier.discard_corrupt(opened[0].expect.key, str(e))
                return None
            outs = self._staging_for(tier, opened, runs, group)
            got = tier.read_runs(opened, runs, outs)
            if got is None:
                self.release(group)
                return None
            for i, oc, segs in zip(idx, opened, got):
                group.nbytes += sum(v.numel() for v in segs.values())
                states[i] = fmt.decode_layers(oc.header, segs, layers, parts, copy=False)
        group.states = [states[i] for i in wanted]
        return group

    def _staging_for(self, tier: Tier, opened: list[OpenChunk], runs: list, group: LayerGroup) -> list[torch.Tensor | None]:
        """One staging buffer for this tier's part of the group, cut per chunk at page multiples."""
        if not tier.owned_buffers:
            return [None] * len(opened)  # views of the tier's own memory: nothing to stage
        sizes = [oc.staging_bytes(r) for oc, r in zip(opened, runs)]
        buf = self.staging.take(sum(sizes))
        group.buffers.append(buf)
        outs, pos = [], 0
        for n in sizes:
            outs.append(buf[pos:pos + n])
            pos += n
        return outs

    def release(self, group: LayerGroup) -> None:
        """The group's states are placed: its staging memory may be reused."""
        for b in group.buffers:
            self.staging.give(b)
        group.buffers.clear()
        group.states = []

    def close(self) -> None:
        for oc in self.opened:
            oc.close()
        self.opened = []
