"""Decode step time of a batch of long contexts, for an A/B across two checkouts.

B prompts of H + 7r tokens (r = 0..B-1: no two contexts of one length) are prefilled once in one
engine; then, per repeat, a 1-token and a (N + 1)-token generate of the same prompts (a prefix-cache
hit on each prompt's full blocks), so a decode step = (their difference) / N. Prints one JSON
line per H with every repeat's step time and their median, and how the decodes read their contexts
(whole key blocks in place, gathered, or none: `ModelRunner._key_reads`); `--profile` adds the
top operations of one more generate.

An A/B runs it from two checkouts in turn, in the same virtual environment:

    git worktree add /tmp/before <commit>
    for i in 1 2; do for d in /tmp/before $PWD; do PYTHONPATH=$d python scripts/decode_batch_steps.py --batch 8 --history 1024,4096; done; done

or within one checkout, against a setting: `--in-place-keys K` (contexts past K keys read in place;
the engine's is `model_runner.IN_PLACE_KEYS`), `--no-headroom` (new runs start right after the run
before them, as before `BlockPool(headroom=)`). With `--history 4560 --new 64` every decode crosses
the key block at 4608.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch

from kvtier.engine import engine as engine_module
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner import model_runner
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--history", default="1024,4096", help="comma list of H")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=16, help="decode steps timed per repeat")
    ap.add_argument("--in-place-keys", type=int, help="read contexts past this many keys in place (default: the engine's)")
    ap.add_argument("--no-headroom", action="store_true", help="new runs leave no key block of headroom to the run before")
    ap.add_argument("--json", help="append the rows to this file (one JSON object per line)")
    ap.add_argument("--profile", action="store_true", help="then one more 17-token generate under torch.profiler: its top ops")
    args = ap.parse_args()
    if args.in_place_keys is not None:
        model_runner.IN_PLACE_KEYS = args.in_place_keys
    if args.no_headroom:
        engine_module.KEY_BLOCK = 0  # what the engine passes as BlockPool(headroom=)
    model = load_model("smollm2-135m", dtype="fp32")
    freeze_startup_heap()
    reads: Counter = Counter()
    spy = getattr(model_runner.ModelRunner, "_key_reads", None)  # absent before the in-place reads
    if spy is not None:
        def counted(self, tables, ctx_len):
            keys = spy(self, tables, ctx_len)
            reads["in place"] += sum(p is not None for p in keys.in_place)
            reads["gathered"] += sum(g is not None for g in keys.gathered_rows)
            return keys
        model_runner.ModelRunner._key_reads = counted  # type: ignore[method-assign]
    for h in (int(x) for x in args.history.split(",")):
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(100, 40000, (h + 7 * r,), generator=gen).tolist() for r in range(args.batch)]
        reads.clear()
        steps = []
        with Engine(model, EngineConfig(kv_cache_bytes=6 << 30, max_model_len=16384)) as engine:
            one = SamplingParams(max_tokens=1, temperature=0.0)
            engine.generate(prompts, one)
            for _ in range(args.repeats):
                t = time.perf_counter()
                engine.generate(prompts, one)
                t1 = time.perf_counter() - t
                t = time.perf_counter()
                engine.generate(prompts, SamplingParams(max_tokens=args.new + 1, temperature=0.0, ignore_eos=True))
                steps.append((time.perf_counter() - t - t1) / args.new * 1e3)
            if args.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    engine.generate(prompts, SamplingParams(max_tokens=17, temperature=0.0, ignore_eos=True))
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
        row = {"batch": args.batch, "history": h, "new": args.new, "in_place_keys": model_runner.IN_PLACE_KEYS,
               "headroom": not args.no_headroom, "step_ms": steps, "median_ms": statistics.median(steps),
               "reads": dict(reads) if reads else "every context gathered whole"}
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
