"""Batched direct reads through io_uring: every read of a restore's layer group in one submission.

The disk tier's other way, four threads each calling `preadv` per chunk, spends much of its CPU
outside the reads themselves: a thread blocks per read, wakes per read, and takes the GIL back per
read, on the two cores the new tokens compute on. For a cold 4096-token restore (576 reads) its
threads took 68 ms of CPU and waited 151 ms for a core; through one ring per layer group the
reader thread takes ~39 ms, its CRC-32C checks included (scripts/restore_threads.py,
docs/benchmarks.md). The kernel does the same direct I/O either way.

The `liburing` binding's waits hold the GIL, so a ring never blocks in it: completions raise an
eventfd, and the wait is a read of that eventfd (`os.eventfd_read` releases the GIL). The reads
land straight in their destinations (the chunks' pool slots) as `preadv` would; nothing returns to
its caller while a read it submitted may still write. Where io_uring is missing (another OS, an
older kernel, a container that filters the system call) or turned off with KVTIER_IO_URING=0, the
tier keeps its threads.
"""
from __future__ import annotations

import errno
import logging
import os
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
    """Whether rings work here (checked once: a ring is made and torn down)."""
    if os.environ.get("KVTIER_IO_URING", "1") == "0" or not hasattr(os, "eventfd"):
        return False
    try:
        Ring(2).close()
    except Exception as e:  # noqa: BLE001 - ImportError, a kernel without it, a filtered system call
        log.info("disk tier: io_uring is not available (%s: %s); reading on threads", type(e).__name__, e)
        return False
    return True


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
