"""The IO side of a layer-wise restore: which layers each read takes, and when the new tokens may start."""

from __future__ import annotations

import threading

from kvtier.engine.restore.layerwise import LayerReader
from kvtier.planning.costs import READ_GROUP_LAYERS
from kvtier.store import Repr
from kvtier.store.reads import LayerGroup


class GatedReads:
    """PlannedReads stand-in: each read waits for a permit, then returns an empty group."""

    def __init__(self) -> None:
        self.permits = threading.Semaphore(0)
        self.calls: list[tuple[int, ...]] = []
        self.done = threading.Semaphore(0)

    def read(self, layers, parts, **_kw) -> LayerGroup:
        self.permits.acquire()
        self.calls.append(tuple(layers))
        self.done.release()
        return LayerGroup(tuple(layers), {p: [] for p in parts}, 0)

    def release(self, group: LayerGroup) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_device_read_starts_the_new_tokens_on_its_first_layer_and_ends_a_group_at_the_buffer():
    """Reads from a device (a thread): layer 0 is read alone and a group ends where the read
    buffer does, so the new tokens start after `depth` layers, not after the group that holds the
    depth-th layer; memory reads (no thread) keep their groups."""
    assert READ_GROUP_LAYERS == 4  # the expected groups below are written for it
    layout = [Repr.KV] * 12
    reads = GatedReads()
    reader = LayerReader(reads, layout, first=0, depth=6, threaded=True)  # type: ignore[arg-type]
    assert reader.groups == [(0,), (1, 2, 3, 4), (5,), (6, 7, 8, 9), (10, 11)]
    bubble_free = LayerReader(reads, layout, first=2, depth=3, threaded=True)  # type: ignore[arg-type]
    assert bubble_free.groups == [(2,), (3, 4), (5, 6, 7, 8), (9, 10, 11)]
    assert LayerReader(reads, layout, first=0, depth=6, threaded=False).groups == [tuple(range(12))]  # type: ignore[arg-type]

    reader.start()
    try:
        primed = []
        for _ in range(3):
            assert not reader.primed()
            reads.permits.release()
            assert reads.done.acquire(timeout=10)
            for _ in range(1000):  # the reader thread counts the group right after read() returns
                if reader.has(len(reads.calls) - 1):
                    break
                threading.Event().wait(0.001)
            primed.append(reader.primed())
        assert primed == [False, False, True]  # 1, then 5, then 6 layers read
    finally:
        reads.permits.release(len(reader.groups))  # let the thread finish before close() joins it
        reader.close()
