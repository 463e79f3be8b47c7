"""A cold restore's opening reads each chunk's header and its first layer in one request
(`disk.head_bytes`): the first layer group is then copied from that read, not read again. The
restore still equals a recompute bit for bit (fp32 and bf16, kv and hidden), a bad byte in what
the opening read is still a miss, and where the opening does not read ahead (a first layer over the
cap, heads over the total cap, a store feeding a GPU) the first layer is read as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model
from kvtier.store import format as fmt
from kvtier.store.tiered import TieredStore
from kvtier.store.tiers import disk, uring

from kvtier_testlib import first_logits

CHUNK, HIST, NEW = 64, 320, 9  # 5 whole chunks
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

Request = tuple[str, int, int]  # (file, offset, bytes)


def _engine(model, spec: str | None, method: str = "kv") -> Engine:
    return Engine(model, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024, enable_prefix_cache=False),
                  store=spec, reuse=ReuseConfig(method=method, chunk_tokens=CHUNK) if spec else None)




@pytest.fixture
def requests(monkeypatch) -> list[Request]:
    """Every read request the disk tier makes, on its threads (io_uring off: one path to count)."""
    seen: list[Request] = []
    init, read, scatter = disk._FileReader.__init__, disk._FileReader.read, disk._FileReader.scatter

    def opened(self, path, align):
        init(self, path, align)
        self.path = path

    def counted_read(self, offset, nbytes, out=None):
        seen.append((self.path, offset, nbytes))
        return read(self, offset, nbytes, out)

    def counted_scatter(self, offset, dests):
        seen.append((self.path, offset, sum(d.nbytes for d in dests)))
        return scatter(self, offset, dests)

    monkeypatch.setattr(uring, "available", lambda: False)
    monkeypatch.setattr(disk._FileReader, "__init__", opened)
    monkeypatch.setattr(disk._FileReader, "read", counted_read)
    monkeypatch.setattr(disk._FileReader, "scatter", counted_scatter)
    return seen


def _saved(model, tmp_path: Path, method: str = "kv") -> tuple[str, list[int], list[Path]]:
    ids = torch.randint(3, model.config.vocab_size, (HIST + NEW,), generator=torch.Generator().manual_seed(3)).tolist()
    spec = f"disk:{tmp_path}/d:1GB"
    with _engine(model, spec, method) as e:
        e.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))
        assert e.flush(30)
    files = sorted((tmp_path / "d").rglob("*.kvc"))
    assert len(files) == HIST // CHUNK
    return spec, ids, files


def _first_layer(path: Path) -> tuple[int, int]:
    """Byte range [start, end) of the chunk file's first layer."""
    header = fmt.parse_header(path.read_bytes())
    segs = [s for s in header.segments if s.layer == min(t.layer for t in header.segments)]
    return min(s.offset for s in segs), max(s.offset + s.nbytes for s in segs)


@pytest.mark.parametrize("dtype,method", [("fp32", "kv"), ("bf16", "kv"), ("bf16", "hidden")])
def test_the_first_layer_comes_with_the_header_and_the_restore_equals_recompute(tiny_gqa, tmp_path, requests,
                                                                                dtype, method):
    """kv: the first layer's K/V are copied from the head into the pool; hidden: its hidden states
    are projected from views of the head."""
    model = tiny_gqa if dtype == "fp32" else load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    spec, ids, files = _saved(model, tmp_path, method)
    requests.clear()
    out, logits = first_logits(_engine(model, spec, method), ids, GREEDY)
    ref, ref_logits = first_logits(_engine(model, None), ids, GREEDY)
    assert out.reused_by_tier == {"disk": HIST} and out.restore_method == method
    assert torch.equal(logits, ref_logits) and out.output_ids == ref.output_ids
    for f in files:
        start, end = _first_layer(f)
        mine = [r for r in requests if r[0] == str(f)]
        assert mine[0][1] == 0 and mine[0][2] >= end  # the opening: header and first layer at once
        # No later request reads the first layer again.
        assert all(off >= end or off + n <= start for _, off, n in mine[1:]), mine
        assert len(mine) > 1  # the other layers were read after it


def test_a_flipped_byte_in_the_first_layer_is_a_miss(tiny_gqa, tmp_path, requests):
    spec, ids, files = _saved(tiny_gqa, tmp_path)
    victim = files[2]
    start, end = _first_layer(victim)
    data = bytearray(victim.read_bytes())
    data[(start + end) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    engine = _engine(tiny_gqa, spec)
    tier = engine.link.store.tier("disk")
    out, logits = first_logits(engine, ids, GREEDY)
    ref, ref_logits = first_logits(_engine(tiny_gqa, None), ids, GREEDY)
    assert torch.equal(logits, ref_logits) and out.output_ids == ref.output_ids
    assert tier.counters["corrupt"] == 1  # removed, then saved again from the recompute, intact
    assert victim.read_bytes() != bytes(data)


@pytest.mark.parametrize("why", ["a chunk's first layer over the cap", "the heads' total over the cap",
                                 "a store feeding a GPU"])
def test_a_first_layer_not_read_ahead_is_read_after_the_header(tiny_gqa, tmp_path, requests, monkeypatch, why):
    spec, ids, files = _saved(tiny_gqa, tmp_path)
    if why == "a chunk's first layer over the cap":
        monkeypatch.setattr(disk, "MAX_HEAD_AHEAD", 1024)  # below any chunk's first layer here
    elif why == "the heads' total over the cap":
        monkeypatch.setattr(disk, "MAX_HEADS_AHEAD", 4 * 16384)  # four chunks' first layers, not five
    else:  # heads are pageable memory: a pinned store's first group goes through pinned staging
        pinned = TieredStore.open(spec, None, chunk_tokens=CHUNK, pin=True)
        assert pinned.tier("disk").read_ahead is False  # what the engine on a GPU opens
        pinned.close()
        opened = TieredStore.open

        def as_pinned(*a, **kw):  # the CPU engine's store, with the disk tier as a pinned store has it
            store = opened(*a, **kw)
            store.tier("disk").read_ahead = False
            return store

        monkeypatch.setattr(TieredStore, "open", as_pinned)
    requests.clear()
    out, logits = first_logits(_engine(tiny_gqa, spec), ids, GREEDY)
    ref, ref_logits = first_logits(_engine(tiny_gqa, None), ids, GREEDY)
    assert out.reused_by_tier == {"disk": HIST} and torch.equal(logits, ref_logits)
    for f in files:
        start, end = _first_layer(f)
        mine = [r for r in requests if r[0] == str(f)]
        assert mine[0] == (str(f), 0, min(os.path.getsize(f), disk.HEAD_BYTES))
        assert any(off <= start < off + n for _, off, n in mine[1:])  # read on its own, as before
