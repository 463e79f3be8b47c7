"""Exact bf16 attention, the GEMM kernel (`kvtier/models/exact_matmul.py`) against the fused flash
kernel (`kvtier/models/exact_attention.py`), through the entry points the engine calls, with
SmolLM2-135M's heads (9 query, 3 K/V, head_dim 64) on random inputs: 64 new tokens after a
history (what `bench e2e` times per layer), a 2,048-token prefill chunk, one decoding token, and
batches of 32 decodes (contexts read in place from a pool, or gathered and padded). Milliseconds
per call (one layer), the median of `--repeats`, the two kernels alternating `--rounds` times;
the ratio is GEMM / flash per round. Prints a table and writes JSON.

    cd scripts && python bf16_attention_ab.py [--rounds 3] [--repeats 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from kvtier.bench.common import machine_info
from kvtier.bench.stats import median_of
from kvtier.models import exact_attention as X
from kvtier.models import exact_matmul

HEADS, KV_HEADS, HD = 9, 3, 64
DT = torch.bfloat16


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


def causal_case(hist: int, new: int) -> Callable[[], object]:
    ctx = hist + new
    k, v = _randn(X.key_rows(ctx) + 512, KV_HEADS, HD), _randn(X.key_rows(ctx) + 512, KV_HEADS, HD)  # a pool's room
    q = _randn(new, HEADS, HD)
    return lambda: X.causal(q, k[:ctx], v[:ctx], hist)


def in_place_case(lengths: list[int]) -> Callable[[], object]:
    """Each token's whole key blocks as views of its own run of one pool (the contexts back to
    back), its piece gathered: the runner's long-context decode."""
    span = max(lengths) + 512
    k, v = _randn(len(lengths) * span, KV_HEADS, HD), _randn(len(lengths) * span, KV_HEADS, HD)
    splits = [X.split(n) for n in lengths]
    reach = max(keys for _, keys in splits)
    pieces = (_randn(len(lengths), reach, KV_HEADS, HD), _randn(len(lengths), reach, KV_HEADS, HD))
    wholes = [(k[r * span : r * span + base], v[r * span : r * span + base]) if base else None
              for r, (base, _) in enumerate(splits)]
    q = _randn(len(lengths), HEADS, HD)
    return lambda: X.decode(q, pieces, wholes, lengths)


def padded_case(lengths: list[int]) -> Callable[[], object]:
    """The contexts gathered to one width (the runner's short-context decode)."""
    width = X.key_rows(max(lengths))
    k, v = _randn(len(lengths), width, KV_HEADS, HD), _randn(len(lengths), width, KV_HEADS, HD)
    q = _randn(len(lengths), HEADS, HD)
    return lambda: X.decode_padded(q, k, v, lengths)


CASES: dict[str, Callable[[], Callable[[], object]]] = {
    **{f"64 new after {h}": (lambda h=h: causal_case(h, 64)) for h in (1024, 4096, 8128)},
    **{f"1 decode at {h + 1}": (lambda h=h: causal_case(h, 1)) for h in (1100, 4100, 8100)},
    "2048-token prefill": lambda: causal_case(0, 2048),
    "2048 after 6144": lambda: causal_case(6144, 2048),
    "32 decodes at 4000-5147, in place": lambda: in_place_case([4000 + 37 * i for i in range(32)]),
    "32 decodes at 8192, in place": lambda: in_place_case([8192] * 32),
    "32 decodes at 100-503, padded": lambda: padded_case([100 + 13 * i for i in range(32)]),
    "32 decodes at 600-1003, padded": lambda: padded_case([600 + 13 * i for i in range(32)]),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the two kernels (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=9, help="timed calls per kernel and round (default: %(default)s)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    if not exact_matmul.usable(HEADS, KV_HEADS, HD):
        raise SystemExit("this CPU's bf16 GEMMs are not row-invariant: the GEMM kernel would not run here")
    torch.manual_seed(0)
    rows = []
    print(f"{'case':36} {'flash ms':>9} {'gemm ms':>9} {'gemm/flash':>11}")
    with torch.inference_mode():
        for name, make in CASES.items():
            fn = make()
            times: dict[str, list[float]] = {"flash": [], "gemm": []}
            for _ in range(args.rounds):
                for mode in times:
                    exact_matmul.set_mode(mode)
                    for _ in range(2):  # warm-up: buffers, caches
                        fn()
                    times[mode].append(median_of(fn, args.repeats) * 1e3)
            ratio = statistics.median(g / f for f, g in zip(times["flash"], times["gemm"]))
            rows.append(dict(case=name, flash_ms=times["flash"], gemm_ms=times["gemm"], ratio=round(ratio, 3)))
            print(f"{name:36} {statistics.median(times['flash']):9.2f} {statistics.median(times['gemm']):9.2f} "
                  f"{ratio:11.2f}", flush=True)
    exact_matmul.set_mode("auto")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, meta=dict(machine_info(), threads=torch.get_num_threads(),
                                                rounds=args.rounds, repeats=args.repeats)), f, indent=1)


if __name__ == "__main__":
    main()
