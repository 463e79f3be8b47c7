"""Runs of the haystacks grid on different seeds, pooled: each row's items summed over the runs,
overall and per slice (more items per slice, narrower intervals), the goals judged on the pool.

Only runs that differ in their seed alone pool: the same model, dtype, rows and grid (haystacks,
forms, lengths, fact counts, items per run); the same seed twice would count its items twice.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.bench.impress.goals import accuracy_goals
from kvtier.bench.impress.haystack_task import HAYSTACK_TASK, accuracy_of

# The settings that make a run's items and rows; a pool needs them equal in every run but the seed.
GRID = ("model", "dtype", "n_haystacks", "haystacks", "forms", "fact_counts", "haystack_lengths", "wiki_data",
        "granule_tokens", "windows", "ratios", "variants", "layer_slopes", "layer_windows", "probe_kv_heads",
        "probe_first", "fast_inexact")
# Per-row means over items, pooled weighted by each run's items.
MEANS = ("kl_mean", "bytes_vs_full", "layers_passed", "identify_share")


class PoolError(ValueError):
    """The runs cannot be pooled (the message says why)."""


def _haystack_rows(doc: dict, name: str) -> list[dict]:
    if doc.get("mode") != "accuracy":
        raise PoolError(f"{name}: not a --mode accuracy run (mode {doc.get('mode')!r})")
    rows = [r for r in doc.get("rows", []) if r.get("task") == HAYSTACK_TASK]
    if not rows:
        raise PoolError(f"{name}: no {HAYSTACK_TASK} rows (run with --tasks {HAYSTACK_TASK})")
    return rows


def pool(docs: Sequence[dict], names: Sequence[str]) -> dict:
    """Accuracy runs `docs` (their JSON documents; `names` for messages) -> one document whose
    rows sum the runs' items, with the goals judged on them."""
    if len(docs) < 2:
        raise PoolError("pooling needs at least two runs")
    first = docs[0].get("args", {})
    seeds: list[int] = []
    for doc, name in zip(docs, names):
        args = doc.get("args", {})
        for key in GRID:  # an empty option and one not recorded alike
            if (args.get(key) or None) != (first.get(key) or None):
                raise PoolError(f"{name}: --{key.replace('_', '-')} {args.get(key)!r} differs from "
                                f"{names[0]}'s {first.get(key)!r}: only runs that differ in --seed pool")
        if args.get("seed") in seeds:
            raise PoolError(f"{name}: seed {args.get('seed')} is already in the pool (its items would count twice)")
        seeds.append(args.get("seed"))
    runs = [_haystack_rows(doc, name) for doc, name in zip(docs, names)]
    variants = [r["variant"] for r in runs[0]]
    for rows, name in zip(runs, names):
        if [r["variant"] for r in rows] != variants:
            raise PoolError(f"{name}: rows {[r['variant'] for r in rows]} differ from {names[0]}'s {variants}")
    out = []
    for i, variant in enumerate(variants):
        parts = [rows[i] for rows in runs]
        n = sum(r["n"] for r in parts)
        slices = list(dict.fromkeys(s for r in parts for s in r["by_slice"]))
        by_slice = {s: accuracy_of(sum(r["by_slice"].get(s, {}).get("n", 0) for r in parts),
                               sum(r["by_slice"].get(s, {}).get("correct", 0) for r in parts)) for s in slices}
        row = dict(task=HAYSTACK_TASK, variant=variant, **accuracy_of(n, sum(r["correct"] for r in parts)),
                   by_slice=by_slice, lost=sum(r.get("lost", 0) for r in parts),
                   **{k: sum(r[k] * r["n"] for r in parts) / n for k in MEANS})
        out.append(row)
    return dict(rows=out, goals=accuracy_goals(out), seeds=seeds, runs=list(names), mode="accuracy",
                model=docs[0].get("model"), dtype=docs[0].get("dtype"),
                machines=[doc.get("machine") for doc in docs])  # each run's own
