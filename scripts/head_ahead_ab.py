"""Does reading each chunk's first layer with its header start a cold restore's compute sooner?
Paired, in one process: each saved context is restored cold (a fresh engine, the page cache
dropped) once with the shipped opening (`disk.head_bytes`: the header and the first layer in one
request) and once reading the header alone (the first layer then read on its own, as before),
alternating which goes first. Prints, per variant, the median TTFT, when the compute starts (its
first wait for a layer group ends: `restore_timeline.py`'s events) and the opening, then the median
of the per-pair differences.

    cd scripts && python head_ahead_ab.py [--history 4096] [--contexts 3] [--rounds 4] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import restore_timeline as rt  # scripts/ is on the path of a script run from it
import torch
from profile_disk_restore import cold_restore, save_context

import kvtier.store.tiers.disk as disk
from kvtier.engine.config import EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model

Sample = tuple[float, float, float]  # (TTFT, compute start, opening) in seconds


def restore(model, config: EngineConfig, spec: str, d: str, ids: list[int], history: int,
            once: SamplingParams) -> Sample:
    rt.EVENTS.clear()
    wall = cold_restore(model, config, spec, d, ids, history, once, "head_ahead_ab")
    t0 = next(e[2] for e in rt.EVENTS if e[0] == "generate")
    first_wait = min((e for e in rt.EVENTS if e[0] == "wait"), key=lambda e: e[2])
    opened = next(e for e in rt.EVENTS if e[0] == "open")
    return wall, first_wait[3] - t0, opened[3] - opened[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--contexts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4, help="pairs per context (default: %(default)s)")
    ap.add_argument("--dtype", default="fp32")
    args = ap.parse_args()
    model = load_model("smollm2-135m", dtype=args.dtype)
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, args.history + 64), enable_prefix_cache=False)
    rt.instrument()
    shipped = disk.head_bytes
    variants = {"shipped": shipped, "head-only": lambda expect: disk.HEAD_BYTES}
    got: dict[str, list[Sample]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as d:
        spec = f"disk:{d}:20GB"
        for c in range(args.contexts):
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(c)).tolist()
            save_context(model, config, spec, ids, args.history, once)
            for r in range(args.rounds):
                for name in list(variants)[::1 if (c + r) % 2 else -1]:
                    disk.head_bytes = variants[name]  # type: ignore[assignment]
                    got[name].append(restore(model, config, spec, d, ids, args.history, once))
    disk.head_bytes = shipped  # type: ignore[assignment]
    for name, xs in got.items():
        print(f"H={args.history} {args.dtype} {name:9s}: TTFT median {1e3 * statistics.median(x[0] for x in xs):.0f} ms; "
              f"compute starts at {1e3 * statistics.median(x[1] for x in xs):.1f} ms; "
              f"opening {1e3 * statistics.median(x[2] for x in xs):.1f} ms")
    pairs = list(zip(got["shipped"], got["head-only"]))
    print(f"paired, head-only minus shipped: compute start {1e3 * statistics.median(b[1] - a[1] for a, b in pairs):+.1f} ms, "
          f"TTFT {1e3 * statistics.median(b[0] - a[0] for a, b in pairs):+.1f} ms (n={len(pairs)})")


if __name__ == "__main__":
    main()
