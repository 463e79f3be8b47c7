"""The copies exact CPU attention makes around its kernel, before and after, interleaved in one
process on pool-shaped tensors (SmolLM2-135M's: 30 layers, 3 K/V heads of 64, 9 query heads).

    prefill   64 new tokens over H history tokens, 30 layers, the context in consecutive pool
              slots (`range`) or gathered from scattered blocks (`gather`).
              before: per layer, the context gathered (a gathered one), then padded to whole key
                      blocks by F.pad (a fresh buffer allocated, zeroed and filled).
              after:  two buffers per step, their tail zeroed once; each layer copies its context
                      into them (`ModelRunner._key_blocks` and `model_runner._context`).
    decode    B decodes of H-token contexts padded to whole key blocks, one layer's gather of K
              or V (the attention call itself is the same in both).
              before: a fresh buffer per gather; padding read from slot 0, then index_fill_ zeroes it.
              after:  one buffer kept between steps; padding read from the pool's zero slot.

    python scripts/attention_copies_ab.py [--dtype bf16] [--history 1024,4096] [--batch 8,32] [--json out.json]

Prints medians of --reps interleaved repetitions (the first 4 dropped as warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kvtier.dtypes import torch_dtype
from kvtier.engine.runner.model_runner import _context
from kvtier.models.attention import causal_attention, key_rows

LAYERS, KV_HEADS, HD, HEADS, NEW, BLOCK = 30, 3, 64, 9, 64, 16


def prefill(h: int, dtype: torch.dtype, gathered: bool, after: bool, kc, vc, q) -> None:
    rows = h + NEW
    if gathered:
        blocks = torch.randperm(kc.shape[1] // BLOCK - 1, generator=torch.Generator().manual_seed(h))
        ctx: range | torch.Tensor = (blocks[: -(-rows // BLOCK)][:, None] * BLOCK + torch.arange(BLOCK)).flatten()[:rows]
    else:
        ctx = range(BLOCK, BLOCK + rows)
    pads: list[torch.Tensor | None] = [None, None]
    if after:
        pads = [torch.empty(key_rows(rows), KV_HEADS, HD, dtype=dtype) for _ in range(2)]
        for p in pads:
            p[rows:].zero_()
    for li in range(LAYERS):
        k, v = (_context(q, c[li], ctx, p) for c, p in zip((kc, vc), pads))
        causal_attention(q, k, v, h)


def decode(b: int, h: int, after: bool, kc, keep: dict) -> None:
    width = key_rows(h + 1)
    zero = kc.shape[1] - 1
    slots = torch.full((b, width), zero if after else 0, dtype=torch.long)
    for r in range(b):
        slots[r, : h + 1] = torch.arange(r * width, r * width + h + 1)
    flat = slots.flatten()
    if after:
        out = keep.get(flat.numel())
        if out is None:
            out = keep[flat.numel()] = torch.empty(flat.numel(), KV_HEADS, HD, dtype=kc.dtype)
        torch.index_select(kc[0], 0, flat, out=out)
    else:
        padding = torch.cat([torch.arange(r * width + h + 1, (r + 1) * width) for r in range(b)])
        kc[0].index_select(0, flat).index_fill_(0, padding, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--history", default="1024,4096")
    ap.add_argument("--batch", default="8,32")
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = torch_dtype(args.dtype)
    hs, bs = [int(x) for x in args.history.split(",")], [int(x) for x in args.batch.split(",")]
    g = torch.Generator().manual_seed(0)
    slots = max(max(bs) * key_rows(max(hs) + 1), 2 * (max(hs) + NEW + 2 * BLOCK)) + BLOCK
    kc, vc = (torch.randn(LAYERS, slots, KV_HEADS, HD, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(NEW, HEADS, HD, generator=g).to(dtype)
    cases = [(f"prefill H={h} {mode}", lambda after, h=h, mode=mode: prefill(h, dtype, mode == "gather", after, kc, vc, q))
             for h in hs for mode in ("range", "gather")]
    keep: dict = {}
    cases += [(f"decode B={b} H={h} (one gather)", lambda after, b=b, h=h: decode(b, h, after, kc, keep))
              for b in bs for h in hs]
    rows = []
    for name, run in cases:
        t: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.reps + 4):
            for after in (False, True)[:: 1 if r % 2 else -1]:
                s = time.perf_counter()
                run(after)
                if r >= 4:
                    t[after].append(time.perf_counter() - s)
        before_ms, after_ms = (1e3 * statistics.median(t[x]) for x in (False, True))
        rows.append(dict(case=name, before_ms=round(before_ms, 2), after_ms=round(after_ms, 2)))
        print(f"{args.dtype} {name:34s} before {before_ms:8.2f} ms  after {after_ms:8.2f} ms  "
              f"({after_ms / before_ms:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), threads=torch.get_num_threads(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
