"""The blended recompute's attention at its own shapes, two ways: CPU SDPA's fused flash kernel
against the same attention as GEMMs (`ScatteredRows` with the model's kernels where
`scattered_gemm` picks them: bf16 on a CPU with native bf16; HF transformers' eager arithmetic,
the query heads sharing a K/V head as the rows of one product), for 16, 32, 64, 128 and 256 rows per piece.
Rows at the positions of a LegoLink-8 plan over ten 606-token documents and a 28-token question
(6,234 keys), the question alone (naive), and 930 scattered rows (CacheBlend's 15%).

    python scripts/blend_attention_kernels.py [--repeats 9] [--json out/blend_attention_kernels.json]

Prints each case's median milliseconds per layer and its rate in GFLOP/s over the causal
query-key pairs (4 x heads x head_dim FLOPs each: q.k and p.v), and the largest difference from
a float64 reference. Medians of --repeats calls on the threads torch uses (the engine's).
Beside them, a floor no softmax attention can beat on this CPU: the exponentials alone, one
`torch.exp` in fp32 over as many elements as the case has causal query-key pairs per head times
the heads.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from kvtier.bench.common import machine_info
from kvtier.bench.stats import median_of
from kvtier.models.attention import attention_at, scattered_gemm
from kvtier.models.kernels import Kernels

CTX, KV_HEADS, HEADS, HD = 6234, 3, 9, 64  # SmolLM2-135M's attention
GEMM = Kernels(bf16_attention="gemm")  # GEMMs wherever this CPU's pass their check (bf16 only)


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
            kernels: dict[str, Callable[[], torch.Tensor]] = {}
            for rows in (16, 32, 64, 128, 256):
                kernels[f"flash (SDPA), {rows} rows"] = lambda rows=rows: attention_at(q, k, v, pos, rows)
                if scattered_gemm(q.device, dtype, HEADS, KV_HEADS, HD, GEMM):
                    kernels[f"gemm, {rows} rows"] = lambda rows=rows: attention_at(q, k, v, pos, rows, GEMM)
            for kernel, fn in kernels.items():
                err = float((fn().double() - ref).abs().max())  # also the warm-up call
                ms = median_of(fn, args.repeats) * 1000
                out.append(dict(dtype=str(dtype).removeprefix("torch."), case=name, rows=len(pos), kernel=kernel, ms=ms,
                                gflops=flops / ms / 1e6, max_abs_err=err))
                print(f"{out[-1]['dtype']:8s} {name:16s} {len(pos):4d} rows  {kernel:22s} {ms:7.1f} ms  "
                      f"{flops / ms / 1e6:6.1f} GFLOP/s  max |err| {err:.2g}", flush=True)
            scores = torch.randn(HEADS * sum(p + 1 for p in pos))  # one fp32 score per causal pair and head
            dst = torch.empty_like(scores)
            ms = median_of(lambda: torch.exp(scores, out=dst), args.repeats) * 1000
            out.append(dict(dtype=str(dtype).removeprefix("torch."), case=name, rows=len(pos), kernel="exp alone",
                            ms=ms, pairs_per_s=scores.numel() / ms * 1000))
            print(f"{out[-1]['dtype']:8s} {name:16s} {len(pos):4d} rows  {'exp alone (a floor)':22s} {ms:7.1f} ms  "
                  f"{scores.numel() / ms / 1e6:6.2f} G pairs/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine_info(), threads=torch.get_num_threads(), cases=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
