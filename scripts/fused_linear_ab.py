"""Linears that read one input as one call (`invariant.Fused`: q/k/v, gate/up) against one call per
linear, interleaved in one process on SmolLM2-135M's weights.

    kernel   the packed oneDNN calls alone at 1, 64 and 512 rows: q+k+v (three calls) against qkv
             (one), gate+up against gate_up.
    engine   a returning context of H history tokens restored from the memory tier plus 64 new
             tokens (TTFT, with HF continuing its DynamicCache in RAM in the same loop: the e2e
             floor), and a 32-token greedy decode over a 200-token prompt, each request run once
             per variant with the variant switched in place (`Fused.tail`). Both variants must
             produce the same tokens.

    python scripts/fused_linear_ab.py [--dtype bf16] [--history 1024] [--rounds 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvtier.models import invariant

FUSED = invariant.Fused.tail


def separate(self: invariant.Fused, x: torch.Tensor, first: int) -> list[torch.Tensor]:
    return [p(x) for p in self.parts[first:]]


def kernel(dtype: torch.dtype, reps: int = 30) -> list[dict]:
    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, 8)

    def lin(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [None], "")

    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(o, 576, generator=g).to(dtype) for n, o in (("q", 576), ("k", 192), ("v", 192), ("gate", 1536), ("up", 1536))}
    p = {n: pack(t) for n, t in w.items()}
    p["qkv"] = pack(torch.cat([w["q"], w["k"], w["v"]]))
    p["gate_up"] = pack(torch.cat([w["gate"], w["up"]]))
    rows = []
    for m in (1, 64, 512):
        x = torch.randn(m, 576, generator=g).to(dtype)
        cases = {"q+k+v": ("q", "k", "v"), "qkv": ("qkv",), "gate+up": ("gate", "up"), "gate_up": ("gate_up",)}
        ts: dict[str, list[float]] = {c: [] for c in cases}
        for _ in range(reps):
            for c, names in cases.items():
                t = time.perf_counter()
                for _ in range(20):
                    for n in names:
                        lin(x, p[n])
                ts[c].append((time.perf_counter() - t) / 20 * 1e6)
        rows.append({"rows": m, **{c: statistics.median(v[4:]) for c, v in ts.items()}})
    return rows


def engine(dtype: str, hist: int, rounds: int) -> dict:
    from kvtier.bench.hf import HFPeers, build_hf
    from kvtier.engine.config import EngineConfig, ReuseConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import SamplingParams
    from kvtier.models.loading import load_model

    loaded = load_model("smollm2-135m", dtype=dtype, tokenizer=False)
    hf = build_hf(loaded)
    rng = random.Random(0)
    ctxs = [[rng.randrange(100, 40000) for _ in range(hist + 64)] for _ in range(10)]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    dec = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    cfg = EngineConfig(kv_cache_bytes=2 << 30, enable_prefix_cache=False, max_model_len=hist + 128)
    ts: dict[str, list[float]] = {k: [] for k in ("hf_floor", "separate", "fused", "decode_separate", "decode_fused")}
    tokens: dict[tuple, set] = {}
    with Engine(loaded, cfg, store="memory:8GB", reuse=ReuseConfig(method="kv")) as eng:
        for c in ctxs:
            eng.generate([c[:hist]], one)
        eng.flush()
        hfp = [HFPeers(hf, c, hist, ["hf_floor"], None, None, "") for c in ctxs]  # type: ignore[arg-type]
        try:
            for r in range(rounds):
                for i, c in enumerate(ctxs):
                    t = time.perf_counter()
                    hfp[i].hf_floor()
                    ts["hf_floor"].append(time.perf_counter() - t)
                    for name, tail in (("separate", separate), ("fused", FUSED)):
                        invariant.Fused.tail = tail  # type: ignore[method-assign]
                        t = time.perf_counter()
                        out = eng.generate([c], one)[0].output_ids
                        ts[name].append(time.perf_counter() - t)
                        tokens.setdefault((i, 1), set()).add(tuple(out))
                for name, tail in (("decode_separate", separate), ("decode_fused", FUSED)):
                    invariant.Fused.tail = tail  # type: ignore[method-assign]
                    t = time.perf_counter()
                    out = eng.generate([ctxs[r][:200]], dec)[0].output_ids
                    ts[name].append(32 / (time.perf_counter() - t))
                    tokens.setdefault((r, 32), set()).add(tuple(out))
        finally:
            invariant.Fused.tail = FUSED  # type: ignore[method-assign]
    skip = len(ctxs)  # the first round warms up
    med = {k: statistics.median(v[skip:] if len(v) > skip else v) for k, v in ts.items()}
    return {"dtype": dtype, "history": hist, "ttft_s": {k: med[k] for k in ("hf_floor", "separate", "fused")},
            "decode_tok_s": {k.removeprefix("decode_"): med[k] for k in ("decode_separate", "decode_fused")},
            "same_tokens": all(len(v) == 1 for v in tokens.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16,fp32", help="comma list (default: %(default)s)")
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=4, help="rounds over 10 contexts, the first a warm-up")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from kvtier.dtypes import torch_dtype

    out = []
    for dtype in args.dtype.split(","):
        k = kernel(torch_dtype(dtype))
        print(f"{dtype} kernel calls (us): " + "; ".join(
            f"{r['rows']} rows: q+k+v {r['q+k+v']:.0f} qkv {r['qkv']:.0f}, gate+up {r['gate+up']:.0f} gate_up {r['gate_up']:.0f}"
            for r in k))
        e = engine(dtype, args.history, args.rounds)
        t, d = e["ttft_s"], e["decode_tok_s"]
        print(f"{dtype} H={args.history}+64 from memory: TTFT separate {t['separate'] * 1e3:.1f} ms, fused {t['fused'] * 1e3:.1f} "
              f"ms, HF floor {t['hf_floor'] * 1e3:.1f} ms (fused/floor {t['fused'] / t['hf_floor']:.2f}, separate/floor "
              f"{t['separate'] / t['hf_floor']:.2f}); decode batch 1: separate {d['separate']:.1f} tok/s, fused "
              f"{d['fused']:.1f} tok/s; same tokens: {e['same_tokens']}")
        out.append({"kernel_us": k, **e})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
