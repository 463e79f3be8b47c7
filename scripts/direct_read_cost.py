"""What a direct-I/O read costs the CPU here, by how the bytes are split: FILES files of 3 MB (a
64-token SmolLM2 chunk in fp32) are read cold with O_DIRECT on four threads, as the disk tier reads
them, split four ways: one read per file; one read per file into 64 scattered buffers (the K/V
segments going to their pool slots); 8 reads of 8 buffers each (a restore's layer groups); 64 reads
per file. Prints medians of wall and process CPU time (user + system, all threads; the read plans
are built before the clocks start). Needs root
(it drops the page cache through /proc/sys/vm/drop_caches) and a filesystem with direct I/O; the
files (192 MB) stay in `--dir` for the next run.

    python scripts/direct_read_cost.py [--dir /var/tmp/kvtier-read-cost] [--files 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

SIZE = 3 << 20  # bytes per file
PIECES = 64  # segments per file
Plan = Callable[[int], list[tuple[int, list[memoryview]]]]  # file index -> [(offset, buffers)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp/kvtier-read-cost")
    ap.add_argument("--files", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n, seg = args.files, SIZE // PIECES
    os.makedirs(args.dir, exist_ok=True)
    paths = [os.path.join(args.dir, str(i)) for i in range(n)]
    for p in paths:
        if not os.path.exists(p) or os.path.getsize(p) != SIZE:
            with open(p, "wb") as f:
                f.write(os.urandom(SIZE))
    # Page-aligned destination memory, faulted in first (a pool's pages are resident).
    memory = mmap.mmap(-1, 2 * n * SIZE)
    view = memoryview(memory)
    view[::mmap.PAGESIZE] = b"\0" * (len(view) // mmap.PAGESIZE)

    def whole(i: int) -> list[memoryview]:
        return [view[i * SIZE:(i + 1) * SIZE]]

    def scattered(i: int) -> list[memoryview]:  # segment k of file i lands among other files' segments
        return [view[(k * n + i) * 2 * seg:(k * n + i) * 2 * seg + seg] for k in range(PIECES)]

    plans: dict[str, Plan] = {
        "1 read": lambda i: [(0, whole(i))],
        "1 read, 64 scattered buffers": lambda i: [(0, scattered(i))],
        "8 reads of 8 buffers": lambda i: [(g * 8 * seg, b[g * 8:(g + 1) * 8]) for b in [scattered(i)] for g in range(8)],
        "64 reads": lambda i: [(k * seg, [b[k]]) for b in [scattered(i)] for k in range(PIECES)],
    }

    def run(plan: Plan) -> tuple[float, float]:
        reads = [plan(i) for i in range(n)]  # the buffers' views built before the clocks start
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        c0, w0 = time.process_time(), time.perf_counter()  # process CPU: every thread, user and system

        def one(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY | os.O_DIRECT)
            try:
                for offset, buffers in reads[i]:
                    os.preadv(fd, buffers, offset)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, range(n)))
        return time.perf_counter() - w0, time.process_time() - c0

    print(f"{n} files of {SIZE >> 20} MB, cold, O_DIRECT, 4 threads; medians of {args.repeats}")
    for name, plan in plans.items():
        got = [run(plan) for _ in range(args.repeats)]
        wall, cpu = statistics.median(g[0] for g in got), statistics.median(g[1] for g in got)
        print(f"  {name:30s} wall {1e3 * wall:6.0f} ms   CPU {1e3 * cpu:5.0f} ms   {n * SIZE / wall / 1e6:5.0f} MB/s")


if __name__ == "__main__":
    main()
