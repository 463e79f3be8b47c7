"""The importance restore's choices, one function per `Selection` variant's scoring: pure compute
over tensors already read (the reads are in reads.py, the layer in prefill.py).

A prefix is chosen in units (`Units`): single tokens, or whole store granules chosen by their
summed importance so a read never fetches a granule for one token of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvtier.engine.impress.importance import LayerSelection, mean_jaccard, select, select_all, top_k
from kvtier.models.attention import column_importance


@dataclass(frozen=True)
class Units:
    """A prefix of `prefix` tokens cut into `count` whole units of `unit` tokens, `kept` of them
    chosen per layer; a trailing part-unit is always kept besides them. Token scores are first
    max-pooled over `window` tokens centred on each (1: as they are)."""

    prefix: int
    unit: int
    count: int
    kept: int
    window: int = 1

    def pooled(self, imp: torch.Tensor) -> torch.Tensor:
        """[heads, prefix] token importance -> [heads, count] importance per unit."""
        if self.window > 1:  # [heads, 1, prefix] -> the same shape, each token its window's highest
            imp = F.max_pool1d(imp[:, None], self.window, stride=1, padding=self.window // 2)[:, 0]
        if self.unit == 1:
            return imp
        return imp[:, : self.count * self.unit].reshape(imp.shape[0], self.count, self.unit).sum(-1)

    def tokens(self, chosen: torch.Tensor) -> torch.Tensor:
        """[kept] chosen units, ascending -> the prefix tokens they hold (and the trailing part-unit)."""
        if self.unit == 1:
            return chosen
        whole = (chosen[:, None] * self.unit + torch.arange(self.unit)).flatten()
        return torch.cat([whole, torch.arange(self.count * self.unit, self.prefix)])


@dataclass(frozen=True)
class ProbeHeads:
    """The probe KV heads [kv.start, kv.stop) and the query heads that read them."""

    kv: slice
    q: slice

    @staticmethod
    def of(first: int, count: int, group: int) -> ProbeHeads:
        return ProbeHeads(slice(first, first + count), slice(first * group, (first + count) * group))


def probe_selection(q: torch.Tensor, k_new: torch.Tensor, probe_keys: torch.Tensor, heads: ProbeHeads, units: Units,
                    threshold: float, rule: str) -> tuple[torch.Tensor, LayerSelection | None]:
    """IMPRESS's (and PROBES', threshold 0) first step: the probe heads score the prefix from their
    keys alone. q [n, heads, hd], k_new [n, kv_heads, hd] the new rows'; probe_keys [m, probes, hd].
    -> (the probe query heads' importance [probe q heads, units], their consensus set or None
    where they disagree)."""
    imp = units.pooled(column_importance(q[:, heads.q], probe_keys, k_new[:, heads.kv]))  # [probe q heads, units]
    return imp, select(imp, units.kept, threshold, rule)


def fallback_selection(q: torch.Tensor, keys: torch.Tensor, k_new: torch.Tensor, units: Units,
                       probe_imp: torch.Tensor) -> tuple[torch.Tensor, LayerSelection]:
    """The probes disagreed: one set from every head's importance over every prefix key
    keys [m, kv_heads, hd]; the probes' agreement is kept for the statistics.
    -> (every query head's importance [heads, units], the set)."""
    imp = units.pooled(column_importance(q, keys, k_new))  # [heads, units]
    return imp, select_all(imp, units.kept, mean_jaccard(probe_imp, units.kept))


@dataclass
class LayerPool:
    """A request's unit scores max-pooled over its last `window` layers: each layer's summed
    importance as a share of that layer's total (layers differ in how much the new rows attend to
    the prefix at all), then the highest share a unit had in any of them ranks it."""

    window: int
    recent: list[torch.Tensor] = field(default_factory=list)  # the last layers' shares, each [units]

    def choose(self, importance: torch.Tensor, sel: LayerSelection, kept: int) -> LayerSelection:
        """importance [heads, units] the layer's scorers' -> `sel` with its units ranked by the pool."""
        total = importance.sum(dim=0)  # [units]
        share = total / total.sum().clamp_min(torch.finfo(total.dtype).tiny)
        self.recent = [*self.recent, share][-self.window:]
        return LayerSelection(top_k(torch.stack(self.recent).amax(dim=0), kept), sel.passed, sel.jaccard)


def h2o_selection(q: torch.Tensor, keys: torch.Tensor, k_new: torch.Tensor, units: Units,
                  score_heads: list[int] | None) -> torch.Tensor:
    """H2O: a set from the importance every prefix key gets from every query head (or only the
    query heads `score_heads`: what a probe there would choose). -> [kept tokens] ascending."""
    imp = column_importance(q, keys, k_new)  # [heads, m]
    if score_heads is not None:
        imp = imp[score_heads]
    return units.tokens(select_all(units.pooled(imp), units.kept).tokens)
