"""`kvtier bench e2e` (and `kvtier bench e2e report JSON`): options of the end-to-end benchmark."""

from __future__ import annotations

import argparse

from kvtier.bench.common import csv_arg
from kvtier.bench.e2e.peers import PEERS
from kvtier.cli.bench.options import Target, add_command
from kvtier.engine.config import DEFAULT_CHUNK_TOKENS


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", default="smollm2-135m", help="model preset, name or path (default: %(default)s)")
    a("--dtype", type=csv_arg, default="fp32,bf16", help="comma-separated compute dtypes (default: %(default)s)")
    a("--history", type=lambda t: [int(x) for x in csv_arg(t)], default="1024,4096,8128",
      help="comma-separated history lengths H; H + new tokens must fit the model's window "
           "(smollm2: H <= 8128) (default: %(default)s)")
    a("--new-tokens", type=int, default=64, help="new tokens after the history (default: %(default)s)")
    a("--contexts", type=int, default=3, help="timed random contexts per cell, plus one warm-up (default: %(default)s)")
    a("--tiers", type=csv_arg, default="memory,disk,redis", help="tiers to measure (default: %(default)s)")
    a("--peers", type=csv_arg, default=",".join(PEERS), help="subset of peers (default: %(default)s)")
    a("--method", default="auto", help="kvtier restore method, as ReuseConfig(method=...) takes it: auto, kv, "
                                       "hidden, bubblefree, cake, recompute (default: %(default)s)")
    a("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
      help="tokens per stored chunk of the kvtier peers' stores (larger: fewer, larger reads from disk; "
           "see docs/benchmarks.md) (default: %(default)s)")
    a("--kv-cache", default="4GB", help="Engine KV budget (default: %(default)s)")
    a("--max-batched-tokens", type=int, default=None,
      help="Engine per-step token budget (default: the EngineConfig default)")
    a("--fast-inexact", action="store_true",
      help="kvtier engines with the plain kernels (EngineConfig.exact=False), to compare with the exact default")
    a("--bf16-attention", default="auto", choices=("auto", "gemm", "flash"),
      help="kvtier engines' exact bf16 attention kernel (EngineConfig.bf16_attention) (default: %(default)s)")
    a("--workdir", default="out/e2e-work", help="disk tier and HF files; wiped at start (default: %(default)s)")
    a("--redis-url", default=None, help="Redis server (default: %(default)s = start a private redis-server)")
    a("--json", default=None, help="JSON output, rewritten after every row (default: %(default)s)")
    a("--markdown", default=None, help="markdown table + goals (default: %(default)s)")
    a("--plot", default=None, help="PNG of TTFT per peer (default: %(default)s)")
    a("--seed", type=int, default=0, help="seed of the random contexts (default: %(default)s)")


def _add_report(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="sub")
    rp = sub.add_parser("report", help="re-render the table, goals, markdown and plot from a JSON file")
    rp.add_argument("json_in", help="JSON written by a run")
    rp.add_argument("--markdown", dest="report_markdown", default=None, help="markdown output (default: %(default)s)")
    rp.add_argument("--plot", dest="report_plot", default=None, help="PNG output (default: %(default)s)")


def _add_all(p: argparse.ArgumentParser) -> None:
    add_arguments(p)
    _add_report(p)


run = Target("kvtier.bench.e2e.run", "cmd_e2e")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "e2e", _add_all, run,
                       "returning-context TTFT through the public API vs HF peers")
