"""`kvtier bench store`: options of the store throughput benchmark."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command
from kvtier.cli.options import option


@dataclass(frozen=True)
class StoreBenchOptions:
    """`kvtier bench store`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    tokens: int = option(4096, "", "context length written and read per tier")
    chunk_tokens: int = option(64, "", "tokens per stored chunk (default: %(default)s)")
    capacity: str = option("4GB", "", "memory and disk tier capacity")
    dir: str | None = option(None, "", "directory for the disk tier (default: a temp dir under /tmp)")
    disk_opts: str = option("", "", "extra disk spec options, e.g. ':bw=500MB/s:lat=100us'")
    redis: str | None = option(None, "", "also benchmark this redis URL, e.g. redis://127.0.0.1:6379")
    reps: int = option(3, "", "repetitions (the median is reported)")
    sealed: bool = option(False, "", "run every tier twice, without and with a store secret (BLAKE3 digests + HMAC): "
                          "the cost of authenticated state")
    json: str | None = option(None, "", "write results as JSON", metavar="FILE")
    markdown: str | None = option(None, "", "write a markdown table", metavar="FILE")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, StoreBenchOptions)


run = Target("kvtier.bench.store", "cmd_bench_store")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "store", add_arguments, run,
                       "store throughput per tier vs raw device bandwidth")
