"""Exact CPU attention at the kernel level, split by position (`kvtier/models/exact_attention.py`)
against whole 512-key blocks (the attention module of `--before`, read from git): the time of 30
layers' worth of calls with SmolLM2's heads (9 query, 3 K/V, head_dim 64) on random inputs, for
64 new tokens after a history, a 2,048-token prefill chunk, and one decoding token. Best of two
medians per row, the two ways alternating; also each way's error against fp64 attention.

    cd scripts && python key_split_kernel.py [--before f741134] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from key_split_ab import BEFORE, module_at  # scripts/ is on the path of a script run from it

from kvtier.dtypes import torch_dtype
from kvtier.models import exact_attention

HEADS, KV_HEADS, HD, LAYERS = 9, 3, 64, 30
CASES = [(1024, 64), (1500, 64), (4096, 64), (8128, 64), (0, 2048), (6144, 2048), (1100, 1), (4100, 1), (8100, 1)]


def per_step_ms(f, reps: int) -> float:
    for _ in range(2):
        f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3 * LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", default=BEFORE)
    ap.add_argument("--dtype", default="fp32")
    args = ap.parse_args()
    dtype = torch_dtype(args.dtype)
    whole = module_at(args.before)._blocked
    ways = {"whole blocks": whole, "split": exact_attention.causal}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1700, h, HD, generator=g).to(dtype) for h in (HEADS, KV_HEADS, KV_HEADS))
    want = F.scaled_dot_product_attention(*(x.double().transpose(0, 1)[None] for x in (q, k, v)),
                                          is_causal=True, enable_gqa=True)[0].transpose(0, 1)
    for name, f in ways.items():
        err = (f(q, k, v, 0).double() - want).abs()
        print(f"{name:13s} error against fp64 over 1,700 tokens: max {err.max():.2e}, mean {err.mean():.2e}")
    print(f"| queries | {' | '.join(ways)} | (ms per {LAYERS} layers, {args.dtype}) |")
    for h, n in CASES:
        ctx = h + n
        q = torch.randn(n, HEADS, HD).to(dtype)
        k = torch.zeros(exact_attention.key_rows(ctx) + 512, KV_HEADS, HD, dtype=dtype)  # room for whole blocks
        v = torch.zeros_like(k)
        k[:ctx], v[:ctx] = torch.randn(ctx, KV_HEADS, HD).to(dtype), torch.randn(ctx, KV_HEADS, HD).to(dtype)
        reps = 3 if n > 64 else 30 if n == 64 else 300
        best = dict.fromkeys(ways, float("inf"))
        for _ in range(2):  # the ways alternate
            for name, f in ways.items():
                best[name] = min(best[name], per_step_ms(lambda: f(q, k, v, h), reps))
        print(f"| {n} after {h} | " + " | ".join(f"{t:.1f}" for t in best.values()) + " |", flush=True)


if __name__ == "__main__":
    main()
