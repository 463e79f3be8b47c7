"""When a cold disk restore reads and when its compute waits: engine A saves H tokens and closes,
engine B (a restart) drops the page cache and restores them for H + 64 new tokens. For each restore
it prints, from the `generate` call on, the opening of the chunks (`PlannedReads.open`), each layer
group's read (start, end, MB/s) and each wait of the new tokens' compute for a group
(`LayerReader.take`; the first take is when the compute starts, once the opening and the read
buffer's reads are done). A take that returns at once means the read was already in: the reads
were hidden under the compute, and what the cold restore costs beyond the memory tier's is what
comes before the compute starts and the reads' CPU on the compute's cores (`restore_threads.py`
measures that).

    cd scripts && python restore_timeline.py [--history 4096] [--dtype fp32] [--contexts 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from kvtier.engine.config import EngineConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.engine.restore import layerwise
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model
from kvtier.store.reads import PlannedReads
from profile_disk_restore import cold_restore, save_context  # scripts/ is on the path of a script run from it

Event = tuple[str, str, float, float, int]  # (what, layers, start, end, bytes)
EVENTS: list[Event] = []


def _record(what: str, layers: str, start: float, nbytes: int = 0) -> None:
    EVENTS.append((what, layers, start, time.perf_counter(), nbytes))


def instrument() -> None:
    """Wrap the restore's opening, group reads and compute-side waits to append to EVENTS."""
    open_, read, take, generate = PlannedReads.open, PlannedReads.read, layerwise.LayerReader.take, Engine.generate

    def timed_open(self: PlannedReads) -> bool:
        t = time.perf_counter()
        ok = open_(self)
        _record("open", f"{len(self.chunks)} chunks", t)
        return ok

    def timed_read(self: PlannedReads, layers, parts, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        group = read(self, layers, parts, **kw)
        _record("read", f"L{layers[0]}-{layers[-1]}", t, group.nbytes if group is not None else 0)
        return group

    def timed_take(self: layerwise.LayerReader, gi: int):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        group = take(self, gi)
        _record("wait", f"L{self.groups[gi][0]}-{self.groups[gi][-1]}", t)
        return group

    def timed_generate(self: Engine, *args, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        out = generate(self, *args, **kw)
        _record("generate", "", t)
        return out

    PlannedReads.open, PlannedReads.read = timed_open, timed_read  # type: ignore[method-assign]
    layerwise.LayerReader.take = timed_take  # type: ignore[method-assign]
    Engine.generate = timed_generate  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--contexts", type=int, default=2)
    args = ap.parse_args()
    model = load_model("smollm2-135m", dtype=args.dtype)
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, args.history + 64), enable_prefix_cache=False)
    instrument()
    with tempfile.TemporaryDirectory() as d:
        spec = f"disk:{d}:20GB"
        for c in range(args.contexts):
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(c)).tolist()
            save_context(model, config, spec, ids, args.history, once)
            EVENTS.clear()
            wall = cold_restore(model, config, spec, d, ids, args.history, once, "timeline")
            t0 = next(e[2] for e in EVENTS if e[0] == "generate")
            print(f"context {c}: H={args.history} {args.dtype}, TTFT {1e3 * wall:.0f} ms (times from the generate call)")
            waited = 0.0
            for what, layers, start, end, nbytes in sorted(EVENTS, key=lambda e: e[2]):
                if what == "generate":
                    continue
                rate = f"  {nbytes / 1e6:5.1f} MB at {nbytes / 1e6 / max(end - start, 1e-9):5.0f} MB/s" if nbytes else ""
                print(f"  {what:4s} {layers:10s} {1e3 * (start - t0):7.1f} -> {1e3 * (end - t0):7.1f} ms "
                      f"({1e3 * (end - start):5.1f}){rate}")
                waited += (end - start) if what == "wait" else 0.0
            start = min((e[2] for e in EVENTS if e[0] == "wait"), default=t0)
            print(f"  the compute started at {1e3 * (start - t0):.1f} ms (after the opening and the read buffer's "
                  f"reads), then waited {1e3 * waited:.1f} ms for reads in all")


if __name__ == "__main__":
    main()
