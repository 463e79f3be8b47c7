"""A returning context's context read in place (the pool slots past it zeroed, `ModelRunner.clearable`)
against copied into a padded buffer every layer (the code before), paired per context in one process,
beside HF's floor on the same weights.

For each of N+1 random contexts (the first a warm-up) and each way, in alternating order: a
memory-only engine saves H tokens and restores them for H + 64 new tokens; and a fresh engine (a
restart) restores them from a disk tier after the page cache is dropped. HF's floor (the history's
DynamicCache kept in RAM, then the 64 new tokens) is timed on each context too. Prints median TTFT,
its share of the floor's, and the median paired difference (copy - in place).

    cd scripts && python context_in_place_ab.py [--history 4096] [--dtype fp32] [--contexts 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from profile_disk_restore import save_context, timed_restore  # scripts/ is on the path of a script run from it

from kvtier.bench.common import drop_page_cache
from kvtier.bench.hf import HFPeers, build_hf
from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model

WAYS = ("in place", "copied")


def timed(engine: Engine, way: str, ids: list[int], once: SamplingParams, history: int) -> float:
    if way == "copied":
        engine.runner.clearable = None  # every context ending inside a key block goes through the padded copy
    return timed_restore(engine, ids, once, history, way)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--contexts", type=int, default=10)
    ap.add_argument("--json", help="write every sample here")
    args = ap.parse_args()
    h = args.history
    model = load_model("smollm2-135m", dtype=args.dtype)
    hf = build_hf(model)
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, h + 64), enable_prefix_cache=False)
    reuse = ReuseConfig(method="kv")
    samples: dict[str, list[float]] = {f"{tier}, {way}": [] for tier in ("memory", "cold disk") for way in WAYS}
    floor: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.contexts + 1):
            ids = torch.randint(100, 40000, (h + 64,), generator=torch.Generator().manual_seed(i)).tolist()
            for way in WAYS[:: 1 if i % 2 else -1]:
                disk = f"{root}/{i}-{way.replace(' ', '')}"
                save_context(model, config, f"disk:{disk}:20GB", ids, h, once)
                with Engine(model, config, store="memory:4GB", reuse=reuse) as m:
                    m.generate([ids[:h]], once)
                    m.flush()
                    mem = timed(m, way, ids, once, h)
                with Engine(model, config, store=f"disk:{disk}:20GB", reuse=reuse) as b:
                    drop_page_cache(disk)
                    cold = timed(b, way, ids, once, h)
                if i:
                    samples[f"memory, {way}"].append(mem)
                    samples[f"cold disk, {way}"].append(cold)
            peers = HFPeers(hf, ids, h, ["hf_floor"], Path(root) / "hf.pt", None, "")
            t = time.perf_counter()
            peers.hf_floor()
            if i:
                floor.append(time.perf_counter() - t)
            del peers
    base = statistics.median(floor)
    print(f"H={h} {args.dtype}, {args.contexts} contexts; HF floor median {base:.3f} s")
    for name, xs in samples.items():
        print(f"  {name:20s} median {statistics.median(xs):.3f} s ({statistics.median(xs) / base:.2f}x the floor)")
    for tier in ("memory", "cold disk"):
        d = [a - b for a, b in zip(samples[f"{tier}, copied"], samples[f"{tier}, in place"])]
        print(f"  {tier}: copied - in place, paired median {1e3 * statistics.median(d):+.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), floor_s=floor, samples_s=samples), f, indent=1)


if __name__ == "__main__":
    main()
