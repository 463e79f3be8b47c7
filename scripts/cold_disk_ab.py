"""A cold disk restore after a restart, today's code against the previous opening and pool mapping,
interleaved per context so the VM's drift (the same command varies 10-30% between runs here) hits
both alike.

For each of N+1 random contexts (the first a warm-up): engine A saves H tokens and closes; then, in
alternating order, one fresh engine per variant drops the chunk files' page cache and restores them
for H + 64 tokens (max_tokens=1). Prints the median TTFT and the median time spent opening the
chunks (`PlannedReads.open`), with quartiles; `--json` writes the samples.

    before  the chunks opened and parsed on the disk tier's four IO threads (they queue for the
            GIL), the CPU pool's pages left to their first touch (the restore's direct reads fault them)
    after   the IO threads open and read the first pages, the caller parses; the pool's first
            max_model_len slots mapped when the engine starts

    python scripts/cold_disk_ab.py [--history 4096] [--dtype bf16] [--contexts 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from profile_disk_restore import time_opening  # scripts/ is on the path of a script run from it

from kvtier.bench.common import drop_page_cache
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.loading import load_model
from kvtier.store.tiers import disk

OPEN_NOW, FAULT_IN = disk.DiskTier.open_chunks, ModelRunner._fault_in


def _open_on_io_threads(self: disk.DiskTier, expects):  # the previous opening, for the baseline
    return disk._in_batches(self._io, lambda i: self.open_chunk(expects[i]), len(expects))


VARIANTS = {"before": (_open_on_io_threads, lambda self, slots: None), "after": (OPEN_NOW, FAULT_IN)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--contexts", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args()
    opened = time_opening()
    model = load_model("smollm2-135m", dtype=args.dtype)
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=8192, enable_prefix_cache=False)
    ttft: dict[str, list[float]] = {v: [] for v in VARIANTS}
    opening: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        spec = f"disk:{d}:20GB"
        for i in range(args.contexts + 1):
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(i)).tolist()
            with Engine(model, config, store=spec) as a:
                a.generate([ids[:args.history]], once)
                a.flush()
            for name in list(VARIANTS)[:: 1 if i % 2 else -1]:
                disk.DiskTier.open_chunks, ModelRunner._fault_in = VARIANTS[name]  # type: ignore[method-assign]
                with Engine(model, config, store=spec) as b:
                    drop_page_cache(d)
                    t = time.perf_counter()
                    out = b.generate([ids], once)[0]
                    wall = time.perf_counter() - t
                if out.prompt_tokens_reused != args.history:
                    raise SystemExit(f"{name}: reused {out.prompt_tokens_reused} of {args.history} tokens")
                if i:  # context 0 is the warm-up
                    ttft[name].append(wall)
                    opening[name].append(opened[-1])
    for name in VARIANTS:
        q = statistics.quantiles(ttft[name], n=4)
        print(f"H={args.history} {args.dtype} {name:6s}: TTFT median {statistics.median(ttft[name]):.3f} s "
              f"(q25 {q[0]:.3f}, q75 {q[2]:.3f}), opening median {1e3 * statistics.median(opening[name]):.1f} ms, "
              f"n={len(ttft[name])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), ttft_s=ttft, opening_s=opening), f, indent=1)


if __name__ == "__main__":
    main()
