"""The engine over a store it cannot trust, and tenants that must not see each other.

- A planted chunk that claims more tokens than its span (the direct-I/O read used to size itself
  by the header and overwrite a neighbour's KV): a miss; the neighbour's and the victim's outputs
  equal a clean engine's.
- A sealed store (store secret) restores exactly like an unsealed one.
- Cache salts (the server's tenants): the same prompt under another salt reuses nothing, from the
  device prefix cache or the store; under the same salt it is reused; a session's TTL expiry never
  removes another salt's chunks.
- Session bookkeeping stays bounded under a flood of distinct session ids.
"""
from __future__ import annotations

import logging
import os
import stat
import tracemalloc
from dataclasses import replace

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.link.sessions import SessionRetention
from kvtier.engine.request import SamplingParams
from kvtier.store import format as fmt
from kvtier.store.seal import Seal

from kvtier_testlib import fake_profile

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
CHUNK = 16
SECRET = b"0123456789abcdef0123456789abcdef"


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model, spec, prefix_cache=False, **reuse):
    return Engine(model, EngineConfig(kv_cache_bytes=32 << 20, enable_prefix_cache=prefix_cache), store=spec,
                  profile=fake_profile(model.fingerprint, compute_scale=50.0),
                  reuse=ReuseConfig(method="kv", chunk_tokens=CHUNK, **reuse))


def _plain(model, prompts):
    return [o.output_ids for o in Engine(model, EngineConfig(kv_cache_bytes=32 << 20)).generate(prompts, GREEDY)]


def _planted(ns, kind: str):
    """(namespace to pack as, token count, seal) of a chunk planted under a real key."""
    if kind == "longer":  # 12x the span: 192 rows where the plan gave 16 slots
        return ns, 12 * CHUNK, Seal()
    if kind == "shorter":
        return ns, CHUNK // 2, Seal()
    if kind == "dtype":  # the same bytes per token in another storage dtype would be garbage
        return replace(ns, storage_dtype="float16"), CHUNK, Seal()
    return ns, CHUNK, Seal(b"not the store's secret, 32 bytes")  # "unsealed": a forger's secret


@pytest.mark.parametrize("kind", ["longer", "shorter", "dtype", "unsealed"])
def test_a_planted_chunk_never_touches_a_neighbours_kv(tiny_gqa, tmp_path, kind):
    vocab = tiny_gqa.config.vocab_size
    victim, neighbour = _prompt(3 * CHUNK + 5, 1, vocab), _prompt(40, 2, vocab)
    seal = Seal(SECRET) if kind == "unsealed" else Seal()
    engine = _engine(tiny_gqa, f"disk:{tmp_path}/s:1GB", seal=seal)
    engine.generate([victim], GREEDY)
    assert engine.flush(30)
    store = engine.link.store
    match = store.lookup(victim)
    assert match.num_tokens >= 3 * CHUNK
    # Plant, under the victim's first key, a well-formed chunk that is not the one planned.
    ns, first = store.namespace, match.chunks[0]
    as_ns, n, forger = _planted(ns, kind)
    shape = as_ns.part_shape("k", n)
    g = torch.Generator().manual_seed(9)
    layers = {layer: {"k": torch.randn(shape, generator=g) * 100, "v": torch.randn(shape, generator=g) * 100}
              for layer in range(ns.num_layers)}
    disk = store.tier("disk")
    disk.delete(first.key)
    assert disk.put(fmt.pack(as_ns, store.root, first.key, store.root, 0, 0, n < CHUNK, layers, seal=forger))
    # The neighbour decodes while the victim's restore is tried.
    a = engine.add_request(neighbour, GREEDY)
    engine.step()
    b = engine.add_request(victim + [5, 6], GREEDY)
    outs = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output_ids
    engine.close()
    assert [outs[a], outs[b]] == _plain(tiny_gqa, [neighbour, victim + [5, 6]])
    assert disk.counters["corrupt"] >= 1  # refused and removed, not served


def test_disk_tier_files_are_private_whatever_the_umask(tiny_gqa, tmp_path):
    """Stored KV can be inverted to the prompt: directories 0700, files 0600 under umask 022."""
    old = os.umask(0o022)
    try:
        engine = _engine(tiny_gqa, f"disk:{tmp_path}/new/store:1GB")
        engine.generate([_prompt(3 * CHUNK + 5, 6, tiny_gqa.config.vocab_size)], GREEDY)
        assert engine.flush(30)
        engine.close()
    finally:
        os.umask(old)
    made = list((tmp_path / "new").rglob("*")) + [tmp_path / "new"]
    modes = {p.is_dir(): set() for p in made}
    for p in made:
        modes[p.is_dir()].add(stat.S_IMODE(p.stat().st_mode))
    assert modes == {True: {0o700}, False: {0o600}}


def test_sealed_store_restores_exactly(tiny_gqa, tmp_path):
    vocab = tiny_gqa.config.vocab_size
    prompt = _prompt(4 * CHUNK + 3, 3, vocab)
    spec = f"disk:{tmp_path}/s:1GB"
    first = _engine(tiny_gqa, spec, seal=Seal(SECRET))
    out = first.generate([prompt], GREEDY)[0]
    first.close()
    follow = prompt + out.output_ids + [7, 8]
    second = _engine(tiny_gqa, spec, seal=Seal(SECRET))  # a restart, same secret: restored
    again = second.generate([follow], GREEDY)[0]
    second.close()
    assert again.reused_by_tier.get("disk", 0) >= 4 * CHUNK
    assert again.output_ids == _plain(tiny_gqa, [follow])[0]
    other = _engine(tiny_gqa, spec, seal=Seal(b"another secret of enough length!"))  # other secret: a miss
    assert other.generate([follow], GREEDY)[0].prompt_tokens_reused == 0
    other.close()


@pytest.mark.redis
def test_an_engine_over_an_unsealed_redis_says_so_once(tiny_gqa, redis_url, caplog):
    caplog.set_level(logging.WARNING, logger="kvtier.store")

    def planting_warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if "plant" in r.getMessage()]

    _engine(tiny_gqa, f"memory:64MB,{redis_url}").close()
    assert len(planting_warnings()) == 1
    caplog.clear()
    _engine(tiny_gqa, f"memory:64MB,{redis_url}", seal=Seal(SECRET)).close()
    assert not planting_warnings()


def _run(engine, prompt, salt, session=None):
    engine.add_request(prompt, GREEDY, cache_salt=salt, session_id=session)
    done = None
    while engine.has_work():
        for out in engine.step():
            done = out if out.finished else done
    return done


def test_salts_partition_the_device_cache_and_the_store(tiny_gqa):
    vocab = tiny_gqa.config.vocab_size
    prompt = _prompt(5 * CHUNK + 7, 4, vocab)
    for prefix_cache in (True, False):  # the device prefix cache, then the store alone
        engine = _engine(tiny_gqa, "memory:64MB", prefix_cache=prefix_cache)
        a1 = _run(engine, prompt, "tenant-a")
        engine.flush(30)
        b1 = _run(engine, prompt, "tenant-b")
        b2 = _run(engine, prompt, "tenant-b\x1fmine")  # a body cache_salt inside tenant b
        a2 = _run(engine, prompt, "tenant-a")
        engine.close()
        assert a1.prompt_tokens_reused == 0
        assert b1.prompt_tokens_reused == 0 and b2.prompt_tokens_reused == 0, prefix_cache
        assert a2.prompt_tokens_reused >= 5 * CHUNK
        assert a1.output_ids == b1.output_ids == a2.output_ids == _plain(tiny_gqa, [prompt])[0]


def test_another_salts_session_expiry_never_removes_my_chunks(tiny_gqa):
    vocab = tiny_gqa.config.vocab_size
    prompt = _prompt(4 * CHUNK, 5, vocab)
    engine = _engine(tiny_gqa, "memory:64MB", session_ttl_s=60.0)
    _run(engine, prompt, "tenant-a", session="a\x1fchat")
    _run(engine, prompt, "tenant-b", session="b\x1fchat")  # b sends a's prompt under its own session
    engine.flush(30)
    side = engine.link.scheduler_side
    t_b = side.sessions.sessions["b\x1fchat"].last_seen
    side.sessions.sessions["a\x1fchat"].last_seen = t_b + 100  # a stays active; b goes idle
    side._next_expiry = 0.0
    assert side.expire_sessions(now=t_b + 61) > 0
    assert side.store.lookup(prompt, "tenant-b").num_tokens == 0  # b's own chunks are gone
    assert side.store.lookup(prompt, "tenant-a").num_tokens == 4 * CHUNK  # a's are untouched
    engine.close()


def test_a_flood_of_session_ids_keeps_bookkeeping_bounded():
    keep = SessionRetention(ttl_s=3600.0, max_sessions=100)
    keep.arrived("live", ["k0"], 0.0)  # in flight: never forgotten
    tracemalloc.start()
    for i in range(1000):
        keep.arrived(f"s{i}" + "x" * 200, [f"{i:032x}"], float(i))
        keep.finished(f"s{i}" + "x" * 200, [f"{i:032x}"], float(i))
        if i == 199:
            base = tracemalloc.get_traced_memory()[0]
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert len(keep.sessions) == 100 and "live" in keep.sessions
    assert keep.forgotten == 901
    assert grown < 64 << 10  # flat: 800 more sessions cost no more than noise


def test_one_partitions_flood_forgets_its_own_sessions_first():
    keep = SessionRetention(ttl_s=3600.0, max_sessions=300, max_per_partition=100)
    for i in range(50):  # tenant b's conversations, idle
        keep.finished(f"b{i}", [f"{i:032x}"], float(i), partition="tenant-b")
    for i in range(1000):  # tenant a floods with new session ids
        keep.finished(f"a{i}", [], 100.0 + i, partition="tenant-a")
    assert sum(sid.startswith("b") for sid in keep.sessions) == 50  # all of b's are kept
    assert sum(sid.startswith("a") for sid in keep.sessions) == 100
    assert keep.per_partition == {"tenant-a": 100, "tenant-b": 50} and keep.forgotten == 900
    gone, dead = keep.expire(now=1e9)  # expiry keeps the per-partition counts right
    assert len(gone) == 150 and not keep.per_partition and len(dead) == 50


def test_sealed_restore_is_bit_identical_in_bf16(tmp_path):
    """Sealing changes only digests and a tag: a bf16 restore from a sealed disk tier gives the
    recomputed first-token logits bit for bit (torch.equal) and the same tokens."""
    from kvtier.models.loading import load_model

    model = load_model("tiny-gqa", dtype="bf16", tokenizer=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, first_logits=True)
    prompt = _prompt(4 * CHUNK + 3, 7, model.config.vocab_size)
    spec = f"disk:{tmp_path}/s:1GB"
    first = _engine(model, spec, seal=Seal(SECRET))
    out = first.generate([prompt], params)[0]
    first.close()
    follow = prompt + out.output_ids + [7, 8]
    second = _engine(model, spec, seal=Seal(SECRET))
    again = second.generate([follow], params)[0]
    second.close()
    plain = Engine(model, EngineConfig(kv_cache_bytes=32 << 20)).generate([follow], params)[0]
    assert again.reused_by_tier.get("disk", 0) >= 4 * CHUNK
    assert model.dtype == torch.bfloat16  # (first_logits come back upcast to fp32, losslessly)
    assert torch.equal(again.first_logits, plain.first_logits)
    assert again.output_ids == plain.output_ids
