"""A closed engine is freed by reference counting alone: its KV pool, its store and the store's
memory tier go when the last reference does, not at some later garbage collection. Left to the
collector, freeing a pool (gigabytes of resident pages) landed as a 100-200 ms pause inside a later
request: cold restores on the AMD EPYC stalled that long in one run of six, in whatever Python
code the collection happened to interrupt."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from kvtier.engine.config import EngineConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams

HIST = 320
ONE = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture
def no_collector() -> Iterator[None]:
    gc.collect()  # what earlier tests left
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _engine(model, spec: str, method: str, static_decode: bool | None = None) -> Engine:
    return Engine(model, EngineConfig(kv_cache_bytes=64 << 20, max_model_len=1024, enable_prefix_cache=False,
                                      static_decode=static_decode),
                  store=spec, reuse=ReuseConfig(method=method, chunk_tokens=64))


@pytest.mark.parametrize("method,static_decode", [("kv", None), ("hidden", None), ("bubblefree", None),
                                                  ("cake", None), ("impress", None), ("kv", True)])
def test_a_closed_engine_is_freed_without_the_garbage_collector(tiny_gqa, tmp_path, no_collector, method,
                                                                static_decode):
    ids = torch.randint(3, tiny_gqa.config.vocab_size, (HIST + 9,), generator=torch.Generator().manual_seed(1)).tolist()
    spec = f"memory:64MB,disk:{tmp_path}/d:1GB"
    with _engine(tiny_gqa, spec, method) as a:
        a.generate([ids[:HIST]], ONE)
        assert a.flush(30)
    # A restart: the history comes from disk (with the static decoder: GPU engines' default).
    engine = _engine(tiny_gqa, f"disk:{tmp_path}/d:1GB", method, static_decode)
    out = engine.generate([ids], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert out.reused_by_tier == {"disk": HIST}  # a restore ran (its reader, its staging)
    store = engine.link.store
    alive = {"pool": weakref.ref(engine.runner.k_cache[0]), "runner": weakref.ref(engine.runner),
             "store": weakref.ref(store), "disk tier": weakref.ref(store.tier("disk")),
             "engine": weakref.ref(engine)}
    engine.close()
    del engine, store
    assert [name for name, ref in alive.items() if ref() is not None] == []


def test_a_closed_store_frees_its_memory_tier(tiny_gqa, tmp_path, no_collector):
    ids = torch.randint(3, tiny_gqa.config.vocab_size, (HIST,), generator=torch.Generator().manual_seed(2)).tolist()
    engine = _engine(tiny_gqa, f"memory:64MB,disk:{tmp_path}/d:1GB", "kv")
    engine.generate([ids], ONE)
    assert engine.flush(30)
    memory = weakref.ref(engine.link.store.tier("memory"))
    engine.close()
    del engine
    assert memory() is None
