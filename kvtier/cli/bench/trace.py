"""`kvtier bench trace`: options of the trace replay."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command, add_dtype_argument
from kvtier.cli.options import option
from kvtier.engine.config import DEFAULT_CHUNK_TOKENS


@dataclass(frozen=True)
class TraceOptions:
    """`kvtier bench trace`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    model: str = option("smollm2-135m", "workload", "model preset, name or path (default: %(default)s)")
    workload: str = option("all", "workload", "which trace to replay (default: %(default)s)",
                           choices=("multiturn", "longdoc", "all"))
    sessions: int = option(10, "workload", "multiturn: chat sessions (default: %(default)s)")
    rate: float = option(0.5, "workload", "multiturn: session arrivals per second (Poisson)")
    think: float = option(3.0, "workload", "multiturn: mean think time between turns, s (exponential; HCache uses 30 "
                          "s, scaled down here)")
    output_scale: float = option(0.2, "workload", "multiturn: multiply answer lengths (mean 359 tokens) by this "
                                 "(default: 0.2)")
    max_turns: int = option(12, "workload", "multiturn: most turns per session (default: %(default)s)")
    documents: int = option(3, "workload", "longdoc: documents (one reader each)")
    questions: int = option(4, "workload", "longdoc: questions per document")
    doc_tokens: int = option(3000, "workload", "longdoc: document length in tokens")
    doc_rate: float = option(0.2, "workload", "longdoc: reader arrivals per second")
    doc_think: float = option(3.0, "workload", "longdoc: mean think time between questions, s")
    doc_output_tokens: float = option(50.0, "workload", "longdoc: mean answer tokens (L-Eval ~50)")
    seed: int = option(0, "workload", "seed of the trace (default: %(default)s)")
    configs: str = option("auto", "engine and store", "comma list of configuration names or groups "
                          "main,pressure,tbt,full,all (default: all on multiturn, main on longdoc)")
    no_baseline: bool = option(False, "engine and store", "do not add the recompute run that outputs are compared with")
    threads: int = option(1, "engine and store", "torch threads (default 1: robust on a shared CPU; 0 = torch's "
                          "default)")
    max_num_seqs: int = option(8, "engine and store", "most requests in the running batch (default: %(default)s)")
    max_batched_tokens: int = option(2048, "engine and store", "per-step token budget (default: %(default)s)")
    max_model_len: int = option(4096, "engine and store", "context window; a conversation that outgrows it ends "
                                "(default: %(default)s)")
    kv_cache_gb: float = option(1.0, "engine and store", "device KV pool (default: 1 GB, never full)")
    chunk_tokens: int = option(DEFAULT_CHUNK_TOKENS, "engine and store", "tokens per stored chunk (default: "
                               "%(default)s)")
    memory: str = option("1GB", "engine and store", "memory tier of the unpressured stacks")
    disk: str = option("4GB", "engine and store", "disk tier size")
    pressure_memory: str = option("24MB", "engine and store", "memory tier under pressure (working set: ~100s of MB)")
    pressure_disk: str = option("64MB", "engine and store", "disk tier of the full stack (redis below it)")
    pressure_max_num_seqs: int = option(3, "engine and store", "max_num_seqs under pressure (requests queue)")
    pressure_kv_cache_gb: float = option(0.125, "engine and store", "device pool of the full stack, with the device "
                                         "prefix cache on")
    device_cache: bool = option(False, "engine and store", "device prefix cache on in every store config")
    fill_holes: bool = option(False, "engine and store", "with the device prefix cache on: "
                              "ReuseConfig(fill_holes=True), recompute device-cached tokens the store lacks so the "
                              "stored chain of chunks has no hole (engine default: off)")
    redis: str = option("auto", "engine and store", "auto (start /usr/bin/redis-server privately), none, or a binary")
    home: str | None = option(None, "engine and store", "where the hardware profile is cached (default: KVTIER_HOME)")
    workdir: str | None = option(None, "engine and store", "scratch dir for disk tiers (default: a temp dir, removed)")
    check_sessions: int = option(0, "sequential lossless check", "also replay this many multiturn sessions one turn "
                                 "at a time (batch 1) through a recompute and a reuse engine and compare greedy "
                                 "outputs on identical prompts (default: 0 = off)")
    check_tokens: int = option(32, "sequential lossless check", "answer tokens per turn in the check")
    check_method: str = option("kv", "sequential lossless check", "restore method of the check's reuse engine "
                               "(default: %(default)s)", choices=("kv", "auto", "hidden", "bubblefree"))
    check_only: bool = option(False, "sequential lossless check", "run only the sequential check")
    json: str | None = option(None, "output", "write {rows, goals, meta, requests}; rewritten after every config")
    markdown: str | None = option(None, "output", "markdown table and goals")
    plot: str | None = option(None, "output", "PNG of the TTFT CDFs, first vs later turns")
    from_json: str | None = option(None, "output", "only re-render markdown/plot/goals from a JSON of a run")


def add_arguments(p: argparse.ArgumentParser) -> None:
    groups = add_bench_options(p, TraceOptions)
    add_dtype_argument(groups["workload"])
    groups["output"].add_argument("--merge", nargs="*", default=[], help="with --from-json: more JSON files whose rows to add")


run = Target("kvtier.bench.trace.run", "cmd_trace")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "trace", add_arguments, run,
                       "multi-turn and long-document traces: recompute vs reuse, per tier")
