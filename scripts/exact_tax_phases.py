"""Where exactness costs time in a prefill: the exact engine and the `--fast-inexact` one, in one
process, on the same prompt, in alternating rounds (a VM's drift falls on both), each step's wall
time split by a layer's phases: q/k/v (`DecoderLayer.qkv`: norm, the fused q/k/v linear), RoPE
(`rotate`), attention (`attend`: the pool writes, the context's reads and the kernel) and the rest
(`finish`: o_proj, the residuals, the norm and the MLP), summed over the layers.

    python scripts/exact_tax_phases.py [--model smollm2-135m] [--dtype bf16] [--tokens 2048] [--rounds 5] [--json F]

Prints each mode's median per phase and the exact / inexact ratios; --json keeps every round.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvtier.bench.common import machine_info
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.runner.model_runner import StepAttention
from kvtier.models import llama
from kvtier.models.loading import load_model

_spent: dict[str, float] = collections.defaultdict(float)


def _timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            _spent[name] += time.perf_counter() - t
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens, prefilled in one step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layer = llama.DecoderLayer
    layer.qkv = _timed("qkv", layer.qkv)  # type: ignore[method-assign]
    layer.finish = _timed("finish", layer.finish)  # type: ignore[method-assign]
    StepAttention.rotate = _timed("rotate", StepAttention.rotate)  # type: ignore[method-assign]
    StepAttention.attend = _timed("attend", StepAttention.attend)  # type: ignore[method-assign]
    ids = torch.randint(3, 40000, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engines = {mode: Engine(load_model(args.model, dtype=args.dtype, tokenizer=False),
                            EngineConfig(kv_cache_bytes=256 << 20, max_model_len=max(4096, args.tokens + 16),
                                         max_batched_tokens=args.tokens, exact=mode == "exact",
                                         enable_prefix_cache=False))
               for mode in ("exact", "inexact")}
    rounds: dict[str, dict[str, list[float]]] = {mode: collections.defaultdict(list) for mode in engines}
    try:
        for e in engines.values():
            for _ in range(2):  # warm-up: first-use checks, buffers
                e.generate([ids], params)
        for r in range(args.rounds):
            for mode in (("exact", "inexact") if r % 2 == 0 else ("inexact", "exact")):
                _spent.clear()
                t = time.perf_counter()
                engines[mode].generate([ids], params)
                rounds[mode]["wall"].append(time.perf_counter() - t)
                for name, s in _spent.items():
                    rounds[mode][name].append(s)
    finally:
        for e in engines.values():
            e.close()
    med = {mode: {k: statistics.median(v) for k, v in d.items()} for mode, d in rounds.items()}
    print(f"{args.model} {args.dtype}, a {args.tokens}-token prefill in one step, {args.rounds} rounds, "
          f"{torch.get_num_threads()} threads: median ms")
    print(f"{'phase':8s} {'exact':>8s} {'inexact':>8s} {'exact / inexact':>16s}")
    for k in ("wall", "qkv", "rotate", "attend", "finish"):
        a, b = med["exact"].get(k, float("nan")), med["inexact"].get(k, float("nan"))
        print(f"{k:8s} {a * 1e3:8.1f} {b * 1e3:8.1f} {a / b:15.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "args": vars(args), "rounds": rounds, "median_s": med}, f, indent=1)


if __name__ == "__main__":
    main()
