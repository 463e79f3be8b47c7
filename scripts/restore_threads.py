"""Where a returning context's CPU goes, thread by thread: the same contexts restored from the memory
tier and, after a restart, from a cold disk. For each restore it reads every thread's CPU time and
run-queue wait (`/proc/self/task/*/schedstat`: runnable but not running) and sums them by thread
name; OpenMP's workers are native threads ("omp workers"). Prints medians per restore.

On two cores the compute (the step's thread and the OpenMP workers) fills both; whatever the reads
cost (direct-I/O page pinning, CRC-32C, Python) comes out of the compute's time, and read threads
that are runnable wait for a core. This shows the bound on a cold restore that overlap cannot hide.
The rows "(in opening)" and "(in reading)" are the thread CPU spent inside the restore's
`PlannedReads.open` and `.read` calls, parts of the rows above them (thread CPU is steadier than
wall time on a VM whose speed drifts).
To compare with another revision, run it under scripts/ab.py.

    cd scripts && python restore_threads.py [--history 4096] [--dtype bf16] [--contexts 6]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections import defaultdict

import torch

from kvtier.bench.e2e.run import drop_page_cache
from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model
from kvtier.store.reads import PlannedReads

Snapshot = dict[int, tuple[str, int, int]]  # tid -> (thread name, run ns, run-queue wait ns)
SPENT: dict[str, float] = {"opening": 0.0, "reading": 0.0}  # thread CPU seconds in the restore's calls


def snapshot() -> Snapshot:
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: Snapshot = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(int(tid), "omp workers").rstrip("_0123456789")  # pool threads: one row per pool
        out[int(tid)] = (name, int(run), int(wait))
    return out


def per_name(before: Snapshot, after: Snapshot) -> dict[str, tuple[float, float]]:
    """Seconds of CPU and of run-queue wait each thread name took between two snapshots."""
    acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for tid, (name, run, wait) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        acc[name][0] += (run - run0) / 1e9
        acc[name][1] += (wait - wait0) / 1e9
    return {k: (v[0], v[1]) for k, v in acc.items() if v[0] or v[1]}


def count_calls(spent: dict[str, float]) -> None:
    """From now on, the CPU time of the thread running `PlannedReads.open` (the restore's worker:
    opening the chunks, before the new tokens start) and `PlannedReads.read` (its reader: the
    reads, beside the compute) is added to `spent` under "opening" and "reading"."""
    for name, row in (("open", "opening"), ("read", "reading")):
        plain = getattr(PlannedReads, name)

        def counted(self, *a, _plain=plain, _row=row, **kw):
            c = time.thread_time()
            try:
                return _plain(self, *a, **kw)
            finally:
                spent[_row] += time.thread_time() - c

        setattr(PlannedReads, name, counted)


def timed(engine: Engine, ids: list[int], once: SamplingParams, history: int) -> tuple[float, dict]:
    """(wall seconds, per thread name (CPU, run-queue wait)) of one restore. A thread that ended
    before the restore did (a restore's reader) is gone from /proc: its CPU is the process's CPU
    less the live threads', reported as "threads that ended" (its wait is unknown, 0)."""
    SPENT.update(opening=0.0, reading=0.0)
    s0, c0, t = snapshot(), time.process_time(), time.perf_counter()
    out = engine.generate([ids], once)[0]
    wall, cpu = time.perf_counter() - t, time.process_time() - c0
    if out.prompt_tokens_reused != history:
        raise SystemExit(f"reused {out.prompt_tokens_reused} of {history} tokens")
    split = per_name(s0, snapshot())
    split["threads that ended"] = (max(0.0, cpu - sum(run for run, _ in split.values())), 0.0)
    calls = {f"(in {k})": (v, 0.0) for k, v in SPENT.items() if v}  # parts of the rows above, not added to them
    return wall, split | calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--contexts", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    count_calls(SPENT)
    model = load_model("smollm2-135m", dtype=args.dtype)
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, args.history + 64), enable_prefix_cache=False)
    runs: dict[str, list[tuple[float, dict]]] = {"memory": [], "cold disk": []}
    with tempfile.TemporaryDirectory() as d, Engine(model, config, store="memory:4GB") as mem:
        spec = f"disk:{d}:20GB"
        for c in range(args.contexts + 1):  # context 0 warms up
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(c)).tolist()
            with Engine(model, config, store=spec) as a:
                a.generate([ids[:args.history]], once)
                a.flush()
            with Engine(model, config, store=spec) as b:  # a restart
                drop_page_cache(d)
                disk = timed(b, ids, once, args.history)
            mem.generate([ids[:args.history]], once)
            mem.flush()
            memory = timed(mem, ids, once, args.history)
            if c:
                runs["cold disk"].append(disk)
                runs["memory"].append(memory)
    report = {}
    for where, samples in runs.items():
        names = sorted({n for _, split in samples for n in split})
        rows = {n: tuple(statistics.median(s[1].get(n, (0.0, 0.0))[i] for s in samples) for i in (0, 1)) for n in names}
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(sum(v[0] for n, v in s[1].items() if not n.startswith("(")) for s in samples)
        print(f"H={args.history} {args.dtype} {where}: wall {1e3 * wall:.1f} ms, CPU {1e3 * cpu:.1f} ms (medians of {len(samples)})")
        for n, (run, wait) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
            print(f"  {n:24s} CPU {1e3 * run:7.1f} ms   run-queue wait {1e3 * wait:7.1f} ms")
        report[where] = dict(wall_s=wall, cpu_s=cpu, threads={n: dict(cpu_s=r, runq_wait_s=w) for n, (r, w) in rows.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), report=report), f, indent=1)


if __name__ == "__main__":
    main()
