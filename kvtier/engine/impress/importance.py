"""Which stored prefix tokens a query needs (IMPRESS §4.2-4.3): importance, top-k sets, similarity.

A prefix token's importance for a query is its column sum in the attention weights of the query's
rows (H2O): how much attention the new tokens pay it. Only a few "probe" heads are scored first;
when their top-k sets agree (mean pairwise Jaccard at or above a threshold) one consensus set
stands for every head, so the other heads' keys are never read. When they disagree the layer falls
back to scoring every head (reading all keys).

GQA (SmolLM2: 9 query heads over 3 KV heads): reading a probe means reading a KV head's keys, so
the probe unit is a KV head, and the "probe heads" whose sets are compared are the query heads of
the probe KV heads (one KV head: its 3 query heads, as the paper's 3 probe heads). Pure functions
of tensors: no store, no model (the column sums themselves are
`kvtier.models.attention.column_importance`, which blended restores use too).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch


def top_k(importance: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k most important tokens, ascending (ties: the earlier token). [m] -> [k]."""
    k = max(0, min(k, importance.shape[-1]))
    order = torch.sort(importance, descending=True, stable=True).indices  # stable: ties keep position order
    return torch.sort(order[:k]).values


def jaccard(a: set[int], b: set[int]) -> float:
    """|a & b| / |a | b| (1.0 for two empty sets)."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0


def mean_pairwise_jaccard(sets: list[torch.Tensor]) -> float:
    """Mean Jaccard index over every unordered pair of index sets (1.0 for fewer than two)."""
    as_sets = [set(s.tolist()) for s in sets]
    pairs = list(itertools.combinations(as_sets, 2))
    return sum(jaccard(a, b) for a, b in pairs) / len(pairs) if pairs else 1.0


def mean_jaccard(importance: torch.Tensor, k: int) -> float:
    """How much several heads agree: the mean pairwise Jaccard of their top-k sets. importance [heads, m]."""
    return mean_pairwise_jaccard([top_k(row, k) for row in importance])


def random_jaccard(ratio: float) -> float:
    """Expected Jaccard index of two random k-of-n sets, k/n = ratio: (k/n) / (2 - k/n)."""
    return ratio / (2.0 - ratio)


def similarity_threshold(ratio: float, alpha: float = 0.6) -> float:
    """t = j ** alpha: above it the probes agree more than chance by the paper's margin (§4.3)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"importance ratio must be in (0, 1], got {ratio}")
    return random_jaccard(ratio) ** alpha


def vote(importance: torch.Tensor, k: int) -> torch.Tensor:
    """One set of k tokens from several probe heads' importance [probes, m]: tokens in the top-k
    set of at least two probes first, by summed importance, then the rest by summed importance
    (the paper leaves the vote undefined; this is the majority reading of it). -> [k] ascending."""
    probes, m = importance.shape
    k = max(0, min(k, m))
    total = importance.sum(dim=0)  # [m]
    if probes < 2:
        return top_k(total, k)
    votes = torch.zeros(m)
    for p in range(probes):
        votes[top_k(importance[p], k)] += 1
    # Majority tokens outrank every other token; within each class, summed importance decides.
    rank = total / (total.max() + 1.0) + (votes >= 2).float()
    return top_k(rank, k)


@dataclass(frozen=True)
class LayerSelection:
    tokens: torch.Tensor  # [k] prefix indices kept for this layer, ascending
    passed: bool  # the probes agreed: only their keys were needed to choose
    jaccard: float  # mean pairwise Jaccard of the probe heads' top-k sets


def select(probe_importance: torch.Tensor, k: int, threshold: float, rule: str = "majority") -> LayerSelection | None:
    """The probe step of a layer: a consensus set if the probes agree (J >= threshold), else None
    (the caller reads every head's keys and calls `select_all`). `rule`: "majority" (`vote`) or
    "sum" (the probes' summed importance, as the fallback ranks every head's)."""
    sets = [top_k(row, k) for row in probe_importance]
    j = mean_pairwise_jaccard(sets)
    if j < threshold:
        return None
    chosen = vote(probe_importance, k) if rule == "majority" else top_k(probe_importance.sum(dim=0), k)
    return LayerSelection(chosen, True, j)


def select_all(all_importance: torch.Tensor, k: int, jaccard_of_probes: float = float("nan")) -> LayerSelection:
    """The fallback: one set for the layer from every head's importance summed (H2O over all
    heads; the same bytes as the paper's per-head sets, all K plus k values per head, no masks)."""
    return LayerSelection(top_k(all_importance.sum(dim=0), k), False, jaccard_of_probes)


def vectors_read(kv_heads: int, tokens: int, kept: int, probe_heads: int, passed: bool) -> int:
    """K/V vectors (one head, one token) a layer reads: probe keys, then the kept tokens' K of the
    other heads and V of all heads if the probes agreed, else every other key and the kept V."""
    probe = probe_heads * tokens
    if passed:
        return probe + (kv_heads - probe_heads) * kept + kv_heads * kept
    return probe + (kv_heads - probe_heads) * tokens + kv_heads * kept
