"""`kvtier bench restore` (and `kvtier bench restore report JSON...`): options -> RestoreOptions."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.bench.restore.methods import METHODS
from kvtier.cli.bench.options import add_bench_options, add_command, add_dtype_argument, bench_module
from kvtier.cli.options import option
from kvtier.device import add_device_argument


@dataclass(frozen=True)
class RestoreBenchOptions:
    """`kvtier bench restore`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    model: str = option("smollm2-135m", "", "comma-separated model names (default: %(default)s)")
    storage_dtype: str = option("", "", "comma-separated storage dtypes (int8, fp16, bf16, fp32); empty = the compute "
                                "dtype (lossless)")
    context: str = option("1024,4096,8192", "", "comma-separated history lengths (default: %(default)s)")
    new_tokens: int = option(64, "", "new tokens after the history, at most one chunk (default: %(default)s)")
    tier: str = option("memory,disk,redis", "", "comma-separated tiers: memory, disk, redis")
    bandwidth: str = option("none,500MB/s,100MB/s,20MB/s", "", "comma-separated read limits; anything but none is "
                            "emulated")
    methods: str = option(",".join(METHODS), "", "comma-separated subset of " + ",".join(METHODS))
    no_baselines: bool = option(False, "", "skip the HF transformers baselines")
    repeats: int = option(3, "", "timed runs per method and cell (default: 3)")
    warmup: int = option(1, "", "untimed runs of each method per model/context")
    greedy_tokens: int = option(8, "", "greedy tokens compared after each restore")
    chunk_tokens: int = option(64, "", "tokens per stored chunk (default: %(default)s)")
    workdir: str = option("out/restore-work", "", "disk tier directory (wiped at start)")
    redis_url: str | None = option(None, "", "redis server to use (default: start a private redis-server)")
    json: str | None = option(None, "", "rows, goals and meta as JSON, rewritten after every cell")
    markdown: str | None = option(None, "", "markdown tables and goals")
    plot: str | None = option(None, "", "PNG path of TTFT vs bandwidth per method")
    seed: int = option(0, "", "seed of the random contexts (default: %(default)s)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_dtype_argument(p, default="bf16")
    add_device_argument(p)
    add_bench_options(p, RestoreBenchOptions)
    sub = p.add_subparsers(dest="sub")  # `report` re-renders a JSON file (markdown, plot, goals)
    rp = sub.add_parser("report", help="re-render markdown/plot/goals from JSON written by runs; with several "
                                       "files, a later file's row replaces an earlier one of the same cell and method")
    rp.add_argument("json_in", nargs="+", help="JSON files written by runs (the --json/--markdown/--plot "
                                               "before `report` say where the merged result goes)")


def options_from_args(args: argparse.Namespace):
    from kvtier import dtypes
    from kvtier.bench.common import csv_arg
    from kvtier.bench.restore.run import BenchConfig, parse_bandwidth

    storage = [dtypes.canonical(s) for s in csv_arg(args.storage_dtype)] or [""]
    methods = csv_arg(args.methods)
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}: use {', '.join(METHODS)}")
    if "recompute" in methods:  # measured first: every other method is compared with it
        methods = ["recompute"] + [m for m in methods if m != "recompute"]
    for b in csv_arg(args.bandwidth):
        parse_bandwidth(b)
    return BenchConfig(models=csv_arg(args.model), dtype=args.dtype, device=args.device, storage=storage,
                       contexts=[int(c) for c in csv_arg(args.context)], new_tokens=args.new_tokens,
                       tiers=csv_arg(args.tier), bandwidths=csv_arg(args.bandwidth), methods=methods,
                       baselines=not args.no_baselines, repeats=args.repeats, warmup=args.warmup,
                       greedy_tokens=args.greedy_tokens, chunk_tokens=args.chunk_tokens, workdir=args.workdir,
                       redis_url=args.redis_url, json_path=args.json, markdown_path=args.markdown,
                       plot_path=args.plot, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    bench = bench_module("kvtier.bench.restore.run")
    if args.sub == "report":
        return bench.report(args.json_in, args.json, args.markdown, args.plot)
    return bench.cmd_restore(options_from_args(args))


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "restore", add_arguments, run,
                       "TTFT of every restore method vs tier and (emulated) bandwidth", about="kvtier.bench.restore.run")
