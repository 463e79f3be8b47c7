"""Importance-only restore (IMPRESS): the rule a restore follows, as plain values.

A returning request's new tokens are computed over only the part of its stored prefix their
queries attend to (importance.py and select.py choose it per layer; prefill.py computes).
The policy fixes the share kept, the threshold's exponent and the selection variant; whether a
layer's probes agree is then a function of the data, not a new decision. Variants for the
ablation (`Selection`): the full prefix (exact: the oracle for the mechanics), H2O over every key,
probes without the threshold, the blind references (random, recent), and sets the caller gives
(what an oracle would keep: a bound for the rankings by attention at a ratio).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvtier.engine.config import ImpressConfig


class Selection(str, enum.Enum):
    IMPRESS = "impress"  # probe heads, similarity threshold, fallback to every key
    PROBES = "probes"  # probe heads' vote in every layer (no threshold)
    H2O = "h2o"  # every key read, a set from all heads' importance (the paper's AS+H2O loading)
    FULL = "full"  # the whole prefix (exact)
    RANDOM = "random"  # k tokens at random (a blind reference)
    RECENT = "recent"  # the last k tokens (a blind reference)
    GIVEN = "given"  # per-layer sets chosen by the caller (the benchmark's oracle bounds); no engine option


@dataclass(frozen=True)
class ImpressPolicy:
    ratio: float = 0.25  # share of the prefix each layer keeps (the paper's 25% for most tasks)
    alpha: float = 0.6  # threshold t = j ** alpha (§4.3)
    selection: Selection = Selection.IMPRESS
    seed: int = 0  # RANDOM's draw
    # Tokens per selection unit. 1: single tokens (the paper). The store's granule size: whole
    # granules chosen by their summed importance, so a read never fetches a granule for one token
    # of it (bytes follow the ratio; a trailing part-granule is always kept).
    block: int = 1
    # Tokens a score is pooled over before choosing (odd; 1: none): each token takes the highest
    # importance within window // 2 tokens of it, so what surrounds and follows an important token
    # is kept with it (a question attends to "the access code for the X vault is", the answer is
    # the digits after it; SnapKV pools for the same reason).
    window: int = 1
    vote: str = "majority"  # the probes' consensus: "majority" (in two top-k sets first) or "sum" of importance
    # H2O only (an ablation): score with the query heads of these KV heads alone, every key read;
    # what a probe at those KV heads would choose. None: every head.
    score_kv_heads: tuple[int, ...] | None = None
    # A per-layer budget (an ablation): layer l of L keeps ratio * (1 + slope * (1 - 2l / (L - 1)))
    # of the prefix, so with slope > 0 early layers keep more and late ones less, with slope < 0 the
    # reverse, at the same bytes in all. 0: every layer keeps the same share, which the engine's
    # pool needs (a request's slots are equal across layers); the engine restores with 0 only.
    # Either sign lost answers and raised the KL (docs/impress.md).
    layer_slope: float = 0.0
    # Layers a unit's score is pooled over (1: its own layer only): a layer ranks each unit by the
    # highest share of the probes' attention it got in this layer and the `layer_window - 1` before
    # it, so a fact the earlier layers' questions found is not dropped where one layer looks away.
    # Earlier layers only: a layer's choice is made before the layers after it run. An ablation:
    # it lost more answers than the layer's own scores (docs/impress.md), so no engine option sets it.
    layer_window: int = 1
    # Each whole unit not kept stands in by its tokens' mean K and mean V, counted once per token
    # (an ablation: the restore reads every row to form them, where a store would keep the means
    # at save; no engine option sets it).
    merge: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"importance ratio must be in (0, 1], got {self.ratio}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if self.vote not in ("majority", "sum"):
            raise ValueError(f"vote must be majority or sum, got {self.vote!r}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1 token, got {self.block}")
        if not -1.0 < self.layer_slope < 1.0:
            raise ValueError(f"layer slope must be in (-1, 1), got {self.layer_slope}")
        if isinstance(self.layer_window, bool) or not isinstance(self.layer_window, int) or self.layer_window < 1:
            raise ValueError(f"layer window must be an integer >= 1, got {self.layer_window!r}")
        if self.layer_window > 1 and (self.selection not in (Selection.IMPRESS, Selection.PROBES) or self.vote != "sum"):
            raise ValueError("a layer window pools the probes' summed importance: it needs the impress or probes "
                             "selection with vote sum")
        if self.merge and (self.unit < 2 or self.selection is Selection.FULL):
            raise ValueError("merging the units not kept needs whole units of several tokens (block >= 2)")
        if self.window < 1 or self.window % 2 == 0:
            raise ValueError(f"importance window must be an odd number of tokens >= 1, got {self.window}")

    @staticmethod
    def of(config: ImpressConfig) -> ImpressPolicy:
        """The rule the engine's options (`ImpressConfig`) give."""
        return ImpressPolicy(config.ratio, config.alpha, Selection(config.selection.value), window=config.window,
                             block=PROBE_GRANULE_TOKENS if config.unit.value == "granule" else 1, vote=config.vote)

    @property
    def unit(self) -> int:
        """Tokens per selection unit (the blind selections pick single tokens)."""
        return self.block if self.selection in (Selection.IMPRESS, Selection.PROBES, Selection.H2O, Selection.GIVEN) else 1

    def layer_ratio(self, layer: int, layers: int) -> float:
        """The share layer `layer` of `layers` keeps (`ratio` in each where the slope is 0)."""
        if self.layer_slope == 0.0 or layers < 2:
            return self.ratio
        return min(1.0, self.ratio * (1 + self.layer_slope * (1 - 2 * layer / (layers - 1))))

    def units(self, prefix: int, layer: int = 0, layers: int = 1) -> tuple[int, int]:
        """(selectable units, units kept) of a prefix at a layer: whole blocks; a trailing part-block
        is kept besides them."""
        n = prefix // self.unit
        return n, min(n, math.ceil(self.layer_ratio(layer, layers) * n))

    def kept(self, prefix: int, layer: int = 0, layers: int = 1) -> int:
        """Prefix tokens a layer keeps (with no slope, the same in every layer: the request's slots)."""
        if self.selection is Selection.FULL:
            return prefix
        n, k = self.units(prefix, layer, layers)
        return k * self.unit + prefix - n * self.unit


@dataclass
class ImpressStats:
    prefix_tokens: int = 0
    kept_tokens: int = 0  # per layer (the first layer's, where the policy's slope varies it)
    layers_passed: int = 0  # layers whose probes agreed (only probe keys read to choose)
    layers: int = 0
    jaccard: list[float] = field(default_factory=list)  # per layer, probe heads' mean pairwise Jaccard
    kept: list[torch.Tensor] = field(default_factory=list)  # per layer, the prefix tokens kept [k]
    bytes_read: int = 0
    read_calls: int = 0
    granules_read: int = 0
    granules_whole: int = 0
    chosen_share: float = 0.0  # of the stored granules of the parts read by token, the share read
    read_s: float = 0.0
    identify_s: float = 0.0  # scoring and choosing (importance, top-k, Jaccard, vote)
    seconds: float = 0.0


PROBE_GRANULE_TOKENS = 16  # rows per checksum in the importance layout: a quarter of a 64-token chunk


def probe_kv_heads_for(num_kv_heads: int) -> int:
    """Probe KV heads per layer: the paper's three where there are many; one where there are few
    (SmolLM2's 3 KV heads: three probes would be every key; one gives 3 query heads to compare)."""
    return 1 if num_kv_heads <= 4 else 3


def blind_selection(policy: ImpressPolicy, prefix: int, k: int) -> torch.Tensor:
    """RANDOM's or RECENT's k of `prefix` tokens (no identification). -> [k] ascending."""
    if policy.selection is Selection.RECENT:
        return torch.arange(prefix - k, prefix)
    g = torch.Generator().manual_seed(policy.seed)
    return torch.sort(torch.randperm(prefix, generator=g)[:k]).values
