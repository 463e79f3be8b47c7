"""Blended restores (non-prefix reuse) in the engine: every token recomputed equals an exact
prefill bit for bit; the plan and the bits do not depend on the batch; tenants never see each
other's segments; blended state never serves an exact lookup; hostile segment bytes are misses."""
from __future__ import annotations

import dataclasses
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.link import restorer as restorer_module
from kvtier.engine.prompts import PromptError
from kvtier.engine.request import SamplingParams
from kvtier.engine.restore import blend as blend_module
from kvtier.engine.restore.blend import _stacked
from kvtier.engine.restore.segments import SPACE, SegmentReads, SegmentStates
from kvtier.engine.runner.model_runner import ModelRunner
from kvtier.models.loading import load_model
from kvtier.models.presets import PRESETS
from kvtier.planning.blend import BlendOptions, pieces
from kvtier.planning.costs import READ_GROUP_LAYERS
from kvtier.store import reads as reads_module
from kvtier.testing.transfers import RecordingTransfer

N = 300
SEGMENTS = ((20, 120), (125, 260))  # two documents, text between and after them
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, first_logits=True)
EVERY_TOKEN = BlendOptions(link_tokens=10**6)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def model(request):
    return load_model("tiny-gqa", dtype=request.param, tokenizer=False)


@pytest.fixture(scope="module")
def fp32():
    return load_model("tiny-gqa", dtype="fp32", tokenizer=False)


def _ids(model, seed: int = 3, n: int = N) -> list[int]:
    return torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, store: str = "memory:256MB", **reuse) -> Engine:
    return Engine(model, store=store, reuse=ReuseConfig(chunk_tokens=64, blend=BlendOptions(), **reuse))


def _blend(engine: Engine, ids, options=None, salt: str | None = None, segments=SEGMENTS):
    rid = engine.add_request(ids, GREEDY, cache_salt=salt, segments=segments, blend=True if options is None else options)
    final = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final[rid]


def test_every_token_recomputed_is_an_exact_prefill_bit_for_bit(model):
    ids = _ids(model)
    with Engine(model) as plain:
        want = plain.generate([ids], GREEDY)[0]
    with _engine(model) as engine:
        engine.precompile([ids[a:b] for a, b in SEGMENTS])
        out = _blend(engine, ids, EVERY_TOKEN)
        assert engine.flush(30)
        again = engine.generate([ids], GREEDY)[0]  # not blending: its prefix is the device's
        engine.reset_prefix_cache()
        stored = engine.generate([ids], GREEDY)[0]  # then the store's
    assert out.restore is not None and out.restore.method == "blend"
    assert out.restore.recomputed_tokens == N - 1 and out.restore.blended_tokens == 0
    assert out.restore.bytes_read == 0  # nothing loaded: no document read
    assert torch.equal(out.first_logits, want.first_logits)
    assert out.output_ids == want.output_ids
    # Every token being exact, its whole blocks were published on the device and its whole chunks
    # saved under the exact keys, and both give a prefill's bits.
    assert again.reused_by_tier == {"device": (N - 1) // 16 * 16}
    assert stored.reused_by_tier == {"memory": N // 64 * 64}
    for o in (again, stored):
        assert torch.equal(o.first_logits, want.first_logits)


def test_the_default_blend_loads_the_segments_and_recomputes_the_rest(fp32):
    ids = _ids(fp32)
    with _engine(fp32) as engine:
        first = _blend(engine, ids)
        assert engine.flush(30)
        engine.reset_prefix_cache()  # (its exact lead's blocks: the device would serve them)
        again = _blend(engine, ids)
    k = BlendOptions().link_tokens
    loaded = sum(b - a - k for a, b in SEGMENTS)
    for out in (first, again):
        assert out.restore.blended_tokens == loaded
        assert out.restore.recomputed_tokens == N - 1 - loaded
        assert out.prompt_tokens_reused == 0  # nothing exact was reused
    assert torch.equal(first.first_logits, again.first_logits)  # stored state is the state computed alone


GAPS = ((20, 120), (121, 200), (201, 260))  # one-token runs between documents


@pytest.mark.parametrize("options,segments", [(BlendOptions(), SEGMENTS),
                                              (BlendOptions(mode="cacheblend", ratio=0.2), SEGMENTS),
                                              (BlendOptions(mode="naive"), GAPS)],
                         ids=["legolink", "cacheblend", "naive-one-token-gaps"])
def test_the_plan_and_the_bits_are_the_same_across_runs_and_batches(fp32, options, segments):
    ids = _ids(fp32)
    with _engine(fp32) as engine:
        alone = _blend(engine, ids, options, segments=segments)
        assert engine.flush(30)
        engine.reset_prefix_cache()  # each from nothing on the device (its exact lead's blocks are published)
        again = _blend(engine, ids, options, segments=segments)
        engine.reset_prefix_cache()
        # In a batch: other requests prefilling and decoding beside it.
        for seed in (9, 10):
            engine.add_request(_ids(fp32, seed=seed, n=200), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        batched = _blend(engine, ids, options, segments=segments)
    for out in (again, batched):
        assert out.restore.recomputed_tokens == alone.restore.recomputed_tokens
        assert out.restore.blended_tokens == alone.restore.blended_tokens
        assert torch.equal(out.first_logits, alone.first_logits)
        assert out.output_ids == alone.output_ids


def test_the_bits_do_not_depend_on_whether_the_requests_blocks_lie_consecutive(model):
    """Where the request's blocks are consecutive in the pool, the scattered pass reads its keys in
    place and the loaded rows are rotated straight into their slots, a stored chunk's piece at a
    time (a read group's layers at once); else the pieces are joined, and keys and rows gathered
    and scattered. Documents computed
    alone, read back whole and read back into a pool that cut the request at every block give the
    same bits (fp32 and bf16)."""
    ids = _ids(model)
    with _engine(model) as engine:
        computed = _blend(engine, ids)  # each document computed alone: one piece
        assert engine.flush(30)
        runner, bs = engine.runner, engine.runner.block_size
        layers_a_call: list[int] = []
        place = runner.rotate_in_layers

        def placed(layers, *a, **k):
            layers_a_call.append(len(layers))
            return place(layers, *a, **k)

        runner.rotate_in_layers = placed  # type: ignore[method-assign]
        engine.reset_prefix_cache()  # each from nothing on the device (its exact lead's blocks are published)
        whole = _blend(engine, ids)  # read back: a piece per stored chunk (64 tokens; documents of 100 and 135)
        assert READ_GROUP_LAYERS in layers_a_call  # read groups placed at once: the path compared here
        # The same slots, cut into one run per block (every user of the runs reads them as given).
        runner.slot_runs = lambda block_ids, start, end: [  # type: ignore[method-assign]
            r for b in range(start - start % bs, end, bs)
            for r in ModelRunner.slot_runs(runner, block_ids, max(b, start), min(b + bs, end))]
        engine.reset_prefix_cache()
        gathered = _blend(engine, ids)
    assert computed.restore.bytes_read == 0 and whole.restore.bytes_read > 0 and gathered.restore.bytes_read > 0
    for out in (whole, gathered):
        assert out.restore.recomputed_tokens == computed.restore.recomputed_tokens
        assert torch.equal(out.first_logits, computed.first_logits) and out.output_ids == computed.output_ids


def test_tenants_never_see_each_others_segments(fp32):
    ids = _ids(fp32)
    with _engine(fp32) as engine:
        _blend(engine, ids, salt="tenant-a")
        assert engine.flush(30)
        b = _blend(engine, ids, salt="tenant-b")
        a = _blend(engine, ids, salt="tenant-a")
        store = engine.store
        seg = ids[SEGMENTS[0][0]:SEGMENTS[0][1]]
        assert store.lookup(seg, "tenant-a", SPACE).num_tokens == len(seg)
        assert store.lookup(seg, "", SPACE).num_tokens == 0
    assert b.restore.bytes_read == 0  # tenant b computed the segments alone: it found none of a's
    assert a.restore.bytes_read > 0
    assert torch.equal(a.first_logits, b.first_logits)


def _final(engine: Engine, rid: str):
    while engine.has_work():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                return out
    raise AssertionError(f"{rid} did not finish")


def test_documents_precompiled_are_found_in_a_prompt_that_marks_none(fp32):
    ids = _ids(fp32)
    docs = [ids[a:b] for a, b in SEGMENTS]
    with _engine(fp32) as engine:
        marked = _blend(engine, ids, salt="tenant-c")
        assert engine.precompile(docs, "tenant-a") == (0, 2)
        assert engine.flush(30)
        found = _final(engine, engine.add_request(ids, GREEDY, cache_salt="tenant-a"))
        other = _final(engine, engine.add_request(ids, GREEDY, cache_salt="tenant-b"))
        refused = _final(engine, engine.add_request(ids, GREEDY, cache_salt="tenant-a", blend=False))
        engine.corpus.add([(None, d) for d in docs])  # every tenant's, as --blend-corpus gives them
        everyone = _final(engine, engine.add_request(ids, GREEDY, cache_salt="tenant-d"))
    # Found unmarked, the documents blend as marked ones do: loaded (tenant a's precompiled state), the same bits.
    assert found.restore.method == "blend" and found.restore.bytes_read > 0
    assert found.restore.blended_tokens == marked.restore.blended_tokens > 0
    assert torch.equal(found.first_logits, marked.first_logits)
    # Tenant a's documents are not searched for in tenant b's prompt, nor in a request that refuses to blend.
    for out in (other, refused):
        assert out.restore is None or out.restore.blended_tokens == 0
    assert not torch.equal(other.first_logits, marked.first_logits)
    assert everyone.restore.blended_tokens == marked.restore.blended_tokens
    assert torch.equal(everyone.first_logits, marked.first_logits)


def test_a_blended_request_never_serves_an_exact_lookup(fp32):
    ids = _ids(fp32)
    with Engine(fp32) as plain:
        want = plain.generate([ids], GREEDY)[0]
    with _engine(fp32) as engine:
        _blend(engine, ids)
        assert engine.flush(30)
        store = engine.store
        assert store.lookup(ids).num_tokens == 0  # nothing saved under the prompt's exact keys
        seg = ids[SEGMENTS[0][0]:SEGMENTS[0][1]]
        assert store.lookup(seg).num_tokens == 0  # segment state lies in its own key space
        exact = engine.generate([ids], GREEDY)[0]  # the same prompt, not blending
    # No stored chunk; on the device only the whole blocks of its exact lead (the text before the
    # first document and that document's link rows: 28 tokens), none holding a loaded row.
    lead = SEGMENTS[0][0] + BlendOptions().link_tokens
    assert exact.reused_by_tier == {"device": lead // 16 * 16} and exact.restore is None
    assert torch.equal(exact.first_logits, want.first_logits)


@pytest.mark.parametrize("options, hidden", [(BlendOptions(), False), (BlendOptions(mode="naive"), False),
                                             (BlendOptions(mode="cacheblend", ratio=0.3), False),
                                             (BlendOptions(), True)],
                         ids=["legolink", "naive", "cacheblend", "legolink-hidden-layers"])
def test_the_exact_rows_before_the_first_loaded_one_are_saved_under_the_exact_keys(model, options, hidden):
    ids = _ids(model)
    layers = model.config.num_layers
    layout = ("hidden", "kv") * (layers // 2) + ("kv",) * (layers % 2) if hidden else None
    segments = ((150, 230), (235, 290))  # 150 exact tokens lead: two whole chunks of 64
    other = ids[:150] + _ids(model, seed=6, n=60)  # a later request sharing that lead
    with Engine(model) as plain:
        want = plain.generate([other], GREEDY)[0]
    with _engine(model, layout=layout) as engine:
        out = _blend(engine, ids, options, salt="a", segments=segments)
        assert engine.flush(30)
        assert out.restore.blended_tokens > 0
        store = engine.store
        assert store.lookup(ids, "a").num_tokens == 128  # whole chunks only, none past a loaded row
        assert store.lookup(ids).num_tokens == 0  # under the request's tenant only
        engine.reset_prefix_cache()  # (the device holds the lead's whole blocks too)
        again = _blend(engine, other, False, salt="a", segments=())  # an exact request
    assert again.reused_by_tier == {"memory": 128}
    assert torch.equal(again.first_logits, want.first_logits)


@pytest.mark.parametrize("where", ["device", "store", "store, copied to a device"])
def test_the_exact_prefix_comes_from_the_device_or_the_store_exactly(fp32, tmp_path, where, monkeypatch):
    """(copied to a device: the recording back end, whose copies deliver garbage until waited on)"""
    rec = RecordingTransfer()
    ids = _ids(fp32)
    head = ids[:128] + _ids(fp32, seed=5, n=50)  # an exact request sharing the first 128 tokens
    store = f"disk:{tmp_path}/d:64MB"
    with _engine(fp32, store) as engine:
        engine.generate([head], SamplingParams(max_tokens=1, temperature=0.0))
        assert engine.flush(30)
        if where == "device":
            out = _blend(engine, ids, EVERY_TOKEN)
    if where.startswith("store"):
        if "copied" in where:
            monkeypatch.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda device: rec)
        with _engine(fp32, store) as engine:  # a fresh device: the prefix comes from the disk
            out = _blend(engine, ids, EVERY_TOKEN)
        monkeypatch.undo()
    if "copied" in where:
        assert rec.uploads and rec.uploads[0] == 2, rec.uploads  # its two chunks, a copy each
    with Engine(fp32) as plain:
        want = plain.generate([ids], GREEDY)[0]
    assert out.prompt_tokens_reused == 128  # exact: the device's whole blocks, or the stored chunks
    assert out.reused_by_tier == ({"device": 128} if where == "device" else {"disk": 128})
    assert torch.equal(out.first_logits, want.first_logits)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_documents_read_from_a_tier_on_their_thread_give_the_bits_computed_alone(fp32, tmp_path, request, tier):
    ids = _ids(fp32)
    store = f"disk:{tmp_path}/d:64MB" if tier == "disk" else request.getfixturevalue("redis_url")
    with _engine(fp32, store) as engine:
        computed = _blend(engine, ids)
        assert engine.flush(30)
    with _engine(fp32, store) as engine:  # a fresh process's view: only the tier holds them
        read = _blend(engine, ids)
    assert read.restore.bytes_read > 0 and computed.restore.bytes_read == 0
    assert torch.equal(read.first_logits, computed.first_logits)


def _deep(dtype: str, layers: int = 11):
    """tiny-gqa with 11 layers: three read groups of READ_GROUP_LAYERS, the last one short (with
    9, a group of one layer last)."""
    name = "tiny-deep" if layers == 11 else f"tiny-deep-{layers}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, name, dataclasses.replace(PRESETS["tiny-gqa"], num_layers=layers))
        return load_model(name, dtype=dtype, tokenizer=False)


@pytest.fixture(scope="module")
def deep():
    return _deep("fp32")


def test_documents_read_from_a_disk_land_in_the_stores_staging_memory_given_back_group_by_group(deep, tmp_path,
                                                                                               monkeypatch):
    """Fresh read memory faults its pages in (on a process's first blend, more than the reads
    take): disk reads use the store's staging pool. Each read group's memory goes back once its
    layers are placed, before the restore ends, and nothing reads it after: memory given back is
    overwritten here, and the bits stay those of the documents computed alone. A second blend
    reads into memory the first gave back."""
    assert deep.config.num_layers > 2 * READ_GROUP_LAYERS
    ids = _ids(deep)
    store = f"disk:{tmp_path}/d:64MB"
    with _engine(deep, store) as engine:
        want = _blend(engine, ids)
        assert engine.flush(30)
    with _engine(deep, store) as engine:
        staging, disk = engine.store.staging, engine.store.tier("disk")
        taken: list[int] = []
        given: list[int] = []
        given_before_close: list[int] = []
        take, give, close = staging.take, staging.give, blend_module._Loader.close

        def poisoned(b: torch.Tensor) -> None:
            given.append(b.data_ptr())
            b.fill_(0xFF)  # NaN in every float dtype: a view read after this shows in the logits
            give(b)

        def closing(loader, wait: bool = True):
            given_before_close.append(len(given))
            return close(loader, wait)

        monkeypatch.setattr(staging, "take", lambda n: (b := take(n), taken.append(b.data_ptr()))[0])
        monkeypatch.setattr(staging, "give", poisoned)
        monkeypatch.setattr(blend_module._Loader, "close", closing)
        read0 = disk.counters["bytes_read"]
        first = _blend(engine, ids)
        read1 = disk.counters["bytes_read"]
        assert engine.flush(30)
        engine.store.discard(engine.store.keys_for(ids))  # the exact rows it saved: the next reads every document
        engine.reset_prefix_cache()  # and computes its lead again (on CUDA the lead's bits depend on its passes)
        assert len(taken) >= 3 and sorted(given) == sorted(taken)  # a buffer a group, every one back
        assert given_before_close[0] >= 2  # groups went back as they were placed, not all at the end
        first_given = set(given)
        taken.clear()
        second = _blend(engine, ids)
        assert disk.counters["bytes_read"] - read1 == read1 - read0 > 0
    assert first_given & set(taken)  # the second blend read into memory the first gave back
    assert torch.equal(first.first_logits, want.first_logits) and torch.equal(second.first_logits, want.first_logits)


@pytest.mark.parametrize("options, segments, tier", [(None, SEGMENTS, "memory"), (None, SEGMENTS, "disk"),
                                                     (BlendOptions(mode="cacheblend", ratio=0.2), SEGMENTS, "memory"),
                                                     (BlendOptions(mode="naive"), GAPS, "memory"),
                                                     (None, SEGMENTS, "memory, hidden layers"),
                                                     (None, SEGMENTS, "memory, bf16"),
                                                     (None, SEGMENTS, "memory, 9 layers")],
                         ids=["legolink", "legolink-disk", "cacheblend", "naive-three-documents", "hidden-layers",
                              "legolink-bf16", "legolink-a-one-layer-group"])
def test_stored_documents_go_to_a_device_packed_a_submission_per_read_group(deep, monkeypatch, tmp_path, options,
                                                                            segments, tier):
    """Off the CPU (the recording back end: CUDA's operations, copies that deliver garbage until
    waited on), a read group of every stored document goes over as one submission of a run per
    stored chunk, is packed by one gather and placed with one rotation and two scatters; the
    bits are the host path's. A group mixing hidden-state and K/V layers goes over as views, a
    copy per chunk and run of one kind of layer."""
    if "bf16" in tier:
        deep = _deep("bf16")
    if "9 layers" in tier:
        deep = _deep("fp32", 9)
    ids = _ids(deep)
    layers = deep.config.num_layers
    layout = ("hidden", "kv") * (layers // 2) + ("kv",) * (layers % 2) if "hidden" in tier else None

    def blend_read(rec: RecordingTransfer | None):
        with pytest.MonkeyPatch.context() as mp:
            if rec is not None:
                mp.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda device: rec)
            with _engine(deep, f"disk:{tmp_path}/{rec is None}:64MB" if tier == "disk" else "memory:256MB",
                         layout=layout) as engine:
                _blend(engine, ids, options, segments=segments)  # the documents computed alone and stored
                assert engine.flush(30)
                engine.store.discard(engine.store.keys_for(ids))  # the exact rows it saved
                engine.reset_prefix_cache()
                if rec is not None:
                    rec.uploads.clear()
                return _blend(engine, ids, options, segments=segments)

    want = blend_read(None)
    rec = RecordingTransfer()
    placed: list[int] = []
    place_rows = ModelRunner.place_rows
    monkeypatch.setattr(ModelRunner, "place_rows", lambda self, layers, *a: (placed.append(len(layers)),
                                                                             place_rows(self, layers, *a))[1])
    got = blend_read(rec)
    assert got.restore.bytes_read > 0 and torch.equal(got.first_logits, want.first_logits)
    sizes = [len(range(a, min(a + READ_GROUP_LAYERS, deep.config.num_layers)))
             for a in range(0, deep.config.num_layers, READ_GROUP_LAYERS)]
    # Nothing else went over this way (no exact prefix stored); a run per stored chunk: documents
    # of 100 and 135 rows (or 100, 79 and 59) in 64-row chunks.
    if layout is not None:  # every group mixes the two: a view per layer and piece, a copy per chunk and run
        assert placed == [] and len(rec.uploads) == len(_same_runs(layout)), rec.uploads
        assert all(u == 5 for u in rec.uploads), rec.uploads
        return
    assert placed == sizes  # a group of every document placed at once
    if tier == "memory":
        assert rec.uploads == [5] * len(sizes), rec.uploads
    else:  # a disk's partial chunk may read its K and V apart: a run each
        assert len(rec.uploads) == len(sizes) and all(5 <= u <= 10 for u in rec.uploads), rec.uploads


def test_the_loader_holds_at_most_two_read_groups(deep, tmp_path, monkeypatch):
    """The loader holds at most READ_AHEAD groups (the one placed and the next), placing made slow here: a
    blend's memory for reads (disk staging, device copies) stays two groups' whatever the
    documents' size; the bits are those of an unhurried blend."""
    ids = _ids(deep)
    store = f"disk:{tmp_path}/d:64MB"
    with _engine(deep, store) as engine:
        want = _blend(engine, ids)
        assert engine.flush(30)
    held: list[int] = []
    read, place = SegmentReads.read, blend_module.BlendRestore._place
    monkeypatch.setattr(SegmentReads, "read", lambda self, layers: (read(self, layers), held.append(len(self._held)))[0])
    monkeypatch.setattr(blend_module.BlendRestore, "_place", lambda self, li: (time.sleep(0.05), place(self, li))[1])
    with _engine(deep, store) as engine:
        got = _blend(engine, ids)
    assert got.restore.bytes_read > 0 and torch.equal(got.first_logits, want.first_logits)
    assert len(held) == 3 and max(held) == blend_module.READ_AHEAD == 2, held


def _same_runs(layout) -> list[range]:
    """The runs of one kind of layer within each read group (what a group's read asks for at once)."""
    from kvtier.engine.restore.segments import _same_repr
    from kvtier.store.layout import Repr

    reprs = [Repr(r) for r in layout]
    return [run for a in range(0, len(reprs), READ_GROUP_LAYERS)
            for run in _same_repr(reprs, range(a, min(a + READ_GROUP_LAYERS, len(reprs))))]


@pytest.mark.parametrize("where", ["restore worker", "step", "step, hung read"])
def test_a_read_that_raises_or_hangs_gives_its_staging_back_and_the_documents_are_computed_alone_or_the_request_prefills(
        deep, tmp_path, monkeypatch, where):
    """A read that fails (again, once looked up afresh): on the restore worker the documents are
    computed alone; in the request's step, where that would hold every other request for a
    prefill's worth of work, the restore is a miss at once (no second try) and the request
    prefills in chunks: an exact prefill's logits. A read that hangs past the step's wait is a miss
    the same way, the step never waiting for the read itself: the read still hangs when the
    request is done, its thread gives the staging memory back once it ends, and a blend reading a
    disk right after goes to the restore worker. Either way the staging memory goes back."""
    ids = _ids(deep)
    store = f"disk:{tmp_path}/d:64MB"
    with _engine(deep, store) as engine:
        want = _blend(engine, ids)
        assert engine.flush(30)
    with Engine(deep) as plain:
        exact = plain.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, first_logits=True))[0]
    decode = reads_module.fmt.decode_run
    entered, release = [], threading.Event()

    def hostile(header, segments, layers, part):
        if layers[0] >= READ_GROUP_LAYERS and not release.is_set():  # the second group: after a first was placed
            entered.append(layers[0])
            if where == "step, hung read":
                assert release.wait(60)  # a read that hangs till the test lets it end
            else:
                raise ValueError("a shape the header cannot have")
        return decode(header, segments, layers, part)

    monkeypatch.setattr(reads_module.fmt, "decode_run", hostile)
    if where == "step, hung read":
        monkeypatch.setattr(restorer_module, "INLINE_BLEND_WAIT_S", 0.1)
    if where == "restore worker":
        monkeypatch.setattr(restorer_module, "INLINE_BLEND_READ_S", 0.0)
    threads: list[str] = []
    work = blend_module.BlendRestore._work
    monkeypatch.setattr(blend_module.BlendRestore, "_work",
                        lambda self: (threads.append(threading.current_thread().name), work(self))[1])
    with _engine(deep, store) as engine:
        staging = engine.store.staging
        taken: list[int] = []
        given: list[int] = []
        take, give = staging.take, staging.give
        monkeypatch.setattr(staging, "take", lambda n: (b := take(n), taken.append(b.data_ptr()))[0])
        monkeypatch.setattr(staging, "give", lambda b: (given.append(b.data_ptr()), give(b))[1])
        out = _blend(engine, ids)
        if where == "step, hung read":
            assert not release.is_set() and sorted(given) != sorted(taken)  # the read still hangs, holding its memory
            release.set()
            other = _ids(deep, seed=4, n=20) + ids[20:]  # the same documents after another start (not prefilled)
            after = _blend(engine, other)  # backed off: on the worker
            assert threads[-1] == "kvtier-restore" and after.restore.method == "blend"
    assert not [t for t in threading.enumerate() if t.name == "kvtier-blend-io"]
    assert taken and sorted(given) == sorted(taken)
    if where.startswith("step"):
        assert threads[0] == threading.current_thread().name
        assert len(entered) == 1, entered  # never a second try
        assert out.restore is None or out.restore.method != "blend", out.restore
        assert torch.equal(out.first_logits, exact.first_logits)
    else:
        assert threads == ["kvtier-restore"]
        assert out.restore.method == "blend" and out.restore.bytes_read == 0  # computed alone
        assert torch.equal(out.first_logits, want.first_logits)


def test_an_exact_prefix_read_that_hangs_never_holds_the_step(deep, tmp_path, monkeypatch):
    """A blend in its step reads its exact prefix's chunks from a disk on a thread of its own,
    within the step's wait: one that hangs makes the restore a miss (the request prefills: an
    exact prefill's logits) while it still hangs."""
    ids = _ids(deep)
    store = f"disk:{tmp_path}/d:64MB"
    with _engine(deep, store) as engine:
        engine.generate([ids[:130]], SamplingParams(max_tokens=1, temperature=0.0))  # the exact prefix [0, 128)
        engine.precompile([ids[140:250]])
        assert engine.flush(30)
    with Engine(deep) as plain:
        exact = plain.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, first_logits=True))[0]
    from kvtier.store.tiers.disk import DiskTier

    read, release, hung = DiskTier.read, threading.Event(), []

    def hanging(self, expect, layers=None, parts=("k", "v", "h")):
        # the exact chunks are read whole (the documents a layer group at a time)
        if threading.current_thread().name == "kvtier-blend-io" and len(list(layers or ())) > READ_GROUP_LAYERS \
                and not release.is_set():
            hung.append(threading.current_thread().name)
            assert release.wait(60)
        return read(self, expect, layers, parts)

    monkeypatch.setattr(DiskTier, "read", hanging)
    monkeypatch.setattr(restorer_module, "INLINE_BLEND_WAIT_S", 0.1)
    threads: list[str] = []
    work = blend_module.BlendRestore._work
    monkeypatch.setattr(blend_module.BlendRestore, "_work",
                        lambda self: (threads.append(threading.current_thread().name), work(self))[1])
    try:
        with _engine(deep, store) as engine:
            out = _blend(engine, ids, segments=((140, 250),))
            assert hung and not release.is_set()
    finally:
        release.set()
    assert threads == [threading.current_thread().name]
    assert out.restore is None or out.restore.method != "blend", out.restore
    assert torch.equal(out.first_logits, exact.first_logits)


def test_a_document_found_over_a_network_at_restore_time_is_never_read_in_the_step(deep, tmp_path, monkeypatch,
                                                                                    redis_url):
    """Offered in its step over a local disk, a blend whose document is found only in Redis when
    its restore starts (evicted from the disk meanwhile) is a miss: no network read in the step."""
    ids = _ids(deep)
    store = f"disk:{tmp_path}/d:64MB,{redis_url}"
    with _engine(deep, store) as engine:
        _blend(engine, ids)
        assert engine.flush(30)
    with Engine(deep) as plain:
        exact = plain.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, first_logits=True))[0]
    find, restoring, tiers_read = SegmentStates.find, [], []

    def evicting(states, tokens, salt):
        if restoring:  # the restore's own lookup: the disk's copy is gone
            for c in (find(states, tokens, salt) or SimpleNamespace(chunks=())).chunks:
                if c.tier == "disk":
                    states.store.tier("disk").delete(c.key)
        return find(states, tokens, salt)

    work, init = blend_module.BlendRestore._work, SegmentReads.__init__
    monkeypatch.setattr(SegmentStates, "find", evicting)
    monkeypatch.setattr(blend_module.BlendRestore, "_work",
                        lambda self: (restoring.append(threading.current_thread().name), work(self))[1])
    monkeypatch.setattr(SegmentReads, "__init__", lambda self, states, found, placed=None: (
        init(self, states, found, placed), tiers_read.extend(c.tier for c in self.chunks))[0])
    with _engine(deep, store) as engine:
        out = _blend(engine, ids)
    assert restoring == [threading.current_thread().name] and "redis" not in tiers_read
    assert out.restore is None or out.restore.method != "blend", out.restore
    assert torch.equal(out.first_logits, exact.first_logits)


def test_a_document_gone_from_the_tier_its_lookup_named_is_read_from_another(fp32, tmp_path, monkeypatch):
    """Evicted from memory between the lookup and the read, a document still on disk is read from
    there (looked up again), not computed alone."""
    ids = _ids(fp32)
    with _engine(fp32, f"memory:64MB,disk:{tmp_path}/d:64MB") as engine:
        want = _blend(engine, ids)
        assert engine.flush(30)
        engine.store.discard(engine.store.keys_for(ids))
        find, computed = SegmentStates.find, []

        def evicting(states, tokens, salt):
            match = find(states, tokens, salt)
            for c in match.chunks if match is not None else ():
                if c.tier == "memory":
                    states.store.memory.delete(c.key)
            return match

        monkeypatch.setattr(SegmentStates, "find", evicting)
        monkeypatch.setattr(SegmentStates, "compute", lambda *a: computed.append(a) or pytest.fail("computed alone"))
        read = engine.store.tier("disk").counters["bytes_read"]
        out = _blend(engine, ids)
        assert engine.store.tier("disk").counters["bytes_read"] > read
    assert out.restore.method == "blend" and out.restore.bytes_read > 0 and not computed
    assert torch.equal(out.first_logits, want.first_logits)


def test_a_restore_aborted_while_waiting_for_a_read_does_no_more_work(deep, tmp_path, monkeypatch):
    ids = _ids(deep)
    store = f"disk:{tmp_path}/d:64MB"
    with _engine(deep, store) as engine:
        _blend(engine, ids)
        assert engine.flush(30)
    restores: list = []
    computed: list = []
    looked_up: list = []
    init, read, compute, find = (blend_module.BlendRestore.__init__, SegmentReads.read, SegmentStates.compute,
                                 SegmentStates.find)

    def keep(self, *a, **k):
        init(self, *a, **k)
        restores.append(self)

    waiting = threading.Event()
    stack = blend_module._Loader.stack

    def waits(loader, i, g):
        if g > 0:
            waiting.set()
        return stack(loader, i, g)

    def aborting(self, layers):
        if layers.start == 0:
            return read(self, layers)
        assert waiting.wait(30)  # the restore waits for this group: aborted meanwhile, the read gives up
        restores[-1].abort()
        return None

    monkeypatch.setattr(blend_module.BlendRestore, "__init__", keep)
    monkeypatch.setattr(SegmentReads, "read", aborting)
    monkeypatch.setattr(blend_module._Loader, "stack", waits)
    monkeypatch.setattr(SegmentStates, "compute", lambda *a: (computed.append(a), compute(*a))[1])
    monkeypatch.setattr(SegmentStates, "find", lambda *a: (looked_up.append(a), find(*a))[1])
    with _engine(deep, store) as engine:
        out = _blend(engine, ids)
    assert restores and restores[-1].failed and not computed
    assert len(looked_up) == 2 * len(SEGMENTS)  # the offer's lookups and the restore's: none again
    assert out.finished and out.restore_method != "blend"


@pytest.mark.parametrize("device", ["cpu", "copied to a device"])
@pytest.mark.parametrize("where", ["restore worker", "step"])
def test_hostile_segment_bytes_are_misses(fp32, tmp_path, monkeypatch, device, where):
    """(copied to a device: the recording back end, where a read group goes over packed). On the
    restore worker the documents are then computed alone; in the request's step the restore is a
    miss and the request prefills (an exact prefill's logits)."""
    if device != "cpu":
        rec = RecordingTransfer()
        monkeypatch.setattr("kvtier.engine.runner.model_runner.make_transfer", lambda d: rec)
    if where == "restore worker":
        monkeypatch.setattr(restorer_module, "INLINE_BLEND_READ_S", 0.0)
    ids = _ids(fp32)
    store = f"disk:{tmp_path}/d:64MB"
    with _engine(fp32, store) as engine:
        want = _blend(engine, ids)
        assert engine.flush(30)
    files = [p for p in (tmp_path / "d").rglob("*") if p.is_file() and p.stat().st_size > 4096]
    assert files
    for p in files:  # flip bytes in every stored chunk's payload
        raw = bytearray(p.read_bytes())
        for i in range(len(raw) - 2048, len(raw), 97):
            raw[i] ^= 0xFF
        p.write_bytes(bytes(raw))
    with Engine(fp32) as plain:
        exact = plain.generate([ids], SamplingParams(max_tokens=1, temperature=0.0, first_logits=True))[0]
    with _engine(fp32, store) as engine:
        out = _blend(engine, ids)
        corrupt = engine.store.tiers[0].counters["corrupt"]
    assert corrupt > 0
    if where == "step":
        assert out.restore is None and torch.equal(out.first_logits, exact.first_logits)
    else:
        assert out.restore.method == "blend" and out.restore.bytes_read == 0  # computed alone again
        assert torch.equal(out.first_logits, want.first_logits)


def test_blending_is_refused_with_a_message_where_it_is_off(fp32):
    ids = _ids(fp32)
    with Engine(fp32) as no_store:
        with pytest.raises(PromptError, match="needs a store"):
            no_store.add_request(ids, GREEDY, segments=SEGMENTS, blend=True)
    with Engine(fp32, store="memory:64MB") as off:
        with pytest.raises(PromptError, match="--blend"):
            off.add_request(ids, GREEDY, segments=SEGMENTS, blend=True)
        off.add_request(ids, GREEDY, segments=SEGMENTS)  # not asked: marked documents just prefill
    with _engine(fp32) as engine:
        with pytest.raises(PromptError, match="document 1 does not occur"):
            engine.add_request(ids, GREEDY, documents=[ids[20:40], [1, 2, 3]])
        with pytest.raises(PromptError, match="segment"):
            engine.add_request(ids, GREEDY, segments=[(10, 5)])
        # The wrong shapes are refused, never read another way: one string is not its characters,
        # a float or a bool is not a position.
        for bad in ("one document as a bare string", [None], [b"bytes"], [[1, 2.5]]):
            with pytest.raises(PromptError, match="documents must be a list|document 0 must be"):
                engine.add_request(ids, GREEDY, documents=bad)
            with pytest.raises(PromptError, match="documents must be a list|document 0 must be"):
                engine.precompile(bad)
        for bad in ([(0.7, 9.9)], [(True, 9)], [(0, 5, 9)], (0, 5)):
            with pytest.raises(PromptError, match="segments must be"):
                engine.add_request(ids, GREEDY, segments=bad)
        # Integers of any kind are taken: numpy's and torch's, in arrays and tensors.
        import numpy as np

        a, b = SEGMENTS[0]
        for docs in ([np.array(ids[a:b])], [torch.tensor(ids[a:b])], [tuple(np.int64(t) for t in ids[a:b])]):
            engine.add_request(ids, GREEDY, documents=docs)
        for segs in ([(np.int64(a), np.int64(b))], list(np.array([[a, b]])), [tuple(torch.tensor([a, b]))]):
            engine.add_request(ids, GREEDY, segments=segs)


def test_the_samples_of_an_n_request_blend_alike(fp32):
    ids = _ids(fp32)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2)
    with _engine(fp32) as engine:
        engine.precompile([ids[a:b] for a, b in SEGMENTS])
        outs = engine.generate([ids], params, documents=[[ids[a:b] for a, b in SEGMENTS]], blend=True)
    assert [o.restore.method for o in outs] == ["blend", "blend"]
    assert outs[0].output_ids == outs[1].output_ids
    assert outs[0].restore.blended_tokens == outs[1].restore.blended_tokens > 0


def test_an_engine_whose_store_keeps_no_state_for_a_layer_refuses_to_blend(fp32):
    layout = ("none",) + ("kv",) * (fp32.config.num_layers - 1)
    with pytest.raises(ValueError, match="every layer"):
        Engine(fp32, store="memory:64MB", reuse=ReuseConfig(chunk_tokens=64, layout=layout, blend=BlendOptions()))


def _reference_blend(model, ids, segments, options: BlendOptions) -> torch.Tensor:
    """The method computed independently of the engine, with the plain decoder layers: each
    document alone from position 0, its K rotated to its place; for cacheblend, the layers up to
    the check layer over every token, the loaded tokens scored there (K deviation, times the
    attention the rows after the last document pay them in the later layers over the loaded state
    when weighted) and the top share recomputed; the plan's runs and the last token computed
    against every key at or before their position. -> the last token's logits."""
    import math

    import torch.nn.functional as F

    from kvtier.models.rope import Rope, rotate
    from kvtier.planning.blend import BlendMode, BlendScore, merged, plan_blend

    cfg, net, n = model.config, model.module, len(ids)
    rope = Rope(cfg, n, torch.float32)
    group = cfg.num_heads // cfg.num_kv_heads

    def attend(q, k, v, pos):  # q [m, heads, hd] at pos [m]; k, v [ctx, kv_heads, hd] at [0, ctx)
        k, v = (t.repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
        mask = torch.arange(k.shape[1])[None, :] <= pos[:, None]
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)

    def paid(q, k, pos, before):  # attention the rows q at pos pay keys [0, before), summed -> [before]
        k = k[: int(pos[-1]) + 1].repeat_interleave(group, 1).transpose(0, 1)  # [heads, ctx, hd]
        s = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(cfg.head_dim)  # [heads, m, ctx]
        s = s.masked_fill(torch.arange(k.shape[1])[None, :] > pos[:, None], float("-inf"))
        return s.softmax(-1)[:, :, :before].sum(dim=(0, 1))

    def layers(x, pos, k_all=None, v_all=None, keep=None, upto=None, probe=None):
        cos, sin = rope.cos_sin(pos)
        for li, layer in enumerate(net.layers[: upto]):
            q, k, v = layer.qkv(x)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            if k_all is None:
                keep.append((k, v))
                x = layer.finish(x, attend(q, k, v, pos))
            else:
                k_all[li][pos], v_all[li][pos] = k, v
                x = layer.finish(x, attend(q, k_all[li], v_all[li], pos))
                if probe is not None and li > probe["after"]:
                    m = probe["queries"]
                    probe["paid"] += paid(q[-m:], k_all[li], pos[-m:], int(pos[-m]))
        return x

    with torch.inference_mode():
        k_all = [torch.zeros(n, cfg.num_kv_heads, cfg.head_dim) for _ in net.layers]
        v_all = [torch.zeros_like(k_all[0]) for _ in net.layers]
        for a, b in segments:
            alone: list = []
            layers(net.embed(torch.tensor(ids[a:b])), torch.arange(b - a), keep=alone)
            cos, sin = rope.cos_sin(torch.full((b - a,), a))
            for li, (k, v) in enumerate(alone):
                k_all[li][a:b], v_all[li][a:b] = rotate(k, cos, sin), v
        plan = plan_blend(ids, segments, 0, 0, options)
        runs = list(plan.runs)
        if BlendMode(options.mode) is BlendMode.CACHEBLEND:
            check = options.check_layer
            loaded_pos = torch.cat([torch.arange(a, e) for a, e in plan.loaded])
            old = k_all[check][loaded_pos].clone()
            fresh: list = []  # the layers up to the check over every token but the last
            layers(net.embed(torch.tensor(ids[: n - 1])), torch.arange(n - 1), keep=fresh, upto=check + 1)
            for li, (k, v) in enumerate(fresh):
                k_all[li][: n - 1], v_all[li][: n - 1] = k, v
            score = (k_all[check][loaded_pos] - old).square().sum(dim=(1, 2))
            if BlendScore(options.score) is BlendScore.WEIGHTED:
                tail = max(b for _, b in segments)
                probe = dict(after=check, queries=min(64, n - 1 - tail), paid=torch.zeros(n - 1 - min(64, n - 1 - tail)))
                pos = torch.cat([torch.arange(a, e) for a, e in runs])
                layers(net.embed(torch.tensor(ids)[pos]), pos, k_all, v_all, probe=probe)
                score = score * probe["paid"][loaded_pos]
            order = torch.sort(score, descending=True, stable=True).indices[: int(options.ratio * len(loaded_pos))]
            runs = merged(runs + [(p, p + 1) for p in loaded_pos[order].tolist()])
        pos = torch.cat([torch.arange(a, e) for a, e in runs] + [torch.tensor([n - 1])])
        return net.logits(layers(net.embed(torch.tensor(ids)[pos]), pos, k_all, v_all)[-1:])[0]


@pytest.mark.parametrize("options,rows", [(BlendOptions(link_tokens=0), 512), (BlendOptions(link_tokens=8), 512),
                                          (BlendOptions(mode="cacheblend", ratio=0.2, check_layer=1), 512),
                                          (BlendOptions(mode="cacheblend", ratio=0.2, check_layer=1), 16),
                                          (BlendOptions(mode="cacheblend", ratio=0.2, check_layer=1, score="deviation"), 512)],
                         ids=["legolink-0", "legolink-8", "cacheblend-weighted", "cacheblend-weighted-16-row-passes",
                              "cacheblend-deviation"])
def test_the_blend_is_the_method_computed_independently(fp32, options, rows):
    ids = _ids(fp32)
    with _engine(fp32) as engine:
        engine.link.restorer.compute_chunk_tokens = rows  # passes of at most `rows` rows (the probe's too)
        out = _blend(engine, ids, options)
    want = _reference_blend(fp32, ids, SEGMENTS, options)
    assert torch.allclose(out.first_logits, want, atol=1e-4, rtol=1e-4), float((out.first_logits - want).abs().max())


def test_cacheblend_without_rows_after_the_last_document_picks_by_the_deviation_alone(fp32):
    """No question follows the last document: nothing weighs the deviations, so the weighted
    score picks what the deviation alone picks (and runs no extra pass)."""
    ids, segments = _ids(fp32), ((20, 120), (125, N - 1))
    outs = []
    for score in ("weighted", "deviation"):
        with _engine(fp32) as engine:
            outs.append(_blend(engine, ids, BlendOptions(mode="cacheblend", ratio=0.2, check_layer=1, score=score),
                               segments=segments))
    assert outs[0].restore.recomputed_tokens == outs[1].restore.recomputed_tokens
    assert torch.equal(outs[0].first_logits, outs[1].first_logits)
    with _engine(fp32) as engine:  # with a question after it, the weighting changes the picks
        weighted = _blend(engine, ids, BlendOptions(mode="cacheblend", ratio=0.2, check_layer=1))
        alone = _blend(engine, ids, BlendOptions(mode="cacheblend", ratio=0.2, check_layer=1, score="deviation"))
    assert not torch.equal(weighted.first_logits, alone.first_logits)


def test_the_llm_finds_its_precompiled_documents_in_a_text_prompt(tmp_path, monkeypatch):
    from kvtier.llm import LLM

    # The LLM measures and saves a hardware profile: under a home of its own, so that the suite's
    # other engines of this model do not change their stored layout partway through the run.
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))

    doc = "the river runs north past the old mill and the stone bridge, then east to the sea " * 3
    prompt = f"Read this. {doc}Where does the river run?"
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, first_logits=True)
    with LLM("tiny-gqa", dtype="fp32", store="memory:64MB", chunk_tokens=16, blend=True) as llm:
        llm.precompile([doc])
        found = llm.generate(prompt, params)[0]
        marked = llm.generate(prompt, params, documents=[doc])[0]
        plain = llm.generate(prompt, params, blend=False)[0]
    assert found.restore.method == "blend" and found.restore.blended_tokens > 0
    assert found.prompt_token_ids == marked.prompt_token_ids  # the document tokenized alone, as if marked
    assert torch.equal(found.engine_outputs[0].first_logits, marked.engine_outputs[0].first_logits)
    assert plain.restore is None or plain.restore.blended_tokens == 0


def test_read_groups_stack_only_views_of_one_buffer_at_an_even_stride():
    """A read group's layers go to the pool in one call only where each piece's K and V of every
    layer are views of one buffer at an even stride (as chunks read from memory are); a copied,
    reordered or hidden-state read stacks nothing."""
    buf = torch.arange(4 * 2 * 10 * 3 * 8, dtype=torch.float32).view(4, 2, 10, 3, 8)  # [layers, k|v, rows, kvh, hd]
    layers = [((buf[li, 0, 2:7], buf[li, 1, 2:7], None), (buf[li, 0, 7:], buf[li, 1, 7:], None)) for li in range(4)]
    got = _stacked(layers)
    assert got is not None and len(got) == 2
    for (k, v), (a, b) in zip(got, ((2, 7), (7, 10)), strict=True):
        assert torch.equal(k, buf[:, 0, a:b]) and torch.equal(v, buf[:, 1, a:b])
        assert k.data_ptr() == buf[0, 0, a].data_ptr()  # a view: nothing copied
    copied = [layers[0], tuple((k.clone(), v, h) for k, v, h in layers[1]), *layers[2:]]
    assert _stacked(copied) is None
    assert _stacked([layers[0], layers[1], layers[3], layers[2]]) is None  # out of order: not one stride
    assert _stacked([layers[0], layers[1][:1], *layers[2:]]) is None  # pieces that differ
    hidden = [((None, None, buf[li, 0, 2:7].flatten(1)),) for li in range(4)]
    assert _stacked(hidden) is None


def test_a_blend_recomputing_at_most_a_chunk_runs_in_its_step_and_a_larger_on_the_restore_worker(model, monkeypatch):
    """A small blend of stored documents runs on the step thread (a second thread's OpenMP team
    would slow each of its ops); a larger one, CacheBlend, or one with a document to compute alone
    on the restore worker. Where it runs never changes its bits."""
    ids = _ids(model)
    where: list[str] = []
    work = blend_module.BlendRestore._work
    monkeypatch.setattr(blend_module.BlendRestore, "_work",
                        lambda self: (where.append(threading.current_thread().name), work(self))[1])
    step_thread = threading.current_thread().name
    with _engine(model) as engine:
        restorer = engine.link.restorer
        alone = _blend(engine, ids)  # the documents computed alone (and stored)
        assert engine.flush(30)
        inline = _blend(engine, ids)
        assert engine.flush(30)
        restorer.inline_blend_tokens = inline.restore.recomputed_tokens - 1
        worker = _blend(engine, ids)
        assert engine.flush(30)
        restorer.inline_blend_tokens = 10**6
        cacheblend = _blend(engine, ids, BlendOptions(mode="cacheblend", ratio=0.2))
    assert where == ["kvtier-restore", step_thread, "kvtier-restore", "kvtier-restore"]
    assert alone.restore.bytes_read == 0 and inline.restore.bytes_read > 0
    assert torch.equal(alone.first_logits, inline.first_logits)
    assert worker.restore.recomputed_tokens == inline.restore.recomputed_tokens and cacheblend.restore is not None
    assert torch.equal(worker.first_logits, inline.first_logits) and worker.output_ids == inline.output_ids


def test_a_blend_computes_the_prompts_last_token_in_its_last_pass_and_the_step_runs_no_layer_for_it(model, monkeypatch):
    """Where documents are loaded, the blend's last pass holds the prompt's last token, so the
    step that samples the first token runs no layer for it (a pass over the whole context for one
    row), in the step and on the restore worker alike, and a decode after it reads its K/V from the
    pool; every token recomputed, the step computes it as an exact prefill does."""
    ids = _ids(model)
    rows: list[tuple[int, int, bool]] = []  # (start, tokens, off the step) of every run the runner computed
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, items, *a, **k: (
        rows.extend((it.start, len(it.token_ids), it.off_thread) for it in items), execute(self, items, *a, **k))[1])
    scattered = blend_module._Scattered.__init__  # a blend's pass over rows scattered across the prompt

    def scattered_pass(self, runner, block_ids, runs, end, place, lead=None, capture=None):
        rows.extend((a, e - a, True) for a, e in runs)
        scattered(self, runner, block_ids, runs, end, place, lead, capture)

    monkeypatch.setattr(blend_module._Scattered, "__init__", scattered_pass)
    with _engine(model) as engine:
        engine.precompile([ids[a:b] for a, b in SEGMENTS])
        restorer = engine.link.restorer
        inline = _blend(engine, ids)
        folded_inline = list(rows)
        engine.reset_prefix_cache()
        rows.clear()
        restorer.inline_blend_tokens = 0  # on the restore worker
        worker = _blend(engine, ids)
        folded_worker = list(rows)
        engine.reset_prefix_cache()
        rows.clear()
        every = _blend(engine, ids, EVERY_TOKEN)
    assert inline.restore.blended_tokens > 0 and worker.restore.blended_tokens > 0
    for seen in (folded_inline, folded_worker):
        assert (N - 1, 1, False) not in seen  # no step ran the last prompt token
        assert any(s <= N - 1 < s + n for s, n, off in seen if off)  # a blend's pass did
        assert [s for s, n, off in seen if not off] == [N, N + 1, N + 2]  # the step decoded the next three
    assert torch.equal(worker.first_logits, inline.first_logits) and worker.output_ids == inline.output_ids
    assert (N - 1, 1, False) in rows and every.restore.blended_tokens == 0


@pytest.mark.parametrize("prefix", ["none", "store", "device"])
@pytest.mark.parametrize("hidden", [False, True], ids=["kv", "hidden-state-layers"])
def test_the_exact_lead_rides_in_the_next_pass_with_the_bits_of_a_pass_of_its_own(model, monkeypatch, hidden, prefix):
    """The run before the first loaded row joins the scattered rows' pass where it fits: no step of
    its own, and every bit the same as with its own pass (the first token's logits, the exact
    chunks it saves, which a later request restores as a prefill's), the lead starting the prompt
    or continuing an exact prefix read from the store or held by the device (its attention then
    reads that history from the pool, past which the placed rows must stay)."""
    ids = _ids(model)
    layers = model.config.num_layers
    layout = ("hidden", "kv") * (layers // 2) + ("kv",) * (layers % 2) if hidden else None
    # lead [0, 88) or, after a 128-token exact prefix, [128, 208): one more whole chunk of 64 saved
    segments = ((80, 160), (170, 260)) if prefix == "none" else ((200, 260), (265, 290))
    steps: list[int] = []  # the first position of each run the runner computed for a blend
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, items, *a, **k: (
        steps.extend(it.start for it in items if it.off_thread), execute(self, items, *a, **k))[1])
    passes = blend_module.BlendRestore._passes

    def own_pass(self, runs, lead):  # the lead in a pass of its own
        return [[lead], *pieces(runs[1:], self.chunk_tokens)]

    got = {}
    for name in ("rides", "alone"):
        if name == "alone":
            monkeypatch.setattr(blend_module.BlendRestore, "_passes", own_pass)
        with _engine(model, layout=layout) as engine:
            if prefix != "none":
                _blend(engine, ids[:130], False, salt="a", segments=())  # an exact request: 128 tokens saved
                assert engine.flush(30)
                if prefix == "store":
                    engine.reset_prefix_cache()
            steps.clear()
            out = _blend(engine, ids, salt="a", segments=segments)
            assert engine.flush(30)
            saved = engine.store.lookup(ids, "a")
            states = [engine.store.read_layers(c.key, range(layers)) for c in saved.chunks]
        got[name] = (out, saved.num_tokens, states, list(steps))
    monkeypatch.setattr(blend_module.BlendRestore, "_passes", passes)
    (rides, n_rides, s_rides, steps_rides), (alone, n_alone, s_alone, steps_alone) = got["rides"], got["alone"]
    assert rides.restore.blended_tokens > 0 and n_rides == n_alone == (64 if prefix == "none" else 192)
    if prefix != "none":
        assert rides.reused_by_tier == {"memory" if prefix == "store" else "device": 128}
    assert steps_rides == [] and len(steps_alone) == 1  # the lead: a step only where it has its own pass
    assert torch.equal(rides.first_logits, alone.first_logits) and rides.output_ids == alone.output_ids
    for chunk_rides, chunk_alone in zip(s_rides, s_alone, strict=True):  # every layer's saved K, V or hidden state
        for a, b in zip(chunk_rides, chunk_alone, strict=True):
            for x, y in ((a.k, b.k), (a.v, b.v), (a.h, b.h)):
                assert (x is None and y is None) or torch.equal(x, y)


def test_the_lead_keeps_a_pass_of_its_own_where_the_linears_are_not_row_invariant(monkeypatch):
    """`--fast-inexact`: a row's bits there depend on the rows beside it, so the lead's exact chunks
    come from a pass of its own, as a prefill's would."""
    plain = load_model("tiny-gqa", dtype="bf16", tokenizer=False)  # its own: the engine sets its kernels
    steps: list[int] = []
    execute = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute", lambda self, items, *a, **k: (
        steps.extend(it.start for it in items if it.off_thread), execute(self, items, *a, **k))[1])
    with Engine(plain, EngineConfig(exact=False), store="memory:256MB",
                reuse=ReuseConfig(chunk_tokens=64, blend=BlendOptions())) as engine:
        out = _blend(engine, _ids(plain), segments=((80, 160), (170, 260)))
    assert not plain.module.kernels.exact and out.restore.blended_tokens > 0
    assert 0 in steps


@pytest.mark.parametrize("where", ["disk", "slow disk", "network", "budget"])
def test_a_small_blend_reading_a_slow_disk_or_over_the_steps_budget_runs_on_the_restore_worker(
        model, tmp_path, monkeypatch, where):
    """In its request's step over the memory tier's state or a local disk read in time (the
    step could wait for its reads at most INLINE_BLEND_READ_S at the disk's predicted rate), and
    where its compute fits the step's token budget; else on the worker, its compute paid from the
    budget step by step until the worker is done (what is left then is owed no more: the worker
    computes nothing further). Its bits are the inline blend's wherever it runs. Both engines
    store K/V in every layer: a layout chosen from the hardware profile may store hidden states
    on a disk, projected at the new positions where K/V are rotated (other bits, as lossy)."""
    from kvtier.engine.config import EngineConfig

    ids = _ids(model)
    threads: list[str] = []
    work = blend_module.BlendRestore._work
    monkeypatch.setattr(blend_module.BlendRestore, "_work",
                        lambda self: (threads.append(threading.current_thread().name), work(self))[1])
    kv = ("kv",) * model.config.num_layers
    with _engine(model, layout=kv) as engine:
        engine.precompile([ids[a:b] for a, b in SEGMENTS])
        assert engine.flush(30)
        want = _blend(engine, ids)
    store = {"disk": f"disk:{tmp_path}/d:64MB", "slow disk": f"disk:{tmp_path}/d:64MB:lat=300ms",
             "network": f"disk:{tmp_path}/d:64MB"}.get(where, "memory:256MB")
    if where == "network":  # a tier read over a network (Redis): its waits are not the step's to take
        from kvtier.store.tiers.disk import DiskTier
        monkeypatch.setattr(DiskTier, "local_reads", False)
    budget = want.restore.recomputed_tokens - 1 if where == "budget" else 512
    with Engine(model, EngineConfig(max_batched_tokens=budget), store=store,
                reuse=ReuseConfig(chunk_tokens=64, blend=BlendOptions(), layout=kv)) as engine:
        engine.precompile([ids[a:b] for a, b in SEGMENTS])
        assert engine.flush(30)
        got = _blend(engine, ids)
        charged = engine.link.stats.restore_tokens_charged
    assert threads == [threading.current_thread().name, threading.current_thread().name if where == "disk"
                       else "kvtier-restore"]
    assert got.restore.recomputed_tokens == want.restore.recomputed_tokens
    assert got.restore.bytes_read > 0  # the documents were read, not computed alone
    # the starting step pays what its budget holds; a later step the rest, unless the worker
    # finished first
    assert min(budget, want.restore.recomputed_tokens) <= charged <= want.restore.recomputed_tokens
    assert torch.equal(got.first_logits, want.first_logits) and got.output_ids == want.output_ids


def test_a_blends_exact_prefix_is_published_to_the_device_prefix_cache_and_nothing_past_it(model):
    """The text before the first document and that document's link rows are computed over exact
    keys with the step's kernels: their whole blocks serve a later request from the device as an
    exact prefill's would (a system prompt shared by RAG requests); no block holding a loaded row
    ever does."""
    ids = _ids(model)
    segments = ((40, 140), (145, 280))  # 40 tokens before the first document: with its 8 link rows, 48
    other = ids[:64] + _ids(model, seed=9, n=40)  # shares 64 tokens: 48 exact, then 16 of the document
    with Engine(model) as plain:
        want = plain.generate([other], GREEDY)[0]
    with _engine(model) as engine:
        engine.precompile([ids[a:b] for a, b in segments])
        assert engine.flush(30)
        first = _blend(engine, ids, segments=segments)
        again = _blend(engine, ids, segments=segments)
        exact = engine.generate([other], GREEDY)[0]  # (its own blocks then hold 64 exact tokens of ids)
        assert engine.reset_prefix_cache() > 0
        cold = _blend(engine, ids, segments=segments)
    assert first.restore.method == "blend" and first.prompt_tokens_reused == 0
    assert exact.prompt_tokens_reused == 48 and exact.reused_by_tier == {"device": 48}
    assert torch.equal(exact.first_logits, want.first_logits)  # the published blocks are exact state
    assert again.reused_by_tier.get("device") == 48
    assert again.restore.recomputed_tokens == first.restore.recomputed_tokens - 48
    assert torch.equal(again.first_logits, first.first_logits) and again.output_ids == first.output_ids
    assert cold.restore.recomputed_tokens == first.restore.recomputed_tokens  # reset: from nothing again
    assert torch.equal(cold.first_logits, first.first_logits)


def test_given_logits_join_the_steps_rows_in_chunk_order():
    """The step's logits rows: the runner's per computed run (every token of a prompt-logprobs
    run, the last of a run that samples, none of a run that does not), a given row in its place."""
    from kvtier.engine.engine import _with_given
    from kvtier.engine.runner.batch import RunItem

    runs = [RunItem([1, 2, 3], 0, [], want_logits=True, all_logits=True),  # 3 rows
            RunItem([4, 5], 0, [], want_logits=False),  # none
            RunItem([6], 9, [], want_logits=True)]  # 1 row
    computed = torch.arange(4.0)[:, None]  # [rows, vocab 1]: 0, 1, 2 for the first run, 3 for the last
    given = [None, torch.tensor([[10.0]]), None, torch.tensor([[11.0]]), None]
    rows = _with_given(computed, runs, given)
    assert rows.flatten().tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 3.0]
    assert _with_given(None, [], [torch.tensor([[7.0]])]).flatten().tolist() == [7.0]
