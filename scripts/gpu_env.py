"""Report what the CUDA path relies on, on the machine at hand (run by scripts/gpu_check.sh).

Prints torch/CUDA versions, whether varlen_attn takes a block table (and which page sizes it
accepts), the pinned-memory limit, and a plain pinned and pageable host-to-device copy rate:
the peak the restore benchmark compares its achieved bandwidth against. Writes JSON to argv[1].
"""
from __future__ import annotations

import inspect
import json
import resource
import sys
import time

import torch

from kvtier.bench.common import pinned_copy_rate


def varlen_pages() -> dict:
    out: dict = {}
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as e:  # older torch
        return {"available": False, "why": repr(e)}
    params = inspect.signature(varlen_attn).parameters
    out["available"] = True
    out["params"] = list(params)
    if "block_table" not in params:
        return out
    for page in (16, 64, 256):
        try:
            heads, kvh, hd, n = 8, 2, 64, 300
            blocks = -(-n // page)
            q = torch.randn(1, heads, hd, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(blocks + 2, page, kvh, hd, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            cu_q = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
            cu_k = torch.tensor([0, n], device="cuda", dtype=torch.int32)
            bt = torch.arange(blocks, device="cuda", dtype=torch.int32)[None]
            kw = dict(block_table=bt, seqused_k=torch.tensor([n], device="cuda", dtype=torch.int32))
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            varlen_attn(q, k, v, cu_q, cu_k, 1, n, **kw)
            torch.cuda.synchronize()
            out[f"page_{page}"] = "ok"
        except Exception as e:
            out[f"page_{page}"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def main() -> None:
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "cuda_available": torch.cuda.is_available(),
            "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK)}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", memory_gb=p.total_memory / 1e9,
                    bf16=torch.cuda.is_bf16_supported())
        info["h2d_pinned_GBps"] = pinned_copy_rate("cuda") / 1e9
        info["h2d_pageable_GBps"] = pinned_copy_rate("cuda", pinned=False) / 1e9
        info["varlen_attn"] = varlen_pages()
        t = time.perf_counter()
        g = torch.Generator().manual_seed(0)
        torch.randn(256 << 20, generator=g)
        info["cpu_randn_Mps"] = 256 * 1.048576 / (time.perf_counter() - t)
    print(json.dumps(info, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
