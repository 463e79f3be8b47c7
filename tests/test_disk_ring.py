"""The disk tier's io_uring reads (kvtier/store/tiers/uring.py): a cold kv restore's reads straight
into the pool go through one ring per layer group and restore exactly what a recompute computes; a
bad byte is still a miss; the ring itself returns every read's count, short reads and errors
included, whatever the number of reads; and KVTIER_IO_URING=0 turns it off."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model
from kvtier.store.staging import Staging
from kvtier.store.tiers import disk, uring

from kvtier_testlib import first_logits

pytestmark = pytest.mark.skipif(not uring.available(), reason="io_uring is not available on this system")

CHUNK, HIST, NEW = 64, 320, 9  # 5 whole chunks: each layer's K or V of a chunk is whole 512-byte blocks
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _engine(model, spec: str | None) -> Engine:
    return Engine(model, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024, enable_prefix_cache=False),
                  store=spec, reuse=ReuseConfig(method="kv", chunk_tokens=CHUNK) if spec else None)


def _ids(model) -> list[int]:
    return torch.randint(3, model.config.vocab_size, (HIST + NEW,), generator=torch.Generator().manual_seed(5)).tolist()




def _saved(model, spec: str, ids: list[int]) -> None:
    with _engine(model, spec) as e:
        e.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))
        assert e.flush(30)


@pytest.fixture
def ring_jobs(monkeypatch) -> list[int]:
    """Reads submitted per ring call, and no read of a chunk on the threads."""
    jobs: list[int] = []
    read = uring.RingPool.read

    def counted(self, js):
        jobs.append(len(js))
        return read(self, js)

    def no_threads(*a, **kw):
        raise AssertionError("a chunk was read on the threads")

    monkeypatch.setattr(uring.RingPool, "read", counted)
    monkeypatch.setattr(disk.DiskTier, "_try_read", staticmethod(no_threads))
    return jobs


def _restore_matches_recompute(model, tmp_path) -> dict:
    """Save the history, restart, restore it from disk: the first step's logits and the tokens
    equal a recompute's bit for bit. -> the restoring disk tier's usage()."""
    ids, spec = _ids(model), f"disk:{tmp_path}/d:1GB"
    _saved(model, spec, ids)
    engine = _engine(model, spec)
    usage = engine.link.store.tier("disk").usage()
    out, logits = first_logits(engine, ids, GREEDY)
    ref, ref_logits = first_logits(_engine(model, None), ids, GREEDY)
    assert out.reused_by_tier == {"disk": HIST} and out.restore_method == "kv"
    assert torch.equal(logits, ref_logits) and out.output_ids == ref.output_ids
    return usage


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_cold_kv_restore_reads_through_the_ring_and_equals_recompute(tiny_gqa, tmp_path, ring_jobs, dtype,
                                                                       monkeypatch):
    model = tiny_gqa if dtype == "fp32" else load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    taken: list[int] = []
    take = Staging.take
    monkeypatch.setattr(Staging, "take", lambda self, n: taken.append(n) or take(self, n))
    assert _restore_matches_recompute(model, tmp_path)["io_uring"] is True
    # Every layer group of every chunk went in one submission per group: 5 chunks per call.
    assert ring_jobs and all(n == HIST // CHUNK for n in ring_jobs)
    assert taken == []  # straight into the pool: no staging buffer was taken for any group


@pytest.mark.parametrize("where", ["header", "payload"])
def test_a_flipped_byte_read_on_the_ring_is_a_miss(tiny_gqa, tmp_path, where):
    ids, spec = _ids(tiny_gqa), f"disk:{tmp_path}/d:1GB"
    _saved(tiny_gqa, spec, ids)
    files = sorted((tmp_path / "d").rglob("*.kvc"), key=os.path.getmtime)
    assert len(files) == HIST // CHUNK
    victim = files[2]
    data = bytearray(victim.read_bytes())
    # The header's JSON (its own checksum fails at open), or the payload (the header checks, the
    # segment's CRC does not, after the read landed in the pool)
    data[{"header": 60, "payload": -600}[where]] ^= 0x10
    victim.write_bytes(bytes(data))
    engine = _engine(tiny_gqa, spec)
    tier = engine.link.store.tier("disk")
    out, _ = first_logits(engine, ids, GREEDY)
    ref, _ = first_logits(_engine(tiny_gqa, None), ids, GREEDY)
    assert out.output_ids == ref.output_ids
    assert tier.counters["corrupt"] == 1  # removed, then saved again from the recompute, intact
    assert victim.read_bytes() != bytes(data)


def test_the_ring_returns_every_count_in_waves(tmp_path):
    payload = os.urandom(64 << 10)
    path = tmp_path / "f"
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    bad = os.open(tmp_path, os.O_RDONLY)  # a directory: its read fails, and -EISDIR comes back
    bufs = [bytearray(4096) for _ in range(11)]
    jobs = [uring.ReadJob(fd, i * 5000, [memoryview(b)]) for i, b in enumerate(bufs[:9])]
    jobs.append(uring.ReadJob(fd, len(payload) - 100, [memoryview(bufs[9])]))  # past the end: short
    jobs.append(uring.ReadJob(bad, 0, [memoryview(bufs[10])]))
    ring = uring.Ring(4)  # fewer entries than reads: submitted in waves as reads complete
    try:
        got = ring.read(jobs)
    finally:
        ring.close()
        os.close(fd)
        os.close(bad)
    assert got[:9] == [4096] * 9 and got[9] == 100 and got[10] == -errno.EISDIR
    for i, b in enumerate(bufs[:9]):
        assert bytes(b) == payload[i * 5000:i * 5000 + 4096]
    assert bytes(bufs[9][:100]) == payload[-100:]


def test_kvtier_io_uring_0_reads_on_the_threads(tiny_gqa, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_IO_URING", "0")
    uring.available.cache_clear()
    try:
        assert _restore_matches_recompute(tiny_gqa, tmp_path)["io_uring"] is False
    finally:
        monkeypatch.delenv("KVTIER_IO_URING")
        uring.available.cache_clear()


def test_concurrent_readers_each_get_a_ring(tmp_path):
    """Restores read at once from their own threads: the pool hands each call a ring of its own
    (a ring is not shared between threads), and every read lands where its job said."""
    import threading

    payload = os.urandom(1 << 20)
    path = tmp_path / "f"
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    pool = uring.RingPool()
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def reader(seed: int) -> None:
        try:
            start.wait()
            for round_ in range(20):
                offs = [(seed * 7919 + round_ * 104729 + i * 65537) % (len(payload) - 4096) for i in range(8)]
                bufs = [bytearray(4096) for _ in offs]
                got = pool.read([uring.ReadJob(fd, o, [memoryview(b)]) for o, b in zip(offs, bufs)])
                assert got == [4096] * len(offs)
                assert all(bytes(b) == payload[o:o + 4096] for o, b in zip(offs, bufs))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    kept = len(pool._free)  # one ring per reader that ran at the same time as another, kept for reuse
    pool.close()
    os.close(fd)
    assert not errors, errors[0]
    assert 1 <= kept <= 4
