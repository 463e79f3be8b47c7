"""Which KV heads an importance restore probes, and how often they agree: measured once per model,
dtype and probe count (cached under KVTIER_HOME/probes).

The probe is the candidate whose query heads' top-k choice of a prefix changes the query rows'
attention output least (relative to attending to the whole prefix), measured over stretches of
standard-library docstrings. Why not simply the paper's first heads: on some models another KV
head's choice matches every head's much better (docs/impress.md has the measurements).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.dtypes import name_of
from kvtier.engine.calibrate.cache import load, load_or_measure
from kvtier.engine.restore.importance import column_importance, mean_jaccard, similarity_threshold, top_k
from kvtier.models.attention import causal_attention
from kvtier.models.llama import CausalLM, ObserveFn, SelfAttention
from kvtier.models.loading import LoadedModel
from kvtier.models.rope import Rope
from kvtier.text import stdlib_text

TOKENS, QUERY = 1024, slice(400, 432)  # each calibration text, and the span of it that follows it as the query


@dataclass(frozen=True)
class ProbeCalibration:
    first: int  # first probe KV head
    pass_rate: float  # share of layers whose probe heads agreed on the calibration text
    # Each candidate first head's mean relative error (zeros where none was measured: the first heads).
    relative_error: tuple[float, ...] = field(default=(), compare=False)


def _each_layer(model: CausalLM, rope: Rope, ids: Sequence[int], observe: ObserveFn) -> None:
    """A full forward over `ids` through the shared layer loop; `observe` sees each layer's q, k, v
    (RoPE applied, [tokens, heads | kv_heads, hd]) before that layer attends over all of them."""
    dev = rope.cos_h.device
    cos, sin = rope.halves(torch.arange(len(ids), device=dev))  # [tokens, 1, hd/2]
    model.run_layers(model.embed(torch.tensor(list(ids), dtype=torch.long, device=dev)), SelfAttention(cos, sin, observe))


@torch.inference_mode()
def calibrate_probe(model: CausalLM, rope: Rope, prefix_ids: Sequence[int], query_ids: Sequence[int],
                    probes: int, ratio: float = 0.25) -> tuple[int, list[float]]:
    """Which `probes` consecutive KV heads to probe: those whose query heads' top-k choice of the
    prefix changes the query rows' attention output (every head's) least, relative to attending
    to the whole prefix, averaged over layers. -> (first probe KV head, each candidate's mean
    relative error)."""
    cfg = model.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    m, k = len(prefix_ids), math.ceil(ratio * len(prefix_ids))
    own = torch.arange(m, m + len(query_ids))
    err = [0.0] * (cfg.num_kv_heads - probes + 1)

    def observe(li: int, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor) -> None:
        imp = column_importance(q[m:], kk[:m], kk[m:])  # [heads, m]
        full = causal_attention(q[m:], kk, v, m).float()  # [n, heads, hd]: the query rows over everything
        for j in range(len(err)):
            idx = torch.cat([top_k(imp[j * g : (j + probes) * g].sum(0), k), own]).to(kk.device)
            out = causal_attention(q[m:], kk.index_select(0, idx), v.index_select(0, idx), k).float()
            err[j] += float((out - full).norm() / full.norm()) / cfg.num_layers

    _each_layer(model, rope, list(prefix_ids) + list(query_ids), observe)
    return min(range(len(err)), key=err.__getitem__), err


@torch.inference_mode()
def probe_pass_rate(model: CausalLM, rope: Rope, ids: Sequence[int], m: int, first: int, probes: int,
                    ratio: float = 0.25, alpha: float = 0.6) -> float:
    """Share of layers whose probe heads (KV heads [first, first + probes)) agree at `ratio`: the
    mean pairwise Jaccard of their query heads' top-k sets of the prefix ids[:m], scored by the
    rows after it, reaches the threshold. Layers below it read every key (the planner's input)."""
    cfg = model.cfg
    g = cfg.num_heads // cfg.num_kv_heads
    k, t = math.ceil(ratio * m), similarity_threshold(ratio, alpha)
    passed = [0]

    def observe(li: int, q: torch.Tensor, kk: torch.Tensor, v: torch.Tensor) -> None:
        imp = column_importance(q[m:, first * g : (first + probes) * g], kk[:m, first : first + probes],
                                kk[m:, first : first + probes])  # [probe q heads, m]
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
    first, total = 0, [0.0] * (cfg.num_kv_heads - probes + 1)
    if probes < cfg.num_kv_heads and loaded.tokenizer is not None:  # else the paper's first heads
        for ids in texts:
            _, err = calibrate_probe(loaded.module, rope, ids, ids[QUERY], probes)
            total = [a + b / 3 for a, b in zip(total, err)]
        first = min(range(len(total)), key=total.__getitem__)
    rate = sum(probe_pass_rate(loaded.module, rope, ids + ids[QUERY], len(ids), first, probes) for ids in texts) / 3
    return ProbeCalibration(first, rate, tuple(total))


# Without a measurement: the paper's first heads, and probes assumed to agree in every layer (the
# planner then learns the real pass rate from restores).
UNCALIBRATED = ProbeCalibration(0, 1.0)


def _key(loaded: LoadedModel, probes: int) -> str:
    return f"{loaded.fingerprint}-{name_of(loaded.dtype)}-{probes}"


def _decode(doc: dict[str, Any]) -> ProbeCalibration:
    return ProbeCalibration(int(doc["probe_first"]), float(doc["pass_rate"]),
                            tuple(float(e) for e in doc.get("relative_error", ())))


def calibrate(loaded: LoadedModel, probes: int) -> ProbeCalibration:
    """A model's probe KV heads and how often they agree (`calibrate_probe`'s best candidate, and
    `probe_pass_rate` there), measured once per model, dtype and probe count."""

    def encode(c: ProbeCalibration) -> dict[str, Any]:
        return {"probe_first": c.first, "pass_rate": c.pass_rate, "relative_error": list(c.relative_error),
                "probes": probes}

    return load_or_measure(kind="probes", key=_key(loaded, probes), measure=lambda: _measure(loaded, probes),
                           decode=_decode, encode=encode)


def cached_calibration(loaded: LoadedModel, probes: int) -> ProbeCalibration | None:
    """What `calibrate` cached for this model, dtype and probe count, if anything (times nothing)."""
    return load("probes", _key(loaded, probes), _decode)
