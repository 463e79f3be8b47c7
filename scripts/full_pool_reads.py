"""A long context in a KV pool full of cached prefixes, as a server's pool is after a while: does
it still get consecutive blocks, so that exact CPU attention reads it in place? SmolLM2-135M,
prefix cache on, a pool of `--pool-mib` that holds a few contexts. Each context's history of H
tokens is prefilled, then timed: its next turn of 64 new tokens (TTFT) and one more turn that
decodes `--decodes` tokens. The first contexts find clean rows of blocks; once the pool is full
of cached blocks every later one needs some evicted (`BlockPool._evicting_extent`). Per phase:
median times and how the layers read the contexts (in place, or gathered: a copy every layer of
every step). Prints a table and writes JSON.

    cd scripts && python full_pool_reads.py [--dtype bf16] [--history 8000] [--contexts 10] [--json F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.bench.common import machine_info
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner import model_runner
from kvtier.models.loading import load_model

NEW = 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--history", type=int, default=8000)
    ap.add_argument("--contexts", type=int, default=10)
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--pool-mib", type=int, default=1024)
    ap.add_argument("--json")
    a = ap.parse_args()
    lm = load_model("smollm2-135m", dtype=a.dtype, tokenizer=False)
    reads = {"in place": 0, "gathered": 0}
    real = model_runner._context

    def spy(new, cache, ctx, pad):  # how each layer of each run reads its context
        if ctx is not None:
            reads["gathered" if isinstance(ctx, torch.Tensor) else "in place"] += 1
        return real(new, cache, ctx, pad)

    model_runner._context = spy
    engine = Engine(lm, EngineConfig(kv_cache_bytes=a.pool_mib << 20, max_model_len=a.history + NEW + a.decodes + 8))
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    more = SamplingParams(max_tokens=a.decodes, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for i in range(a.contexts):
            ids = torch.randint(100, lm.config.vocab_size, (a.history + NEW,), generator=gen).tolist()
            full = engine.pool._clean_extent(-(-(a.history + NEW) // engine.pool.block_size)) is None
            engine.generate([ids[: a.history]], one)
            for k in reads:
                reads[k] = 0
            t0 = time.perf_counter()
            engine.generate([ids], one)
            t1 = time.perf_counter()
            engine.generate([ids + [5]], more)
            t2 = time.perf_counter()
            rows.append(dict(context=i, pool_full=full, ttft_s=t1 - t0, decode_turn_s=t2 - t1, **dict(reads)))
            print(rows[-1], flush=True)
    finally:
        engine.close()
        model_runner._context = real
    summary = {}
    for phase in (False, True):
        sel = [r for r in rows[1:] if r["pool_full"] == phase]  # the first context is the warm-up
        if sel:
            summary["full pool" if phase else "clean rows left"] = dict(
                contexts=len(sel), ttft_s=statistics.median(r["ttft_s"] for r in sel),
                decode_turn_s=statistics.median(r["decode_turn_s"] for r in sel),
                in_place=sum(r["in place"] for r in sel), gathered=sum(r["gathered"] for r in sel))
    print(f"\n| pool | contexts | TTFT, {NEW} new (s) | turn of {a.decodes} decodes (s) | context reads in place | gathered |")
    print("|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['contexts']} | {s['ttft_s']:.3f} | {s['decode_turn_s']:.3f} | {s['in_place']} | {s['gathered']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), machine=machine_info(), rows=rows, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
