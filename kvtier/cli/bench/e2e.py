"""`kvtier bench e2e` (and `kvtier bench e2e report JSON`): options of the end-to-end benchmark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.bench.common import csv_arg
from kvtier.bench.e2e.peers import PEERS
from kvtier.cli.bench.options import Target, add_bench_options, add_command
from kvtier.cli.options import option
from kvtier.engine.config import DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class E2EOptions:
    """`kvtier bench e2e`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    model: str = option("smollm2-135m", "", "model preset, name or path (default: %(default)s)")
    dtype: list[str] = option("fp32,bf16", "", "comma-separated compute dtypes (default: %(default)s)", type=csv_arg)
    history: list[int] = option("1024,4096,8128", "", "comma-separated history lengths H; H + new tokens must fit the "
                                "model's window (smollm2: H <= 8128) (default: %(default)s)",
                                type=lambda t: [int(x) for x in csv_arg(t)])
    new_tokens: int = option(64, "", "new tokens after the history (default: %(default)s)")
    contexts: int = option(3, "", "timed random contexts per cell, plus one warm-up (default: %(default)s)")
    tiers: list[str] = option("memory,disk,redis", "", "tiers to measure (default: %(default)s)", type=csv_arg)
    peers: list[str] = option(",".join(PEERS), "", "subset of peers (default: %(default)s)", type=csv_arg)
    method: str = option("auto", "", "kvtier restore method, as ReuseConfig(method=...) takes it: auto, kv, hidden, "
                         "bubblefree, cake, recompute (default: %(default)s)")
    chunk_tokens: int = option(DEFAULT_CHUNK_TOKENS, "", "tokens per stored chunk of the kvtier peers' stores "
                               "(larger: fewer, larger reads from disk; see docs/benchmarks.md) (default: %(default)s)")
    kv_cache: str = option("4GB", "", "Engine KV budget (default: %(default)s)")
    max_batched_tokens: int | None = option(None, "", "Engine per-step token budget (default: the EngineConfig "
                                            "default)")
    fast_inexact: bool = option(False, "", "kvtier engines with the plain kernels (EngineConfig.exact=False), to "
                                "compare with the exact default")
    bf16_attention: str = option("auto", "", "kvtier engines' exact bf16 attention kernel "
                                 "(EngineConfig.bf16_attention) (default: %(default)s)",
                                 choices=("auto", "gemm", "flash"))
    workdir: str = option("out/e2e-work", "", "disk tier and HF files; wiped at start (default: %(default)s)")
    redis_url: str | None = option(None, "", "Redis server (default: %(default)s = start a private redis-server)")
    json: str | None = option(None, "", "JSON output, rewritten after every row (default: %(default)s)")
    markdown: str | None = option(None, "", "markdown table + goals (default: %(default)s)")
    plot: str | None = option(None, "", "PNG of TTFT per peer (default: %(default)s)")
    seed: int = option(0, "", "seed of the random contexts (default: %(default)s)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, E2EOptions)


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
