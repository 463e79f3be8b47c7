"""A returning context restored with the store's chunks of 64 tokens (the default) against 256,
interleaved per context in one process.

For each of N+1 random contexts (the first a warm-up), per chunk size: an engine saves H tokens to a
disk tier of that size's own and closes; a fresh engine (a restart) drops the files' page cache and
restores them for H + 64 tokens (the two sizes in alternating order); and a memory-only engine
saves and restores the same context. With `--floor`, HF's floor on the same weights (the
history's DynamicCache kept in RAM, then the 64 new tokens) is timed on each context too, between
the sizes' restores, and every median is also given as a share of the floor's. Prints median TTFT
(with quartiles) and the median time spent opening the chunks (`PlannedReads.open`).

    cd scripts && python chunk_size_ab.py [--history 4096] [--dtype bf16] [--contexts 8] [--sizes 64,256] [--floor]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from profile_disk_restore import cold_restore, time_opening  # scripts/ is on the path of a script run from it

from kvtier.bench.hf import HFPeers, build_hf
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--contexts", type=int, default=8)
    ap.add_argument("--sizes", default="64,256", help="chunk sizes in tokens (comma list)")
    ap.add_argument("--floor", action="store_true", help="time HF's floor on each context too")
    ap.add_argument("--json", help="write every sample here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    opened = time_opening()
    model = load_model("smollm2-135m", dtype=args.dtype)
    hf = build_hf(model) if args.floor else None
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, args.history + 64), enable_prefix_cache=False)
    cold: dict[int, list[float]] = {c: [] for c in sizes}
    opening: dict[int, list[float]] = {c: [] for c in sizes}
    memory: dict[int, list[float]] = {c: [] for c in sizes}
    floor: list[float] = []

    def reuse(c: int) -> ReuseConfig:
        return ReuseConfig(chunk_tokens=c, method="kv")

    with tempfile.TemporaryDirectory() as root:
        for i in range(args.contexts + 1):
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(i)).tolist()
            for c in sizes:
                with Engine(model, config, store=f"disk:{root}/{c}:20GB", reuse=reuse(c)) as a:
                    a.generate([ids[: args.history]], once)
                    a.flush()
                with Engine(model, config, store="memory:4GB", reuse=reuse(c)) as m:
                    m.generate([ids[: args.history]], once)
                    m.flush()
                    t = time.perf_counter()
                    m.generate([ids], once)
                    if i:
                        memory[c].append(time.perf_counter() - t)
            order = sizes[:: 1 if i % 2 else -1]
            for j, c in enumerate(order):
                wall = cold_restore(model, config, f"disk:{root}/{c}:20GB", f"{root}/{c}", ids, args.history, once,
                                    f"chunks of {c}", reuse=reuse(c))
                if i:
                    cold[c].append(wall)
                    opening[c].append(opened[-1])
                if hf is not None and j == len(order) // 2 - 1 + len(order) % 2:  # between the sizes
                    peers = HFPeers(hf, ids, args.history, ["hf_floor"], Path(root) / "hf.pt", None, "")
                    t = time.perf_counter()
                    peers.hf_floor()
                    if i:
                        floor.append(time.perf_counter() - t)
                    del peers
    base = statistics.median(floor) if floor else 0.0
    if floor:
        q = statistics.quantiles(floor, n=4)
        print(f"H={args.history} {args.dtype} HF floor: median {base:.3f} s (q25 {q[0]:.3f}, q75 {q[2]:.3f}); n={len(floor)}")
    for c in sizes:
        q = statistics.quantiles(cold[c], n=4)
        cd, mem = statistics.median(cold[c]), statistics.median(memory[c])
        shares = f" [cold disk {cd / base:.2f}x, memory {mem / base:.2f}x the floor]" if base else ""
        print(f"H={args.history} {args.dtype} chunks of {c}: cold disk TTFT median {cd:.3f} s "
              f"(q25 {q[0]:.3f}, q75 {q[2]:.3f}), opening {1e3 * statistics.median(opening[c]):.1f} ms; "
              f"memory {mem:.3f} s; n={len(cold[c])}{shares}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), floor_s=floor, cold_disk_s=cold, memory_s=memory, opening_s=opening), f, indent=1)


if __name__ == "__main__":
    main()
