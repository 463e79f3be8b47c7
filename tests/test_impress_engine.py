"""`--restore-method impress` in the engine: the request's stored prefix restored by importance,
checked against the standalone computation (and, keeping every token, against a no-store engine);
and approximate state never stored, published or restored as exact."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtier.engine.config import ImpressConfig, ReuseConfig
from kvtier.engine.engine import Engine
from kvtier.engine.impress.policy import ImpressPolicy, Selection
from kvtier.engine.impress.prefill import impress_prefill
from kvtier.engine.impress.restore import chunk_ratios
from kvtier.engine.request import SamplingParams
from kvtier.models.loading import load_model
from kvtier.models.rope import Rope
from kvtier.store.selective import TokenReads
from kvtier.testing.impress_harness import ReducedCache, extend

HIST, NEW, OUT = 256, 12, 8
CHUNK = 64  # four chunks of granules: what the reads and reordering below are counted in
GREEDY = SamplingParams(max_tokens=OUT, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-gqa", dtype="fp32", tokenizer=False)


def _ids(model, n: int, seed: int = 11) -> list[int]:
    return torch.randint(3, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _impress_engine(model, tmp_path, ratio: float) -> Engine:
    return Engine(model, store=f"disk:{tmp_path}/d:256MB", reuse=ReuseConfig(method="impress", chunk_tokens=CHUNK, impress=ImpressConfig(ratio=ratio)))


def _turn_one(model, tmp_path, ids: list[int]) -> None:
    """Turn 1 on an engine of its own: the prefix comes back to a fresh device, from the store."""
    with _impress_engine(model, tmp_path, 1.0) as engine:
        engine.generate([ids[:HIST]], SamplingParams(max_tokens=1, temperature=0.0))
        assert engine.flush(30)


def test_keeping_every_token_generates_what_a_no_store_engine_does(model, tmp_path):
    ids = _ids(model, HIST + NEW)
    with Engine(model) as plain:
        want = plain.generate([ids], GREEDY)[0].output_ids
    _turn_one(model, tmp_path, ids)
    with _impress_engine(model, tmp_path, 1.0) as engine:
        out = engine.generate([ids], GREEDY)[0]
    assert out.restore is not None and out.restore.method == "impress"
    assert out.restore.prefix_attended == HIST and out.prompt_tokens_reused == HIST
    assert out.output_ids == want


def _standalone(model, store, ids: list[int], policy: ImpressPolicy) -> tuple[list[int], list[float]]:
    """Greedy tokens of the same restore run outside the engine (impress_prefill, then extend),
    and each one's logprob."""
    reads = TokenReads(store, store.lookup(ids[:HIST]).chunks)
    rope = Rope(model.config, 4096, model.dtype)
    try:
        logits, kv, _ = impress_prefill(model.module, rope, reads, ids[HIST:], policy)
    finally:
        reads.close()
    cache = ReducedCache.of(kv)
    out, lps, last = [], [], logits[-1]
    while True:
        out.append(int(last.argmax()))
        lps.append(float(torch.log_softmax(last, dim=-1)[out[-1]]))
        if len(out) == OUT:
            return out, lps
        last = extend(model.module, rope, cache, out[-1:])[-1]


@pytest.fixture(scope="module")
def bf16_model():
    return load_model("tiny-gqa", dtype="bf16", tokenizer=False)


@pytest.mark.parametrize("options,dtype", [(dict(unit="token", window=1, vote="majority"), "fp32"),
                                           (dict(selection="h2o", unit="granule", window=1), "fp32"),
                                           ({}, "fp32"), ({}, "bf16")],
                         ids=["paper", "h2o-granule", "defaults", "defaults-bf16"])
def test_a_quarter_of_the_prefix_decodes_as_the_standalone_restore_does(request, tmp_path, options, dtype, monkeypatch):
    model = request.getfixturevalue("model" if dtype == "fp32" else "bf16_model")
    ids = _ids(model, HIST + NEW, seed=12)
    _turn_one(model, tmp_path, ids)
    config = ImpressConfig(ratio=0.25, **options)
    with Engine(model, store=f"disk:{tmp_path}/d:256MB", reuse=ReuseConfig(method="impress", chunk_tokens=CHUNK, impress=config)) as engine:
        runs = _step_runs(engine, monkeypatch)
        out = engine.generate([ids], replace(GREEDY, logprobs=0))[0]
        policy = ImpressPolicy(ratio=0.25, selection=Selection(config.selection.value), window=config.window,
                               block=16 if config.unit.value == "granule" else 1, vote=config.vote)
        want, want_lps = _standalone(model, engine.link.store, ids, policy)
    assert out.restore is not None and out.restore.prefix_attended == HIST // 4
    assert out.output_ids == want
    assert [lp.logprob for lp in out.logprobs] == want_lps  # the same bits, not only the same argmax
    # The restore computed and placed every new token but the last: the request's steps compute
    # the last prompt token, then one token at a time.
    assert runs == [(HIST + NEW - 1 + i, 1) for i in range(OUT)]


def _step_runs(engine: Engine, monkeypatch) -> list[tuple[int, int]]:
    """(start, tokens) of every run the engine's steps execute, appended as they run."""
    runs: list[tuple[int, int]] = []
    execute = engine.runner.execute

    def recording(items, *args, **kwargs):
        runs.extend((it.start, len(it.token_ids)) for it in items)
        return execute(items, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", recording)
    return runs


def test_bad_importance_options_are_refused():
    with pytest.raises(ValueError, match="importance_selection"):
        ImpressConfig(selection="sometimes")
    with pytest.raises(ValueError, match="importance_unit"):
        ImpressConfig(unit="word")
    with pytest.raises(ValueError, match="importance_ratio"):
        ImpressConfig(ratio=0.0)
    with pytest.raises(ValueError, match="importance_window"):
        ImpressConfig(window=8)


@torch.inference_mode()
def _exact_kv(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = model.config
    cache = ReducedCache([torch.empty(0, cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers,
                         [torch.empty(0, cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers, 0)
    extend(model.module, Rope(cfg, 4096, torch.float32), cache, ids)
    return torch.stack(cache.k), torch.stack(cache.v)  # [layers, tokens, kv_heads, hd]


def test_approximate_state_never_enters_a_lossless_key_or_the_device_cache(model, tmp_path):
    ids = _ids(model, HIST + NEW, seed=13)
    _turn_one(model, tmp_path, ids)
    with _impress_engine(model, tmp_path, 0.25) as engine:
        store = engine.link.store
        keys_before = set(store.tier("disk").iterate())
        hits_before = engine.pool.hits
        two = engine.generate([ids], GREEDY)[0]
        turn3 = ids + two.output_ids + _ids(model, NEW, seed=14)
        three = engine.generate([turn3], GREEDY)[0]
        assert engine.flush(30)
        assert two.restore and two.restore.method == "impress"
        assert three.restore and three.restore.method == "impress"
        # Nothing the two approximate requests computed was saved or published.
        assert set(store.tier("disk").iterate()) == keys_before
        assert engine.pool.hits == hits_before
        # And every stored chunk any of the three sequences matches holds exact state.
        for seq in (ids[:HIST], ids + two.output_ids, turn3):
            k, v = _exact_kv(model, seq)
            for c in store.lookup(seq).chunks:
                got = store.read_chunk(c.key)
                assert got is not None
                for st in got:
                    torch.testing.assert_close(st.k, k[st.layer, c.start : c.end], atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(st.v, v[st.layer, c.start : c.end], atol=1e-4, rtol=1e-4)


def test_chunk_ratios_average_the_kept_share_over_layers():
    kept = [torch.tensor([0, 1, 64, 65, 66]), torch.tensor([0, 1, 2, 3, 127])]
    got = chunk_ratios(kept, [("a", 0, 64), ("b", 64, 128)])
    assert got == {"a": 6 / 128, "b": 4 / 128}


def test_score_policy_hears_what_importance_restores_needed(model, tmp_path):
    ids = _ids(model, HIST + NEW, seed=15)
    _turn_one(model, tmp_path, ids)
    reuse = ReuseConfig(method="impress", chunk_tokens=CHUNK, impress=ImpressConfig(ratio=0.25), eviction_policy="score")
    with Engine(model, store=f"memory:64MB,disk:{tmp_path}/d:256MB", reuse=reuse) as engine:
        out = engine.generate([ids], GREEDY)[0]
        store = engine.link.store
        assert out.restore is not None and out.restore.method == "impress"
        policy = store.score_policy()
        assert policy is not None
        chunks = store.lookup(ids[:HIST]).chunks
        # Every chunk was read once from disk and observed at its kept share: score = 1 x share.
        shares = [policy.score(c.key) for c in chunks]
        assert all(0 < s < 1 for s in shares) and sum(shares) == pytest.approx(len(chunks) * 0.25, rel=0.05)


def test_reordering_changes_what_is_read_not_what_is_restored(model, tmp_path):
    ids = _ids(model, HIST + NEW, seed=16)
    _turn_one(model, tmp_path, ids)
    # Reordering serves single-token selection (whole granules say nothing about order within one).
    reuse = ReuseConfig(method="impress", chunk_tokens=CHUNK, impress=ImpressConfig(ratio=0.25, unit="token", window=1, reorder_s=0))
    with Engine(model, store=f"memory:64MB,disk:{tmp_path}/d:256MB", reuse=reuse) as engine:
        # Approximate state is never published: the same prompt restores by importance each time.
        first, second = (engine.generate([ids], GREEDY)[0] for _ in range(2))
        store = engine.link.store
        report = store.reorder()
        third = engine.generate([ids], GREEDY)[0]
    assert report.chunks == HIST // CHUNK and report.missing == 0  # every chunk, on both tiers
    assert first.output_ids == second.output_ids == third.output_ids
    assert first.restore is not None and third.restore is not None
    assert third.restore.prefix_attended == first.restore.prefix_attended == HIST // 4
    # The kept quarter now fills the first granules of each chunk instead of touching nearly all.
    assert third.restore.bytes_read < 0.75 * first.restore.bytes_read


def test_a_fault_inside_the_restore_is_a_miss_and_the_prefix_is_recomputed(model, tmp_path, monkeypatch, caplog):
    """Any failure while an importance restore prepares (here a fault that is no read error) ends it
    as a miss: the request recomputes its prefix and answers as a no-store engine does; the fault
    is logged, the reads it opened are closed, and the engine goes on serving."""
    import logging

    from kvtier.engine.impress import restore as impress_restore

    ids = _ids(model, HIST + NEW)
    with Engine(model) as plain:
        want = plain.generate([ids], GREEDY)[0].output_ids
    _turn_one(model, tmp_path, ids)
    closed = []
    real_close = TokenReads.close
    monkeypatch.setattr(TokenReads, "close", lambda self: closed.append(1) or real_close(self))

    def fault(*args, **kw):
        raise RuntimeError("a fault in the choosing prefill")

    monkeypatch.setattr(impress_restore, "impress_prefill", fault)
    with caplog.at_level(logging.ERROR), _impress_engine(model, tmp_path, 1.0) as engine:
        out = engine.generate([ids], GREEDY)[0]
        again = engine.generate([ids[:HIST] + _ids(model, NEW, seed=5)], GREEDY)[0]
    assert out.output_ids == want and out.prompt_tokens_reused == 0
    assert again.finished and closed
    assert any("ImpressRestore failed" in r.getMessage() for r in caplog.records)
