"""`kvtier bench impress`: options of the importance-only restore benchmark (every --mode)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from kvtier.cli.bench.options import Target, add_bench_options, add_command, add_dtype_argument
from kvtier.cli.options import option


@dataclass(frozen=True)
class ImpressBenchOptions:
    """`kvtier bench impress`'s flags: one field each (kvtier.cli.bench.options.add_bench_options)."""

    mode: str = option("accuracy", "", "accuracy: needle multiple choice and free-form retrieval; ttft: restore time "
                       "by disk bandwidth; reorder: granules and TTFT of held-out queries of one stored document "
                       "before and after a reorder pass; admission: the faster tier's hit ratio on important tokens "
                       "by eviction policy (simulated)", choices=("accuracy", "ttft", "reorder", "admission"))
    model: str = option("smollm2-135m", "", "model preset, name or path (default: %(default)s)")
    tasks: str = option("choice,retrieval", "", "accuracy: choice (needle multiple choice), retrieval (free-form "
                        "codes, numbers and names, with the summary perplexity proxy), haystacks (free-form "
                        "retrieval over texts of several kinds, by slice), comma-separated (default: %(default)s)")
    n: int = option(210, "", "accuracy: multiple-choice items (5 depths x lengths x seeds)")
    n_retrieval: int = option(120, "", "accuracy: retrieval items, cycling over lengths x (1, 4 facts) x (code, "
                              "number, name)")
    lengths: str = option("1024,2048,4096", "", "accuracy: document lengths in tokens (choice, retrieval)")
    n_haystacks: int = option(240, "", "accuracy: haystacks items, cycling over haystack kinds x fact forms (lengths "
                              "and fact counts balanced)")
    haystacks: str | None = option(None, "", "accuracy: haystack kinds (docstrings, reference, code, table, dialogue, "
                                   "wiki) (default: every one available)")
    forms: str = option("code,name,date,phrase", "", "accuracy: haystacks' fact forms (default: %(default)s)")
    fact_counts: str = option("1,2,3,4", "", "accuracy: haystacks' facts per document (default: %(default)s)")
    haystack_lengths: str = option("1024,2048,3072,4096", "", "accuracy: haystacks' lengths in tokens "
                                   "(default: %(default)s)")
    wiki_data: str = option("../shared/data/musique/musique_dev_100.json", "", "accuracy: the MuSiQue file whose "
                            "passages make the wiki haystack (skipped where absent) (default: %(default)s)")
    ratios: str = option("0.5,0.25", "", "accuracy: importance ratios (default: %(default)s)")
    windows: str = option("1,17", "", "accuracy: pooling windows in tokens (odd; 1: none) of the importance rows "
                          "(default: %(default)s)")
    layer_slopes: str = option("", "", "accuracy: per-layer budgets for the defaults' rows, a slope s each (layer l of "
                               "L keeps ratio * (1 + s * (1 - 2l / (L - 1))): with s > 0 early layers more, late less; "
                               "with s < 0 the reverse; the same bytes); rows named like the defaults' with "
                               "-s<slope>; comma-separated in (-1, 1) (default: none)")
    layer_windows: str = option("", "", "accuracy: the defaults' rows with each unit's score max-pooled over the "
                                "last w layers (this one and the w - 1 before it; the same bytes); rows named like "
                                "the defaults' with -L<w>; comma-separated integers >= 2 (default: none)")
    seed: int = option(0, "", "accuracy: seed of both tasks' items (default: %(default)s)")
    probe_kv_heads: int = option(0, "", "accuracy: probe KV heads per layer (default: the engine's, 1 for <= 4 KV "
                                 "heads, else 3)")
    probe_first: int = option(-1, "", "accuracy: the first probe KV head of every layer (default -1: the engine's "
                              "calibrated choice per layer)")
    variants: str | None = option(None, "", "accuracy: only these rows (comma-separated names; full is always run; "
                                  "oracle-answer-g-w17@R and oracle-question-g-w17@R, haystacks only: the granules "
                                  "full KV's own attention reads most at ratio R, a bound for rankings by attention)")
    granule_tokens: int = option(16, "", "accuracy: rows per verified granule in the importance layout (what a "
                                 "partial read rounds to)")
    history: int = option(8128, "", "ttft: stored history tokens")
    new: int = option(64, "", "ttft: new tokens after the history")
    ratio: float = option(0.25, "", "ttft: importance ratio")
    bandwidths: str = option("none,500,100,20", "", "ttft: emulated disk bandwidths in MB/s")
    repeats: int = option(3, "", "ttft: timed runs per row (default: %(default)s)")
    methods: str | None = option(None, "", "ttft: only these rows (comma-separated: recompute, kv, cake, impress, "
                                 "impress-g, the defaults' probes-sum-g-w17, auto-lossy, auto-lossy-g, "
                                 "auto-lossy-probes-sum-g-w17, read) (default: all)")
    bandwidth: str = option("100", "", "reorder: emulated disk bandwidth in MB/s (or none)")
    warm: int = option(4, "", "reorder: queries that feed the importance statistics")
    queries: int = option(4, "", "reorder: held-out queries timed before and after")
    dir: str | None = option(None, "", "ttft: disk tier directory (default: a new temporary one)")
    tier: str | None = option(None, "", "ttft: one store tier to keep the history in instead of the disk tier, e.g. "
                              "redis://127.0.0.1:6379?prefix=bench (bandwidths are emulated on it the same way)",
                              metavar="SPEC")
    docs: int = option(200, "", "admission: stored documents")
    doc_chunks: int = option(32, "", "admission: chunks per document")
    requests: int = option(3000, "", "admission: requests in the trace")
    zipf: float = option(0.8, "", "admission: Zipf exponent of document popularity")
    capacity: float = option(0.2, "", "admission: faster tier's share of all chunks")
    fast_inexact: bool = option(False, "", "accuracy: the plain kernels instead of the row-invariant ones (every row "
                                "alike; several times faster on a CPU for multi-thousand-token documents)")
    json: str | None = option(None, "", "rows, goals and the run's settings as JSON")
    plot: str | None = option(None, "", "PNG of the mode's figure")
    replot: str | None = option(None, "", "only draw the figure of an earlier run's JSON", metavar="JSON")
    pool: str | None = option(None, "", "only pool earlier accuracy runs' haystacks rows (comma-separated JSON files "
                              "of runs alike but for --seed): each row's items summed, overall and per slice, and "
                              "the goals judged on the pool; written with --json, drawn with --plot", metavar="JSONS")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_bench_options(p, ImpressBenchOptions)
    add_dtype_argument(p)


run = Target("kvtier.bench.impress.run", "cmd")


def register(bench_subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return add_command(bench_subparsers, "impress", add_arguments, run,
                       "importance-only restore (IMPRESS): accuracy (multiple choice, free-form retrieval), bytes and TTFT against full KV and the exact"
                       " methods")
