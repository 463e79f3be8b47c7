"""Where a cold disk restore's time goes: engine A saves H tokens and closes, engine B (a restart)
drops the page cache and restores them for H + 64 tokens, three times; prints wall and CPU time,
the time spent opening the chunks, and a profile of the main thread for the last one. With
--same-engine, instead: one engine restores H tokens again and again (new tokens after them each
time) from a disk-only store, and another from a memory-only one, without a restart: the median
TTFT of each, so the disk tier's own cost is seen apart from a restart's.

    python scripts/profile_disk_restore.py [H] [--dtype bf16] [--same-engine]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import os
import pstats
import statistics
import tempfile
import time

import torch

from kvtier.bench.e2e.run import drop_page_cache
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model
from kvtier.store.reads import PlannedReads


def time_opening() -> list[float]:
    """From now on, every restore's opening of its chunks (`PlannedReads.open`) appends its
    seconds to the list returned."""
    opening: list[float] = []
    plain_open = PlannedReads.open

    def timed_open(self: PlannedReads) -> bool:
        t = time.perf_counter()
        try:
            return plain_open(self)
        finally:
            opening.append(time.perf_counter() - t)

    PlannedReads.open = timed_open  # type: ignore[method-assign]
    return opening


def save_context(model, config: EngineConfig, spec: str, ids: list[int], history: int, once: SamplingParams) -> None:
    """Engine A saves the first `history` tokens of `ids` to `spec` and closes (its saves drained)."""
    with Engine(model, config, store=spec) as a:
        a.generate([ids[:history]], once)
        a.flush()


def cold_restore(model, config: EngineConfig, spec: str, directory: str, ids: list[int], history: int,
                 once: SamplingParams, label: str, **engine_kw) -> float:
    """A restart: a fresh engine over `spec` drops `directory`'s page cache and restores `history`
    tokens of `ids` for as many new tokens as `ids` has past them, new ones each call (see
    `fresh_tail`); -> the TTFT in seconds (exits unless exactly the history was reused)."""
    with Engine(model, config, store=spec, **engine_kw) as engine:
        drop_page_cache(directory)
        return timed_restore(engine, fresh_tail(ids, history), once, history, label)


_tails = itertools.count()


def fresh_tail(ids: list[int], history: int) -> list[int]:
    """`history` tokens of `ids`, then as many new tokens as `ids` has past them, different on every
    call: a restore saves its new tokens too (a chunk is reused in part), so restoring the very
    same ids again would restore history + 63 tokens and compute one."""
    g = torch.Generator().manual_seed(next(_tails))
    return ids[:history] + torch.randint(100, 40000, (len(ids) - history,), generator=g).tolist()


def timed_restore(engine: Engine, ids: list[int], once: SamplingParams, history: int, label: str) -> float:
    """The TTFT in seconds of `engine` restoring `history` tokens of `ids` for the rest of them
    (exits unless all were reused)."""
    t = time.perf_counter()
    out = engine.generate([ids], once)[0]
    wall = time.perf_counter() - t
    if out.prompt_tokens_reused != history:
        raise SystemExit(f"{label}: reused {out.prompt_tokens_reused} of {history} tokens")
    return wall


def same_engine(model, config: EngineConfig, history: int, once: SamplingParams, rounds: int = 6) -> None:
    """One engine per tier restoring `history` tokens again and again, the tiers taking turns."""
    ids = torch.randint(100, 40000, (history + 64,), generator=torch.Generator().manual_seed(0)).tolist()
    with tempfile.TemporaryDirectory() as d:
        save_context(model, config, f"disk:{d}:20GB", ids, history, once)
        with Engine(model, config, store=f"disk:{d}:20GB") as disk, Engine(model, config, store="memory:8GB") as memory:
            memory.generate([ids[:history]], once)
            memory.flush()
            times: dict[str, list[float]] = {"disk only": [], "memory only": []}
            for r in range(rounds + 2):  # two warm-up rounds
                for name, engine in (("disk only", disk), ("memory only", memory)):
                    t = timed_restore(engine, fresh_tail(ids, history), once, history, name)
                    if r >= 2:
                        times[name].append(t)
    for name, ts in times.items():
        print(f"{name}: median {statistics.median(ts) * 1e3:.1f} ms over {rounds} ({' '.join(f'{t * 1e3:.0f}' for t in ts)})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("history", type=int, nargs="?", default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--same-engine", action="store_true", help="disk-only against memory-only restores, no restart")
    args = ap.parse_args()
    model = load_model("smollm2-135m", dtype=args.dtype)
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    opening = time_opening()
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=8192, enable_prefix_cache=False)
    if args.same_engine:
        same_engine(model, config, args.history, once)
        return
    with tempfile.TemporaryDirectory() as d:
        spec = f"memory:8GB,disk:{d}:20GB"
        for i in range(3):
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(i)).tolist()
            save_context(model, config, spec, ids, args.history, once)
            with Engine(model, config, store=spec) as b:
                drop_page_cache(d)
                prof = cProfile.Profile()
                opening.clear()
                c0, t0 = os.times(), time.perf_counter()
                prof.enable()
                out = b.generate([ids], once)[0]
                prof.disable()
                c1, wall = os.times(), time.perf_counter() - t0
            r = out.restore
            print(f"wall {wall:.3f} s, CPU user {c1.user - c0.user:.3f} s sys {c1.system - c0.system:.3f} s; "
                  f"reused {out.prompt_tokens_reused} by {r.method if r else '-'}; opening chunks "
                  f"{sum(opening):.3f} s; reads waited {r.wait_s if r else 0:.3f} s")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
