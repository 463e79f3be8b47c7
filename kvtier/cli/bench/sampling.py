"""`kvtier bench sampling`: options of the sampler decode-throughput benchmark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command, int_list
from kvtier.cli.engine_args import add_model_arguments, positive_int
from kvtier.cli.options import option


@dataclass(frozen=True)
class SamplingBenchOptions:
    """`kvtier bench sampling`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    batch: list[int] = option(lambda: [1, 8], "", "batch sizes: that many prompts decoded together (comma list, "
                              "default: 1,8)", type=int_list)
    tokens: int = option(64, "", "max_tokens per request; all of them but the JSON row's, which may end sooner "
                         "(default: %(default)s)", type=positive_int)
    prompt_len: int = option(64, "", "tokens per prompt (default: %(default)s)", type=positive_int)
    repeats: int = option(3, "", "timed runs of every row after one warm-up; medians are reported (default: "
                          "%(default)s)", type=positive_int)
    seed: int = option(0, "", "request i is seeded seed + i (default: %(default)s)")
    out: str = option("out/sampling", "", "folder for sampling.json, sampling.md and sampling.png (default: "
                      "%(default)s)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, SamplingBenchOptions)
    add_model_arguments(p)


run = Target("kvtier.bench.sampling", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "sampling", add_arguments, run,
                       "decode tok/s of the batched sampler (penalties, logprobs, JSON schema) beside the "
                       "per-row host sampler it replaced")
