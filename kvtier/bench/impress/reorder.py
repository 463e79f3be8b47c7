"""`kvtier bench impress --mode reorder`: what one reorder pass (IMPRESS §4.4.1) saves on a
repeated-prefix trace.

One stored document (`--history` tokens of standard-library docstrings) is asked about again and
again: each query is a different `--new`-token stretch of later text after the document, restored
by importance (single tokens, the paper's selection) from a throttled disk. `--warm` queries feed
the store's importance statistics, one reorder pass rewrites the chunks, then `--queries` held-out
queries are timed. The same held-out queries were timed first on a separate engine over the chunks
as saved (token order), so both columns are the same requests over the same bytes in another order.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvtier.bench.common import drop_page_cache
from kvtier.bench.goals import Goal, evaluate
from kvtier.engine.config import EngineConfig, ImportanceSelection, ImportanceUnit, ImpressConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.impress.policy import PROBE_GRANULE_TOKENS
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import LoadedModel, load_model

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def _engine(loaded: LoadedModel, spec: str, tokens: int, ratio: float) -> Engine:
    cfg = EngineConfig(kv_cache_bytes=2 << 30, max_model_len=tokens + 64)
    # Single tokens, as the paper (reordering serves them; whole granules need none); passes run by hand.
    impress = ImpressConfig(ratio=ratio, unit=ImportanceUnit.TOKEN, window=1, vote="majority",
                            selection=ImportanceSelection.IMPRESS, reorder_s=0)
    reuse = ReuseConfig(method="impress", impress=impress)
    return Engine(loaded, cfg, store=spec, reuse=reuse)


def _timed(engine: Engine, root: Path, prompts: list[list[int]]) -> list[dict]:
    out = []
    for ids in prompts:
        drop_page_cache(root)
        r = engine.generate([ids], ONE_TOKEN)[0]
        assert r.restore is not None and r.restore.method == "impress", "the prefix was not restored by importance"
        out.append(dict(ttft_s=r.ttft, bytes_read=r.restore.bytes_read))
    return out


def granules(loaded: LoadedModel, history: int, bytes_read: float) -> float:
    """K/V granules a restore read: its bytes less every layer's probe keys (read whole), over a
    granule's bytes (one KV part of `PROBE_GRANULE_TOKENS` tokens)."""
    c, item = loaded.config, loaded.dtype.itemsize
    probe = history * c.num_layers * c.head_dim * item  # one probe KV head
    return (bytes_read - probe) / (PROBE_GRANULE_TOKENS * c.num_kv_heads * c.head_dim * item)


def _granule_cut(rows: Sequence[dict]) -> list[dict]:
    return [dict(value=rows[0]["granules"] / max(rows[1]["granules"], 1e-9), target=1.2)]


GOALS = (Goal("one reorder pass cuts K/V granules read by >= 1.2x on a repeated-prefix trace", _granule_cut,
              lambda g: g["value"] >= g["target"], lambda gs: gs[0]),)


def run(args: argparse.Namespace) -> dict:
    loaded = load_model(args.model, dtype=args.dtype)
    assert loaded.tokenizer is not None
    from kvtier.text import stdlib_text

    hist, new, n = args.history, args.new, args.warm + args.queries
    text = loaded.tokenizer.encode(stdlib_text((hist + new * n) * 8), add_special_tokens=False)
    doc = text[:hist]
    prompts = [doc + text[hist + i * new: hist + (i + 1) * new] for i in range(n)]
    warm, held = prompts[:args.warm], prompts[args.warm:]
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvtier-reorder-"))
    spec = f"disk:{root}:16GB" + ("" if args.bandwidth == "none" else f":bw={args.bandwidth}MB/s")
    with _engine(loaded, f"disk:{root}:16GB", hist + new, args.ratio) as first:  # turn 1: the document, stored
        first.generate([doc], ONE_TOKEN)
        assert first.flush(600)
    with _engine(loaded, spec, hist + new, args.ratio) as engine:
        before = _timed(engine, root, held)
    with _engine(loaded, spec, hist + new, args.ratio) as engine:
        _timed(engine, root, warm)
        store = engine.store
        assert store is not None
        report = store.reorder()
        after = _timed(engine, root, held)
    rows = []
    for phase, runs in (("token order", before), ("reordered", after)):
        b = statistics.median(r["bytes_read"] for r in runs)
        rows.append(dict(phase=phase, ttft_s=statistics.median(r["ttft_s"] for r in runs),
                         ttft_runs=[r["ttft_s"] for r in runs], bytes_read=b, granules=granules(loaded, hist, b)))
        print(f"{phase:12s} TTFT {rows[-1]['ttft_s'] * 1000:7.0f} ms  read {b / 1e6:6.1f} MB  "
              f"granules {rows[-1]['granules']:.0f}", flush=True)
    print(f"reorder pass: {report.chunks} chunks rewritten ({report.nbytes / 1e6:.1f} MB) in {report.seconds:.2f} s")
    return dict(rows=rows, goals=evaluate(GOALS, rows), history=hist, new=new, warm=args.warm, queries=args.queries,
                bandwidth=args.bandwidth, reorder=vars(report), dir=str(root))


def table(doc: dict) -> str:
    lines = [f"| chunks stored in | TTFT ms (median of {doc['queries']}) | MB read | K/V granules read |",
             "|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['phase']} | {r['ttft_s'] * 1000:.0f} | {r['bytes_read'] / 1e6:.1f} | {r['granules']:.0f} |")
    return "\n".join(lines)

