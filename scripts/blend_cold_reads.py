"""A process's first blended restores from a cold disk: MuSiQue questions 0, 1 and 0 again, each
blended (LegoLink, the default) after its full prefill, the page cache of the store's files
dropped before each request, as `kvtier bench blend` times its cold-disk rows.

    python scripts/blend_cold_reads.py [--model smollm2-135m] [--dtype bf16] [--order 0,1,0]

Prints, per blend, its TTFT, the bytes its documents read and the minor page faults the process
took meanwhile: memory a read lands in for the first time faults its pages in during the read.
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from kvtier.bench.blend import run as bench
from kvtier.bench.blend.ideal import FlopModel
from kvtier.bench.common import drop_page_cache, machine_info
from kvtier.cli.main import build_parser
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model
from kvtier.planning.blend import BlendOptions


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--order", default="0,1,0", help="questions blended, in this order (default: %(default)s)")
    args = ap.parse_args()
    order = [int(x) for x in args.order.split(",")]
    bench_args = build_parser().parse_args(["bench", "blend", "--model", args.model, "--dtype", args.dtype,
                                            "--n", str(max(order) + 1)])
    loaded = load_model(args.model, dtype=args.dtype, tokenizer=True)
    prompts = bench._prompts(loaded, bench_args, False)
    params = SamplingParams(max_tokens=1, temperature=0.0, first_logits=True)
    ctx = bench.Context(loaded, bench_args, False, FlopModel.of(loaded.module), params)
    m = machine_info()
    print(f"{m['cpu_model']} ({m['cpu_id']}), {m['cpu_count']} CPUs, bf16 flags {m['cpu_bf16_flags']}; {args.dtype}")
    root = Path(tempfile.mkdtemp(prefix="kvtier-cold-"))
    with bench._engine(ctx, f"disk:{root}/store:{bench_args.disk_size}") as engine:
        bench._warm_up(engine, prompts[0])
        for i in sorted(set(order)):
            engine.precompile(list(prompts[i].documents))
        engine.flush(600)
        for i in order:
            p = prompts[i]
            drop_page_cache(root)
            t = time.perf_counter()
            bench._serve(engine, p.ids, p.spans, params, blend=False, cache_prompt=False)
            full = time.perf_counter() - t
            drop_page_cache(root)
            before = _faults()
            out = bench._blended(engine, p.ids, params, p.spans, BlendOptions())
            faults = _faults() - before
            read = out.restore.bytes_read if out.restore else 0
            print(f"question {i}: full prefill {full:.1f} s; blended TTFT {out.ttft or 0:.3f} s, "
                  f"{read / 1e6:.0f} MB read, {faults} minor page faults", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
