"""`kvtier bench restore` (and `kvtier bench restore report JSON...`): options -> RestoreOptions."""

from __future__ import annotations

import argparse

from kvtier.bench.restore.methods import METHODS
from kvtier.cli.bench.options import add_command, add_dtype_argument
from kvtier.device import add_device_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="comma-separated model names (default: %(default)s)")
    add_dtype_argument(p, default="bf16")
    add_device_argument(p)
    p.add_argument("--storage-dtype", default="", help="comma-separated storage dtypes (int8, fp16, bf16, fp32); "
                                                       "empty = the compute dtype (lossless)")
    p.add_argument("--context", default="1024,4096,8192", help="comma-separated history lengths (default: %(default)s)")
    p.add_argument("--new-tokens", type=int, default=64,
                   help="new tokens after the history, at most one chunk (default: %(default)s)")
    p.add_argument("--tier", default="memory,disk,redis", help="comma-separated tiers: memory, disk, redis")
    p.add_argument("--bandwidth", default="none,500MB/s,100MB/s,20MB/s",
                   help="comma-separated read limits; anything but none is emulated")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--no-baselines", action="store_true", help="skip the HF transformers baselines")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method and cell (default: 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each method per model/context")
    p.add_argument("--greedy-tokens", type=int, default=8, help="greedy tokens compared after each restore")
    p.add_argument("--chunk-tokens", type=int, default=64, help="tokens per stored chunk (default: %(default)s)")
    p.add_argument("--workdir", default="out/restore-work", help="disk tier directory (wiped at start)")
    p.add_argument("--redis-url", default=None, help="redis server to use (default: start a private redis-server)")
    p.add_argument("--json", default=None, help="rows, goals and meta as JSON, rewritten after every cell")
    p.add_argument("--markdown", default=None, help="markdown tables and goals")
    p.add_argument("--plot", default=None, help="PNG path of TTFT vs bandwidth per method")
    p.add_argument("--seed", type=int, default=0, help="seed of the random contexts (default: %(default)s)")
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
    from kvtier.bench.restore import run as bench

    if args.sub == "report":
        return bench.report(args.json_in, args.json, args.markdown, args.plot)
    return bench.cmd_restore(options_from_args(args))


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "restore", add_arguments, run,
                       "TTFT of every restore method vs tier and (emulated) bandwidth", about="kvtier.bench.restore.run")
