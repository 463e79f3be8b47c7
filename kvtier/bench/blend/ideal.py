"""The least time a row's first token can take on this machine: the bytes it read over the measured
bandwidth, or the FLOPs it computed over the measured matmul rate, whichever is longer (the roofline
of bench/roofline.py, whose rates are measured in the same run).

FLOPs count what each row runs: every layer's matmuls for each computed token (the LM head once,
for the first token's logits) and attention's q.k and p.v over the keys before it. A blended
row's computed tokens are its plan's runs and the prompt's last token; cacheblend's also the
layers up to the check layer over the whole blended region, the uncovered tokens once more where
the prompt's last rows weigh the deviations (their pass over the loaded state), and its picked
tokens (whose positions the engine does not report) at the loaded rows' mean number of keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.bench.roofline import Rates, shape_of
from kvtier.models.llama import CausalLM
from kvtier.planning.blend import BlendMode, BlendOptions, BlendScore, plan_blend

Runs = Sequence[tuple[int, int]]


def _keys(a: int, b: int) -> int:
    """Keys the queries at positions [a, b) attend to under the causal mask: sum of p + 1."""
    return (b * (b + 1) - a * (a + 1)) // 2


@dataclass(frozen=True)
class FlopModel:
    layer_flops: int  # per token: every layer's matmuls (2 x weights), the LM head apart
    head_flops: int  # the LM head for one token
    attn_per_key: int  # per query and key: q.k and p.v over every head and layer
    layers: int

    @staticmethod
    def of(model: CausalLM) -> FlopModel:
        shape = shape_of(model)
        head = 2 * model.lm_head.weight.numel()
        return FlopModel(shape.flops_per_token - head, head, shape.attn_flops_per_key, model.cfg.num_layers)

    def runs(self, runs: Runs, layers: int | None = None) -> float:
        """FLOPs of computing the tokens of `runs` through `layers` layers (default: all)."""
        share = (self.layers if layers is None else layers) / self.layers
        return share * sum((b - a) * self.layer_flops + self.attn_per_key * _keys(a, b) for a, b in runs)


def row_flops(fm: FlopModel, ids: Sequence[int], spans: Runs, blend: BlendOptions | None, computed: int) -> float:
    """FLOPs of a row's first token: `computed` prompt tokens (the last one included) at the end of
    the prompt for an exact row (blend None), else what the blend's plan recomputes."""
    n = len(ids)
    if blend is None:
        return fm.runs([(n - computed, n)]) + fm.head_flops
    plan = plan_blend(ids, spans, 0, 0, blend)
    if plan is None:  # nothing to load: the engine prefilled
        return fm.runs([(0, n)]) + fm.head_flops
    runs = [*plan.runs, (n - 1, n)]
    flops = fm.runs(runs) + fm.head_flops
    if BlendMode(blend.mode) is BlendMode.CACHEBLEND:
        flops += fm.runs([(0, n - 1)], layers=min(blend.check_layer, fm.layers - 1) + 1)
        if BlendScore(blend.score) is BlendScore.WEIGHTED:
            flops += fm.runs(plan.runs)
        picked = computed - sum(b - a for a, b in runs)
        loaded = plan.loaded
        rows = sum(b - a for a, b in loaded)
        if picked > 0 and rows:
            mean_keys = sum(_keys(a, b) for a, b in loaded) / rows
            flops += picked * (fm.layer_flops + fm.attn_per_key * mean_keys)
    return flops


@dataclass(frozen=True)
class Ideal:
    read_s: float
    compute_s: float

    @property
    def seconds(self) -> float:
        return max(self.read_s, self.compute_s)


def ideal(bytes_read: int, flops: float, bandwidth: float, rates: Rates) -> Ideal:
    """The row's roofline: `bandwidth` bytes/s for its reads, the measured matmul rate for its FLOPs."""
    return Ideal(bytes_read / bandwidth if bytes_read else 0.0, flops / rates.flops)
