"""Which KV heads an importance restore probes in each layer, and how often they agree: measured
once per model, dtype and probe count (cached under KVTIER_HOME/probes).

A layer's probe is the candidate whose query heads' top-k choice of a prefix changes the query
rows' attention output least (relative to attending to the whole prefix), measured over stretches
of standard-library docstrings. Why not simply the paper's first heads: on some models another KV
head's choice matches every head's much better, and which one differs from layer to layer (on
SmolLM2 each of the three KV heads is the best probe in some layers; docs/impress.md has the
measurements).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.dtypes import name_of
from kvtier.engine.calibrate.cache import load, load_or_measure
from kvtier.engine.impress.importance import mean_jaccard, similarity_threshold, top_k
from kvtier.engine.impress.select import ProbeHeads
from kvtier.models.attention import causal_attention, column_importance
from kvtier.models.llama import CausalLM, ObserveFn, SelfAttention
from kvtier.models.loading import LoadedModel
from kvtier.models.rope import Rope
from kvtier.text import stdlib_text

TOKENS, QUERY = 1024, slice(400, 432)  # each calibration text, and the span of it that follows it as the query


@dataclass(frozen=True)
class ProbeCalibration:
    first: tuple[int, ...]  # each layer's first probe KV head (empty: 0 in every layer, the paper's)
    pass_rate: float  # share of layers whose probe heads agreed on the calibration text
    # Each candidate first head's relative error, mean over layers (zeros where none was measured:
    # the first heads), and that of each layer's own choice.
    relative_error: tuple[float, ...] = field(default=(), compare=False)
    chosen_error: float = field(default=0.0, compare=False)


def _each_layer(model: CausalLM, rope: Rope, ids: Sequence[int], observe: ObserveFn) -> None:
    """A full forward over `ids` through the shared layer loop; `observe` sees each layer's q, k, v
    (RoPE applied, [tokens, heads | kv_heads, hd]) before that layer attends over all of them."""
    dev = rope.cos_h.device
    cos, sin = rope.halves(torch.arange(len(ids), device=dev))  # [tokens, 1, hd/2]
    model.run_layers(model.embed(torch.tensor(list(ids), dtype=torch.long, device=dev)), SelfAttention(cos, sin, model.kernels, observe))


@torch.inference_mode()
def calibrate_probe(model: CausalLM, rope: Rope, prefix_ids: Sequence[int], query_ids: Sequence[int],
                    probes: int, ratio: float = 0.25) -> torch.Tensor:
    """How well each candidate probe (`probes` consecutive KV heads) chooses in each layer: how much
    its query heads' top-k choice of the prefix changes the query rows' attention output (every
    head's), relative to attending to the whole prefix. -> [layers, candidate first heads]."""
    cfg = model.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    m, k = len(prefix_ids), math.ceil(ratio * len(prefix_ids))
    own = torch.arange(m, m + len(query_ids))
    err = torch.zeros(cfg.num_layers, cfg.num_kv_heads - probes + 1)

    def observe(li: int, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor) -> None:
        imp = column_importance(q[m:], kk[:m], kk[m:])  # [heads, m]
        full = causal_attention(q[m:], kk, v, m, model.kernels).float()  # [n, heads, hd]: the query rows over everything
        for j in range(err.shape[1]):
            idx = torch.cat([top_k(imp[j * g : (j + probes) * g].sum(0), k), own]).to(kk.device)
            out = causal_attention(q[m:], kk.index_select(0, idx), v.index_select(0, idx), k, model.kernels).float()
            err[li, j] = float((out - full).norm() / full.norm())

    _each_layer(model, rope, list(prefix_ids) + list(query_ids), observe)
    return err


@torch.inference_mode()
def probe_pass_rate(model: CausalLM, rope: Rope, ids: Sequence[int], m: int, first: Sequence[int], probes: int,
                    ratio: float = 0.25, alpha: float = 0.6) -> float:
    """Share of layers whose probe heads (layer l: KV heads [first[l], first[l] + probes)) agree at
    `ratio`: the mean pairwise Jaccard of their query heads' top-k sets of the prefix ids[:m],
    scored by the rows after it, reaches the threshold. Layers below it read every key (the
    planner's input)."""
    cfg = model.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    k, t = math.ceil(ratio * m), similarity_threshold(ratio, alpha)
    passed = [0]

    def observe(li: int, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor) -> None:
        heads = ProbeHeads.of(first[li], probes, g)
        imp = column_importance(q[m:, heads.q], kk[:m, heads.kv], kk[m:, heads.kv])  # [probe q heads, m]
        passed[0] += mean_jaccard(imp, k) >= t

    _each_layer(model, rope, ids, observe)
    return passed[0] / cfg.num_layers


def _texts(loaded: LoadedModel) -> list[list[int]]:
    """Three stretches of standard-library docstrings; seeded random ids for a model without a
    tokenizer (a random-weight preset)."""
    if loaded.tokenizer is None:
        return [torch.randint(3, loaded.config.vocab_size, (TOKENS,), generator=torch.Generator().manual_seed(s)).tolist()
                for s in range(3)]
    return [loaded.tokenizer.encode(stdlib_text(12000, skip), add_special_tokens=False)[:TOKENS] for skip in (0, 40, 80)]


def _measure(loaded: LoadedModel, probes: int) -> ProbeCalibration:
    cfg = loaded.config
    rope = Rope(cfg, TOKENS + QUERY.stop - QUERY.start, loaded.dtype, loaded.module.lm_head.weight.device)
    texts = _texts(loaded)
    err = torch.zeros(cfg.num_layers, cfg.num_kv_heads - probes + 1)  # [layers, candidates]
    first: tuple[int, ...] = ()
    if probes < cfg.num_kv_heads and loaded.tokenizer is not None:  # else the paper's first heads
        err = sum((calibrate_probe(loaded.module, rope, ids, ids[QUERY], probes) for ids in texts), err) / len(texts)
        first = tuple(err.argmin(1).tolist())  # each layer's best
    rate = sum(probe_pass_rate(loaded.module, rope, ids + ids[QUERY], len(ids), first or (0,) * cfg.num_layers, probes)
               for ids in texts) / len(texts)
    return ProbeCalibration(first, rate, tuple(err.mean(0).tolist()), float(err.min(1).values.mean()))


# Without a measurement: the paper's first heads, and probes assumed to agree in every layer (the
# planner then learns the real pass rate from restores).
UNCALIBRATED = ProbeCalibration((), 1.0)


def _key(loaded: LoadedModel, probes: int) -> str:
    return f"{loaded.fingerprint}-{name_of(loaded.dtype)}-{probes}-by-layer"  # by-layer: not the older one-head file


def _decode(doc: dict[str, Any]) -> ProbeCalibration:
    return ProbeCalibration(tuple(int(f) for f in doc["probe_first"]), float(doc["pass_rate"]),
                            tuple(float(e) for e in doc.get("relative_error", ())), float(doc.get("chosen_error", 0.0)))


def calibrate(loaded: LoadedModel, probes: int) -> ProbeCalibration:
    """A model's probe KV heads per layer and how often they agree (`calibrate_probe`'s best
    candidate in each layer, and `probe_pass_rate` there), measured once per model, dtype and
    probe count."""

    def encode(c: ProbeCalibration) -> dict[str, Any]:
        return {"probe_first": list(c.first), "pass_rate": c.pass_rate, "relative_error": list(c.relative_error),
                "chosen_error": c.chosen_error, "probes": probes}

    return load_or_measure(kind="probes", key=_key(loaded, probes), measure=lambda: _measure(loaded, probes),
                           decode=_decode, encode=encode)


def cached_calibration(loaded: LoadedModel, probes: int) -> ProbeCalibration | None:
    """What `calibrate` cached for this model, dtype and probe count, if anything (times nothing)."""
    return load("probes", _key(loaded, probes), _decode)
