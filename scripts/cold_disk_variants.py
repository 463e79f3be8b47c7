"""Ideas for a faster cold disk restore, each against the shipped code in the same process, paired:
the same saved context is restored cold (a fresh engine, the page cache dropped) once per variant
per round, in rotating order, so the VM's drift (10-30% between runs of one command here) hits every
variant alike; the figure to read is the median of the per-round differences from `plain`.

    plain     the shipped code (reads straight into the pool through io_uring where it works)
    threads   the disk tier's reads on its four threads (`preadv` per chunk and layer group), as
              before io_uring and as where it is missing or KVTIER_IO_URING=0
    thp       the CPU KV pool on transparent huge pages (madvise): fewer pages for direct I/O to pin
              and for attention's reads to walk
    crc-gil   CRC-32C keeps the GIL for buffers under 1 MiB instead of releasing it per segment
    read-all  the new tokens start only once every layer is read (no overlap of reads and compute)
    io-nice   `threads`, with the read threads at nice 19 (reads yield the cores to the compute):
              compare it with `threads`
    groups8   `threads`, reading 8 layers per call instead of 4 (fewer `preadv` calls; each costs
              the reader's core tens of us here beside its bytes). The planner's cost model still
              assumes 4-layer groups when it picks the read buffer's depth
    doubling  `threads`, groups that double after the first layer ([0], [1-2], [3-6], [7-14], [15-29]),
              read as far ahead as the reads go (direct reads need no staging): 5 reads per chunk, not 9;
              the plan's read-buffer cut is dropped, so the new tokens wait for [1-2] and [3-6] whole
    head-only the opening reads each chunk's header alone, and the first layer is read after it (as
              before the opening read the first layer with the header)
    parse-early  the threads' opening, each header parsed as soon as its read is in (the shipped
              code parses once every read is in)

Only io_uring is shipped (`threads` is what it replaced, and what runs where the ring cannot):
docs/benchmarks.md has the figures.

    cd scripts && python cold_disk_variants.py [--history 4096] [--dtype bf16] [--contexts 4]
        [--rounds 4] [--variants plain,threads,thp,crc-gil,read-all,io-nice,groups8,doubling,head-only,parse-early] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import crc32c
import torch
from profile_disk_restore import (  # scripts/ is on the path of a script run from it
    cold_restore,
    save_context,
    time_opening,
)

import kvtier.engine.restore.layerwise as layerwise
import kvtier.engine.runner.model_runner as model_runner
import kvtier.store.tiers.disk as disk
from kvtier.engine.config import EngineConfig
from kvtier.engine.request import SamplingParams
from kvtier.heap import freeze_startup_heap
from kvtier.models.loading import load_model
from kvtier.planning.planner import Planner
from kvtier.store import seal, staging
from kvtier.store.tiers import uring

HUGE_PAGE = 2 << 20
SHIPPED = dict(empty=staging.aligned_empty, digest=seal.digest, depth=Planner._start_depth, pool=disk.ThreadPoolExecutor,
               uring=uring.available, group=layerwise.READ_GROUP_LAYERS, groups=layerwise.layer_groups,
               reader=layerwise.LayerReader.__init__, head=disk.head_bytes, open=disk.DiskTier.open_chunks)


def huge_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """Private anonymous memory advised for huge pages, aligned to 2 MiB (a shared mapping would
    be shmem, which THP's "madvise" mode leaves on small pages)."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive
    skip = (-raw.data_ptr()) % HUGE_PAGE
    return raw[skip:skip + nbytes]


def crc_keeping_gil(alg: str, data) -> int:
    if alg != seal.CRC32C:
        return SHIPPED["digest"](alg, data)
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    return crc32c.crc32c(data, gil_release_mode=int(size >= 1 << 20))


def doubled(layout, first, size, cuts=()):
    if not cuts:  # not a threaded reader's groups
        return SHIPPED["groups"](layout, first, size, cuts)
    return SHIPPED["groups"](layout, first, len(layout), [first + (1 << k) - 1 for k in range(1, 8)])


def parsing_as_read(self, expects):
    """`DiskTier.open_chunks` parsing each header as soon as its read is in, while the threads read
    the next ones (the shipped code waits for every read, then parses)."""
    heads = self._io.map(disk.DiskTier._open_head, [self] * len(expects), [e.key for e in expects],
                         [disk.head_bytes(e) for e in expects])
    return [self.open_chunk(e, opened=h) for e, h in zip(expects, heads)]


def reading_ahead(self, *args, **kwargs) -> None:
    SHIPPED["reader"](self, *args, **kwargs)
    if self._thread is not None:
        self.depth = len(self.layout)


def read_all_first(cls, io, comp, lead, steal, buffer):
    return len(io), cls._run(io, comp, lead, len(io), steal)[0]


class NiceReaders(ThreadPoolExecutor):
    def __init__(self, max_workers: int, thread_name_prefix: str) -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix,
                         initializer=lambda: os.setpriority(os.PRIO_PROCESS, 0, 19))


VARIANTS: dict[str, Callable[[], None]] = {
    "plain": lambda: None,
    "threads": lambda: setattr(uring, "available", lambda: False),
    "thp": lambda: setattr(model_runner, "aligned_empty", huge_empty),
    "crc-gil": lambda: setattr(seal, "digest", crc_keeping_gil),
    "read-all": lambda: setattr(Planner, "_start_depth", classmethod(read_all_first)),
    "io-nice": lambda: (VARIANTS["threads"](), setattr(disk, "ThreadPoolExecutor", NiceReaders)),
    "groups8": lambda: (VARIANTS["threads"](), setattr(layerwise, "READ_GROUP_LAYERS", 8)),
    "doubling": lambda: (VARIANTS["threads"](), setattr(layerwise, "layer_groups", doubled),
                         setattr(layerwise.LayerReader, "__init__", reading_ahead)),
    "head-only": lambda: setattr(disk, "head_bytes", lambda expect: disk.HEAD_BYTES),
    "parse-early": lambda: setattr(disk.DiskTier, "open_chunks", parsing_as_read),
}


def use(variant: str) -> None:
    model_runner.aligned_empty, seal.digest = SHIPPED["empty"], SHIPPED["digest"]
    Planner._start_depth, disk.ThreadPoolExecutor = SHIPPED["depth"], SHIPPED["pool"]  # type: ignore[method-assign]
    uring.available = SHIPPED["uring"]  # type: ignore[assignment]
    layerwise.READ_GROUP_LAYERS, layerwise.layer_groups = SHIPPED["group"], SHIPPED["groups"]
    layerwise.LayerReader.__init__ = SHIPPED["reader"]  # type: ignore[method-assign]
    disk.head_bytes, disk.DiskTier.open_chunks = SHIPPED["head"], SHIPPED["open"]  # type: ignore[assignment,method-assign]
    VARIANTS[variant]()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--contexts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=4, help="restores per variant per context (default: %(default)s)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json")
    args = ap.parse_args()
    names = args.variants.split(",")
    if names[0] != "plain" or any(n not in VARIANTS for n in names):
        raise SystemExit(f"--variants: plain first, then any of {', '.join(VARIANTS)}")
    opened = time_opening()
    model = load_model("smollm2-135m", dtype=args.dtype)
    freeze_startup_heap()  # as the server does: no full collection over torch's modules in a timing
    once = SamplingParams(max_tokens=1, temperature=0.0)
    config = EngineConfig(kv_cache_bytes=1 << 30, max_model_len=max(8192, args.history + 64), enable_prefix_cache=False)
    ttft: dict[str, list[float]] = {v: [] for v in names}
    opening: dict[str, list[float]] = {v: [] for v in names}
    with tempfile.TemporaryDirectory() as d:
        spec = f"disk:{d}:20GB"
        for c in range(args.contexts):
            ids = torch.randint(100, 40000, (args.history + 64,), generator=torch.Generator().manual_seed(c)).tolist()
            use("plain")
            save_context(model, config, spec, ids, args.history, once)
            for r in range(args.rounds + (c == 0)):  # one warm-up round first
                k = c * args.rounds + r
                for name in names[k % len(names):] + names[:k % len(names)]:
                    use(name)
                    wall = cold_restore(model, config, spec, d, ids, args.history, once, name)
                    if c or r:
                        ttft[name].append(wall)
                        opening[name].append(opened[-1])
    use("plain")
    for name in names:
        diff = [b - a for a, b in zip(ttft["plain"], ttft[name])]
        q = statistics.quantiles(ttft[name], n=4)
        print(f"H={args.history} {args.dtype} {name:8s}: TTFT median {1e3 * statistics.median(ttft[name]):.1f} ms "
              f"(q25 {1e3 * q[0]:.0f}, q75 {1e3 * q[2]:.0f}); paired vs plain {1e3 * statistics.median(diff):+.1f} ms; "
              f"opening {1e3 * statistics.median(opening[name]):.1f} ms; n={len(diff)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), ttft_s=ttft, opening_s=opening), f, indent=1)


if __name__ == "__main__":
    main()
