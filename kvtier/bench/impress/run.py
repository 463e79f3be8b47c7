"""`kvtier bench impress`: importance-only restores (IMPRESS) against the full stored prefix.

accuracy  multiple choice and free-form retrieval on a real model (accuracy.py).
ttft      a long history on a disk tier at emulated bandwidths: TTFT of the engine's exact restores
          (recompute, kv, cake) beside `--restore-method impress`, and the bytes and seconds of the
          IMPRESS, H2O-style and full reads of the same prefix through the same code.

Both write JSON with `rows` and `goals` ({goal, met, value, target}) and, with --plot, a figure.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.bench.common import drop_page_cache, machine_info, write_json_atomic
from kvtier.bench.impress import accuracy as impress_accuracy
from kvtier.bench.impress import admission as impress_admission
from kvtier.bench.impress import reorder as impress_reorder
from kvtier.bench.impress.goals import default_kind, ttft_goals
from kvtier.bench.impress.layout import CHUNK, namespace
from kvtier.bench.impress.pooled import pool
from kvtier.bench.report import pyplot, save_figure
from kvtier.engine.config import ImportanceSelection, ImportanceUnit, ImpressConfig
from kvtier.engine.impress.policy import PROBE_GRANULE_TOKENS, ImpressPolicy, ImpressStats, Selection
from kvtier.engine.impress.prefill import impress_prefill
from kvtier.models.loading import LoadedModel, load_model
from kvtier.models.rope import Rope
from kvtier.store import TieredStore
from kvtier.store.selective import TokenReads


# ----- TTFT -------------------------------------------------------------------------------------
def _history(loaded: LoadedModel, tokens: int) -> list[int]:
    """Standard-library docstrings, or seeded random ids for a random-weight preset (TTFT and bytes
    do not depend on what the tokens say)."""
    from kvtier.text import stdlib_text

    if loaded.tokenizer is None:
        return torch.randint(3, loaded.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    return loaded.tokenizer.encode(stdlib_text(tokens * 8), add_special_tokens=False)[:tokens]


@dataclass(frozen=True)
class EngineRow:
    """A row of the ttft mode: the engine with this restore method and importance selection. The
    auto rows let the planner choose, importance restores allowed (they store the importance
    layout, as impress does)."""

    method: str
    unit: str = "token"
    window: int = 1
    vote: str = "majority"
    lossy: bool = False
    selection: str = "impress"


def _engine_rows() -> dict[str, EngineRow]:
    """The earlier selections (single tokens or whole granules, the probes' majority vote,
    no pooling) and the engine's defaults."""
    c = ImpressConfig()
    return {"recompute": EngineRow("recompute"), "kv": EngineRow("kv"), "cake": EngineRow("cake"),
            "impress": EngineRow("impress"), "impress-g": EngineRow("impress", "granule"),
            default_kind(): EngineRow("impress", c.unit.value, c.window, c.vote, selection=c.selection.value),
            "auto-lossy": EngineRow("auto", lossy=True), "auto-lossy-g": EngineRow("auto", "granule", lossy=True),
            f"auto-lossy-{default_kind()}": EngineRow("auto", c.unit.value, c.window, c.vote, True, c.selection.value)}


def _engine_ttft(loaded: LoadedModel, spec: str, ids: list[int], ratio: float, row: EngineRow):
    from kvtier.engine.config import EngineConfig, ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import SamplingParams

    cfg = EngineConfig(kv_cache_bytes=2 << 30, max_model_len=len(ids) + 64)
    impress = ImpressConfig(ratio=ratio, unit=ImportanceUnit(row.unit), window=row.window, vote=row.vote,
                            selection=ImportanceSelection(row.selection))
    reuse = ReuseConfig(method=row.method, impress=impress, allow_lossy=row.lossy)
    with Engine(loaded, cfg, store=spec, reuse=reuse) as engine:
        out = engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return out


def _throttled(spec: str, bw: str) -> str:
    """`spec` read at `bw` MB/s (emulated), or as is for "none"."""
    if bw == "none":
        return spec
    if spec.startswith("redis"):
        return f"{spec}{'&' if '?' in spec else '?'}bw={bw}MB/s"
    return f"{spec}:bw={bw}MB/s"


def cmd_ttft(args: argparse.Namespace) -> dict:
    engine_rows = _engine_rows()
    rows_wanted = {m.strip() for m in args.methods.split(",") if m.strip()} if args.methods else set(engine_rows) | {"read"}
    if unknown := sorted(rows_wanted - set(engine_rows) - {"read"}):
        raise SystemExit(f"--methods: unknown {', '.join(unknown)} (choose from {', '.join([*engine_rows, 'read'])})")
    loaded = load_model(args.model, dtype=args.dtype)
    hist, new = args.history, args.new
    ids = _history(loaded, hist + new)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-impress-"))
    base = args.tier or f"disk:{root}:16GB"
    # Turn 1, once per namespace: the exact engines' layout and the importance layout.
    for method in ("kv", "impress"):
        _engine_ttft(loaded, base, ids[:hist], args.ratio, EngineRow(method))
    rows: list[dict] = []
    rope = Rope(loaded.config, hist + new + 64, loaded.dtype)
    reads_of = {"read:full": ImpressPolicy(selection=Selection.FULL),
                f"read:h2o@{args.ratio:g}": ImpressPolicy(ratio=args.ratio, selection=Selection.H2O),
                f"read:impress@{args.ratio:g}": ImpressPolicy(ratio=args.ratio, vote="majority"),
                f"read:impress-g@{args.ratio:g}": ImpressPolicy(ratio=args.ratio, block=PROBE_GRANULE_TOKENS, vote="majority"),
                f"read:{default_kind()}@{args.ratio:g}": ImpressPolicy.of(ImpressConfig(ratio=args.ratio))}
    for bw in args.bandwidths.split(","):
        spec = _throttled(base, bw)
        for name, row in engine_rows.items():
            if name not in rows_wanted:
                continue
            runs = []
            for _ in range(args.repeats):
                drop_page_cache(root)
                runs.append(_engine_ttft(loaded, spec, ids, args.ratio, row))
            ttft = statistics.median(o.ttft for o in runs)
            rs = runs[0].restore
            if name.startswith("auto"):
                print(f"        {name} chose {[o.restore.method if o.restore else 'recompute' for o in runs]}")
            rows.append(dict(bandwidth=bw, method=name, ttft_s=ttft, runs=[o.ttft for o in runs],
                             bytes_read=rs.bytes_read if rs else 0, restored_by=rs.method if rs else None,
                             attended=rs.prefix_attended if rs else None,
                             predicted_s=statistics.median(o.restore.predicted_s for o in runs if o.restore) if rs else None))
            predicted = rows[-1]["predicted_s"]  # what auto compares (0: a forced importance restore is not planned)
            said = f", predicted {predicted * 1000:.0f} ms" if predicted else ""
            print(f"{bw:>5} MB/s  {name:22s} TTFT {ttft * 1000:7.0f} ms  read {rows[-1]['bytes_read'] / 1e6:7.1f} MB{said}",
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
        lines = [impress_accuracy.table(doc)]
    else:
        lines = ["| bandwidth MB/s | method | TTFT ms (median) | bytes read MB |", "|---|---|---|---|"]
        for r in doc["rows"]:
            lines.append(f"| {r['bandwidth']} | {r['method']} | {r['ttft_s'] * 1000:.0f} | {r['bytes_read'] / 1e6:.1f} |")
    lines.append("")
    for g in doc["goals"]:
        lines.append(f"- {'met' if g['met'] else 'NOT met'}: {g['goal']} (value {g['value']:.3f}, target {g['target']:g})")
    return "\n".join(lines)


def _plot(doc: dict, mode: str, path: str) -> None:
    plt = pyplot()

    if mode == "accuracy":
        fig = plt.figure(figsize=(11, 4))
        impress_accuracy.plot(doc, fig)
        fig.tight_layout()
        save_figure(fig, path, dpi=120)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    if mode == "reorder":
        ax.bar([r["phase"] for r in doc["rows"]], [r["granules"] for r in doc["rows"]])
        ax.set_ylabel("K/V granules read per restore (median)")
    elif mode == "admission":
        ax.bar([r["policy"] for r in doc["rows"]], [r["important_hit_ratio"] for r in doc["rows"]])
        ax.set_ylabel("faster tier's hit ratio on important tokens (simulated)")
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
    if mode == "ttft":
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def cmd(args: argparse.Namespace) -> int:
    import json

    if args.pool:  # earlier runs on other seeds, pooled
        if args.replot:
            raise SystemExit("--pool and --replot: give one (--pool draws its figure with --plot)")
        names = [p for p in args.pool.split(",") if p]
        try:
            doc = pool([json.loads(Path(p).read_text()) for p in names], names)
        except (OSError, ValueError) as e:  # an unreadable file, bad JSON, or runs that do not pool
            raise SystemExit(f"--pool: {e}") from None
        doc.update(args=vars(args) | {"func": None})
        print(f"pooled seeds {doc['seeds']}")
        print(_table(doc, "accuracy"))
        if args.json:
            write_json_atomic(args.json, doc)
        if args.plot:
            _plot(doc, "accuracy", args.plot)
        return 0
    if args.replot:  # a figure from an earlier run's JSON
        doc = json.loads(Path(args.replot).read_text())
        _plot(doc, doc["mode"], args.plot or str(Path(args.replot).with_suffix(".png")))
        return 0
    if args.fast_inexact and args.mode != "accuracy":
        raise SystemExit(f"--fast-inexact applies to --mode accuracy only (--mode {args.mode} times the engine's "
                         "exact kernels)")
    torch.manual_seed(0)
    run = {"accuracy": impress_accuracy.run, "ttft": cmd_ttft, "reorder": impress_reorder.run,
           "admission": impress_admission.run}[args.mode]
    doc = run(args)
    doc.update(mode=args.mode, model=args.model, dtype=args.dtype, machine=machine_info(), args=vars(args) | {"func": None})
    print(_table(doc, args.mode))
    if args.json:
        write_json_atomic(args.json, doc)
    if args.plot:
        _plot(doc, args.mode, args.plot)
    return 0
