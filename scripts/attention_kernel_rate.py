"""How fast the CPU flash kernel turns attention scores over, for the layouts the two sides of
`kvtier bench e2e` call it with: kvtier's exact path (a K/V head's grouped query heads as rows of
one matrix, `exact_attention.causal`), HF's SDPA (K/V repeated for every query head), and a third
layout tried for thread balance (the group members as the batch, K/V shared with stride 0).

At long histories this kernel is most of a returning context's time on both sides, so its rate
bounds how far under HF's floor a restore can get. Prints a table and writes JSON.

    cd scripts && python attention_kernel_rate.py [--keys 1024,4096,8192] [--new 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from kvtier.bench.stats import median_of

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
KV_HEADS, GROUP, HD = 3, 3, 64  # SmolLM2-135M: 9 query heads over 3 K/V heads, head_dim 64


def _median_ms(fn, repeats: int) -> float:
    for _ in range(3):  # warm-up: the kernel's buffers, the caches
        fn()
    return median_of(fn, repeats) * 1e3


def layouts(keys: int, new: int, dtype: torch.dtype) -> dict[str, tuple]:
    """(q, k, v) per layout for `new` queries over `keys` keys, all unmasked (the history part)."""
    q = torch.randn(new, KV_HEADS * GROUP, HD, dtype=dtype)  # [new, heads, hd]
    k, v = (torch.randn(1, KV_HEADS, keys, HD, dtype=dtype) for _ in range(2))  # [1, kvh, keys, hd]
    qg = q.view(new, KV_HEADS, GROUP, HD).permute(1, 2, 0, 3)  # [kvh, group, new, hd]
    return {
        "kvtier (group as rows)": (qg.reshape(1, KV_HEADS, GROUP * new, HD), k, v),
        "HF (K/V repeated)": (q.transpose(0, 1)[None].contiguous(), k.repeat_interleave(GROUP, 1),
                              v.repeat_interleave(GROUP, 1)),
        "group as batch": (qg.permute(1, 0, 2, 3).contiguous(), k.expand(GROUP, -1, -1, -1), v.expand(GROUP, -1, -1, -1)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", default="1024,4096,8192")
    ap.add_argument("--new", type=int, default=64, help="query tokens (the e2e bench's new tokens)")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    print(f"{'threads':>7} {'dtype':>5} {'keys':>6}  {'layout':<24} {'ms':>7} {'Mscore/s':>9} {'GFLOP/s':>8}")
    for threads in map(int, args.threads.split(",")):
        torch.set_num_threads(threads)
        for name in args.dtypes.split(","):
            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[name]
            for keys in map(int, args.keys.split(",")):
                for layout, (q, k, v) in layouts(keys, args.new, dtype).items():
                    ms = _median_ms(lambda: FLASH(q, k, v, 0.0, False), args.repeats)
                    scores = KV_HEADS * GROUP * args.new * keys
                    rate, gflops = scores / ms / 1e3, 4 * scores * HD / ms / 1e6  # QK^T and PV: 2 FMAs per score and dim
                    rows.append({"threads": threads, "dtype": name, "keys": keys, "new": args.new, "layout": layout,
                                 "ms": round(ms, 3), "mscore_per_s": round(rate, 1), "gflop_per_s": round(gflops, 1)})
                    print(f"{threads:>7} {name:>5} {keys:>6}  {layout:<24} {ms:7.2f} {rate:9.0f} {gflops:8.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
