"""The importance restore's compute: a request's new tokens through the shared layer loop
(`CausalLM.run_layers`), each layer's queries attending to the prefix tokens the policy keeps.

Per layer, the new rows' queries score the prefix with the probe heads' keys (read up front, one
read per chunk for every layer); if the probe heads' top-k sets agree one consensus set is kept
and only its tokens' K and V are read; otherwise every key is read and the set comes from all
heads (the fallback). The kept tokens take compact slots with K at its original position (stored K
is already rotated there), so each layer keeps exactly k slots of prefix, possibly different tokens
per layer, and no mask is needed; the new tokens follow at RoPE positions prefix + i.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvtier.engine.impress.importance import LayerSelection, similarity_threshold
from kvtier.engine.impress.policy import ImpressPolicy, ImpressStats, Selection, blind_selection
from kvtier.engine.impress.reads import TimedReads
from kvtier.engine.impress.select import (
    LayerPool,
    ProbeHeads,
    Units,
    fallback_selection,
    h2o_selection,
    probe_selection,
)
from kvtier.models.attention import causal_attention
from kvtier.models.config import ModelConfig
from kvtier.models.kernels import Kernels
from kvtier.models.llama import CausalLM, LayerAttention
from kvtier.models.rope import Rope
from kvtier.store.selective import TokenReads

T = TypeVar("T")


@dataclass(frozen=True)
class CompactKV:
    """One sequence's K/V per layer in compact slots: the kept prefix tokens of that layer (K rotated
    at their original positions), then the new tokens, at RoPE position slot + rope_offset."""

    k: list[torch.Tensor]  # per layer [slots, kv_heads, hd]
    v: list[torch.Tensor]
    rope_offset: int  # prefix tokens the first layer dropped (every layer's, unless the policy's slope varies it)

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]


@dataclass(frozen=True)
class Choice:
    kept: torch.Tensor  # [k] prefix tokens a layer keeps, ascending
    keys: torch.Tensor | None = None  # [m, kv_heads, hd] every prefix key, where choosing read them


# Selection -> the ImportanceAttention method that chooses a layer's kept tokens.
_CHOOSERS = {Selection.IMPRESS: "_impress", Selection.PROBES: "_probes", Selection.H2O: "_h2o",
             Selection.FULL: "_full", Selection.RANDOM: "_blind", Selection.RECENT: "_blind", Selection.GIVEN: "_given"}


class ImportanceAttention(LayerAttention):
    """The new rows (RoPE tables cos/sin) attend, per layer, to the kept prefix tokens' K/V then to
    their own; what each layer kept is collected in `k`/`v` (`CompactKV`) and `stats`."""

    def __init__(self, cfg: ModelConfig, policy: ImpressPolicy, reads: TimedReads, probes: dict[int, torch.Tensor],
                 stats: ImpressStats, cos: torch.Tensor, sin: torch.Tensor, probe_first: Sequence[int],
                 probe_count: int, kernels: Kernels, given: Sequence[torch.Tensor] | None = None) -> None:
        m, layers = stats.prefix_tokens, cfg.num_layers
        self.kernels = kernels
        g = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        self.policy, self.reads, self.probes, self.stats, self.cos, self.sin = policy, reads, probes, stats, cos, sin
        self.units = [Units(m, policy.unit, *policy.units(m, li, layers), policy.window) for li in range(layers)]
        self.kept = [policy.kept(m, li, layers) for li in range(layers)]  # prefix tokens each layer keeps
        self.heads = [ProbeHeads.of(f, probe_count, g) for f in probe_first]  # per layer
        self.score_heads = None if policy.score_kv_heads is None else \
            [h * g + i for h in policy.score_kv_heads for i in range(g)]
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.threshold = similarity_threshold(policy.ratio, policy.alpha)
        self.layer_pool = LayerPool(policy.layer_window) if policy.layer_window > 1 else None
        # By name, not a bound method: this object holding its own method would be a reference
        # cycle, and the reads it holds (with their store) would wait for a garbage collection.
        self._chooser = _CHOOSERS[policy.selection]
        if (policy.selection is Selection.GIVEN) != (given is not None):
            raise ValueError("the given selection needs a set per layer, and only it takes them")
        if given is not None:
            if len(given) != layers or any(s.shape != (self.kept[li],) for li, s in enumerate(given)):
                raise ValueError(f"given sets: one per layer ({layers}), each of the {self.kept[0]} tokens the policy keeps")
        self.given = given

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin

    def attend(self, li: int, h: torch.Tensor, q: torch.Tensor, kn: torch.Tensor, vn: torch.Tensor) -> torch.Tensor:
        st = self.stats
        choice: Choice = getattr(self, self._chooser)(li, q, kn)
        st.kept.append(choice.kept)
        if self.policy.merge:  # every row is read to form the means: the kept ones come from the same reads
            k_kept, v_kept = self._merged(li, choice)
        else:
            k_kept, v_kept = self.reads.kept_kv(li, choice.kept, choice.keys, self.kept[li] == st.prefix_tokens)
        kc = torch.cat([k_kept.to(kn.device, kn.dtype), kn])  # [k + n, kv_heads, hd]
        vc = torch.cat([v_kept.to(vn.device, vn.dtype), vn])
        self.k.append(kc)
        self.v.append(vc)
        return causal_attention(q, kc, vc, k_kept.shape[0], self.kernels)  # the new rows start after the prefix's slots

    def _merged(self, li: int, choice: Choice) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept tokens' K and V, then the units a layer did not keep, each as its tokens' mean K
        and V repeated once per token (a softmax over u equal slots weighs one by u).
        -> K, V [kept + dropped units * unit, kv_heads, hd]."""
        u, kept = self.units[li], choice.kept
        dropped = torch.ones(u.count, dtype=torch.bool)
        dropped[kept[kept < u.count * u.unit] // u.unit] = False

        def rows(x: torch.Tensor) -> torch.Tensor:  # [m, kv_heads, hd] -> [kept + dropped * unit, kv_heads, hd]
            whole = x[: u.count * u.unit].float().reshape(u.count, u.unit, *x.shape[1:])
            means = whole.mean(1)[dropped.to(x.device)].to(x.dtype).repeat_interleave(u.unit, dim=0)
            return torch.cat([x.index_select(0, kept.to(x.device)), means])

        keys = choice.keys if choice.keys is not None else self.reads.keys(li)
        return rows(keys), rows(self.reads.values(li))

    def _identify(self, compute: Callable[[], T]) -> T:
        t = time.perf_counter()
        out = compute()
        self.stats.identify_s += time.perf_counter() - t
        return out

    def _impress(self, li: int, q: torch.Tensor, kn: torch.Tensor) -> Choice:
        """The probes' consensus where they agree (J >= threshold), else every key and every head."""
        return self._by_probes(li, q, kn, self.threshold)

    def _probes(self, li: int, q: torch.Tensor, kn: torch.Tensor) -> Choice:
        """The probes' consensus in every layer: with no threshold they always agree."""
        return self._by_probes(li, q, kn, 0.0)

    def _by_probes(self, li: int, q: torch.Tensor, kn: torch.Tensor, threshold: float) -> Choice:
        probe_keys, rule = self.probes[li], self.policy.vote
        imp, sel = self._identify(lambda: probe_selection(q, kn, probe_keys, self.heads[li], self.units[li], threshold, rule))
        keys = None
        if sel is None:  # the probes disagree: every key, a set from every head
            keys, probe_imp = self.reads.keys(li), imp
            imp, sel = self._identify(lambda: fallback_selection(q, keys, kn, self.units[li], probe_imp))
        chosen: LayerSelection = sel
        if (pool := self.layer_pool) is not None:  # ranked by the last layers' scores, not this one's alone
            chosen = self._identify(lambda: pool.choose(imp, chosen, self.units[li].kept))
        self.stats.jaccard.append(chosen.jaccard)
        self.stats.layers_passed += chosen.passed
        return Choice(self.units[li].tokens(chosen.tokens), keys)

    def _h2o(self, li: int, q: torch.Tensor, kn: torch.Tensor) -> Choice:
        """H2O: every key read, a set from all (or the chosen) heads' importance."""
        keys = self.reads.keys(li)
        if self.kept[li] == self.stats.prefix_tokens:
            return Choice(torch.arange(self.stats.prefix_tokens), keys)
        return Choice(self._identify(lambda: h2o_selection(q, keys, kn, self.units[li], self.score_heads)), keys)

    def _full(self, li: int, q: torch.Tensor, kn: torch.Tensor) -> Choice:
        """The whole prefix (exact): read as whole segments."""
        return Choice(torch.arange(self.stats.prefix_tokens))

    def _given(self, li: int, q: torch.Tensor, kn: torch.Tensor) -> Choice:
        """The caller's set for the layer (an oracle's)."""
        assert self.given is not None
        return Choice(self.given[li])

    def _blind(self, li: int, q: torch.Tensor, kn: torch.Tensor) -> Choice:
        """RANDOM and RECENT: k tokens without looking at the queries."""
        return Choice(self._identify(lambda: blind_selection(self.policy, self.stats.prefix_tokens, self.kept[li])))


@torch.inference_mode()
def impress_prefill(model: CausalLM, rope: Rope, reads: TokenReads, new_ids: Sequence[int],
                    policy: ImpressPolicy, given: Sequence[torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, CompactKV, ImpressStats]:
    """Compute `new_ids` after the stored prefix `reads` opens, keeping per layer only the tokens
    `policy` selects (`given`: with `Selection.GIVEN`, each layer's set [kept] ascending).
    -> (fp32 logits [new, vocab], each layer's compact K/V, stats)."""
    t0 = time.perf_counter()
    m, n = reads.tokens, len(new_ids)
    layers = model.cfg.num_layers
    stats = ImpressStats(prefix_tokens=m, kept_tokens=policy.kept(m, 0, layers), layers=layers)
    timed = TimedReads(reads, stats)
    probes = timed.probe_keys() if policy.selection in (Selection.IMPRESS, Selection.PROBES) else {}
    dev = rope.cos_h.device
    cos, sin = rope.halves(torch.arange(m, m + n, device=dev))  # [n, 1, hd/2]: the new rows follow the prefix
    attention = ImportanceAttention(model.cfg, policy, timed, probes, stats, cos, sin,
                                    reads.ns.probe_first, reads.ns.probe_kv_heads, model.kernels, given)
    h = model.run_layers(model.embed(torch.tensor(list(new_ids), dtype=torch.long, device=dev)), attention)
    timed.report()
    stats.seconds = time.perf_counter() - t0
    # RoPE position = slot + offset, counted in the first layer's prefix slots (with a slope, each
    # layer has its own count of kept slots before the same new tokens).
    return model.logits(h), CompactKV(attention.k, attention.v, m - (attention.k[0].shape[0] - n)), stats
