"""`kvtier bench store`: options of the store throughput benchmark."""

from __future__ import annotations

import argparse

from kvtier.cli.bench.options import Target, add_command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=4096, help="context length written and read per tier")
    p.add_argument("--chunk-tokens", type=int, default=64, help="tokens per stored chunk (default: %(default)s)")
    p.add_argument("--capacity", default="4GB", help="memory and disk tier capacity")
    p.add_argument("--dir", default=None, help="directory for the disk tier (default: a temp dir under /tmp)")
    p.add_argument("--disk-opts", default="", help="extra disk spec options, e.g. ':bw=500MB/s:lat=100us'")
    p.add_argument("--redis", default=None, help="also benchmark this redis URL, e.g. redis://127.0.0.1:6379")
    p.add_argument("--reps", type=int, default=3, help="repetitions (the median is reported)")
    p.add_argument("--sealed", action="store_true",
                   help="run every tier twice, without and with a store secret (BLAKE3 digests + HMAC): "
                        "the cost of authenticated state")
    p.add_argument("--json", metavar="FILE", default=None, help="write results as JSON")
    p.add_argument("--markdown", metavar="FILE", default=None, help="write a markdown table")


run = Target("kvtier.bench.store", "cmd_bench_store")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "store", add_arguments, run,
                       "store throughput per tier vs raw device bandwidth")
