"""The importance restore's reads from the store, timed apart from the compute: the probe keys up
front, every key of a layer where choosing needs them, and the kept tokens' K and V."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

from kvtier.engine.impress.policy import ImpressStats
from kvtier.store.selective import TokenReads

T = TypeVar("T")


class TimedReads:
    """`TokenReads` of one restore; the time spent reading goes to `stats.read_s`."""

    def __init__(self, reads: TokenReads, stats: ImpressStats) -> None:
        self.reads, self.stats = reads, stats

    def _timed(self, read: Callable[[], T]) -> T:
        t = time.perf_counter()
        out = read()
        self.stats.read_s += time.perf_counter() - t
        return out

    def probe_keys(self) -> dict[int, torch.Tensor]:
        """Per layer, the probe KV heads' keys of the whole prefix [m, probes, hd] (one read per chunk)."""
        return self._timed(self.reads.probe_keys)

    def keys(self, layer: int) -> torch.Tensor:
        """Every prefix key of a layer [m, kv_heads, hd]."""
        return self._timed(lambda: self.reads.whole(layer, "k"))

    def values(self, layer: int) -> torch.Tensor:
        """Every prefix value of a layer [m, kv_heads, hd]."""
        return self._timed(lambda: self.reads.whole(layer, "v"))

    def kept_kv(self, layer: int, kept: torch.Tensor, keys: torch.Tensor | None,
                every: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [k, kv_heads, hd] of the kept tokens `kept` [k] of a layer; `keys`: the layer's
        every key where choosing read them already; `every`: the layer keeps the whole prefix."""
        if every:  # whole segments
            k = keys if keys is not None else self.keys(layer)
            return k, self.values(layer)
        if keys is not None:  # the keys are here already (fallback, H2O): the kept values
            return keys.index_select(0, kept), self._timed(lambda: self.reads.rows(layer, "v", kept))
        got = self._timed(lambda: self.reads.rows_of(layer, ("k", "v"), kept))  # one pass over the chunks
        return got["k"], got["v"]

    def report(self) -> None:
        """The reads' totals into the stats."""
        c, st = self.reads.counts, self.stats
        st.bytes_read, st.read_calls, st.granules_read, st.granules_whole = c.nbytes, c.calls, c.granules, c.granules_whole
        st.chosen_share = c.chosen / c.chosen_of if c.chosen_of else 0.0
