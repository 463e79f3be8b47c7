"""`kvtier bench partial`: options of the partial token-wise caching benchmark."""

from __future__ import annotations

import argparse

from kvtier.cli.bench.options import Target, add_command, add_dtype_argument, float_list, split_commas


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", type=split_commas, default=["smollm2-135m", "mha-small"],
                   help="models or presets, comma list (default: smollm2-135m,mha-small)")
    add_dtype_argument(p)
    p.add_argument("--requests", type=int, default=24, help="requests per policy and rate")
    p.add_argument("--rates", type=float_list, default=[0.5, 1.0], help="Poisson arrival rates, requests/s (comma list)")
    p.add_argument("--prompt-min", type=int, default=256, help="shortest prompt, tokens")
    p.add_argument("--prompt-max", type=int, default=512, help="longest prompt, tokens")
    p.add_argument("--mean-output", type=int, default=128, help="mean output tokens (log-normal, ShareGPT's spread)")
    p.add_argument("--budget-share", type=float, default=0.25, help="KV budget as a share of the peak demand")
    p.add_argument("--slo-x", type=float, default=1.5, help="TPOT SLO as a multiple of the unloaded decode step")
    p.add_argument("--ratios", type=float_list, default=[0.2, 0.4, 0.6], help="fixed uncached shares to compare")
    p.add_argument("--swap-mbps", type=float, default=None, help="also read fronts back at this emulated MB/s")
    p.add_argument("--policies", type=split_commas, default=None,
                   help="run only these (the ample-memory runs always run: they set the budget)")
    p.add_argument("--max-batched-tokens", type=int, default=256, help="per-step token budget (prefill chunks)")
    p.add_argument("--duration", type=float, default=90.0,
                   help="seconds each policy runs at most after the first arrival (then running requests are aborted)")
    p.add_argument("--recalibrate", action="store_true", help="measure the cost model again")
    p.add_argument("--seed", type=int, default=0, help="seeds arrivals, lengths and prompts")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--json", default=None, help="write rows and goals to this JSON file")
    p.add_argument("--plot", default=None, help="write concurrency over time and throughput to this PNG")


run = Target("kvtier.bench.partial.run", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "partial", add_arguments, run,
                       "serving under a small KV budget: partial token-wise caching (eLLM) beside preemption by "
                       "recompute and by swap")
