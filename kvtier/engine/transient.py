"""A worker for torch work off the step thread whose thread lives only while it has work.

torch's CPU ops run on an OpenMP team per calling thread (libgomp in torch's wheels), and libgomp
keeps a thread's team until the thread exits. While the process holds more OpenMP threads than
CPUs, libgomp lets every team's workers sleep between parallel regions instead of spinning, so
each small op of every thread (the step thread's too) waits for its team to wake: a decode step
takes about twice as long (docs/benchmarks.md, "torch on more than one thread"). A thread pool's
idle thread would keep its team, and so that slowdown, for the rest of the process after its first
job; this worker's thread exits once its queue is empty, and its team with it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class TransientWorker:
    """Runs submitted calls one at a time, in the order submitted, on a thread started for them
    that exits when none is left (`concurrent.futures.Future` results, like an executor's)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: deque[tuple[Future, Callable[[], Any]]] = deque()
        self._thread: threading.Thread | None = None  # running calls (None once it has taken its last)
        self._last: threading.Thread | None = None  # the latest started: joined at shutdown, even while exiting
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: submit after shutdown")
            self._queue.append((future, fn))
            if self._thread is None:
                thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                try:
                    thread.start()
                except BaseException:  # no thread for it (the process's limit): never a call queued for no one
                    self._queue.pop()
                    raise
                self._thread = self._last = thread
        return future

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None  # a later submit starts a new thread
                    return
                future, fn = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # the caller's future carries it, as an executor's does
                future.set_exception(e)

    @property
    def alive(self) -> bool:
        """Whether a thread runs (or is about to run) calls now."""
        with self._lock:
            return self._thread is not None

    def shutdown(self, wait: bool = True) -> None:
        """Take no more calls; with `wait`, return once those queued have run."""
        with self._lock:
            self._closed = True
            thread = self._last
        if wait and thread is not None:
            thread.join()  # also one past its last call: a thread still exiting at interpreter exit aborts it
