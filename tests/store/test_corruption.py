"""Flipped bytes, truncation and foreign chunks are misses: never data, never a crash."""
import shutil

import pytest

from kvtier.store import TieredStore

from store_testlib import make_ns, make_state, open_fds, tokens


def _one_chunk_store(spec, ns):
    store = TieredStore.open(spec, ns, chunk_tokens=16)
    t = tokens(16)
    k, v, _ = make_state(16)
    store.save(t, 0, k, v, None)
    store.flush()
    ref = store.lookup(t).chunks[0]
    return store, t, ref


def _disk_chunks(tmp_path, ns, n):
    """A disk store holding `n` whole 16-token chunks, and their references in order."""
    store = TieredStore.open(f"disk:{tmp_path}:64MB", ns, chunk_tokens=16)
    t = tokens(16 * n)
    k, v, _ = make_state(16 * n)
    store.save(t, 0, k, v, None)
    assert store.flush()
    return store, store.lookup(t).chunks


def _chunk_file(tmp_path):
    (path,) = [p for p in tmp_path.rglob("*.kvc")]
    return path


@pytest.mark.parametrize("where", ["payload", "header", "magic"])
def test_flipped_byte_is_a_miss(tmp_path, ns, where, caplog):
    store, t, ref = _one_chunk_store(f"disk:{tmp_path}:10MB", ns)
    path = _chunk_file(tmp_path)
    data = bytearray(path.read_bytes())
    pos = {"payload": len(data) - 100, "header": 60, "magic": 0}[where]  # 60: in the header JSON
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.read_layers(ref, range(4)) is None
    assert store.stats()["tiers"]["disk"]["corrupt"] == 1
    assert not path.exists()
    assert store.lookup(t).num_tokens == 0
    assert "corrupt" in caplog.text
    store.close()


def test_flipped_byte_in_unread_layer_does_not_block_other_layers(tmp_path, ns):
    store, _, ref = _one_chunk_store(f"disk:{tmp_path}:10MB", ns)
    path = _chunk_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # inside layer 3's V
    path.write_bytes(bytes(data))
    assert store.read_layers(ref, [0], ("k",)) is not None  # layer 0 is intact and checked
    assert store.read_layers(ref, [3], ("v",)) is None
    store.close()


@pytest.mark.parametrize("keep", [0, 10, 300, -1])
def test_truncated_file_is_a_miss(tmp_path, ns, keep):
    store, _, ref = _one_chunk_store(f"disk:{tmp_path}:10MB", ns)
    path = _chunk_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    assert store.read_chunk(ref) is None
    assert store.read_layers(ref, [3]) is None
    store.close()


def test_foreign_model_chunk_at_our_key_is_a_miss(tmp_path, ns):
    """A file from another model placed at our path: the header names another key/model."""
    store, t, ref = _one_chunk_store(f"disk:{tmp_path}/ours:10MB", ns)
    other = make_ns(model="model-b")
    s2, _, _ = _one_chunk_store(f"disk:{tmp_path}/theirs:10MB", other)
    s2.close()
    (foreign,) = list((tmp_path / "theirs").rglob("*.kvc"))
    ours = _chunk_file(tmp_path / "ours")
    shutil.copyfile(foreign, ours)
    assert store.read_chunk(ref) is None
    assert store.stats()["tiers"]["disk"]["corrupt"] == 1
    store.close()


def test_corrupt_memory_copy_falls_back_to_disk(tmp_path, ns):
    store, t, ref = _one_chunk_store(f"memory:1MB,disk:{tmp_path}:10MB", ns)
    path = _chunk_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 1
    path.write_bytes(bytes(data))
    assert store.read_chunk(ref) is not None  # memory copy is intact
    report = store.verify()
    assert not report.clean and report.corrupt[0][0] == "disk"
    assert store.verify().clean
    store.close()


@pytest.mark.parametrize("server", ["redis_url", "redis_cluster_url"])
def test_redis_flipped_byte_and_truncation(server, ns, request):
    store, t, ref = _one_chunk_store(request.getfixturevalue(server), ns)
    tier = store.tier("redis")
    rkey = tier._c(ref.key)
    raw = bytearray(tier.client.get(rkey))
    raw[-100] ^= 1
    tier.client.set(rkey, bytes(raw))
    assert store.read_layers(ref, [3], ("v",)) is None
    assert not tier.client.exists(rkey)
    store.save(t, 0, *make_state(16)[:2], None)
    store.flush()
    tier.client.set(rkey, bytes(raw[:500]))
    assert store.read_chunk(ref) is None
    assert store.stats()["tiers"]["redis"]["corrupt"] == 2
    store.close()


def test_verify_reports_and_removes(tmp_path, ns):
    store, _, _ = _one_chunk_store(f"disk:{tmp_path}:10MB", ns)
    assert store.verify().clean
    path = _chunk_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # the last segment ends the file (its size is a multiple of 64)
    path.write_bytes(bytes(data))
    rep = store.verify()
    assert len(rep.corrupt) == 1 and not path.exists()
    store.close()


@pytest.mark.parametrize("ring", [False, True], ids=["threads", "io_uring"])
def test_opening_many_disk_chunks_at_once_keeps_order_and_leaks_nothing(tmp_path, ns, monkeypatch, ring):
    """The disk tier opens a restore's chunks (open + first pages: on its IO threads, or with one
    io_uring submission) and parses them on the caller's: a truncated file, a vanished one, a
    directory planted in a file's place and a device error after the open, among good chunks, are
    misses in their places, the rest open in order, and no file descriptor is left behind."""
    import os

    from kvtier.store.tiers import disk as disk_module
    from kvtier.store.tiers import uring

    if ring and not uring.available():
        pytest.skip("io_uring is not available on this system")
    store, refs = _disk_chunks(tmp_path, ns, 6)
    disk = store.tier("disk")
    if not ring:
        disk._rings = None
    assert (disk._rings is not None) == ring
    paths = [disk.path_of(r.key) for r in refs]
    with open(paths[1], "r+b") as fh:
        fh.truncate(100)  # a torn file: its header cut short
    os.unlink(paths[3])  # removed behind the tier's back
    os.unlink(paths[4])
    os.mkdir(paths[4])  # a directory where the file was
    opens, reads, ring_reads = disk_module._FileReader.__init__, disk_module._FileReader.read, uring.RingPool.read
    failing_fds: set[int] = set()

    def remember_path(self, path, align):
        opens(self, path, align)
        self.path = path
        if path == paths[2]:
            failing_fds.add(self.fd)

    def failing_read(self, offset, nbytes, out=None):
        if self.path == paths[2]:
            raise OSError(5, "Input/output error")  # the device fails after the file opened
        return reads(self, offset, nbytes, out)

    def failing_ring_read(self, jobs):
        got = ring_reads(self, jobs)
        return [-5 if job.fd in failing_fds else n for job, n in zip(jobs, got)]  # -EIO, as the kernel says it

    monkeypatch.setattr(disk_module._FileReader, "__init__", remember_path)
    monkeypatch.setattr(disk_module._FileReader, "read", failing_read)
    monkeypatch.setattr(uring.RingPool, "read", failing_ring_read)
    if ring:
        disk._rings.read([])  # the ring (and its eventfd), kept for the next reads, exists before the count
    fds = open_fds()
    opened = disk.open_chunks([store._expect(r.key) for r in refs])
    assert [oc is not None for oc in opened] == [True, False, False, False, False, True]
    assert [oc.header.key for oc in opened if oc is not None] == [refs[i].key for i in (0, 5)]
    for oc in opened:
        if oc is not None:
            oc.close()
    assert open_fds() - fds == set()
    assert disk.counters["corrupt"] == 1 and disk.counters["misses"] >= 2
    store.close()


def test_a_learned_segment_table_serves_alike_headers_and_never_a_forged_one(tmp_path, ns):
    """After one fully checked header, chunks of the same length take their segments from its
    table (equal to a full parse); a header whose table differs (a moved segment, a float digest)
    is parsed and checked in full, and is a miss."""
    import json
    from pathlib import Path

    from kvtier.store import format as fmt

    store, refs = _disk_chunks(tmp_path, ns, 7)
    store.close()

    def rewrite(path, edit):  # the header's JSON edited in place, the preamble's length kept
        path = Path(path)
        data = bytearray(path.read_bytes())
        n = fmt.header_length(bytes(data[:fmt.PREAMBLE.size]))
        start = fmt.PREAMBLE.size
        doc = json.loads(bytes(data[start:n]).rstrip(b" \x00"))
        edit(doc)
        raw = json.dumps(doc).encode()
        assert len(raw) <= n - start
        data[start:n] = raw.ljust(n - start, b" ")
        path.write_bytes(bytes(data))

    store = TieredStore.open(f"disk:{tmp_path}:64MB", ns, chunk_tokens=16)  # a restart: nothing learned
    disk = store.tier("disk")
    paths = [disk.path_of(r.key) for r in refs]
    rewrite(paths[1], lambda d: None)  # the control: rewritten unchanged, still good
    rewrite(paths[2], lambda d: d["segments"][3].__setitem__(2, d["segments"][3][2] + 512))  # moved
    rewrite(paths[3], lambda d: d["segments"][0].__setitem__(4, 1.0))  # a float digest
    rewrite(paths[4], lambda d: d["segments"][5].__setitem__(4, True))  # JSON true, equal to 1
    rewrite(paths[5], lambda d: d["segments"].__setitem__(2, d["segments"][2][:3]))  # an entry cut short
    rewrite(paths[6], lambda d: d["segments"].__setitem__(1, {"4": 1}))  # an entry that is no list
    opened = disk.open_chunks([store._expect_chunk(r) for r in refs])
    assert [oc is not None for oc in opened] == [True, True, False, False, False, False, False]
    first, second = opened[0], opened[1]
    assert first is not None and second is not None
    assert not first.header.from_table and second.header.from_table
    full = fmt.parse_header(disk._open(refs[1].key).read(0, 16384).numpy().data, None)
    assert second.header.segments == full.segments and second.header.total_bytes == full.total_bytes
    assert store.read_chunk(refs[1]) is not None  # its bytes still check against its own digests
    for oc in (first, second):
        oc.close()
    store.close()


@pytest.mark.parametrize("which", ["ns", "mixed_ns"])
def test_headers_of_a_learned_table_plan_reads_as_a_full_parse_does(tmp_path, request, which):
    """The chunks whose headers took a learned segment table share its read plans (made once per
    layers and parts); each plan holds the chunk's own segments, digests included, exactly as
    planning from a full parse of its header gives them."""
    from kvtier.store import format as fmt

    ns = request.getfixturevalue(which)
    store = TieredStore.open(f"disk:{tmp_path}:64MB", ns, chunk_tokens=16)
    t = tokens(64)
    store.save(t, 0, *make_state(64))  # k, v and h: the mixed layout stores hidden states too
    assert store.flush()
    refs = store.lookup(t).chunks
    store.close()
    store = TieredStore.open(f"disk:{tmp_path}:64MB", ns, chunk_tokens=16)  # a restart: nothing learned
    disk = store.tier("disk")
    opened = [oc for oc in disk.open_chunks([store._expect_chunk(r) for r in refs]) if oc is not None]
    assert len(opened) == 4 and opened[0].header.table is None
    table = opened[1].header.table
    assert table is not None and all(oc.header.table is table for oc in opened[1:])
    n = len(opened[0].header.layer_reprs)
    for oc in opened:
        full = fmt.parse_header(disk._open(oc.expect.key).read(0, 16384).numpy().data, None)
        for layers in ([0], [1, 2], list(range(1, n)), list(range(n))):
            kinds = {p for li in layers for p in full.layer_reprs[li].parts()}
            for parts in {tuple(sorted(kinds)), *((p,) for p in kinds)}:
                assert oc.plan_read(layers, parts) == fmt.coalesce(full.segments_of(layers, parts)), (layers, parts)
    assert len({oc.header.segments[0].digest for oc in opened}) == 4  # each its own digests, not the table's
    for oc in opened:
        oc.close()
    store.close()
