"""Two ways of running the engine, paired per context in one process beside HF's floor on the same
weights: the harness of the scripts/*_ab.py comparisons of a returning context.

For each of N+1 random contexts (the first a warm-up) and each way, in alternating order, with the
way's patches applied throughout: a memory-only engine saves H tokens and restores them for
H + 64 new tokens; and a fresh engine (a restart) restores them from a disk tier after the page
cache is dropped. HF's floor (the history's DynamicCache kept in RAM, then the 64 new tokens) is
timed on each context too. Prints median TTFT, its share of the floor's, and the median paired
difference (second way - first way).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
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

Way = Callable[[], contextlib.AbstractContextManager]


def arguments(doc: str, extra: Callable[[argparse.ArgumentParser], object] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--contexts", type=int, default=10)
    ap.add_argument("--json", help="write every sample here")
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def run(ways: dict[str, Way], args: argparse.Namespace) -> None:
    names = list(ways)
    h = args.history
    model = load_model("smollm2-135m", dtype=args.dtype)
    hf = build_hf(model)
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, h + 64), enable_prefix_cache=False)
    reuse = ReuseConfig(method="kv")
    samples: dict[str, list[float]] = {f"{tier}, {way}": [] for tier in ("memory", "cold disk") for way in names}
    floor: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.contexts + 1):
            ids = torch.randint(100, 40000, (h + 64,), generator=torch.Generator().manual_seed(i)).tolist()
            for n, way in enumerate(names[:: 1 if i % 2 else -1]):
                disk = f"{root}/{i}-{n}"
                with ways[way]():
                    save_context(model, config, f"disk:{disk}:20GB", ids, h, once)
                    with Engine(model, config, store="memory:4GB", reuse=reuse) as m:
                        m.generate([ids[:h]], once)
                        m.flush()
                        mem = timed_restore(m, ids, once, h, way)
                    with Engine(model, config, store=f"disk:{disk}:20GB", reuse=reuse) as b:
                        drop_page_cache(disk)
                        cold = timed_restore(b, ids, once, h, way)
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
        per = statistics.median(x / f for x, f in zip(xs, floor))
        print(f"  {name:24s} median {statistics.median(xs):.3f} s ({statistics.median(xs) / base:.2f}x the floor; "
              f"per context {per:.2f}x)")
    for tier in ("memory", "cold disk"):
        d = [b - a for a, b in zip(samples[f"{tier}, {names[0]}"], samples[f"{tier}, {names[1]}"])]
        print(f"  {tier}: {names[1]} - {names[0]}, paired median {1e3 * statistics.median(d):+.1f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), floor_s=floor, samples_s=samples), f, indent=1)
