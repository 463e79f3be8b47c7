"""`kvtier bench impress --mode accuracy`: what an importance-only restore costs in answers.

Each item's document is computed once and stored in the importance layout (memory tier), then
restored by every variant (full KV, the importance restore by ratio, unit and pooling window,
H2O over all keys, random and recent references) and asked its question:

choice     needle multiple choice (bench/tasks.py), answered by log-likelihood; the query's
           teacher-forced perplexity besides.
retrieval  free-form retrieval of codes, numbers and names from 1-4K-token documents with one or
           four facts, decoded greedily and scored by exact match; besides, the perplexity of the
           full-KV summary of the same document, teacher-forced under each restore (a proxy for
           tasks that need the whole document rather than one fact).
haystacks  free-form retrieval over texts of several kinds and facts of several forms, reported
           per slice (haystack_task.py; the items are bench/haystacks.py's).

Rows per (task, variant): accuracy with a Wilson 95% interval, KL(full || variant) of the query
rows' next-token distributions, perplexity, bytes read against full KV, layers whose probes
agreed, identification time.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from kvtier.bench.common import write_json_atomic
from kvtier.bench.haystacks import FORMS, HaystackItem, haystack_items, haystacks
from kvtier.bench.impress.goals import accuracy_goals, default_kind, kind_name, variant
from kvtier.bench.impress.harness import ANSWER_TOKENS, Bench, Tally, continuation_logprob, greedy, kl, nll
from kvtier.bench.impress.haystack_task import HAYSTACK_TASK, run_haystacks, slice_table
from kvtier.bench.impress.layout import CHUNK, namespace
from kvtier.bench.impress.oracle import oracle_kind, oracle_variants
from kvtier.bench.stats import wilson
from kvtier.bench.tasks import WORDS, NeedleItem, RetrievalItem, needle_items, retrieval_items
from kvtier.engine.config import ImpressConfig
from kvtier.engine.impress.policy import PROBE_GRANULE_TOKENS, ImpressPolicy, Selection
from kvtier.models.kernels import Kernels
from kvtier.models.loading import load_model
from kvtier.models.rope import Rope
from kvtier.store import TieredStore

TASKS = ("choice", "retrieval", HAYSTACK_TASK)
SUMMARY_TOKENS = 48  # the reference summary's length


def variant_name(selection: str, ratio: float, granule: bool = False, window: int = 1) -> str:
    """impress@0.25, impress-g@0.25 (whole granules), impress-g-w9@0.25 (scores pooled over 9 tokens)."""
    return f"{kind_name(selection, granule, window)}@{ratio:g}"


def variants(ratios: Sequence[float], windows: Sequence[int], granule: int = PROBE_GRANULE_TOKENS,
             slopes: Sequence[float] = (), layer_windows: Sequence[int] = ()) -> dict[str, ImpressPolicy]:
    """The rows: full KV; per ratio and pooling window the importance restore choosing tokens and
    whole granules, its probes voting by majority (impress: the paper's reading, the earlier
    defaults) or summing their importance (impress-sum), the probes' sum without the
    threshold's fallback (probes-sum), and H2O over every key; at 0.25
    the probes without the threshold, each KV head's query heads as the only scorers, and the
    blind references; per ratio the oracles (oracle.py, the haystacks task only)."""
    out = {"full": ImpressPolicy(selection=Selection.FULL)}
    for r in ratios:
        for w in windows:
            for g in (False, True):
                block = granule if g else 1
                out[variant_name("impress", r, g, w)] = ImpressPolicy(ratio=r, block=block, window=w, vote="majority")
                out[variant_name("impress-sum", r, g, w)] = ImpressPolicy(ratio=r, block=block, window=w, vote="sum")
                out[variant_name("h2o", r, g, w)] = ImpressPolicy(ratio=r, selection=Selection.H2O, block=block, window=w)
                # The probes' sum in every layer, no threshold: what the fallback's reads buy.
                out[variant_name("probes-sum", r, g, w)] = ImpressPolicy(ratio=r, selection=Selection.PROBES,
                                                                         block=block, window=w, vote="sum")
        out[f"{default_kind()}@{r:g}"] = ImpressPolicy.of(ImpressConfig(ratio=r))  # the engine's defaults
        for slope in slopes:  # the defaults with a per-layer budget (an ablation the engine's pool cannot hold)
            out[f"{default_kind()}-s{slope:g}@{r:g}"] = replace(ImpressPolicy.of(ImpressConfig(ratio=r)), layer_slope=slope)
        # The defaults with each unit not kept standing in by its mean K and V (an ablation).
        out[f"{default_kind()}-merge@{r:g}"] = replace(ImpressPolicy.of(ImpressConfig(ratio=r)), merge=True)
        for lw in layer_windows:  # the defaults with scores pooled over the last lw layers (an ablation)
            out[f"{default_kind()}-L{lw}@{r:g}"] = replace(ImpressPolicy.of(ImpressConfig(ratio=r)), layer_window=lw)
    out |= oracle_variants(ratios, granule, ImpressConfig().window)
    out["probes@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.PROBES)
    for j in range(3):  # which KV head's query heads would make a good probe (every key read)
        out[f"h2o-kv{j}@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.H2O, score_kv_heads=(j,))
    out["random@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.RANDOM)
    out["recent@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.RECENT)
    return out


def _choice(bench: Bench, item: NeedleItem, vs: dict[str, ImpressPolicy], tallies: dict[str, Tally]) -> None:
    match, tail = bench.store_document(item.prefix_ids)
    new, q = tail + item.query_ids, len(item.query_ids)
    full = None
    for name, policy in vs.items():
        logits, cache, st = bench.restore(match, new, policy)
        scores = [continuation_logprob(bench.loaded, bench.rope, cache.copy(), logits[-1], c) for c in item.choices]
        full = logits if full is None else full
        t = tallies[name]
        t.correct.append(int(max(range(len(scores)), key=scores.__getitem__) == item.answer))
        t.kl.append(kl(full[-q:], logits[-q:]))
        t.nll.append(nll(logits[-q:], item.query_ids))  # the question, teacher-forced
        t.cells.append(f"{item.length}")
        t.add(st)
    bench.store.discard(bench.store.keys_for(item.prefix_ids))


def _retrieval(bench: Bench, item: RetrievalItem, vs: dict[str, ImpressPolicy], tallies: dict[str, Tally]) -> None:
    match, tail = bench.store_document(item.prefix_ids)
    new, q = tail + item.query_ids, len(item.query_ids)
    full, reference = None, None
    for name, policy in vs.items():
        logits, cache, st = bench.restore(match, new, policy)
        answer = bench.tok.decode(greedy(bench.loaded, bench.rope, cache, logits[-1], ANSWER_TOKENS, bench.stop))
        s_logits, s_cache, _ = bench.restore(match, tail + item.summary_ids, policy)
        if reference is None:  # full KV comes first: its own summary is the reference
            reference = greedy(bench.loaded, bench.rope, s_cache.copy(), s_logits[-1], SUMMARY_TOKENS, bench.end)
            reference = reference or sorted(bench.end)[:1]
        full = logits if full is None else full
        t = tallies[name]
        t.correct.append(int(item.correct(answer)))
        t.answers.append(answer)
        t.kl.append(kl(full[-q:], logits[-q:]))
        t.nll.append(-continuation_logprob(bench.loaded, bench.rope, s_cache, s_logits[-1], reference) / len(reference))
        t.cells.append(f"{item.length}x{item.facts}")
        t.add(st)
    bench.store.discard(bench.store.keys_for(item.prefix_ids))


def _rows(task: str, tallies: dict[str, Tally]) -> list[dict]:
    full_bytes = tallies["full"].bytes
    rows = []
    for name, t in tallies.items():
        n, k = len(t.correct), sum(t.correct)
        lo, hi = wilson(k, n)
        by_cell = {c: statistics.mean(x for x, cc in zip(t.correct, t.cells) if cc == c) for c in dict.fromkeys(t.cells)}
        rows.append(dict(task=task, variant=name, n=n, correct=k, accuracy=k / n, ci95=[lo, hi], by_cell=by_cell,
                         kl_mean=statistics.mean(t.kl), perplexity=math.exp(statistics.mean(t.nll)),
                         bytes_vs_full=statistics.mean(b / f for b, f in zip(t.bytes, full_bytes)),
                         layers_passed=statistics.mean(t.passed), identify_share=statistics.mean(t.identify),
                         seconds_p50=statistics.median(t.seconds), granules_read_share=statistics.mean(t.granules),
                         jaccard_by_layer=[statistics.mean(x) for x in zip(*t.jaccard)] if t.jaccard else [],
                         answers=t.answers))
    return rows


def run(args: argparse.Namespace) -> dict:
    """Every task's rows and goals; with --fast-inexact on the plain kernels (every row alike)."""
    loaded = load_model(args.model, dtype=args.dtype)
    loaded.module.set_kernels(Kernels(exact=not args.fast_inexact))
    tok = loaded.tokenizer
    if tok is None:
        raise SystemExit(f"model {args.model} has no tokenizer: the accuracy tasks need one (use smollm2-135m)")
    lengths = tuple(int(x) for x in args.lengths.split(","))
    tasks = args.tasks.split(",")
    if unknown := set(tasks) - set(TASKS):
        raise SystemExit(f"--tasks: unknown {sorted(unknown)} (choose from {', '.join(TASKS)})")
    windows = [int(x) for x in args.windows.split(",")]
    if bad := [w for w in windows if w < 1 or w % 2 == 0]:
        raise SystemExit(f"--windows: {bad} (each an odd number of tokens >= 1)")
    try:
        slopes = [float(x) for x in args.layer_slopes.split(",") if x.strip()]
    except ValueError as e:
        raise SystemExit(f"--layer-slopes: {e}") from None
    if bad_slopes := [x for x in slopes if not -1.0 < x < 1.0]:
        raise SystemExit(f"--layer-slopes: {bad_slopes} (each in (-1, 1))")
    try:
        layer_windows = [int(x) for x in args.layer_windows.split(",") if x.strip()]
    except ValueError as e:
        raise SystemExit(f"--layer-windows: {e}") from None
    if bad_lw := [w for w in layer_windows if w < 2]:
        raise SystemExit(f"--layer-windows: {bad_lw} (each an integer >= 2)")
    vs = variants([float(x) for x in args.ratios.split(",")], windows, args.granule_tokens, slopes, layer_windows)
    if args.variants:
        wanted = ["full", *(v for v in args.variants.split(",") if v != "full")]
        if missing := [v for v in wanted if v not in vs]:
            raise SystemExit(f"--variants: no such rows {missing} (with --ratios {args.ratios} --windows {args.windows})")
        vs = {k: vs[k] for k in wanted}
        if (oracles := [v for v in wanted if oracle_kind(v)]) and set(tasks) - {HAYSTACK_TASK}:
            raise SystemExit(f"--variants {oracles}: the oracles read the haystacks task's answers (use --tasks haystacks)")
    hay_lengths = tuple(int(x) for x in args.haystack_lengths.split(","))
    rope = Rope(loaded.config, max(lengths + hay_lengths) * 2 + 512, loaded.dtype)
    ns = namespace(loaded, args.granule_tokens, args.probe_kv_heads, args.probe_first)
    print(f"first probe KV head per layer (of {ns.num_kv_heads}, {ns.probe_kv_heads} each): {list(ns.probe_first)}",
          flush=True)
    rows: list[dict] = []
    with TieredStore.open("memory:8GB", ns, chunk_tokens=CHUNK) as store:
        bench = Bench(loaded, tok, rope, store)
        for task in tasks:
            if task == HAYSTACK_TASK:
                rows += run_haystacks(bench, _haystack_items(tok, args, hay_lengths), vs, _checkpoint(args, rows))
                continue
            tallies = {name: Tally() for name in vs if not oracle_kind(name)}
            if task == "choice":
                for needle in tqdm(needle_items(tok, args.n, lengths, seed=args.seed), desc="multiple choice", unit="item"):
                    _choice(bench, needle, {k: vs[k] for k in tallies}, tallies)
            else:
                for fact in tqdm(retrieval_items(tok, args.n_retrieval, lengths, seed=args.seed), desc="retrieval",
                                 unit="item"):
                    _retrieval(bench, fact, {k: vs[k] for k in tallies}, tallies)
            rows += _rows(task, tallies)
    return dict(rows=rows, goals=accuracy_goals(rows), lengths=list(lengths),
                probe_kv_heads=ns.probe_kv_heads, probe_first=list(ns.probe_first))


def _haystack_items(tok, args: argparse.Namespace, lengths: tuple[int, ...]) -> list[HaystackItem]:
    kinds = haystacks(Path(args.wiki_data))
    wanted = args.haystacks.split(",") if args.haystacks else list(kinds)
    if missing := [h for h in wanted if h not in kinds]:
        raise SystemExit(f"--haystacks: {missing} not available (have {', '.join(kinds)}; wiki needs --wiki-data)")
    forms = args.forms.split(",")
    if unknown := [f for f in forms if f not in FORMS]:
        raise SystemExit(f"--forms: unknown {unknown} (choose from {', '.join(FORMS)})")
    if "wiki" not in kinds and not args.haystacks:
        print(f"haystacks: wiki skipped ({args.wiki_data} not found)", flush=True)
    counts = tuple(int(x) for x in args.fact_counts.split(","))
    if bad := [c for c in counts if c < 1 or c > len(WORDS)]:
        raise SystemExit(f"--fact-counts: {bad} (each 1 to {len(WORDS)})")
    return haystack_items(tok, args.n_haystacks, {h: kinds[h] for h in wanted}, forms, lengths, counts, args.seed)


def _checkpoint(args: argparse.Namespace, done: list[dict]):
    """Write the rows so far to --json as the haystack task goes (a long run keeps what it measured)."""
    if not args.json:
        return None
    return lambda rows: write_json_atomic(args.json, dict(rows=done + rows, partial=True))


def table(doc: dict) -> str:
    """The rows as a markdown table, the haystacks' per slice after them (the goals follow in the report)."""
    lines = ["| task | variant | accuracy | 95% CI | KL vs full | perplexity | bytes vs full | layers passed | "
             "identify share |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r.get('task', 'choice')} | {r['variant']} | {r['accuracy'] * 100:.1f}% ({r['correct']}/{r['n']}) | "
                     f"{r['ci95'][0] * 100:.1f}-{r['ci95'][1] * 100:.1f} | {r['kl_mean']:.4f} | "
                     f"{r.get('perplexity', float('nan')):.3f} | {r['bytes_vs_full']:.3f} | {r['layers_passed']:.2f} | "
                     f"{r['identify_share']:.3f} |")
    if hay := [r for r in doc["rows"] if r.get("task") == HAYSTACK_TASK]:
        lines += ["", "haystacks by slice: accuracy (correct/n, Wilson 95%)", slice_table(hay)]
    return "\n".join(lines)


def plot(doc: dict, fig) -> None:
    """Accuracy by ratio per kind of row, a panel per task, full KV and chance as lines."""
    tasks = list(dict.fromkeys(r.get("task", "choice") for r in doc["rows"]))
    for i, task in enumerate(tasks):
        ax = fig.add_subplot(1, len(tasks), i + 1)
        rows = [r for r in doc["rows"] if r.get("task", "choice") == task]
        kinds = dict.fromkeys(r["variant"].split("@")[0] for r in rows if "@" in r["variant"])
        for kind in kinds:
            pts = sorted((float(r["variant"].split("@")[1]), r["accuracy"] * 100) for r in rows
                         if r["variant"].startswith(kind + "@"))
            if len(pts) > 1:
                ax.plot(*zip(*pts), marker="o", label=kind)
        full = variant(rows, "full")
        if full:
            ax.axhline(full["accuracy"] * 100, color="k", ls="--", label="full KV")
        if task == "choice":
            ax.axhline(25, color="grey", ls=":", label="chance")
        ax.set_title(task)
        ax.set_xlabel("importance ratio (share of the prefix kept)")
        ax.set_ylabel("accuracy (%)")
        ax.legend(fontsize=7)
