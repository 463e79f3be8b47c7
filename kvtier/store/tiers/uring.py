"""Batched direct reads through io_uring: every read of a restore's layer group in one submission.

The disk tier's other way, four threads each calling `preadv` per chunk, spends much of its CPU
outside the reads themselves: a thread blocks per read, wakes per read, and takes the GIL back per
read, on the two cores the new tokens compute on. Through one ring per layer group the reader
thread takes about half that CPU, its CRC-32C checks included (scripts/restore_threads.py shows
where a restore's CPU goes; docs/benchmarks.md, "io_uring for disk reads"). The kernel does the same direct I/O either way.

The `liburing` binding's waits hold the GIL, so a ring never blocks in it: completions raise an
eventfd, and the wait is a read of that eventfd (`os.eventfd_read` releases the GIL). The reads
land straight in their destinations (the chunks' pool slots) as `preadv` would; nothing returns to
its caller while a read it submitted may still write. Where io_uring is missing (another OS, an
older kernel, a container that filters the system call) or turned off with KVTIER_IO_URING=0, the
tier keeps its threads.

Whether rings work is first tried in a child process (`available`): the binding's x86-64 wheel
(liburing 2026.3.30) is compiled with AVX-512 instructions, which kill a process on a CPU without
them (SIGILL, e.g. AMD Zen 3) before any `except` could catch it. The child runs this file as a
script and makes every call this module makes, on a real file; only if it exits cleanly does this
process make rings of its own.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, NamedTuple

log = logging.getLogger(__name__)

ENTRIES = 256  # reads in flight per ring (a wave; more are submitted as these complete)


class ReadJob(NamedTuple):
    fd: int
    offset: int
    dests: list[memoryview]  # consecutive bytes of the file from `offset`, in order


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether rings work here: checked once per process, in a child (`probe`) and then here."""
    if os.environ.get("KVTIER_IO_URING", "1") == "0" or not hasattr(os, "eventfd"):
        return False
    why = probe()
    if why is None:
        try:
            Ring(2).close()
        except Exception as e:  # noqa: BLE001 - the child passed; a failure here is still only a fallback
            why = f"{type(e).__name__}: {e}"
    if why is not None:
        log.info("disk tier: io_uring is not available (%s); reading on threads", why)
        return False
    return True


def probe(argv: Sequence[str] | None = None, timeout_s: float = 60.0) -> str | None:
    """Run this file's self-test (or `argv`) in a child; -> None if it passed, else why not."""
    argv = list(argv) if argv is not None else [sys.executable, "-I", os.path.abspath(__file__)]
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the self-test did not run: {type(e).__name__}: {e}"
    if done.returncode == 0:
        return None
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        hint = " (the liburing binding uses instructions this CPU lacks)" if sig == "SIGILL" else ""
        return f"the self-test was killed by {sig}{hint}"
    last = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
    return f"the self-test failed: {last[0]}"


def _self_test() -> None:
    """Every binding call this module makes: a ring, an eventfd, reads (one failing) reaped."""
    with tempfile.TemporaryFile() as f:
        data = bytes(range(256)) * 32
        f.write(data)
        f.flush()
        bad = os.open(os.devnull, os.O_WRONLY)  # reading a write-only fd fails: the error path
        try:
            dst = bytearray(len(data))
            ring = Ring(2)
            try:
                res = ring.read([ReadJob(f.fileno(), 0, [memoryview(dst)[:4096], memoryview(dst)[4096:]]),
                                 ReadJob(bad, 0, [memoryview(bytearray(16))]),
                                 ReadJob(f.fileno(), 4096, [memoryview(bytearray(8))])])
            finally:
                ring.close()
        finally:
            os.close(bad)
    assert res[0] == len(data) and bytes(dst) == data and res[1] < 0 and res[2] == 8, res


class Ring:
    def __init__(self, entries: int = ENTRIES) -> None:
        import liburing

        self._L: Any = liburing
        self.entries = entries
        self._ring = liburing.Ring()
        liburing.io_uring_queue_init(entries, self._ring)
        self._cqe = liburing.Cqe()
        self._efd = -1
        try:
            self._efd = os.eventfd(0, os.EFD_CLOEXEC)
            liburing.io_uring_register_eventfd(self._ring, self._efd)
        except BaseException:
            self.close()
            raise

    def read(self, jobs: Sequence[ReadJob]) -> list[int]:
        """Run every job; -> bytes read by each (a negative errno where one failed). Returns only
        once no job is in flight, whatever happens."""
        L, ring = self._L, self._ring
        res = [0] * len(jobs)
        iovecs: dict[int, Any] = {}  # the kernel reads these until the job completes
        nxt = inflight = 0
        try:
            while nxt < len(jobs) or inflight:
                while nxt < len(jobs) and inflight < self.entries:
                    job = jobs[nxt]
                    iovecs[nxt] = iov = L.Iovec(job.dests)
                    sqe = L.io_uring_get_sqe(ring)
                    L.io_uring_prep_readv(sqe, job.fd, iov, job.offset)
                    L.io_uring_sqe_set_data64(sqe, nxt)
                    nxt += 1
                    inflight += 1
                L.io_uring_submit(ring)
                os.eventfd_read(self._efd)  # blocks until a completion, without the GIL
                inflight -= self._reap(res, iovecs)
        except BaseException:
            while inflight:  # never leave a read that may still write into memory its caller reuses
                L.io_uring_wait_cqe(ring, self._cqe)
                inflight -= self._reap(res, iovecs)
            raise
        return res

    def _reap(self, res: list[int], iovecs: dict[int, Any]) -> int:
        """Take every completion there is; -> how many. Through liburing's iterator, which wraps
        around the completion ring (the binding's `cqe[i]` does not)."""
        L, cqe, n = self._L, self._cqe, 0
        for _ in L.CqeIter(self._ring, cqe):
            done = cqe[0]
            job = done.user_data
            try:
                res[job] = done.res
            except OSError as e:  # the binding raises a negative result as the errno it is
                res[job] = -(e.errno or errno.EIO)
            iovecs.pop(job, None)
            n += 1
        if n:
            L.io_uring_cq_advance(self._ring, n)
        return n

    def close(self) -> None:
        if self._efd >= 0:
            os.close(self._efd)
            self._efd = -1
        if self._ring is not None:
            self._L.io_uring_queue_exit(self._ring)
            self._ring = None


class RingPool:
    """Rings for the threads that read at once (a restore's reader each): taken per call, kept."""

    def __init__(self) -> None:
        self._free: list[Ring] = []
        self._lock = threading.Lock()

    def read(self, jobs: Sequence[ReadJob]) -> list[int]:
        with self._lock:
            ring = self._free.pop() if self._free else None
        ring = ring or Ring()
        try:
            return ring.read(jobs)
        finally:
            with self._lock:
                self._free.append(ring)

    def close(self) -> None:
        with self._lock:
            rings, self._free = self._free, []
        for r in rings:
            r.close()


if __name__ == "__main__":  # the child of `probe`: stdlib and the binding only, no kvtier imports
    _self_test()
