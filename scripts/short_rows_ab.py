"""Decode throughput with a linear's short calls unpadded (the row plans' candidates now) against
padded to 8 rows (before), paired in one process.

Two engines on two copies of SmolLM2, each with its row plans checked afresh under a KVTIER_HOME of
its own (a plan found in the file would otherwise be taken by both), built in `--order` (the engine
built first can run faster here, so run both orders). Per run and batch size, each engine times a
1-token and a 33-token generate of the same 1024-token prompts (fresh contexts per run, prefix
cache off); decode tok/s = 32 x batch / the difference. Prints medians and the median of the
per-run ratios.

    cd scripts && python short_rows_ab.py [--order unpadded,padded] [--runs 6] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from kvtier import paths
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models import invariant
from kvtier.models.loading import load_model

PADDED = tuple(p for p in invariant.CANDIDATES if p.min_rows > 1)  # the candidates before unpadded calls


def build(candidates: tuple[invariant.RowPlan, ...], home: str) -> Engine:
    os.environ["KVTIER_HOME"] = home
    invariant.CANDIDATES, invariant._plans = candidates, {}
    engine = Engine(load_model("smollm2-135m", dtype="fp32"),
                    EngineConfig(kv_cache_bytes=1 << 30, max_model_len=4096, enable_prefix_cache=False))
    engine.generate([[5] * 64], SamplingParams(max_tokens=2, temperature=0.0))  # packs and plans, now
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", default="unpadded,padded")
    ap.add_argument("--runs", type=int, default=6, help="timed runs after one warm-up")
    ap.add_argument("--batch", default="1,4")
    ap.add_argument("--json")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    unpadded = invariant.CANDIDATES
    models_home = str(paths.home())  # the converted weights are linked from here
    engines: dict[str, Engine] = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.order.split(","):
            home = os.path.join(d, name)
            if os.path.isdir(os.path.join(models_home, "models")):
                os.makedirs(home)
                os.symlink(os.path.join(models_home, "models"), os.path.join(home, "models"))
            engines[name] = build(unpadded if name == "unpadded" else PADDED, home)
        invariant.CANDIDATES = unpadded
        freeze_startup_heap()
        rates: dict[str, dict[int, list[float]]] = {k: {b: [] for b in batches} for k in engines}
        for r in range(args.runs + 1):
            for b in batches:
                g = torch.Generator().manual_seed(r)
                prompts = [torch.randint(100, 40000, (1024,), generator=g).tolist() for _ in range(b)]
                for name in (list(engines) if r % 2 else list(engines)[::-1]):
                    e = engines[name]
                    t = time.perf_counter()
                    e.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
                    one = time.perf_counter() - t
                    t = time.perf_counter()
                    e.generate(prompts, SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True))
                    if r:
                        rates[name][b].append(32 * b / (time.perf_counter() - t - one))
        for e in engines.values():
            e.close()
    for b in batches:
        u, p = rates["unpadded"][b], rates["padded"][b]
        ratio = statistics.median([x / y for x, y in zip(u, p)])
        print(f"decode batch {b} x 1024 fp32: unpadded {statistics.median(u):.1f} tok/s, padded "
              f"{statistics.median(p):.1f} tok/s, paired ratio {ratio:.2f} (n={len(u)}, built {args.order})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), tok_s=rates), f, indent=1)


if __name__ == "__main__":
    main()
