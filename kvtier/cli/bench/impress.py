"""`kvtier bench impress`: options of the importance-only restore benchmark (every --mode)."""

from __future__ import annotations

import argparse

from kvtier.cli.bench.options import Target, add_command, add_dtype_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=["accuracy", "ttft", "reorder", "admission"], default="accuracy",
                   help="accuracy: needle multiple choice and free-form retrieval; ttft: restore time by disk bandwidth; reorder: granules "
                        "and TTFT of held-out queries of one stored document before and after a reorder pass; "
                        "admission: the faster tier's hit ratio on important tokens by eviction policy (simulated)")
    p.add_argument("--model", default="smollm2-135m", help="model preset, name or path (default: %(default)s)")
    add_dtype_argument(p)
    p.add_argument("--tasks", default="choice,retrieval",
                   help="accuracy: choice (needle multiple choice), retrieval (free-form codes, numbers and names, "
                        "with the summary perplexity proxy), or both (default: %(default)s)")
    p.add_argument("--n", type=int, default=210, help="accuracy: multiple-choice items (5 depths x lengths x seeds)")
    p.add_argument("--n-retrieval", type=int, default=120,
                   help="accuracy: retrieval items, cycling over lengths x (1, 4 facts) x (code, number, name)")
    p.add_argument("--lengths", default="1024,2048,4096", help="accuracy: document lengths in tokens")
    p.add_argument("--ratios", default="0.5,0.25", help="accuracy: importance ratios (default: %(default)s)")
    p.add_argument("--windows", default="1,17",
                   help="accuracy: pooling windows in tokens (odd; 1: none) of the importance rows (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="accuracy: seed of both tasks' items (default: %(default)s)")
    p.add_argument("--probe-kv-heads", type=int, default=0,
                   help="accuracy: probe KV heads per layer (default: the engine's, 1 for <= 4 KV heads, else 3)")
    p.add_argument("--probe-first", type=int, default=-1,
                   help="accuracy: the first probe KV head of every layer (default -1: the engine's calibrated choice per layer)")
    p.add_argument("--variants", default=None, help="accuracy: only these rows (comma-separated names; full is always run)")
    p.add_argument("--granule-tokens", type=int, default=16,
                   help="accuracy: rows per verified granule in the importance layout (what a partial read rounds to)")
    p.add_argument("--history", type=int, default=8128, help="ttft: stored history tokens")
    p.add_argument("--new", type=int, default=64, help="ttft: new tokens after the history")
    p.add_argument("--ratio", type=float, default=0.25, help="ttft: importance ratio")
    p.add_argument("--bandwidths", default="none,500,100,20", help="ttft: emulated disk bandwidths in MB/s")
    p.add_argument("--repeats", type=int, default=3, help="ttft: timed runs per row (default: %(default)s)")
    p.add_argument("--methods", default=None,
                   help="ttft: only these rows (comma-separated: recompute, kv, cake, impress, impress-g, the defaults' impress-sum-g-w17, auto-lossy, auto-lossy-g, auto-lossy-impress-sum-g-w17, read) (default: all)")
    p.add_argument("--bandwidth", default="100", help="reorder: emulated disk bandwidth in MB/s (or none)")
    p.add_argument("--warm", type=int, default=4, help="reorder: queries that feed the importance statistics")
    p.add_argument("--queries", type=int, default=4, help="reorder: held-out queries timed before and after")
    p.add_argument("--dir", default=None, help="ttft: disk tier directory (default: a new temporary one)")
    p.add_argument("--tier", default=None, metavar="SPEC",
                   help="ttft: one store tier to keep the history in instead of the disk tier, e.g. "
                        "redis://127.0.0.1:6379?prefix=bench (bandwidths are emulated on it the same way)")
    p.add_argument("--docs", type=int, default=200, help="admission: stored documents")
    p.add_argument("--doc-chunks", type=int, default=32, help="admission: chunks per document")
    p.add_argument("--requests", type=int, default=3000, help="admission: requests in the trace")
    p.add_argument("--zipf", type=float, default=0.8, help="admission: Zipf exponent of document popularity")
    p.add_argument("--capacity", type=float, default=0.2, help="admission: faster tier's share of all chunks")
    p.add_argument("--json", default=None, help="rows, goals and the run's settings as JSON")
    p.add_argument("--plot", default=None, help="PNG of the mode's figure")
    p.add_argument("--replot", default=None, metavar="JSON", help="only draw the figure of an earlier run's JSON")


run = Target("kvtier.bench.impress.run", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "impress", add_arguments, run,
                       "importance-only restore (IMPRESS): accuracy (multiple choice, free-form retrieval), bytes and TTFT against full KV and the exact"
                       " methods")
