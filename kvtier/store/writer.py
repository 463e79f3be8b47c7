"""The second stage of saving: a background thread behind a queue bounded in bytes.

The engine's side (`submit`) only appends to a deque and never waits: when the pending bytes
would exceed the bound, the oldest pending jobs are dropped (and counted) to make room, because
saving is an optimisation and decoding must never stall on it.

The thread runs only while jobs are queued: it exits when the queue is empty and `submit` starts
another. Joining a request's pieces is a parallel torch op, which gives the thread an OpenMP team
of its own, and while it lives every other thread's small ops run slower
(kvtier/engine/transient.py says why).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger("kvtier.store")


@dataclass
class _Job:
    payload: Any
    nbytes: int


class BackgroundWriter:
    def __init__(self, process: Callable[[Any], None], max_bytes: int, name: str = "kvtier-writer") -> None:
        self.process = process
        self.max_bytes = max_bytes
        self._q: deque[_Job] = deque()
        self._cv = threading.Condition()
        self._pending_bytes = 0
        self._busy = False
        self._closed = False
        self.dropped = 0
        self.dropped_bytes = 0
        self.done = 0
        self.failed = 0
        self.name = name
        self._thread: threading.Thread | None = None  # running while jobs are queued
        self._last: threading.Thread | None = None  # the latest started: joined at close, even while exiting

    def submit(self, payload: Any, nbytes: int) -> bool:
        """Queue a job; False if it was dropped (too large for the queue, or writer closed)."""
        with self._cv:
            if self._closed or nbytes > self.max_bytes:
                self.dropped += 1
                self.dropped_bytes += nbytes
                if not self._closed:  # never silently: a lost save is a later recompute
                    log.warning("kvtier store: a save of %d bytes exceeds the writer queue (%d bytes): dropped",
                                nbytes, self.max_bytes)
                return False
            while self._q and self._pending_bytes + nbytes > self.max_bytes:
                old = self._q.popleft()
                self._pending_bytes -= old.nbytes
                self.dropped += 1
                self.dropped_bytes += old.nbytes
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                try:
                    thread.start()
                except RuntimeError as e:  # no thread to write it (the process's limit): dropped, said
                    self.dropped += 1
                    self.dropped_bytes += nbytes
                    log.warning("kvtier store: no writer thread (%s): a save of %d bytes dropped", e, nbytes)
                    return False
                self._thread = self._last = thread
            self._q.append(_Job(payload, nbytes))
            self._pending_bytes += nbytes
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._q:  # idle (or closed): the thread, and its OpenMP team, end here
                    self._thread = None
                    return
                job = self._q.popleft()
                self._pending_bytes -= job.nbytes
                self._busy = True
            try:
                self.process(job.payload)
                self.done += 1
            except Exception:  # a failed save is a lost cache entry, never a dead writer
                self.failed += 1
                log.exception("kvtier store: background save failed")
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    @property
    def idle(self) -> bool:
        """Nothing queued and nothing being written."""
        with self._cv:
            return not self._q and not self._busy

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued job is written. False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._q or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float | None = None) -> None:
        self.flush(timeout)
        with self._cv:
            self._closed = True
            thread = self._last  # also one past its last job: a thread still exiting at interpreter exit aborts it
        if thread is not None:
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            # `process` is the owner's bound method: dropped, the owner is freed by reference
            # counting when its last user lets go (with a memory tier's bytes), not at a later
            # garbage collection whose freeing of them lands as a pause in someone's request.
            self.process = _closed

    def stats(self) -> dict:
        with self._cv:
            return dict(queue_depth=len(self._q), writing=int(self._busy), queue_bytes=self._pending_bytes,
                        queue_capacity_bytes=self.max_bytes, dropped_saves=self.dropped,
                        dropped_bytes=self.dropped_bytes, jobs_done=self.done,
                        jobs_failed=self.failed)


def _closed(payload: Any) -> None:
    raise RuntimeError("the writer is closed")
