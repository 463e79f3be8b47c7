"""Blended requests that share their head (the system prompt): MuSiQue questions 1..n-1 blended one
after another from the memory store, with the device prefix cache kept (a head that an earlier
blend computed is served from the device) or reset before each request (the head recomputed),
rounds alternating.

    python scripts/blend_shared_head.py [--head-tokens 200] [--n 5] [--rounds 3] [--json F]

`--head-tokens` lengthens every prompt's head by the same text (a longer system prompt). Prints
and writes (JSON) the TTFT medians and ranges with the device tokens and the rows recomputed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from kvtier.bench.blend import run as bench
from kvtier.bench.blend.ideal import FlopModel
from kvtier.bench.common import machine_info
from kvtier.cli.main import build_parser
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model
from kvtier.planning.blend import BlendOptions

SYSTEM = " You answer questions from the passages given, citing them."


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--head-tokens", type=int, default=0, help="tokens added to every prompt's head (default: 0)")
    ap.add_argument("--n", type=int, default=5, help="questions: the first computes the head (default: 5)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each mode (default: 3)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    bench_args = build_parser().parse_args(["bench", "blend", "--model", args.model, "--dtype", args.dtype,
                                            "--n", str(args.n)])
    loaded = load_model(args.model, dtype=args.dtype, tokenizer=True)
    prompts = bench._prompts(loaded, bench_args, False)
    if args.head_tokens:
        assert loaded.tokenizer is not None  # _prompts needs it too
        head = tuple(loaded.tokenizer.encode(SYSTEM * (args.head_tokens // 8 + 1),
                                             add_special_tokens=False)[: args.head_tokens])
        prompts = [dataclasses.replace(p, ids=p.ids[:1] + head + p.ids[1:],
                                       spans=tuple((a + len(head), b + len(head)) for a, b in p.spans))
                   for p in prompts]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ctx = bench.Context(loaded, bench_args, False, FlopModel.of(loaded.module), params)
    runs: dict[str, list[dict]] = {"kept": [], "reset": []}
    options = BlendOptions()
    with bench._engine(ctx, "memory:4GB") as engine:
        bench._warm_up(engine, prompts[0])
        for p in prompts:
            engine.precompile(list(p.documents))
        engine.flush(600)
        for r in range(args.rounds):
            for mode in ("kept", "reset") if r % 2 == 0 else ("reset", "kept"):
                engine.reset_prefix_cache()
                bench._serve(engine, prompts[0].ids, prompts[0].spans, params, blend=options)  # the head, once
                for p in prompts[1:]:
                    if mode == "reset":
                        engine.reset_prefix_cache()
                    out = bench._serve(engine, p.ids, p.spans, params, blend=options)
                    engine.flush(600)
                    engine.store.discard(engine.store.keys_for(p.ids))  # no exact chunk kept either
                    assert out.restore is not None
                    runs[mode].append(dict(question=p.index, ttft_s=out.ttft, device_tokens=out.reused_by_tier.get("device", 0),
                                           recomputed=out.restore.recomputed_tokens))
    result = dict(machine=machine_info(), model=args.model, dtype=args.dtype, head_tokens=args.head_tokens,
                  tokens_before_first_passage=prompts[0].spans[0][0], runs=runs)
    for mode, xs in runs.items():
        t = sorted(x["ttft_s"] for x in xs)
        summary = dict(ttft_median_s=statistics.median(t), ttft_min_s=t[0], ttft_max_s=t[-1], requests=len(t),
                       device_tokens=sorted({x["device_tokens"] for x in xs}),
                       recomputed=sorted({x["recomputed"] for x in xs}))
        result[mode] = summary
        print(f"{mode}: TTFT median {summary['ttft_median_s']:.3f} s ({t[0]:.3f}-{t[-1]:.3f}) over {len(t)}; "
              f"device tokens {summary['device_tokens']}; recomputed {summary['recomputed']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
