"""`kvtier bench truncation`: perplexity after context truncation, three ways, on real text.

Token truncation (drop tokens, recompute) is the reference; kvtier reuses the stored pre-RoPE KV
of the kept tokens at their new positions; the naive variant keeps the old positions baked in.
Text: Python standard library docstrings (offline). Several windows, mean of per-window PPL.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from kvtier.models.loading import load_model
from kvtier.planning.truncation import TruncationConfig
from kvtier.testing.reference import truncation_fidelity
from kvtier.text import stdlib_text


def cmd(args: argparse.Namespace) -> int:
    model = load_model(args.model, dtype=args.dtype)
    need = args.windows * (args.context + args.continuation)
    if model.tokenizer is None:
        raise ValueError(f"model {model.name} has no tokenizer; this benchmark tokenizes text")
    ids = model.tokenizer.encode(stdlib_text(need * 6), add_special_tokens=False)
    cfg = TruncationConfig(keep_prefix=args.keep_prefix, drop_ratio=args.drop_ratio)
    rows = []
    for w in range(args.windows):
        a = w * (args.context + args.continuation)
        ctx, cont = ids[a : a + args.context], ids[a + args.context : a + args.context + args.continuation]
        if len(cont) < args.continuation:
            break
        f = truncation_fidelity(model.module, ctx, cont, args.limit, cfg)
        rows.append(dict(window=w, ppl_token_truncation=f.ppl_token_truncation, ppl_kv_rerope=f.ppl_kv_rerope,
                         ppl_kv_naive=f.ppl_kv_naive, rerope_vs_tokens=f.rerope_vs_tokens))
        print(f"window {w}: token truncation {f.ppl_token_truncation:.3f}  kv re-RoPE {f.ppl_kv_rerope:.3f}  "
              f"naive {f.ppl_kv_naive:.3f}", flush=True)
    mean = {k: statistics.mean(r[k] for r in rows) for k in ("ppl_token_truncation", "ppl_kv_rerope", "ppl_kv_naive")}
    rel = mean["ppl_kv_rerope"] / mean["ppl_token_truncation"] - 1
    lines = [f"model {args.model} ({model.dtype}), context {args.context} -> limit {args.limit}, keep prefix "
             f"{args.keep_prefix}, drop ratio {args.drop_ratio}, continuation {args.continuation} tokens, "
             f"{len(rows)} windows of stdlib docstrings", "",
             "| variant | mean PPL |", "|---|---|",
             f"| token truncation (recompute kept tokens) | {mean['ppl_token_truncation']:.3f} |",
             f"| kvtier: stored KV, RoPE at new positions | {mean['ppl_kv_rerope']:.3f} ({rel:+.1%}) |",
             f"| naive: stored KV, old positions | {mean['ppl_kv_naive']:.3f} |",
             "", f"goal: re-RoPE within 2% of token truncation: {'met' if abs(rel) <= 0.02 else 'not met'} ({rel:+.2%})"]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "mean": mean, "rerope_vs_tokens": rel}, indent=2))
    return 0
