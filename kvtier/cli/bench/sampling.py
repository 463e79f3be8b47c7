"""`kvtier bench sampling`: options of the sampler decode-throughput benchmark."""

from __future__ import annotations

import argparse

from kvtier.cli.bench.options import Target, add_command, int_list
from kvtier.cli.engine_args import add_model_arguments, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--batch", type=int_list, default=[1, 8],
                   help="batch sizes: that many prompts decoded together (comma list, default: 1,8)")
    p.add_argument("--tokens", type=positive_int, default=64,
                   help="max_tokens per request; all of them but the JSON row's, which may end sooner "
                        "(default: %(default)s)")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3,
                   help="timed runs of every row after one warm-up; medians are reported (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="request i is seeded seed + i (default: %(default)s)")
    p.add_argument("--out", default="out/sampling",
                   help="folder for sampling.json, sampling.md and sampling.png (default: %(default)s)")


run = Target("kvtier.bench.sampling", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "sampling", add_arguments, run,
                       "decode tok/s of the batched sampler (penalties, logprobs, JSON schema) beside the "
                       "per-row host sampler it replaced")
