"""Where a blended restore's time goes: one MuSiQue question's prompt (ten passages, about 6K tokens)
blended from the memory store, its restore work profiled op by op (torch.profiler).

    python scripts/profile_blend.py --dtype fp32 --mode legolink --out out/profile_blend.txt
    python scripts/profile_blend.py --device cuda --model llama3-8b --dtype bf16   (random ids, 10 x 600 tokens)

The restore runs in its request's step or on the engine's restore worker (a blend too large to run
in a step, CacheBlend's), in either case inside `BlendRestore._work`, where the script starts a
profiler for the profiled request only. Prints the TTFTs of the unprofiled blends first (median of
--repeats) with the wall time of their phases (medians: the restore's work, placing the loaded
rows, the scattered rows' attention, the runner's steps; "@restore": on the restore worker), then
the op table and the same grouped by input shape. The profiler's times are its own: under it, some
ops run several times slower than in the unprofiled blends (the softmax of a layer's first
scattered piece, for one), so the phases are the times to go by. On a GPU the phases are host time
(launches, and the waits for the device where the code waits), and a second table sorts the ops by
their device time.
A model without a tokenizer (a random-weight preset) runs random ids laid out as the questions
are (`kvtier bench blend --synthetic`'s), as does --synthetic.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


def _timed(owner: Any, name: str, into: dict[str, float], tag: str) -> Callable[[], None]:
    """Wrap owner.name to add its wall time to into[tag] (suffixed "@restore" off the main thread);
    returns the undo."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            where = "" if threading.current_thread() is threading.main_thread() else "@restore"
            into[tag + where] += time.perf_counter() - t

    setattr(owner, name, timed)
    return lambda: setattr(owner, name, f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="model preset, name or path (default: %(default)s)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    ap.add_argument("--synthetic", action="store_true", help="random ids (the default for a model without a tokenizer)")
    ap.add_argument("--passage-tokens", type=int, default=600,
                    help="random ids: tokens per passage (default: %(default)s)")
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
    from kvtier.engine.runner.model_runner import ModelRunner
    from kvtier.models.attention import ScatteredRows
    from kvtier.models.loading import load_model
    from kvtier.planning.blend import BlendOptions

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    if args.synthetic or loaded.tokenizer is None:
        p = blend_data.synthetic_prompt(loaded.config.vocab_size, args.question, 0, args.passage_tokens)
    else:
        q = blend_data.load_questions(blend_data.data_path(args.data), args.question, 1)[0]
        p = blend_data.text_prompt(lambda s: prompts.encode(loaded, s), loaded.tokenizer, q, args.question, 0)
    gpu = loaded.module.lm_head.weight.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if gpu else [])
    options = BlendOptions(mode=args.mode)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    report: list[str] = []
    with Engine(loaded, store="memory:4GB", reuse=ReuseConfig(blend=BlendOptions())) as engine:
        _serve(engine, p.ids[:64], (), SamplingParams(max_tokens=2, temperature=0.0), blend=False, cache_prompt=False)
        engine.precompile(list(p.documents))
        engine.flush(600)
        phases: list[dict[str, float]] = []
        ttfts = []
        for i in range(args.repeats + 1):
            into: dict[str, float] = collections.defaultdict(float)
            undo = [_timed(blend.BlendRestore, "_work", into, "restore work"),
                    _timed(blend.BlendRestore, "_place", into, "placing loaded rows"),
                    _timed(ScatteredRows, "attend", into, "scattered attention"),
                    _timed(ModelRunner, "execute", into, "runner steps")]
            try:
                out = _serve(engine, p.ids, p.spans, one, blend=options)
            finally:
                for u in undo:
                    u()
            engine.reset_prefix_cache()  # each blend from nothing on the device, as the benchmark's rows
            if i:  # the first blend reads the documents from the store for the first time: not timed
                ttfts.append(out.ttft or 0.0)
                phases.append(into)
        report.append(f"{args.model} on {args.device}, {len(p.ids)} prompt tokens, {args.mode}, {args.dtype}: TTFT median {statistics.median(ttfts):.3f} s "
                      f"over {len(ttfts)} ({' '.join(f'{t:.3f}' for t in ttfts)})")
        report.append("phases, unprofiled (median s; @restore: on the restore worker, else the step thread):")
        for tag in sorted({t for ph in phases for t in ph}):
            report.append(f"  {tag:32s} {statistics.median(ph.get(tag, 0.0) for ph in phases):.3f}")
        work = blend.BlendRestore._work

        def profiled(self: Any) -> None:
            with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
                t = time.perf_counter()
                work(self)
                report.append(f"restore work (profiled): {time.perf_counter() - t:.3f} s, "
                              f"{self.blended.recomputed} tokens recomputed, {self.blended.loaded} loaded")
            ops = prof.key_averages()
            report.append(ops.table(sort_by="self_cpu_time_total", row_limit=25))
            if gpu:
                report.append(ops.table(sort_by="self_cuda_time_total", row_limit=20))
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
