"""Importance-only restore (IMPRESS): a returning request's new tokens computed over only the part
of its stored prefix their queries attend to, read from the store by token.

Per layer, the new rows' queries score the prefix with the probe heads' keys (read up front, one
read per chunk for every layer); if the probe heads' top-k sets agree (importance.select) one
consensus set is kept and only its tokens' other keys and values are read; otherwise every key
is read and the layer's set comes from all heads (the fallback). The kept tokens take compact
slots with K at its original position (stored K is already rotated there), so each layer keeps
exactly k slots of prefix, possibly different tokens per layer, and no mask is needed; the new
tokens follow at RoPE positions prefix + i, so the sequence carries `rope_offset` = prefix - k.

The result is approximate: it is never saved, published or reported as exact state. Selection
variants for the ablation (`Selection`): the full prefix (exact: the oracle for the mechanics),
H2O over every key, probes without the threshold, and the blind references (random, recent).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvtier.models.attention import causal_attention
from kvtier.models.llama import CausalLM
from kvtier.models.rope import Rope, rotate_into
from kvtier.restore.importance import (
    column_importance,
    mean_pairwise_jaccard,
    select,
    select_all,
    similarity_threshold,
    top_k,
)
from kvtier.store.selective import TokenReads


class Selection(str, enum.Enum):
    IMPRESS = "impress"  # probe heads, similarity threshold, fallback to every key
    PROBES = "probes"  # probe heads' vote in every layer (no threshold)
    H2O = "h2o"  # every key read, a set from all heads' importance (the paper's AS+H2O loading)
    FULL = "full"  # the whole prefix (exact)
    RANDOM = "random"  # k tokens at random (a blind reference)
    RECENT = "recent"  # the last k tokens (a blind reference)


@dataclass(frozen=True)
class ImpressPolicy:
    ratio: float = 0.25  # share of the prefix each layer keeps (the paper's 25% for most tasks)
    alpha: float = 0.6  # threshold t = j ** alpha (§4.3)
    selection: Selection = Selection.IMPRESS
    seed: int = 0  # RANDOM's draw

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"importance ratio must be in (0, 1], got {self.ratio}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")

    def kept(self, prefix: int) -> int:
        return prefix if self.selection is Selection.FULL else min(prefix, math.ceil(self.ratio * prefix))


@dataclass
class ImpressStats:
    prefix_tokens: int = 0
    kept_tokens: int = 0  # per layer
    layers_passed: int = 0  # layers whose probes agreed (only probe keys read to choose)
    layers: int = 0
    jaccard: list[float] = field(default_factory=list)  # per layer, probe heads' mean pairwise Jaccard
    kept: list[torch.Tensor] = field(default_factory=list)  # per layer, the prefix tokens kept [k]
    bytes_read: int = 0
    read_calls: int = 0
    granules_read: int = 0
    granules_whole: int = 0
    read_s: float = 0.0
    identify_s: float = 0.0  # scoring and choosing (importance, top-k, Jaccard, vote)
    seconds: float = 0.0


@dataclass
class ReducedCache:
    """One sequence's K/V per layer in compact slots: the kept prefix tokens of that layer (K rotated
    at their original positions), then every token computed since, at RoPE position slot + offset."""

    k: list[torch.Tensor]  # per layer [slots, kv_heads, hd]
    v: list[torch.Tensor]
    rope_offset: int

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]


PROBE_GRANULE_TOKENS = 16  # rows per checksum in the importance layout: a quarter of a 64-token chunk


def probe_kv_heads_for(num_kv_heads: int) -> int:
    """Probe KV heads per layer: the paper's three where there are many; one where there are few
    (SmolLM2's 3 KV heads: three probes would be every key; one gives 3 query heads to compare)."""
    return 1 if num_kv_heads <= 4 else 3


def probe_query_heads(num_heads: int, num_kv_heads: int, probe_kv_heads: int) -> int:
    """Query heads that read the probe KV heads (the first ones: query head h reads KV head h // g)."""
    return probe_kv_heads * (num_heads // num_kv_heads)


def _rotate(rope: Rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope.halves(positions)
    return rotate_into(x, cos, sin, torch.empty_like(x))


def _blind(policy: ImpressPolicy, prefix: int, k: int) -> torch.Tensor:
    if policy.selection is Selection.RECENT:
        return torch.arange(prefix - k, prefix)
    g = torch.Generator().manual_seed(policy.seed)
    return torch.sort(torch.randperm(prefix, generator=g)[:k]).values


@torch.inference_mode()
def impress_prefill(model: CausalLM, rope: Rope, reads: TokenReads, new_ids: Sequence[int],
                    policy: ImpressPolicy) -> tuple[torch.Tensor, ReducedCache, ImpressStats]:
    """Compute `new_ids` after the stored prefix `reads` opens, keeping per layer only the tokens
    `policy` selects. -> (fp32 logits [new, vocab], the reduced cache, stats)."""
    t0 = time.perf_counter()
    cfg, m = model.cfg, reads.tokens
    n, k = len(new_ids), policy.kept(reads.tokens)
    stats = ImpressStats(prefix_tokens=m, kept_tokens=k, layers=cfg.num_layers)
    probe_kv = reads.ns.probe_kv_heads
    pq = probe_query_heads(cfg.num_heads, cfg.num_kv_heads, probe_kv)
    threshold = similarity_threshold(policy.ratio, policy.alpha) if policy.selection is Selection.IMPRESS else 0.0
    uses_probes = policy.selection in (Selection.IMPRESS, Selection.PROBES)
    r0 = time.perf_counter()
    probes = reads.probe_keys() if uses_probes else {}
    stats.read_s += time.perf_counter() - r0
    dev = rope.cos_h.device
    positions = torch.arange(m, m + n, device=dev)
    h = model.embed(torch.tensor(list(new_ids), dtype=torch.long, device=dev))  # [n, hidden]
    ks, vs = [], []
    for li, layer in enumerate(model.layers):
        q, kn, vn = layer.qkv(h)  # [n, heads | kv_heads, hd]
        q, kn = _rotate(rope, q, positions), _rotate(rope, kn, positions)
        k_all = None
        i0 = time.perf_counter()
        if uses_probes:
            imp = column_importance(q[:, :pq], probes[li], kn[:, :probe_kv])  # [pq, m]
            sel = select(imp, k, threshold)
            if sel is None:  # the probes disagree: every key, a set from every head
                stats.identify_s += time.perf_counter() - i0
                k_all = _timed(stats, lambda li=li: reads.whole(li, "k"))
                i0 = time.perf_counter()
                sel = select_all(column_importance(q, k_all, kn), k, mean_jaccard(imp, k))
            stats.jaccard.append(sel.jaccard)
            stats.layers_passed += sel.passed
            kept = sel.tokens
        elif policy.selection in (Selection.H2O, Selection.FULL):
            stats.identify_s += time.perf_counter() - i0
            k_all = _timed(stats, lambda li=li: reads.whole(li, "k"))
            i0 = time.perf_counter()
            kept = torch.arange(m) if k == m else select_all(column_importance(q, k_all, kn), k).tokens
        else:
            kept = _blind(policy, m, k)
        stats.identify_s += time.perf_counter() - i0
        stats.kept.append(kept)
        if k_all is not None:
            k_kept = k_all if k == m else k_all.index_select(0, kept)
        else:
            k_kept = _timed(stats, lambda li=li, kept=kept: reads.rows(li, "k", kept))  # [k, kv_heads, hd]
        v_kept = _timed(stats, lambda li=li, kept=kept: reads.whole(li, "v") if k == m else reads.rows(li, "v", kept))
        kc = torch.cat([k_kept.to(dev, kn.dtype), kn])  # [k + n, kv_heads, hd]
        vc = torch.cat([v_kept.to(dev, vn.dtype), vn])
        ks.append(kc)
        vs.append(vc)
        h = layer.finish(h, causal_attention(q, kc, vc, k))
    c = reads.counts
    stats.bytes_read, stats.read_calls, stats.granules_read, stats.granules_whole = \
        c.nbytes, c.calls, c.granules, c.granules_whole
    stats.seconds = time.perf_counter() - t0
    return model.logits(h), ReducedCache(ks, vs, m - k), stats


def mean_jaccard(importance: torch.Tensor, k: int) -> float:
    return mean_pairwise_jaccard([top_k(row, k) for row in importance])


def _timed(stats: ImpressStats, read):
    t = time.perf_counter()
    out = read()
    stats.read_s += time.perf_counter() - t
    return out


@torch.inference_mode()
def extend(model: CausalLM, rope: Rope, cache: ReducedCache, ids: Sequence[int]) -> torch.Tensor:
    """Compute `ids` after everything in `cache` (appending their K/V): fp32 logits [len(ids), vocab].
    Decoding over a reduced cache, and teacher-forced scoring of a continuation."""
    n, start = len(ids), cache.slots
    dev = rope.cos_h.device
    positions = torch.arange(start, start + n, device=dev) + cache.rope_offset
    h = model.embed(torch.tensor(list(ids), dtype=torch.long, device=dev))
    for li, layer in enumerate(model.layers):
        q, kn, vn = layer.qkv(h)
        q, kn = _rotate(rope, q, positions), _rotate(rope, kn, positions)
        cache.k[li] = torch.cat([cache.k[li], kn])
        cache.v[li] = torch.cat([cache.v[li], vn])
        h = layer.finish(h, causal_attention(q, cache.k[li], cache.v[li], start))
    return model.logits(h)

