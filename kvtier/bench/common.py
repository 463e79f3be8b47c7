"""Helpers any benchmark can share: cold-cache disk reads, timing and output (services.py: Redis).

Nothing here imports torch or the engine, so tests of report code stay fast.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvtier.testing.services import RedisServer, free_port  # noqa: F401  (re-exported for the benchmarks)

T = TypeVar("T")
_READ_BLOCK = 1 << 20  # 1 MiB: large enough that per-call overhead does not hide the device's bandwidth


def _files(root: str | os.PathLike[str]) -> Iterable[str]:
    """`root` itself if it is a file, else every file below it."""
    if os.path.isfile(root):
        yield os.fspath(root)
        return
    for dirpath, _, names in os.walk(root):
        for n in names:
            yield os.path.join(dirpath, n)


def drop_page_cache(root: str | os.PathLike[str]) -> int:
    """Evict a file, or every file under a directory, from the page cache so the next read comes
    from the device. Works without root, unlike /proc/sys/vm/drop_caches. Returns files handled."""
    n = 0
    for path in _files(root):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # vanished meanwhile (a writer's temp file): nothing to evict
        try:
            os.fdatasync(fd)  # dirty pages cannot be dropped: write them first
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return n


def median(xs: Sequence[float]) -> float:
    """Median, NaN for no samples (a missing measurement stays visible instead of raising)."""
    return float(statistics.median(xs)) if xs else float("nan")


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """(wall seconds, result) of one call."""
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def write_json_atomic(path: str | os.PathLike, doc: Any) -> None:
    """Write JSON through a temp file and a rename: a reader (or a kill) never sees half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(p)


def csv_arg(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [t.strip() for t in text.split(",") if t.strip()]


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def _cpu_id(fields: dict[str, str]) -> str | None:
    """"family F model M": the brand string of a cloud CPU ("AMD EPYC") does not tell its
    generations apart (family 25 model 17 is a Zen 4, family 26 a Zen 5)."""
    family, model = fields.get("cpu family"), fields.get("model")
    return f"family {family} model {model}" if family and model else None


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: CPU, cores, native bf16, torch threads, load."""
    cpuinfo = _cpuinfo()
    flags = set(cpuinfo.get("flags", "").split())
    info: dict[str, Any] = dict(
        cpu_model=_cpu_model(), cpu_id=_cpu_id(cpuinfo), cpu_count=os.cpu_count(),
        cpu_native_bf16=bool(flags & {"avx512_bf16", "amx_bf16"}),
        cpu_bf16_flags=sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile"}),
        python=sys.version.split()[0], platform=platform.platform(),
        date=time.strftime("%Y-%m-%d %H:%M:%S %z"), argv=list(sys.argv),
        loadavg_start=[round(x, 2) for x in os.getloadavg()])
    try:
        import torch  # optional: report code can run without it

        info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
    except ImportError:
        pass
    return info


def _read_direct(path: str, buf: mmap.mmap) -> int:
    """Read a file once with O_DIRECT into an aligned buffer; raises OSError if refused."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n = 0
        while True:
            got = os.readv(fd, [buf])
            n += got
            if got < len(buf):
                return n  # EOF (O_DIRECT returns a short read for an unaligned tail)
    finally:
        os.close(fd)


def _read_buffered(path: str) -> int:
    drop_page_cache(path)
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_READ_BLOCK):
            n += len(chunk)
    return n


def read_bandwidth(paths: Iterable[str | os.PathLike]) -> float:
    """The device's cold sequential read bandwidth over `paths` in bytes/s: each file read once,
    1 MiB at a time, with O_DIRECT (bypasses the page cache; mmap memory is page aligned as
    O_DIRECT requires), or buffered after evicting its pages where O_DIRECT is refused."""
    buf = mmap.mmap(-1, _READ_BLOCK)
    total, seconds = 0, 0.0
    try:
        for p in paths:
            path = os.fspath(p)
            t = time.perf_counter()
            try:
                n = _read_direct(path, buf)
            except OSError:  # e.g. tmpfs or a filesystem without O_DIRECT
                t = time.perf_counter()
                n = _read_buffered(path)
            seconds += time.perf_counter() - t
            total += n
    finally:
        buf.close()
    return total / seconds if seconds > 0 else float("nan")


def pinned_copy_rate(device, nbytes: int = 1 << 30, reps: int = 5, pinned: bool = True) -> float:
    """Bytes/s of one plain host-to-device copy of `nbytes` (pinned, or pageable), median of `reps`
    timed with CUDA events: the peak a restore's copies are compared with."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=pinned)
    torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=pinned)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return nbytes / sorted(times)[len(times) // 2]


def bench_redis_client(url: str) -> Any:
    """A client for a store-spec Redis URL, as the store's own tier makes it (password file, TLS
    options, the environment's password), for the HF peers that keep their cache in Redis."""
    from kvtier.store.spec import parse_spec
    from kvtier.store.tiers.redis_tier import connect

    spec = parse_spec(url).redis
    if spec is None:
        raise ValueError(f"not a Redis URL: {url.split('://', 1)[0]}://...")
    return connect(spec)
