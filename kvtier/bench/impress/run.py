"""`kvtier bench impress`: importance-only restores (IMPRESS) against the full stored prefix.

accuracy  the needle multiple-choice task (bench/tasks.py) on a real model: each item's document is
          computed once and stored in the importance layout (memory tier), then restored by every
          variant (full KV; IMPRESS at several ratios; probes without the threshold; H2O over all
          keys; random and recent references) and answered by log-likelihood. Reports accuracy with
          Wilson 95% intervals, KL(full || variant) of the query rows' next-token distributions,
          bytes read against full KV, layers whose probes agreed, identification time.
ttft      a long history on a disk tier at emulated bandwidths: TTFT of the engine's exact restores
          (recompute, kv, cake) beside `--restore-method impress`, and the bytes and seconds of the
          IMPRESS, H2O-style and full reads of the same prefix through the same code.

Both write JSON with `rows` and `goals` ({goal, met, value, target}) and, with --plot, a figure.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from kvtier.bench.common import drop_page_cache, machine_info, write_json_atomic
from kvtier.bench.impress import admission as impress_admission
from kvtier.bench.impress import reorder as impress_reorder
from kvtier.bench.impress.goals import accuracy_goals, ttft_goals, variant
from kvtier.bench.tasks import needle_items
from kvtier.dtypes import name_of
from kvtier.engine.calibrate.probes import calibrate
from kvtier.engine.restore.impress_policy import (
    PROBE_GRANULE_TOKENS,
    ImpressPolicy,
    ImpressStats,
    Selection,
    probe_kv_heads_for,
)
from kvtier.engine.restore.impress_prefill import impress_prefill
from kvtier.models.loading import LoadedModel, load_model
from kvtier.models.rope import Rope
from kvtier.store import StoreNamespace, TieredStore
from kvtier.store.selective import TokenReads
from kvtier.testing.impress_harness import ReducedCache, extend

CHUNK = 64


def variants(ratios: list[float], granule: int) -> dict[str, ImpressPolicy]:
    """The rows: full KV, then per ratio IMPRESS and H2O-style loading choosing tokens, and both
    choosing whole granules ("-g"), then the ablation and blind references at 0.25."""
    out = {"full": ImpressPolicy(selection=Selection.FULL)}
    for r in ratios:
        out[f"impress@{r:g}"] = ImpressPolicy(ratio=r)
        out[f"impress-g@{r:g}"] = ImpressPolicy(ratio=r, block=granule)
        out[f"impress-sum@{r:g}"] = ImpressPolicy(ratio=r, vote="sum")
        out[f"impress-sum-g@{r:g}"] = ImpressPolicy(ratio=r, vote="sum", block=granule)
        out[f"h2o@{r:g}"] = ImpressPolicy(ratio=r, selection=Selection.H2O)
        out[f"h2o-g@{r:g}"] = ImpressPolicy(ratio=r, selection=Selection.H2O, block=granule)
    out["probes@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.PROBES)
    for j in range(3):  # which KV head's query heads would make a good probe (every key read)
        out[f"h2o-kv{j}@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.H2O, score_kv_heads=(j,))
    out["random@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.RANDOM)
    out["recent@0.25"] = ImpressPolicy(ratio=0.25, selection=Selection.RECENT)
    return out


def namespace(loaded: LoadedModel, granule_tokens: int = PROBE_GRANULE_TOKENS, probes: int = 0,
              probe_first: int = -1) -> StoreNamespace:
    """The importance layout the engine would open (its calibrated probe head unless one is given)."""
    c = loaded.config
    probes = probes or probe_kv_heads_for(c.num_kv_heads)
    first = probe_first if probe_first >= 0 else calibrate(loaded, probes).first
    return StoreNamespace(loaded.fingerprint, c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size,
                          compute_dtype=name_of(loaded.dtype), probe_kv_heads=probes, probe_first=first,
                          granule_tokens=granule_tokens)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return mid - half, mid + half


def _empty(loaded: LoadedModel) -> ReducedCache:
    c = loaded.config
    e = torch.empty(0, c.num_kv_heads, c.head_dim, dtype=loaded.dtype)
    return ReducedCache([e] * c.num_layers, [e] * c.num_layers, 0)


def _choice_loglik(loaded: LoadedModel, rope: Rope, cache: ReducedCache, last: torch.Tensor,
                   choice: list[int]) -> float:
    """log P(choice | everything in cache), the first token's distribution being `last` [vocab]."""
    lp = torch.log_softmax(last, -1)[choice[0]].item()
    if len(choice) > 1:
        copy = ReducedCache(list(cache.k), list(cache.v), cache.rope_offset)
        logits = extend(loaded.module, rope, copy, choice[:-1])  # [len - 1, vocab]
        lp += torch.log_softmax(logits, -1).gather(1, torch.tensor(choice[1:])[:, None]).sum().item()
    return lp


def _kl(full: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over rows of KL(full || other), logits [rows, vocab]."""
    p, q = torch.log_softmax(full, -1), torch.log_softmax(other, -1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def _nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] under logits [len(ids), vocab] (row i predicts i + 1)."""
    lp = torch.log_softmax(logits[:-1].float(), -1)
    return -lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def cmd_accuracy(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model, dtype=args.dtype)
    if loaded.tokenizer is None:
        raise SystemExit(f"model {args.model} has no tokenizer: the needle task needs one (use smollm2-135m)")
    lengths = tuple(int(x) for x in args.lengths.split(","))
    items = needle_items(loaded.tokenizer, args.n, lengths, seed=args.seed)
    rope = Rope(loaded.config, max(lengths) * 2 + 512, loaded.dtype)
    vs = variants([float(x) for x in args.ratios.split(",")], args.granule_tokens)
    if args.variants:
        keep = {"full", *args.variants.split(",")}
        vs = {k: v for k, v in vs.items() if k in keep}
    per: dict[str, dict[str, list]] = {name: {"correct": [], "kl": [], "nll": [], "bytes": [], "passed": [], "identify": [],
                                              "seconds": [], "jaccard": [], "granules": []} for name in vs}
    ns = namespace(loaded, args.granule_tokens, args.probe_kv_heads, args.probe_first)
    print(f"probe KV heads [{ns.probe_first}, {ns.probe_first + ns.probe_kv_heads}) of {ns.num_kv_heads}", flush=True)
    with TieredStore.open("memory:8GB", ns, chunk_tokens=CHUNK) as store:
        for item in tqdm(items, desc="needle items", unit="item"):
            cache = _empty(loaded)
            with torch.inference_mode():
                extend(loaded.module, rope, cache, item.prefix_ids)
            store.save(item.prefix_ids, 0, torch.stack(cache.k), torch.stack(cache.v), None)
            store.flush(120)
            match = store.lookup(item.prefix_ids)
            stored = match.num_tokens
            new = item.prefix_ids[stored:] + item.query_ids  # any tail past the last stored chunk is computed
            full_logits = None
            for name, policy in vs.items():
                reads = TokenReads(store, match.chunks)
                try:
                    logits, reduced, st = impress_prefill(loaded.module, rope, reads, new, policy)
                finally:
                    reads.close()
                scores = [_choice_loglik(loaded, rope, ReducedCache.of(reduced), logits[-1], c) for c in item.choices]
                q = per[name]
                q["correct"].append(int(max(range(4), key=scores.__getitem__) == item.answer))
                if full_logits is None:
                    full_logits = logits
                q["kl"].append(_kl(full_logits[-len(item.query_ids):], logits[-len(item.query_ids):]))
                q["nll"].append(_nll(logits[-len(item.query_ids):], item.query_ids))  # the question, teacher-forced
                q["bytes"].append(st.bytes_read)
                q["passed"].append(st.layers_passed / st.layers)
                q["identify"].append(st.identify_s / st.seconds)
                q["seconds"].append(st.seconds)
                q["granules"].append(st.granules_read / max(st.granules_whole, 1))
                if st.jaccard:
                    q["jaccard"].append(st.jaccard)
            store.discard(store.keys_for(item.prefix_ids))
    n = len(items)
    full_bytes = per["full"]["bytes"]
    rows = []
    for name, q in per.items():
        k = sum(q["correct"])
        lo, hi = wilson(k, n)
        rows.append(dict(variant=name, n=n, correct=k, accuracy=k / n, ci95=[lo, hi],
                         kl_mean=statistics.mean(q["kl"]), perplexity=math.exp(statistics.mean(q["nll"])),
                         bytes_vs_full=statistics.mean(
                             b / f for b, f in zip(q["bytes"], full_bytes)),
                         layers_passed=statistics.mean(q["passed"]),
                         identify_share=statistics.mean(q["identify"]), seconds_p50=statistics.median(q["seconds"]),
                         granules_read_share=statistics.mean(q["granules"]),
                         jaccard_by_layer=[statistics.mean(layer) for layer in zip(*q["jaccard"])] if q["jaccard"] else []))
    return dict(rows=rows, goals=accuracy_goals(rows), items=n, lengths=list(lengths),
                probe_kv_heads=[ns.probe_first, ns.probe_first + ns.probe_kv_heads])


# ----- TTFT -------------------------------------------------------------------------------------
def _history(loaded: LoadedModel, tokens: int) -> list[int]:
    """Standard-library docstrings, or seeded random ids for a random-weight preset (TTFT and bytes
    do not depend on what the tokens say)."""
    from kvtier.text import stdlib_text

    if loaded.tokenizer is None:
        return torch.randint(3, loaded.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return loaded.tokenizer.encode(stdlib_text(tokens * 8), add_special_tokens=False)[:tokens]


def _engine_ttft(loaded: LoadedModel, spec: str, method: str, ids: list[int], ratio: float, unit: str = "token",
                 lossy: bool = False):
    from kvtier.engine.config import EngineConfig, ImportanceUnit, ImpressConfig, ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import SamplingParams

    cfg = EngineConfig(kv_cache_bytes=2 << 30, max_model_len=len(ids) + 64)
    reuse = ReuseConfig(method=method, impress=ImpressConfig(ratio=ratio, unit=ImportanceUnit(unit)), allow_lossy=lossy)
    with Engine(loaded, cfg, store=spec, reuse=reuse) as engine:
        out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return out


# Row name -> (restore method, importance unit, lossy allowed). The auto rows let the planner
# choose, with importance restores allowed (they store the importance layout, as impress does).
def _throttled(spec: str, bw: str) -> str:
    """`spec` read at `bw` MB/s (emulated), or as is for "none"."""
    if bw == "none":
        return spec
    if spec.startswith("redis"):
        return f"{spec}{'&' if '?' in spec else '?'}bw={bw}MB/s"
    return f"{spec}:bw={bw}MB/s"


ENGINE_ROWS = {"recompute": ("recompute", "token", False), "kv": ("kv", "token", False),
               "cake": ("cake", "token", False), "impress": ("impress", "token", False),
               "impress-g": ("impress", "granule", False), "auto-lossy": ("auto", "token", True),
               "auto-lossy-g": ("auto", "granule", True)}


def cmd_ttft(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model, dtype=args.dtype)
    hist, new = args.history, args.new
    ids = _history(loaded, hist + new)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-impress-"))
    base = args.tier or f"disk:{root}:16GB"
    # Turn 1, once per namespace: the exact engines' layout and the importance layout.
    for method in ("kv", "impress"):
        _engine_ttft(loaded, base, method, ids[:hist], args.ratio)
    rows: list[dict] = []
    rows_wanted = set(args.methods.split(",")) if args.methods else set(ENGINE_ROWS) | {"read"}
    rope = Rope(loaded.config, hist + new + 64, loaded.dtype)
    reads_of = {"read:full": ImpressPolicy(selection=Selection.FULL),
                f"read:h2o@{args.ratio:g}": ImpressPolicy(ratio=args.ratio, selection=Selection.H2O),
                f"read:impress@{args.ratio:g}": ImpressPolicy(ratio=args.ratio),
                f"read:impress-g@{args.ratio:g}": ImpressPolicy(ratio=args.ratio, block=PROBE_GRANULE_TOKENS)}
    for bw in args.bandwidths.split(","):
        spec = _throttled(base, bw)
        for name, (method, unit, lossy) in ENGINE_ROWS.items():
            if name not in rows_wanted:
                continue
            runs = []
            for _ in range(args.repeats):
                drop_page_cache(root)
                runs.append(_engine_ttft(loaded, spec, method, ids, args.ratio, unit, lossy))
            ttft = statistics.median(o.ttft for o in runs)
            rs = runs[0].restore
            if name.startswith("auto"):
                print(f"        {name} chose {[o.restore.method if o.restore else 'recompute' for o in runs]}")
            rows.append(dict(bandwidth=bw, method=name, ttft_s=ttft, runs=[o.ttft for o in runs],
                             bytes_read=rs.bytes_read if rs else 0, restored_by=rs.method if rs else None,
                             attended=rs.prefix_attended if rs else None))
            print(f"{bw:>5} MB/s  {name:22s} TTFT {ttft * 1000:7.0f} ms  read {rows[-1]['bytes_read'] / 1e6:7.1f} MB",
                  flush=True)
        # The same prefix read by IMPRESS, H2O-style and in full through one code path (no engine).
        if "read" not in rows_wanted:
            continue
        with TieredStore.open(spec, namespace(loaded), chunk_tokens=CHUNK) as store:
            match = store.lookup(ids[:hist])
            for name, policy in reads_of.items():
                stats: list[ImpressStats] = []
                for rep in range(args.repeats + 1):  # the first run warms up and is not counted
                    drop_page_cache(root)
                    t0 = time.perf_counter()  # opening the chunks (one header read each) counts too
                    reads = TokenReads(store, match.chunks)
                    try:
                        logits, _, st = impress_prefill(loaded.module, rope, reads, ids[match.num_tokens:], policy)
                    finally:
                        reads.close()
                    int(logits[-1].argmax())
                    st.seconds = time.perf_counter() - t0
                    if rep:
                        stats.append(st)
                med = statistics.median(s.seconds for s in stats)
                s0 = stats[0]
                rows.append(dict(bandwidth=bw, method=name, ttft_s=med, runs=[s.seconds for s in stats],
                                 bytes_read=s0.bytes_read, read_s=statistics.median(s.read_s for s in stats),
                                 identify_s=statistics.median(s.identify_s for s in stats),
                                 layers_passed=s0.layers_passed, granules_read_share=s0.granules_read / s0.granules_whole))
                print(f"{bw:>5} MB/s  {name:22s} {med * 1000:7.0f} ms  read {s0.bytes_read / 1e6:7.1f} MB "
                      f"(reads {rows[-1]['read_s'] * 1000:.0f} ms, identify {rows[-1]['identify_s'] * 1000:.0f} ms, "
                      f"{s0.layers_passed}/{s0.layers} layers passed)", flush=True)
    tier = base.split(":", 1)[0].split("+", 1)[0]  # disk, memory or redis
    return dict(rows=rows, goals=ttft_goals(rows, args.ratio, tier), history=hist, new=new, dir=str(root), tier=base)


def _table(doc: dict, mode: str) -> str:
    if mode == "reorder":
        lines = [impress_reorder.table(doc)]
    elif mode == "admission":
        lines = [impress_admission.table(doc)]
    elif mode == "accuracy":
        lines = ["| variant | accuracy | 95% CI | KL vs full | query perplexity | bytes vs full | layers passed | "
                 "identify share |", "|---|---|---|---|---|---|---|---|"]
        for r in doc["rows"]:
            lines.append(f"| {r['variant']} | {r['accuracy'] * 100:.1f}% ({r['correct']}/{r['n']}) | "
                         f"{r['ci95'][0] * 100:.1f}-{r['ci95'][1] * 100:.1f} | {r['kl_mean']:.4f} | "
                         f"{r.get('perplexity', float('nan')):.3f} | "
                         f"{r['bytes_vs_full']:.3f} | {r['layers_passed']:.2f} | {r['identify_share']:.3f} |")
    else:
        lines = ["| bandwidth MB/s | method | TTFT ms (median) | bytes read MB |", "|---|---|---|---|"]
        for r in doc["rows"]:
            lines.append(f"| {r['bandwidth']} | {r['method']} | {r['ttft_s'] * 1000:.0f} | {r['bytes_read'] / 1e6:.1f} |")
    lines.append("")
    for g in doc["goals"]:
        lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']} (value {g['value']:.3f}, target {g['target']:g})")
    return "\n".join(lines)


def _plot(doc: dict, mode: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if mode == "reorder":
        ax.bar([r["phase"] for r in doc["rows"]], [r["granules"] for r in doc["rows"]])
        ax.set_ylabel("K/V granules read per restore (median)")
    elif mode == "admission":
        ax.bar([r["policy"] for r in doc["rows"]], [r["important_hit_ratio"] for r in doc["rows"]])
        ax.set_ylabel("faster tier's hit ratio on important tokens (simulated)")
    elif mode == "accuracy":
        for kind in ("impress", "impress-g", "h2o", "h2o-g"):
            pts = sorted((float(r["variant"].split("@")[1]), r["accuracy"] * 100) for r in doc["rows"]
                         if r["variant"].startswith(kind + "@"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=kind)
        full = variant(doc["rows"], "full")
        if full:
            ax.axhline(full["accuracy"] * 100, color="k", ls="--", label="full KV")
        ax.axhline(25, color="grey", ls=":", label="chance")
        ax.set_xlabel("importance ratio (share of the prefix kept)")
        ax.set_ylabel("needle accuracy (%)")
    else:
        methods = sorted({r["method"] for r in doc["rows"]})
        bws = [b for b in dict.fromkeys(r["bandwidth"] for r in doc["rows"])]
        for m in methods:
            ys = [next((r["ttft_s"] for r in doc["rows"] if r["method"] == m and r["bandwidth"] == b), float("nan"))
                  for b in bws]
            ax.plot(bws, ys, marker="o", label=m)
        ax.set_xlabel("emulated disk bandwidth (MB/s)")
        ax.set_ylabel("TTFT / restore seconds (median)")
        ax.set_yscale("log")
    if mode in ("accuracy", "ttft"):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cmd(args: argparse.Namespace) -> int:
    import json

    if args.replot:  # a figure from an earlier run's JSON
        doc = json.loads(Path(args.replot).read_text())
        _plot(doc, doc["mode"], args.plot or str(Path(args.replot).with_suffix(".png")))
        return 0
    torch.manual_seed(0)
    run = {"accuracy": cmd_accuracy, "ttft": cmd_ttft, "reorder": impress_reorder.run,
           "admission": impress_admission.run}[args.mode]
    doc = run(args)
    doc.update(mode=args.mode, model=args.model, dtype=args.dtype, machine=machine_info(), args=vars(args) | {"func": None})
    print(_table(doc, args.mode))
    if args.json:
        write_json_atomic(args.json, doc)
    if args.plot:
        _plot(doc, args.mode, args.plot)
    return 0
