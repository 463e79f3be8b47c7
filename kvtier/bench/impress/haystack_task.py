"""`kvtier bench impress --tasks haystacks`: free-form retrieval over haystacks of several kinds
(bench/haystacks.py), reported per slice, with where each restore lost the asked fact.

Per item and row: the answer decoded greedily (right when the value appears whole), KL of the
query rows against full KV, bytes read, and per layer the share of the asked value's tokens the
layer kept. Rows give accuracy with a Wilson 95% interval overall and per slice (haystack, fact
form, length, fact count, depth of the asked fact), and the per-layer kept share split by whether
the row answered where full KV did ("kept") or not ("lost").
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from kvtier.bench.haystacks import HaystackItem
from kvtier.bench.impress.harness import ANSWER_TOKENS, Bench, Tally, greedy, kl
from kvtier.bench.impress.oracle import FullAttention, full_attention, oracle_kind
from kvtier.bench.stats import wilson
from kvtier.engine.impress.policy import ImpressPolicy

HAYSTACK_TASK = "haystacks"


def _value_kept(kept: Sequence[torch.Tensor], span: tuple[int, int]) -> list[float]:
    """Per layer, the share of the prefix tokens [span) the layer kept."""
    want = torch.arange(*span)
    return [float(torch.isin(want, k.cpu()).float().mean()) for k in kept]


def haystack_item(bench: Bench, item: HaystackItem, vs: dict[str, ImpressPolicy], tallies: dict[str, Tally]) -> None:
    """Every row's restore of one item, asked its question (full KV first: the oracles read its attention)."""
    match, tail = bench.store_document(item.prefix_ids)
    new, q = tail + item.query_ids, len(item.query_ids)
    full: torch.Tensor | None = None
    seen: FullAttention | None = None
    oracles = any(oracle_kind(name) for name in vs)
    try:
        for name, policy in vs.items():
            kind = oracle_kind(name)
            given = None if kind is None or seen is None else seen.sets(kind, policy)
            logits, cache, st = bench.restore(match, new, policy, given)
            prefix = [k[: st.prefix_tokens] for k in cache.k], [v[: st.prefix_tokens] for v in cache.v]
            ids = greedy(bench.loaded, bench.rope, cache, logits[-1], ANSWER_TOKENS, bench.stop)  # extends cache
            if full is None and oracles:  # full KV's attention while it reads the prefix and answers
                seen = full_attention(bench.loaded.module, bench.rope, *prefix, new, ids)
            answer = bench.tok.decode(ids)
            full = logits if full is None else full
            t = tallies[name]
            t.correct.append(int(item.correct(answer)))
            t.answers.append(answer)
            t.kl.append(kl(full[-q:], logits[-q:]))
            t.labels.append(item.slices)
            t.fact_kept.append(_value_kept(st.kept, item.answer_span))  # every selection records each layer's choice
            t.add(st)
    finally:
        bench.store.discard(bench.store.keys_for(item.prefix_ids))


def accuracy_of(n: int, correct: int) -> dict:
    """`correct` of `n` items: the count, the share and its Wilson 95% interval."""
    lo, hi = wilson(correct, n)
    return dict(n=n, correct=correct, accuracy=correct / n, ci95=[lo, hi])


def _accuracy(correct: Sequence[int]) -> dict:
    return accuracy_of(len(correct), sum(correct))


def _by_layer(rows: Sequence[list[float]]) -> list[float]:
    return [statistics.mean(x) for x in zip(*rows)] if rows else []


def haystack_rows(tallies: dict[str, Tally]) -> list[dict]:
    """A row per variant: overall and per-slice accuracy, KL, bytes, and where the value was kept."""
    full = tallies["full"]
    rows = []
    for name, t in tallies.items():
        if not t.correct:
            continue
        slices = sorted({s for labels in t.labels for s in labels})
        by_slice = {s: _accuracy([c for c, labels in zip(t.correct, t.labels) if s in labels]) for s in slices}
        lost = [k for k, c, f in zip(t.fact_kept, t.correct, full.correct) if f and not c]
        kept = [k for k, c, f in zip(t.fact_kept, t.correct, full.correct) if f and c]
        rows.append(dict(task=HAYSTACK_TASK, variant=name, **_accuracy(t.correct), by_slice=by_slice,
                         kl_mean=statistics.mean(t.kl),
                         bytes_vs_full=statistics.mean(b / f for b, f in zip(t.bytes, full.bytes)),
                         layers_passed=statistics.mean(t.passed), identify_share=statistics.mean(t.identify),
                         seconds_p50=statistics.median(t.seconds), lost=len(lost),
                         value_kept_by_layer=_by_layer(t.fact_kept), value_kept_lost_by_layer=_by_layer(lost),
                         value_kept_kept_by_layer=_by_layer(kept), answers=t.answers,
                         slices=[list(labels) for labels in t.labels]))
    return rows


def run_haystacks(bench: Bench, items: Sequence[HaystackItem], vs: dict[str, ImpressPolicy],
                  progress: Callable[[list[dict]], None] | None = None, every: int = 5) -> list[dict]:
    """The task's rows; `progress` gets the rows so far after every `every` items."""
    tallies = {name: Tally() for name in vs}
    for i, item in enumerate(tqdm(items, desc="haystacks", unit="item")):
        haystack_item(bench, item, vs, tallies)
        if progress is not None and (i + 1) % every == 0:
            progress(haystack_rows(tallies))
    return haystack_rows(tallies)


def slice_table(rows: Sequence[dict]) -> str:
    """Accuracy per slice, a column per row (markdown)."""
    if not rows:
        return ""
    names = [r["variant"] for r in rows]
    lines = ["| slice | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for s in ["all", *rows[0]["by_slice"]]:
        cells = []
        for r in rows:
            a = r if s == "all" else r["by_slice"].get(s)
            cells.append("" if a is None else f"{a['accuracy'] * 100:.1f}% ({a['correct']}/{a['n']}, "
                                              f"{a['ci95'][0] * 100:.0f}-{a['ci95'][1] * 100:.0f})")
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
