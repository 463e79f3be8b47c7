"""The threads grammars are compiled on: a large stack, off the event loop and the step thread.

The grammar engine compiles recursively, so a spec deeper than grammar_limits.py measures would
overflow an ordinary thread's stack (8 MiB) and kill the process; these threads have 256 MiB
(address space, touched only as used), far past the depth the limits let through.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

STACK_BYTES = 256 << 20
WORKERS = 2

_create_lock = threading.Lock()
_pool: GrammarThreads | None = None


class GrammarThreads:
    """A few daemon threads taking work from one queue; `submit` returns a Future."""

    def __init__(self, workers: int = WORKERS, stack_bytes: int = STACK_BYTES):
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = queue.SimpleQueue()
        # threading.stack_size applies to threads started after it, process-wide: set it only
        # around these threads' start (under the module's lock).
        previous = threading.stack_size(stack_bytes)
        try:
            self._threads = [threading.Thread(target=self._run, name=f"kvtier-grammar-{i}", daemon=True)
                             for i in range(workers)]
            for t in self._threads:
                t.start()
        finally:
            threading.stack_size(previous)

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue  # its caller stopped waiting before it started
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, who raises it
                future.set_exception(e)


def grammar_threads() -> GrammarThreads:
    """The process's grammar threads, started on first use."""
    global _pool
    with _create_lock:
        if _pool is None:
            _pool = GrammarThreads()
        return _pool
