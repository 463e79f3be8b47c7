"""`kvtier bench trace`: options of the trace replay."""

from __future__ import annotations

import argparse

from kvtier.cli.bench.options import Target, add_command, add_dtype_argument
from kvtier.engine.config import DEFAULT_CHUNK_TOKENS


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--model", default="smollm2-135m", help="model preset, name or path (default: %(default)s)")
    add_dtype_argument(w)
    w.add_argument("--workload", default="all", choices=["multiturn", "longdoc", "all"],
                   help="which trace to replay (default: %(default)s)")
    w.add_argument("--sessions", type=int, default=10, help="multiturn: chat sessions (default: %(default)s)")
    w.add_argument("--rate", type=float, default=0.5, help="multiturn: session arrivals per second (Poisson)")
    w.add_argument("--think", type=float, default=3.0, help="multiturn: mean think time between turns, s "
                   "(exponential; HCache uses 30 s, scaled down here)")
    w.add_argument("--output-scale", type=float, default=0.2,
                   help="multiturn: multiply answer lengths (mean 359 tokens) by this (default: 0.2)")
    w.add_argument("--max-turns", type=int, default=12, help="multiturn: most turns per session (default: %(default)s)")
    w.add_argument("--documents", type=int, default=3, help="longdoc: documents (one reader each)")
    w.add_argument("--questions", type=int, default=4, help="longdoc: questions per document")
    w.add_argument("--doc-tokens", type=int, default=3000, help="longdoc: document length in tokens")
    w.add_argument("--doc-rate", type=float, default=0.2, help="longdoc: reader arrivals per second")
    w.add_argument("--doc-think", type=float, default=3.0, help="longdoc: mean think time between questions, s")
    w.add_argument("--doc-output-tokens", type=float, default=50.0, help="longdoc: mean answer tokens (L-Eval ~50)")
    w.add_argument("--seed", type=int, default=0, help="seed of the trace (default: %(default)s)")
    e = p.add_argument_group("engine and store")
    e.add_argument("--configs", default="auto",
                   help="comma list of configuration names or groups main,pressure,tbt,full,all (default: all on "
                        "multiturn, main on longdoc)")
    e.add_argument("--no-baseline", action="store_true",
                   help="do not add the recompute run that outputs are compared with")
    e.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: robust on a shared CPU; 0 = torch's default)")
    e.add_argument("--max-num-seqs", type=int, default=8, help="most requests in the running batch (default: %(default)s)")
    e.add_argument("--max-batched-tokens", type=int, default=2048, help="per-step token budget (default: %(default)s)")
    e.add_argument("--max-model-len", type=int, default=4096,
                   help="context window; a conversation that outgrows it ends (default: %(default)s)")
    e.add_argument("--kv-cache-gb", type=float, default=1.0, help="device KV pool (default: 1 GB, never full)")
    e.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS,
                   help="tokens per stored chunk (default: %(default)s)")
    e.add_argument("--memory", default="1GB", help="memory tier of the unpressured stacks")
    e.add_argument("--disk", default="4GB", help="disk tier size")
    e.add_argument("--pressure-memory", default="24MB", help="memory tier under pressure (working set: ~100s of MB)")
    e.add_argument("--pressure-disk", default="64MB", help="disk tier of the full stack (redis below it)")
    e.add_argument("--pressure-max-num-seqs", type=int, default=3, help="max_num_seqs under pressure (requests queue)")
    e.add_argument("--pressure-kv-cache-gb", type=float, default=0.125,
                   help="device pool of the full stack, with the device prefix cache on")
    e.add_argument("--device-cache", action="store_true", help="device prefix cache on in every store config")
    e.add_argument("--fill-holes", action="store_true",
                   help="with the device prefix cache on: ReuseConfig(fill_holes=True), recompute device-cached "
                        "tokens the store lacks so the stored chain of chunks has no hole (engine default: off)")
    e.add_argument("--redis", default="auto", help="auto (start /usr/bin/redis-server privately), none, or a binary")
    e.add_argument("--home", default=None, help="where the hardware profile is cached (default: KVTIER_HOME)")
    e.add_argument("--workdir", default=None, help="scratch dir for disk tiers (default: a temp dir, removed)")
    c = p.add_argument_group("sequential lossless check")
    c.add_argument("--check-sessions", type=int, default=0,
                   help="also replay this many multiturn sessions one turn at a time (batch 1) through a recompute "
                        "and a reuse engine and compare greedy outputs on identical prompts (default: 0 = off)")
    c.add_argument("--check-tokens", type=int, default=32, help="answer tokens per turn in the check")
    c.add_argument("--check-method", default="kv", choices=["kv", "auto", "hidden", "bubblefree"],
                   help="restore method of the check's reuse engine (default: %(default)s)")
    c.add_argument("--check-only", action="store_true", help="run only the sequential check")
    o = p.add_argument_group("output")
    o.add_argument("--json", default=None, help="write {rows, goals, meta, requests}; rewritten after every config")
    o.add_argument("--markdown", default=None, help="markdown table and goals")
    o.add_argument("--plot", default=None, help="PNG of the TTFT CDFs, first vs later turns")
    o.add_argument("--from-json", default=None, help="only re-render markdown/plot/goals from a JSON of a run")
    o.add_argument("--merge", nargs="*", default=[], help="with --from-json: more JSON files whose rows to add")


run = Target("kvtier.bench.trace.run", "cmd_trace")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "trace", add_arguments, run,
                       "multi-turn and long-document traces: recompute vs reuse, per tier")
