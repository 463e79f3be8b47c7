"""`kvtier bench partial`: options of the partial token-wise caching benchmark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import (
    Target,
    add_bench_options,
    add_command,
    add_dtype_argument,
    float_list,
    split_commas,
)
from kvtier.cli.options import option


@dataclass(frozen=True)
class PartialBenchOptions:
    """`kvtier bench partial`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    models: list[str] = option(lambda: ["smollm2-135m", "mha-small"], "", "models or presets, comma list (default: "
                               "smollm2-135m,mha-small)", type=split_commas)
    requests: int = option(24, "", "requests per policy and rate")
    rates: list[float] = option(lambda: [0.5, 1.0], "", "Poisson arrival rates, requests/s (comma list)",
                                type=float_list)
    prompt_min: int = option(256, "", "shortest prompt, tokens")
    prompt_max: int = option(512, "", "longest prompt, tokens")
    mean_output: int = option(128, "", "mean output tokens (log-normal, ShareGPT's spread)")
    budget_share: float = option(0.25, "", "KV budget as a share of the peak demand")
    slo_x: float = option(1.5, "", "TPOT SLO as a multiple of the unloaded decode step")
    ratios: list[float] = option(lambda: [0.2, 0.4, 0.6], "", "fixed uncached shares to compare", type=float_list)
    swap_mbps: float | None = option(None, "", "also read fronts back at this emulated MB/s")
    policies: list[str] | None = option(None, "", "run only these (the ample-memory runs always run: they set the "
                                        "budget)", type=split_commas)
    max_batched_tokens: int = option(256, "", "per-step token budget (prefill chunks)")
    duration: float = option(90.0, "", "seconds each policy runs at most after the first arrival (then running "
                             "requests are aborted)")
    recalibrate: bool = option(False, "", "measure the cost model again")
    seed: int = option(0, "", "seeds arrivals, lengths and prompts")
    threads: int | None = option(None, "", "torch threads (default: all cores)")
    json: str | None = option(None, "", "write rows and goals to this JSON file")
    plot: str | None = option(None, "", "write concurrency over time and throughput to this PNG")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, PartialBenchOptions)
    add_dtype_argument(p)


run = Target("kvtier.bench.partial.run", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "partial", add_arguments, run,
                       "serving under a small KV budget: partial token-wise caching (eLLM) beside preemption by "
                       "recompute and by swap")
