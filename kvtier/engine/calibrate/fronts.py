"""The measured cost of a decode step with uncached fronts on this machine (`ProfileCostModel`).

Decode steps of b sequences of s tokens with fronts u, recomputed or read back, are timed on a
scratch pool and fitted by least squares (`optimizer.fit_profile`). The fit is cached per model,
dtype and thread count under KVTIER_HOME/partial, like the hardware profile.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict

import torch

from kvtier.dtypes import name_of
from kvtier.engine.calibrate import cache
from kvtier.engine.calibrate.hardware import estimate as estimate_profile
from kvtier.engine.runner.model_runner import ContextFeed, ModelRunner, RunItem
from kvtier.models.loading import LoadedModel
from kvtier.planning import optimizer

log = logging.getLogger(__name__)

# (decodes, context tokens, front tokens, source): fronts of 0 to about half the context, both sources.
GRID: tuple[tuple[int, int, int, str], ...] = tuple(
    (b, s, u, src) for b in (1, 4, 12) for s in (128, 512) for u in (0, 64, s // 2)
    for src in ("recompute", "swap") if not (u == 0 and src == "swap")
)
HELD_OUT: tuple[tuple[int, int, int, str], ...] = tuple(
    (b, s, u, src) for b in (8,) for s in (320,) for u in (0, 96, 160) for src in ("recompute", "swap")
    if not (u == 0 and src == "swap")
)


def _blocks(i: int, per: int) -> list[int]:
    return list(range(i * per, (i + 1) * per))


def _reader(runner: ModelRunner, slots: torch.Tensor) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    def kv(layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return runner.k_cache[layer].index_select(0, slots), runner.v_cache[layer].index_select(0, slots)

    return kv


@torch.inference_mode()
def measure(model: LoadedModel, points: Iterable[tuple[int, int, int, str]], repeats: int = 3,
            block_size: int = 16) -> list[optimizer.Sample]:
    """Time one decode step per point (median of `repeats` after a warm-up) on a scratch pool."""
    points = list(points)
    b_max = max(p[0] for p in points)
    s_max = max(p[1] for p in points)
    per = -(-(s_max + 1) // block_size)
    runner = ModelRunner(model.module, b_max * per, block_size, s_max + 2)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (b_max, s_max + 1), generator=gen).tolist()
    filled = 0
    samples = []
    for b, s, u, src in points:
        if filled != s:  # each sequence's [0, s) in the pool (prefilled once per context length)
            for i in range(b_max):
                runner.execute([RunItem(ids[i][:s], 0, _blocks(i, per), want_logits=False)])
            filled = s
        dec = [RunItem([ids[i][s]], s, _blocks(i, per)[u // block_size:], want_logits=True, unslotted=u,
                       context_feed=u) for i in range(b)]
        runs: list[RunItem] = []
        feed = None
        if u and src == "recompute":
            runs = [RunItem(ids[i][:u], 0, (), want_logits=False, feeds=i) for i in range(b)]
        elif u:  # read back: copies of the fronts' K/V, as the swap space hands them over
            feed = ContextFeed(0, _reader(runner, torch.cat([runner.slots(_blocks(i, per), 0, u) for i in range(b)])))

        def step(dec: list[RunItem] = dec, runs: list[RunItem] = runs, feed: ContextFeed | None = feed) -> float:
            t = time.perf_counter()
            runner.execute(dec + runs, feed=feed)
            return time.perf_counter() - t

        step()
        secs = statistics.median(step() for _ in range(repeats))
        samples.append(optimizer.Sample(tuple([s + 1] * b), tuple([u] * b), src, secs))
    return samples


def _key(model: LoadedModel) -> str:
    dt = name_of(next(model.module.parameters()).dtype)
    return f"{model.fingerprint[:16]}-{dt}-t{torch.get_num_threads()}"


def _decode(doc: dict) -> optimizer.ProfileCostModel:
    return optimizer.ProfileCostModel(**doc["model"])


def cost_model(model: LoadedModel, runner: ModelRunner | None = None, refresh: bool = False) -> optimizer.ProfileCostModel:
    """The fitted model for this machine: from the cache, else measured now (once; tens of seconds on a small CPU)."""
    return cache.load_or_measure(
        "partial", _key(model),
        lambda: optimizer.fit_profile(measure(model, GRID, block_size=runner.block_size if runner else 16)),
        _decode, lambda fitted: {"model": asdict(fitted)}, refresh=refresh)


def estimate(model: LoadedModel) -> optimizer.ProfileCostModel:
    """A step model from the hardware estimate's rates, without timing anything: a step reads the
    weights once (a prefill's per-step term), each context token costs a history token's attention,
    each recomputed front token a prefill token. Rough: `make_engine` measures the real one."""
    prof = estimate_profile(model)
    return optimizer.ProfileCostModel(c0=prof.prefill_c, c1=prof.prefill_a, g=prof.prefill_g, a=prof.prefill_a,
                                     q=prof.prefill_b, w=2 * prof.place_s * model.config.num_layers)


def cached_or_estimate(model: LoadedModel) -> optimizer.ProfileCostModel:
    """The measured model if one is cached for this machine, else `estimate` (times nothing)."""
    return cache.load("partial", _key(model), _decode) or estimate(model)


def held_out_error(model: LoadedModel, fitted: optimizer.ProfileCostModel,
                   points: Sequence[tuple[int, int, int, str]] = HELD_OUT) -> tuple[float, list[optimizer.Sample]]:
    """MAPE of the fitted model on points it was not fitted on."""
    samples = measure(model, points)
    return optimizer.mape(fitted, samples), samples
