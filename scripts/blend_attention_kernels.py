"""The blended recompute's attention at its own shapes, two ways: CPU SDPA's fused flash kernel (what
`attention_at` runs) against the same attention as GEMMs (HF transformers' eager attention: the
query heads sharing a K/V head as the rows of one product, the softmax in fp32), for a few rows
per piece. Rows at the positions of a LegoLink-8 plan over ten 606-token documents and a 28-token
question (6,234 keys), the question alone (naive), and 930 scattered rows (CacheBlend's 15%).

    python scripts/blend_attention_kernels.py [--repeats 9] [--json out/blend_attention_kernels.json]

Prints each case's median milliseconds per layer and its rate in GFLOP/s over the causal
query-key pairs (4 x heads x head_dim FLOPs each: q.k and p.v), and the largest difference from
a float64 reference. Medians of --repeats calls on the threads torch uses (the engine's).
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence

import torch

from kvtier.bench.common import machine_info
from kvtier.bench.stats import median_of
from kvtier.models.attention import attention_at

CTX, KV_HEADS, HEADS, HD = 6234, 3, 9, 64  # SmolLM2-135M's attention


def gemm_at(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: Sequence[int], rows: int) -> torch.Tensor:
    """The same attention through GEMMs, `rows` queries per piece over the keys up to the piece's last."""
    m, heads, hd = q.shape
    kv = k.shape[1]
    g = heads // kv
    ctx = positions[-1] + 1
    kt = k[:ctx].permute(1, 2, 0).contiguous()  # [kv, hd, ctx]
    vt = v[:ctx].transpose(0, 1).contiguous()  # [kv, ctx, hd]
    qs = q * (1.0 / math.sqrt(hd))
    at, keys = torch.as_tensor(list(positions)), torch.arange(ctx)
    out = torch.empty_like(q)
    for a in range(0, m, rows):
        r = min(rows, m - a)
        n = positions[a + r - 1] + 1
        qg = qs[a : a + r].reshape(r, kv, g, hd).permute(1, 2, 0, 3).reshape(kv, g * r, hd)
        s = torch.matmul(qg, kt[:, :, :n])  # [kv, g * r, n]
        s.view(kv, g, r, n).masked_fill_(keys[None, :n] > at[a : a + r, None], float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), vt[:, :n])  # [kv, g * r, hd]
        out[a : a + r] = o.view(kv, g, r, hd).permute(2, 0, 1, 3).reshape(r, heads, hd)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=9, help="timed calls per case (default: %(default)s)")
    ap.add_argument("--json", default=None, help="write the cases and the machine here")
    args = ap.parse_args()
    torch.manual_seed(0)
    cases = {
        "legolink-8": [p for s in range(40, CTX - 34, 606) for p in range(s, s + 8)] + list(range(CTX - 28, CTX)),
        "naive": list(range(CTX - 28, CTX)),
        "cacheblend-0.15": sorted(torch.randperm(CTX)[:930].tolist()),
    }
    out = []
    for dtype in (torch.bfloat16, torch.float32):
        k, v = (torch.randn(CTX, KV_HEADS, HD).to(dtype) for _ in range(2))
        for name, pos in cases.items():
            q = torch.randn(len(pos), HEADS, HD).to(dtype)
            ref = attention_at(q.double(), k.double(), v.double(), pos)
            flops = 4 * HEADS * HD * sum(p + 1 for p in pos)
            kernels: dict[str, Callable[[], torch.Tensor]] = {"flash (SDPA), 64 rows": lambda: attention_at(q, k, v, pos)}
            for rows in (16, 64):
                kernels[f"gemm, {rows} rows"] = lambda rows=rows: gemm_at(q, k, v, pos, rows)
            for kernel, fn in kernels.items():
                err = float((fn().double() - ref).abs().max())  # also the warm-up call
                ms = median_of(fn, args.repeats) * 1000
                out.append(dict(dtype=str(dtype).removeprefix("torch."), case=name, rows=len(pos), kernel=kernel, ms=ms,
                                gflops=flops / ms / 1e6, max_abs_err=err))
                print(f"{out[-1]['dtype']:8s} {name:16s} {len(pos):4d} rows  {kernel:22s} {ms:7.1f} ms  "
                      f"{flops / ms / 1e6:6.1f} GFLOP/s  max |err| {err:.2g}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine_info(), threads=torch.get_num_threads(), cases=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
