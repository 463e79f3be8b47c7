"""Where a blended restore's time goes: one MuSiQue question's prompt (ten passages, about 6K tokens)
blended from the memory store, its restore work profiled op by op (torch.profiler).

    python scripts/profile_blend.py --dtype fp32 --mode legolink --out out/profile_blend.txt

The restore runs on the engine's restore worker, where a profiler must be started: the script wraps
`BlendRestore._work` for the profiled request only. Prints the untimed-profile TTFTs first (median of
--repeats), then the op table and the same grouped by input shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="fp32", help="compute dtype (default: %(default)s)")
    ap.add_argument("--mode", default="legolink", choices=["legolink", "cacheblend", "naive"],
                    help="the blend (the engine's defaults for it) (default: %(default)s)")
    ap.add_argument("--data", default=None, help="the MuSiQue file (default: as `kvtier bench blend`)")
    ap.add_argument("--question", type=int, default=0, help="question index (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=4, help="timed blends before the profiled one (default: %(default)s)")
    ap.add_argument("--out", default="out/profile_blend.txt", help="the report (default: %(default)s)")
    args = ap.parse_args()
    import torch

    from kvtier.bench.blend import data as blend_data
    from kvtier.bench.blend.run import _serve
    from kvtier.engine import prompts
    from kvtier.engine.config import ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import SamplingParams
    from kvtier.engine.restore import blend
    from kvtier.models.loading import load_model
    from kvtier.planning.blend import BlendOptions

    loaded = load_model("smollm2-135m", dtype=args.dtype)
    q = blend_data.load_questions(blend_data.data_path(args.data), args.question, 1)[0]
    p = blend_data.text_prompt(lambda s: prompts.encode(loaded, s), loaded.tokenizer, q, args.question, 0)
    options = BlendOptions(mode=args.mode)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    report: list[str] = []
    with Engine(loaded, store="memory:4GB", reuse=ReuseConfig(blend=BlendOptions())) as engine:
        _serve(engine, p.ids[:64], (), SamplingParams(max_tokens=2, temperature=0.0), blend=False, cache_prompt=False)
        engine.precompile(list(p.documents))
        engine.flush(600)
        ttfts = [_serve(engine, p.ids, p.spans, one, blend=options).ttft or 0.0 for _ in range(args.repeats + 1)][1:]
        report.append(f"{len(p.ids)} prompt tokens, {args.mode}, {args.dtype}: TTFT median {statistics.median(ttfts):.3f} s "
                      f"over {len(ttfts)} ({' '.join(f'{t:.3f}' for t in ttfts)})")
        work = blend.BlendRestore._work

        def profiled(self: Any) -> None:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                t = time.perf_counter()
                work(self)
                report.append(f"restore work (profiled): {time.perf_counter() - t:.3f} s, "
                              f"{self.blended.recomputed} tokens recomputed, {self.blended.loaded} loaded")
            ops = prof.key_averages()
            report.append(ops.table(sort_by="self_cpu_time_total", row_limit=25))
            report.append(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total",
                                                                              row_limit=20))

        blend.BlendRestore._work = profiled  # type: ignore[method-assign]
        try:
            _serve(engine, p.ids, p.spans, one, blend=options)
        finally:
            blend.BlendRestore._work = work  # type: ignore[method-assign]
    text = "\n".join(report)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
