"""Exact CPU attention reads whole 512-key blocks (`kvtier/models/attention.py`): what that costs,
and why a call's last block is not cut short.

`--exactness`: the CPU flash kernel on random inputs, over whole blocks and over keys cut to the
next multiple of 64 past the last visible key, for a prefill group (30 tokens at positions
700-729, 3 query heads per K/V head) and a decoding row (position 797); prints on how many of
`--seeds` inputs the bits differ. Any difference means the cut would make a token's logits depend on
the shape of the call it ran in.

`--timing`: HF's floor (a DynamicCache kept in RAM, then the 64 new tokens) against kvtier's memory
tier restoring the history, whole blocks and cut, alternating in one process (SmolLM2-135M, H
history tokens). Prints medians and their ratios to the floor, then where one more context's time
goes in each (`torch.profiler`: the attention kernel's and the linears' self time).

    cd scripts && python key_cut_ab.py --exactness [--seeds 6]
    cd scripts && python key_cut_ab.py --timing [--history 1024] [--contexts 10] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.models import attention

STEP = 64
WHOLE = attention._flash


def _cut(keys: int) -> int:
    return -(-keys // STEP) * STEP


def cut_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`attention._flash` over keys cut to the next multiple of STEP past the last one any row sees."""
    seen = (mask == 0).flatten(0, -2).any(0).nonzero()  # [visible keys, 1]
    cut = _cut(int(seen[-1]) + 1)
    return WHOLE(q, k[:, :, :cut], v[:, :, :cut], mask[..., :cut])


def exactness(seeds: int) -> None:
    kv_heads, group, hd = 3, 3, 64
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for name, positions in (("prefill 700-729", list(range(700, 730))), ("decode at 797", [797])):
            differ = []
            for seed in range(seeds):
                gen = torch.Generator().manual_seed(seed)
                keys = attention.key_rows(positions[-1] + 1)
                k, v = (torch.randn(1, kv_heads, keys, hd, generator=gen).to(dtype) for _ in range(2))
                if len(positions) > 1:  # grouped heads as rows, (group member, token) order, as _blocked lays them
                    rows = [p for _ in range(group) for p in positions]
                    mask = attention._mask(rows, keys, dtype, k.device)[None, None]
                else:  # a decode's mask is shared by its grouped heads
                    rows = positions * group
                    mask = attention._mask(positions, keys, dtype, k.device)[:, None, None, :].expand(1, 1, group, keys)
                q = torch.randn(1, kv_heads, len(rows), hd, generator=gen).to(dtype)
                whole, cut = WHOLE(q, k, v, mask), cut_flash(q, k, v, mask)
                if not torch.equal(whole, cut):
                    differ.append(f"{(whole.float() - cut.float()).abs().max().item():.1e}")
            print(f"{str(dtype):15s} {name:16s} cut to {_cut(positions[-1] + 1)} of "
                  f"{attention.key_rows(positions[-1] + 1)} keys: bits differ on {len(differ)} of {seeds} inputs "
                  f"{'(max ' + ', '.join(differ) + ')' if differ else ''}")


def timing(history: int, contexts: int, dtype: str) -> None:
    from kvtier.bench.hf import HFPeers, build_hf
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.engine import Engine
    from kvtier.engine.request import SamplingParams
    from kvtier.models.loading import load_model

    loaded = load_model("smollm2-135m", dtype=dtype)
    hf = build_hf(loaded)
    once = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    config = EngineConfig(kv_cache_bytes=2 << 30, enable_prefix_cache=False, max_model_len=history + 64)
    times: dict[str, list[float]] = {"floor": [], "whole": [], "cut": []}
    with Engine(loaded, config, store="memory:8GB") as engine, tempfile.TemporaryDirectory() as d:
        for c in range(contexts + 1):  # the first is a warm-up
            ids = torch.randint(100, 40000, (history + 64,), generator=torch.Generator().manual_seed(c)).tolist()
            peers = HFPeers(hf, ids, history, ["hf_floor"], Path(d) / "unused", None, "unused")
            order = list(times)
            for name in order[c % 3:] + order[:c % 3]:
                if name != "floor":
                    attention._flash = WHOLE  # the save's prefill as shipped
                    engine.generate([ids[:history]], once)  # saved on the way (again for the second)
                    engine.flush()
                    attention._flash = cut_flash if name == "cut" else WHOLE
                t = time.perf_counter()
                peers.hf_floor() if name == "floor" else engine.generate([ids], once)
                if c:
                    times[name].append(time.perf_counter() - t)
            attention._flash = WHOLE
        profile_one(engine, peers, ids, history, once)
    floor = statistics.median(times["floor"])
    for name, xs in times.items():
        print(f"H={history} {dtype} {name:5s}: median {1e3 * statistics.median(xs):6.1f} ms, "
              f"{statistics.median(xs) / floor:.3f}x the floor (n={len(xs)})")


def profile_one(engine, peers, ids: list[int], history: int, once) -> None:  # type: ignore[no-untyped-def]
    """The last context once more, each way under torch.profiler: attention and linear self time."""
    from torch.profiler import profile

    ops = {"attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
           "linears": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")}
    for name in ("floor", "whole", "cut"):
        if name != "floor":
            attention._flash = WHOLE
            engine.generate([ids[:history]], once)
            engine.flush()
            attention._flash = cut_flash if name == "cut" else WHOLE
        with profile() as prof:
            peers.hf_floor() if name == "floor" else engine.generate([ids], once)
        attention._flash = WHOLE
        rows = {e.key: e for e in prof.key_averages()}
        print(f"{name:5s}: " + ", ".join(
            f"{part} {sum(rows[k].self_cpu_time_total for k in keys if k in rows) / 1e3:.0f} ms "
            f"({sum(rows[k].count for k in keys if k in rows)} calls)" for part, keys in ops.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--exactness", action="store_true")
    ap.add_argument("--timing", action="store_true")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--contexts", type=int, default=10)
    ap.add_argument("--dtype", default="fp32")
    args = ap.parse_args()
    if not (args.exactness or args.timing):
        ap.error("give --exactness, --timing or both")
    if args.contexts < 1 or args.seeds < 1:
        ap.error("--contexts and --seeds must be at least 1")
    if args.exactness:
        exactness(args.seeds)
    if args.timing:
        timing(args.history, args.contexts, args.dtype)


if __name__ == "__main__":
    main()
