"""Reordering stored chunks by importance (IMPRESS §4.4.1).

Importance-only restores keep a scattered quarter of a prefix's tokens: with 16-token granules
nearly every granule holds one, so reading "only the kept tokens" reads almost everything. The
tokens one query keeps are mostly the tokens the next query of the same prefix keeps, so storing
each chunk's K/V rows by descending average importance packs them into the first granules.

`ImportanceStats` keeps, per stored chunk and layer, a moving average of which tokens restores
kept (1 kept, 0 not: the average is how often a token was important). A reorder pass rewrites the
chunks seen often enough whose best order changed (`TieredStore.reorder`), on the writer thread,
never on a restore's path. Only the row order inside a chunk changes, so chunk boundaries, keys and
every prefix sharing the chunk stay valid; the header's `order` maps rows back to tokens and
every exact reader undoes it (store/format.py `in_token_order`).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

EMA_WEIGHT = 0.3  # the newest observation's weight (as the score policy's)
MIN_OBSERVATIONS = 2  # restores that must have seen a chunk before it is reordered


@dataclass
class ReorderReport:
    chunks: int = 0  # rewritten
    unchanged: int = 0  # already stored in their best order
    missing: int = 0  # gone, partial, or refused by every tier holding them
    nbytes: int = 0  # written
    seconds: float = 0.0


class ImportanceStats:
    def __init__(self, weight: float = EMA_WEIGHT) -> None:
        self.weight = weight
        self._ema: dict[str, torch.Tensor] = {}  # key -> [layers, tokens] float32
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, key: str, kept: torch.Tensor) -> None:
        """One restore's kept tokens of chunk `key`: [layers, tokens], 1 where a layer kept the token."""
        kept = kept.float()
        with self._lock:
            old = self._ema.get(key)
            self._ema[key] = kept if old is None or old.shape != kept.shape else old.lerp(kept, self.weight)
            self._seen[key] = self._seen.get(key, 0) + 1

    def due(self, min_observations: int = MIN_OBSERVATIONS) -> list[tuple[str, torch.Tensor]]:
        """(key, best order [layers, tokens]) of every chunk seen at least `min_observations` times."""
        with self._lock:
            return [(k, importance_order(e)) for k, e in self._ema.items() if self._seen[k] >= min_observations]

    def __len__(self) -> int:
        return len(self._ema)


def importance_order(ema: torch.Tensor) -> torch.Tensor:
    """[layers, tokens] average importance -> per layer the tokens by descending importance; equal
    ones keep token order (so a chunk no restore has told apart keeps the identity)."""
    return torch.sort(ema, dim=1, descending=True, stable=True).indices


def kept_masks(kept: list[torch.Tensor], chunks: list[tuple[str, int, int]]) -> dict[str, torch.Tensor]:
    """Per chunk (key, start, end) of a prefix, which of its tokens each layer kept: {key: [layers,
    end - start] bool}, from each layer's kept prefix indices ([k] ascending)."""
    if not kept or not chunks:
        return {}
    m = chunks[-1][2]
    mask = torch.zeros(len(kept), m, dtype=torch.bool)  # [layers, prefix tokens]
    for li, rows in enumerate(kept):
        mask[li, rows[rows < m]] = True
    return {key: mask[:, a:b] for key, a, b in chunks}
