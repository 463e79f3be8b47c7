"""The importance-only restore (IMPRESS) inside the engine: a request's stored prefix read by
token (store/selective.py), with its new tokens computed on the way.

Per layer, the new rows' queries score the prefix with the probe heads' keys (read up front, one
read per chunk for every layer); if the probe heads' top-k sets agree one consensus set is kept
and only its tokens' K and V are read; otherwise every key is read and the set comes from all
heads (the fallback). The kept tokens take compact slots with K at its original position (stored K
is already rotated there), so each layer keeps exactly k slots of prefix, possibly different tokens
per layer, and no mask is needed; the new tokens follow at RoPE positions prefix + i.

Choosing needs the new tokens' queries at every layer, so the restore computes the new tokens
itself (on the restore worker, like Cake's front), places the kept prefix and all new tokens but
the last into the request's slots, and the request's step computes the last one and samples.
The request carries `dropped` (prefix tokens not in its slots) for the rest of its life and is
approximate: never saved, published to the device prefix cache or reported as exact.
`ImpressRestore` offers the same surface as `Restore` (prepare, ready, place, finish, abort).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier import paths
from kvtier.dtypes import name_of
from kvtier.engine.restore.importance import (
    column_importance,
    mean_pairwise_jaccard,
    select,
    select_all,
    similarity_threshold,
    top_k,
)
from kvtier.engine.restore.impress_policy import (
    ImpressPolicy,
    ImpressStats,
    Selection,
    blind_selection,
)
from kvtier.engine.restore.layerwise import RestoreMiss, RestoreStats
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.attention import causal_attention
from kvtier.models.llama import CausalLM
from kvtier.models.loading import LoadedModel
from kvtier.models.rope import Rope, rotate_into
from kvtier.planning.plan import Plan
from kvtier.store.reorder import kept_masks
from kvtier.store.selective import TokenReadMiss, TokenReads
from kvtier.store.tiered import TieredStore
from kvtier.text import stdlib_text


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


def _rotate(rope: Rope, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    cos, sin = rope.halves(positions)
    return rotate_into(x, cos, sin, torch.empty_like(x))


@torch.inference_mode()
def impress_prefill(model: CausalLM, rope: Rope, reads: TokenReads, new_ids: Sequence[int],
                    policy: ImpressPolicy) -> tuple[torch.Tensor, ReducedCache, ImpressStats]:
    """Compute `new_ids` after the stored prefix `reads` opens, keeping per layer only the tokens
    `policy` selects. -> (fp32 logits [new, vocab], the reduced cache, stats)."""
    t0 = time.perf_counter()
    cfg, m = model.cfg, reads.tokens
    n, k = len(new_ids), policy.kept(reads.tokens)
    units, k_units = policy.units(reads.tokens)
    unit = policy.unit

    def pooled(imp: torch.Tensor) -> torch.Tensor:  # [heads, m] -> [heads, units]: importance per unit
        return imp if unit == 1 else imp[:, : units * unit].reshape(imp.shape[0], units, unit).sum(-1)

    def tokens_of(chosen: torch.Tensor) -> torch.Tensor:  # [k_units] ascending -> [k] prefix tokens
        if unit == 1:
            return chosen
        whole = (chosen[:, None] * unit + torch.arange(unit)).flatten()
        return torch.cat([whole, torch.arange(units * unit, m)])  # the trailing part-unit is always kept

    stats = ImpressStats(prefix_tokens=m, kept_tokens=k, layers=cfg.num_layers)
    p0, p1 = reads.ns.probe_first, reads.ns.probe_first + reads.ns.probe_kv_heads  # probe KV heads [p0, p1)
    g = cfg.num_heads // cfg.num_kv_heads  # their query heads: [p0 * g, p1 * g)
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
            imp = pooled(column_importance(q[:, p0 * g : p1 * g], probes[li], kn[:, p0:p1]))  # [probe q heads, units]
            sel = select(imp, k_units, threshold, policy.vote)
            if sel is None:  # the probes disagree: every key, a set from every head
                stats.identify_s += time.perf_counter() - i0
                k_all = _timed(stats, lambda li=li: reads.whole(li, "k"))
                i0 = time.perf_counter()
                sel = select_all(pooled(column_importance(q, k_all, kn)), k_units, mean_jaccard(imp, k_units))
            stats.jaccard.append(sel.jaccard)
            stats.layers_passed += sel.passed
            kept = tokens_of(sel.tokens)
        elif policy.selection in (Selection.H2O, Selection.FULL):
            stats.identify_s += time.perf_counter() - i0
            k_all = _timed(stats, lambda li=li: reads.whole(li, "k"))
            i0 = time.perf_counter()
            if k == m:
                kept = torch.arange(m)
            else:
                imp_all = column_importance(q, k_all, kn)  # [heads, m]
                if policy.score_kv_heads is not None:  # only these KV heads' query heads score
                    imp_all = imp_all[[h * g + i for h in policy.score_kv_heads for i in range(g)]]
                kept = tokens_of(select_all(pooled(imp_all), k_units).tokens)
        else:
            kept = blind_selection(policy, m, k)
        stats.identify_s += time.perf_counter() - i0
        stats.kept.append(kept)
        if k == m:  # every token: whole segments
            k_kept = k_all if k_all is not None else _timed(stats, lambda li=li: reads.whole(li, "k"))
            v_kept = _timed(stats, lambda li=li: reads.whole(li, "v"))
        elif k_all is not None:  # the keys are here already (fallback, H2O): the kept values
            k_kept = k_all.index_select(0, kept)
            v_kept = _timed(stats, lambda li=li, kept=kept: reads.rows(li, "v", kept))
        else:  # K and V of the kept tokens, one pass over the chunks: [k, kv_heads, hd] each
            got = _timed(stats, lambda li=li, kept=kept: reads.rows_of(li, ("k", "v"), kept))
            k_kept, v_kept = got["k"], got["v"]
        kc = torch.cat([k_kept.to(dev, kn.dtype), kn])  # [k + n, kv_heads, hd]
        vc = torch.cat([v_kept.to(dev, vn.dtype), vn])
        ks.append(kc)
        vs.append(vc)
        h = layer.finish(h, causal_attention(q, kc, vc, k))
    c = reads.counts
    stats.bytes_read, stats.read_calls, stats.granules_read, stats.granules_whole = \
        c.nbytes, c.calls, c.granules, c.granules_whole
    stats.chosen_share = c.chosen / c.chosen_of if c.chosen_of else 0.0
    stats.seconds = time.perf_counter() - t0
    return model.logits(h), ReducedCache(ks, vs, m - k), stats


@torch.inference_mode()
def calibrate_probe(model: CausalLM, rope: Rope, prefix_ids: Sequence[int], query_ids: Sequence[int],
                    probes: int, ratio: float = 0.25) -> tuple[int, list[float]]:
    """Which `probes` consecutive KV heads to probe: those whose query heads' top-k choice of the
    prefix changes the query rows' attention output (every head's) least, relative to attending
    to the whole prefix, averaged over layers. The paper takes the first heads; on SmolLM2 that
    choice loses the needle a quarter of the time while another KV head's choice matches every
    head's (docs/impress.md). -> (first probe KV head, each candidate's mean relative error)."""
    cfg = model.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    ids = list(prefix_ids) + list(query_ids)
    m, k = len(prefix_ids), math.ceil(ratio * len(prefix_ids))
    own = torch.arange(m, len(ids))
    err = [0.0] * (cfg.num_kv_heads - probes + 1)
    for q, kk, v in _layers(model, rope, ids):
        imp = column_importance(q[m:], kk[:m], kk[m:])  # [heads, m]
        full = causal_attention(q[m:], kk, v, m).float()  # [n, heads, hd]: the query rows over everything
        for j in range(len(err)):
            idx = torch.cat([top_k(imp[j * g : (j + probes) * g].sum(0), k), own]).to(kk.device)
            out = causal_attention(q[m:], kk.index_select(0, idx), v.index_select(0, idx), k).float()
            err[j] += float((out - full).norm() / full.norm()) / cfg.num_layers
    return min(range(len(err)), key=err.__getitem__), err


def _layers(model: CausalLM, rope: Rope, ids: Sequence[int]):
    """A full forward over `ids`, yielding each layer's (q, k, v) with RoPE applied ([tokens,
    heads | kv_heads, hd]) before that layer attends over all of them."""
    dev = rope.cos_h.device
    positions = torch.arange(len(ids), device=dev)
    h = model.embed(torch.tensor(list(ids), dtype=torch.long, device=dev))
    for layer in model.layers:
        q, kk, v = layer.qkv(h)
        q, kk = _rotate(rope, q, positions), _rotate(rope, kk, positions)
        yield q, kk, v
        h = layer.finish(h, causal_attention(q, kk, v, 0))


@torch.inference_mode()
def probe_pass_rate(model: CausalLM, rope: Rope, ids: Sequence[int], m: int, first: int, probes: int,
                    ratio: float = 0.25, alpha: float = 0.6) -> float:
    """Share of layers whose probe heads (KV heads [first, first + probes)) agree at `ratio`: the
    mean pairwise Jaccard of their query heads' top-k sets of the prefix ids[:m], scored by the
    rows after it, reaches the threshold. Layers below it read every key (the planner's input)."""
    cfg = model.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    k, t, passed = math.ceil(ratio * m), similarity_threshold(ratio, alpha), 0
    for q, kk, _ in _layers(model, rope, ids):
        imp = column_importance(q[m:, first * g : (first + probes) * g], kk[:m, first : first + probes],
                                kk[m:, first : first + probes])
        passed += mean_jaccard(imp, k) >= t
    return passed / cfg.num_layers


@dataclass(frozen=True)
class ProbeCalibration:
    first: int  # first probe KV head
    pass_rate: float  # share of layers whose probe heads agreed on the calibration text


def calibrate(loaded: LoadedModel, probes: int) -> ProbeCalibration:
    """A model's probe KV heads and how often they agree, measured once per model, dtype and probe
    count and cached under KVTIER_HOME/probes. The probe is the candidate `calibrate_probe` finds
    best over three stretches of standard-library docstrings (each followed by a span of itself);
    the paper's first heads where every KV head is a probe or the model has no tokenizer (a
    random-weight preset: its pass rate is measured on seeded random ids)."""
    cfg = loaded.config
    path = paths.home() / "probes" / f"{loaded.fingerprint}-{name_of(loaded.dtype)}-{probes}.json"
    try:
        doc = json.loads(path.read_text())
        return ProbeCalibration(int(doc["probe_first"]), float(doc["pass_rate"]))
    except (OSError, ValueError, KeyError):
        pass
    rope = Rope(cfg, 1024 + 32, loaded.dtype, loaded.module.lm_head.weight.device)
    if loaded.tokenizer is None:
        texts = [torch.randint(3, cfg.vocab_size, (1024,), generator=torch.Generator().manual_seed(s)).tolist()
                 for s in range(3)]
    else:
        texts = [loaded.tokenizer.encode(stdlib_text(12000, skip), add_special_tokens=False)[:1024] for skip in (0, 40, 80)]
    first, total = 0, [0.0] * (cfg.num_kv_heads - probes + 1)
    if probes < cfg.num_kv_heads and loaded.tokenizer is not None:
        for ids in texts:
            _, err = calibrate_probe(loaded.module, rope, ids, ids[400:432], probes)
            total = [a + b / 3 for a, b in zip(total, err)]
        first = min(range(len(total)), key=total.__getitem__)
    rate = sum(probe_pass_rate(loaded.module, rope, ids + ids[400:432], len(ids), first, probes) for ids in texts) / 3
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"probe_first": first, "pass_rate": rate, "relative_error": total, "probes": probes}))
    return ProbeCalibration(first, rate)


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


def chunk_ratios(kept: list[torch.Tensor], chunks: Sequence[tuple[str, int, int]]) -> dict[str, float]:
    """Per chunk (key, start, end), the share of its tokens the layers kept, averaged over layers."""
    if not kept:
        return {}
    bounds = torch.tensor([end for _, _, end in chunks])
    counts = torch.zeros(len(chunks))
    for layer in kept:  # [k] prefix indices
        counts += torch.bincount(torch.bucketize(layer, bounds, right=True), minlength=len(chunks))[: len(chunks)]
    return {key: float(counts[i]) / (len(kept) * (end - start)) for i, (key, start, end) in enumerate(chunks)}


class ImpressRestore:
    def __init__(self, plan: Plan, policy: ImpressPolicy, store: TieredStore, runner: ModelRunner,
                 token_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        self.plan, self.policy, self.store, self.runner = plan, policy, store, runner
        self.new_ids = list(token_ids[plan.history_tokens:])  # computed here; the last again by the step
        self.block_ids = list(block_ids)
        self.start = 0  # the request's slots are all rewritten (a failure recomputes from its start)
        self.stats = RestoreStats()
        self.impress: ImpressStats | None = None
        self._prepared = threading.Event()
        self._error: str | None = None

    def prepare(self) -> None:
        t0 = time.perf_counter()
        reads = None
        try:
            if self._error is not None:
                raise RestoreMiss(self._error)
            reads = TokenReads(self.store, self.plan.chunks)
            _, cache, st = impress_prefill(self.runner.model, self.runner.rope, reads, self.new_ids, self.policy)
            n = cache.slots - 1  # every slot but the last new token's (the step computes it and samples)
            slots = self.runner.upload(self.runner.slots(self.block_ids, 0, n))
            with torch.inference_mode():
                for li in range(len(cache.k)):
                    self.runner.k_cache[li].index_copy_(0, slots, cache.k[li][:n])
                    self.runner.v_cache[li].index_copy_(0, slots, cache.v[li][:n])
            self.runner.transfer.sync_compute()  # done means written
            self.impress = st
            spans = [(c.key, c.start - self.plan.chunks[0].start, c.end - self.plan.chunks[0].start)
                     for c in self.plan.chunks]  # prefix-relative, as the kept indices
            self.store.observe_importance(chunk_ratios(st.kept, spans))
            if self.policy.unit == 1:  # whole-granule choices say nothing about order within a granule
                self.store.observe_kept(kept_masks(st.kept, spans))
            self.store.promote(self.plan.chunks)
            self.stats.bytes_read = st.bytes_read
            self.stats.chunks_loaded = len(self.plan.chunks)
            self.stats.prefix_attended = st.kept_tokens
        except (TokenReadMiss, RestoreMiss, OSError, ValueError) as e:
            self._error = str(e) or type(e).__name__
            raise RestoreMiss(self._error) from e
        finally:
            if reads is not None:
                reads.close()
            self.stats.seconds = time.perf_counter() - t0
            self._prepared.set()

    def ready(self) -> bool:
        return self._prepared.is_set()

    @property
    def failed(self) -> bool:
        return self._error is not None

    def place(self, layer: int) -> None:
        """Everything was placed while preparing: nothing to do layer by layer."""

    def finish(self) -> RestoreStats:
        self._prepared.wait()
        if self._error is not None:
            raise RestoreMiss(self._error)
        return self.stats

    def abort(self) -> None:
        self._error = self._error or "aborted"
