"""The restore worker's thread lives only while it has work, so the OpenMP team torch gives it
does not outlive its restores (kvtier/engine/transient.py says why that matters)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kvtier.engine.transient import TransientWorker


def _eventually(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _native_threads() -> set[str]:
    """The process's Linux threads (ids): those a call started are told apart from others of the
    suite's coming and going."""
    return set(os.listdir("/proc/self/task"))


def test_calls_run_one_at_a_time_in_order_and_failures_reach_their_futures():
    worker = TransientWorker("test-worker")
    seen: list[int] = []
    running = []
    gate = threading.Event()

    def call(i: int):
        def run() -> int:
            running.append(i)
            assert len(running) == 1, running  # never two at once
            if i == 0:
                gate.wait(5)
            seen.append(i)
            running.remove(i)
            if i == 3:
                raise ValueError("three")
            return i * 10
        return run

    futures = [worker.submit(call(i)) for i in range(5)]
    gate.set()
    assert [f.result(10) for f in futures[:3]] == [0, 10, 20]
    with pytest.raises(ValueError, match="three"):
        futures[3].result(10)
    assert futures[4].result(10) == 40
    assert seen == [0, 1, 2, 3, 4]
    worker.shutdown()
    with pytest.raises(RuntimeError, match="after shutdown"):
        worker.submit(lambda: None)


def test_the_thread_exits_when_idle_and_a_later_call_starts_another():
    worker = TransientWorker("test-worker")
    names = []
    assert worker.submit(lambda: names.append(threading.get_ident())).result(10) is None
    assert _eventually(lambda: not worker.alive)
    assert _eventually(lambda: not any(t.ident == names[0] for t in threading.enumerate() if t.is_alive()))
    worker.submit(lambda: names.append(threading.get_ident())).result(10)
    assert _eventually(lambda: not worker.alive)
    assert len(names) == 2
    worker.shutdown()


@pytest.fixture
def two_threads():
    """torch on two threads for this test (the suite's parallel workers run one each)."""
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(was)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts the Linux threads of an OpenMP team")
def test_the_openmp_team_of_a_call_goes_with_its_thread(two_threads):
    big = torch.ones(20_000_000)
    big.clone()  # this thread's own team, before counting
    before = _native_threads()
    worker = TransientWorker("test-worker")
    during: list[set[str]] = []

    def parallel_op() -> None:
        big.clone()  # a parallel copy: torch starts an OpenMP team for this thread
        during.append(_native_threads())

    worker.submit(parallel_op).result(30)
    started = during[0] - before
    assert len(started) >= 2  # the worker and at least one OpenMP thread of its own
    assert _eventually(lambda: not started & _native_threads()), (started, _native_threads())
    worker.shutdown()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2,
                    reason="counts the Linux threads of an OpenMP team")
def test_the_store_writers_thread_runs_only_while_saves_are_queued(two_threads):
    """Joining a request's pieces for a save is a parallel op: the writer's thread, and the team
    torch gives it, end once the queue is empty; the next save starts another."""
    from kvtier.store.writer import BackgroundWriter

    big = torch.ones(20_000_000)
    big.clone()
    before = _native_threads()
    written: list[int] = []
    during: list[set[str]] = []
    writer = BackgroundWriter(lambda n: (big.clone(), written.append(n), during.append(_native_threads())),
                              max_bytes=1 << 30, name="test-writer")
    for round_ in range(2):
        assert writer.submit(round_, 1) and writer.flush(30)
        started = during[round_] - before
        assert len(started) >= 2  # the writer's thread and its team
        assert _eventually(lambda: not started & _native_threads()), (started, _native_threads())
    assert written == [0, 1]
    writer.close(10)
    assert not writer.submit(2, 1)


def test_shutdown_and_close_join_a_thread_still_exiting_after_its_last_job():
    """A thread past its last job but not yet gone, left running at interpreter exit, aborts the
    process: shutdown and close wait for it."""
    from kvtier.store.writer import BackgroundWriter

    worker = TransientWorker("test-worker")
    worker.submit(lambda: None).result(10)
    worker.shutdown()
    assert worker._last is not None and not worker._last.is_alive()
    writer = BackgroundWriter(lambda _: None, max_bytes=1 << 20, name="test-writer")
    assert writer.submit(0, 1) and writer.flush(10)
    writer.close(10)
    assert writer._last is not None and not writer._last.is_alive()


def test_a_thread_that_cannot_start_leaves_nothing_queued_for_no_one(monkeypatch):
    from kvtier.store.writer import BackgroundWriter

    start = threading.Thread.start
    refuse = [True]

    def flaky(self):
        if refuse[0] and self.name.startswith("test-"):
            refuse[0] = False
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", flaky)
    worker = TransientWorker("test-worker")
    with pytest.raises(RuntimeError, match="can't start"):
        worker.submit(lambda: 1)
    assert worker.submit(lambda: 2).result(10) == 2  # the refused call is gone, the next one runs
    worker.shutdown()
    refuse[0] = True
    writer = BackgroundWriter(lambda _: None, max_bytes=1 << 20, name="test-writer")
    assert not writer.submit(0, 5) and writer.dropped == 1 and writer.dropped_bytes == 5
    assert writer.submit(1, 1) and writer.flush(10) and writer.done == 1
    writer.close(10)
