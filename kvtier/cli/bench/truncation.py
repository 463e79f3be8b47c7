"""`kvtier bench truncation`: options of the truncation perplexity benchmark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command, add_dtype_argument
from kvtier.cli.options import option


@dataclass(frozen=True)
class TruncationOptions:
    """`kvtier bench truncation`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    model: str = option("smollm2-135m", "", "model preset, name or path (default: %(default)s)")
    context: int = option(512, "", "tokens before truncation")
    limit: int = option(384, "", "context window the history must fit into")
    continuation: int = option(128, "", "tokens whose perplexity is measured")
    keep_prefix: int = option(16, "", "first tokens always kept (default: %(default)s)")
    drop_ratio: float = option(0.5, "", "share of the rest dropped when the history must shrink (default: %(default)s)")
    windows: int = option(6, "", "text windows averaged (default: %(default)s)")
    json: str | None = option(None, "", "rows and mean perplexities as JSON")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, TruncationOptions)
    add_dtype_argument(p, default="fp32")


run = Target("kvtier.bench.truncation", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "truncation", add_arguments, run,
                       "perplexity after context truncation: re-RoPE KV vs recompute vs naive")
