"""`kvtier bench truncation`: options of the truncation perplexity benchmark."""

from __future__ import annotations

import argparse

from kvtier.cli.bench.options import Target, add_command, add_dtype_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="model preset, name or path (default: %(default)s)")
    add_dtype_argument(p, default="fp32")
    p.add_argument("--context", type=int, default=512, help="tokens before truncation")
    p.add_argument("--limit", type=int, default=384, help="context window the history must fit into")
    p.add_argument("--continuation", type=int, default=128, help="tokens whose perplexity is measured")
    p.add_argument("--keep-prefix", type=int, default=16, help="first tokens always kept (default: %(default)s)")
    p.add_argument("--drop-ratio", type=float, default=0.5, help="share of the rest dropped when the history must shrink (default: %(default)s)")
    p.add_argument("--windows", type=int, default=6, help="text windows averaged (default: %(default)s)")
    p.add_argument("--json", default=None, help="rows and mean perplexities as JSON")


run = Target("kvtier.bench.truncation", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "truncation", add_arguments, run,
                       "perplexity after context truncation: re-RoPE KV vs recompute vs naive")
