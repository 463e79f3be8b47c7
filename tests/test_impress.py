"""IMPRESS's compute over a stored prefix, against oracles: the model's own full forward for the
exact variants, and a masked full attention (the prefix's non-kept tokens masked out, every token
at its original position) for the approximate ones."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kvtier.engine.calibrate import probes as probe_calibration
from kvtier.engine.calibrate.probes import calibrate, calibrate_probe, probe_pass_rate
from kvtier.engine.config import ImpressConfig
from kvtier.engine.impress.importance import LayerSelection, select_all
from kvtier.engine.impress.policy import ImpressPolicy, Selection
from kvtier.engine.impress.prefill import impress_prefill
from kvtier.engine.impress.restore import ImpressRestore
from kvtier.engine.impress.select import LayerPool, Units
from kvtier.models.loading import load_model
from kvtier.models.rope import Rope, rotate_into
from kvtier.store import StoreNamespace, TieredStore
from kvtier.store.selective import TokenReads
from kvtier.testing.impress_harness import ReducedCache, extend

PREFIX, NEW, CHUNK = 96, 8, 32


@pytest.fixture(scope="module", params=["tiny-gqa", "tiny-mha"])
def loaded(request):
    return load_model(request.param, dtype="fp32", tokenizer=False)


def _ids(vocab: int, n: int, seed: int = 3) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _stored(loaded, tmp_path, ids: list[int], probe_first: tuple[int, ...] = ()) -> TieredStore:
    """Save the K/V of ids[:PREFIX] (computed by `extend` from an empty cache) in the importance layout."""
    cfg = loaded.config
    probe = 1 if cfg.num_kv_heads <= 2 else 2
    ns = StoreNamespace(loaded.fingerprint, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                        probe_kv_heads=probe, granule_tokens=8, probe_first=probe_first)
    store = TieredStore.open(f"disk:{tmp_path}/d:64MB", ns, chunk_tokens=CHUNK)
    rope = Rope(cfg, 4096, torch.float32)
    empty = ReducedCache([torch.empty(0, cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers,
                         [torch.empty(0, cfg.num_kv_heads, cfg.head_dim)] * cfg.num_layers, 0)
    logits = extend(loaded.module, rope, empty, ids[:PREFIX])
    torch.testing.assert_close(logits, loaded.module(torch.tensor(ids[:PREFIX])), atol=1e-4, rtol=1e-4)
    store.save(ids[:PREFIX], 0, torch.stack(empty.k), torch.stack(empty.v), None)
    assert store.flush(30)
    return store


def _restore(loaded, store, ids, policy):
    rope = Rope(loaded.config, 4096, torch.float32)
    reads = TokenReads(store, store.lookup(ids[:PREFIX]).chunks)
    try:
        logits, cache, stats = impress_prefill(loaded.module, rope, reads, ids[PREFIX:], policy)
    finally:
        reads.close()
    return rope, logits, cache, stats


@pytest.mark.parametrize("policy", [ImpressPolicy(selection=Selection.FULL), ImpressPolicy(ratio=1.0)],
                         ids=["full", "impress-ratio-1"])
def test_keeping_every_token_equals_the_full_forward(loaded, tmp_path, policy):
    ids = _ids(loaded.config.vocab_size, PREFIX + NEW + 3)
    with _stored(loaded, tmp_path, ids) as store:
        rope, logits, cache, stats = _restore(loaded, store, ids[: PREFIX + NEW], policy)
    want = loaded.module(torch.tensor(ids))
    torch.testing.assert_close(logits, want[PREFIX : PREFIX + NEW], atol=1e-4, rtol=1e-4)
    assert cache.rope_offset == 0 and cache.slots == PREFIX + NEW
    # Decoding on over the cache (teacher-forced) still matches.
    torch.testing.assert_close(extend(loaded.module, rope, ReducedCache.of(cache), ids[PREFIX + NEW :]), want[PREFIX + NEW :],
                               atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def _masked_oracle(model, ids: list[int], kept: list[torch.Tensor]) -> torch.Tensor:
    """Full attention over the whole prefix with layer l's non-kept prefix tokens masked out of the
    new rows' attention; every token at its original position. Logits of the new rows [NEW, vocab]."""
    cfg = model.cfg
    rope = Rope(cfg, 4096, torch.float32)
    n = len(ids)
    pos = torch.arange(n)
    cos, sin = rope.halves(pos)
    h = model.embed(torch.tensor(ids))
    g = cfg.num_heads // cfg.num_kv_heads
    for li, layer in enumerate(model.layers):
        q, k, v = layer.qkv(h)
        q, k = rotate_into(q, cos, sin, torch.empty_like(q)), rotate_into(k, cos, sin, torch.empty_like(k))
        allow = torch.ones(n, n, dtype=torch.bool).tril()
        drop = torch.ones(PREFIX, dtype=torch.bool)
        drop[kept[li]] = False
        allow[PREFIX:, :PREFIX] &= ~drop  # the new rows see only the kept prefix tokens
        qh = q.transpose(0, 1)  # [heads, n, hd]
        kh, vh = (x.transpose(0, 1).repeat_interleave(g, 0) for x in (k, v))
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allow)  # [heads, n, hd]
        h = layer.finish(h, out.transpose(0, 1))
    return model.logits(h[PREFIX:])


@pytest.mark.parametrize("selection, score_kv_heads, probe_first, window, layer_window", [
    (Selection.IMPRESS, None, "0", 1, 1), (Selection.IMPRESS, None, "1", 1, 1), (Selection.IMPRESS, None, "by layer", 1, 1),
    (Selection.IMPRESS, None, "0", 5, 1), (Selection.PROBES, None, "0", 1, 1), (Selection.PROBES, None, "0", 3, 3),
    (Selection.H2O, None, "0", 1, 1), (Selection.H2O, (1,), "0", 1, 1), (Selection.RANDOM, None, "0", 1, 1),
    (Selection.RECENT, None, "0", 1, 1)])
def test_a_reduced_prefix_equals_full_attention_with_the_dropped_tokens_masked(loaded, tmp_path, selection,
                                                                               score_kv_heads, probe_first, window,
                                                                               layer_window):
    ids = _ids(loaded.config.vocab_size, PREFIX + NEW + 2, seed=5)
    vote = "sum" if layer_window > 1 else "majority"
    policy = ImpressPolicy(ratio=0.25, selection=selection, score_kv_heads=score_kv_heads, window=window,
                           vote=vote, layer_window=layer_window)
    layers = loaded.config.num_layers
    firsts = tuple(li % 2 for li in range(layers)) if probe_first == "by layer" else (int(probe_first),) * layers
    with _stored(loaded, tmp_path, ids, firsts) as store:
        rope, logits, cache, stats = _restore(loaded, store, ids[: PREFIX + NEW], policy)
    k = math.ceil(0.25 * PREFIX)
    assert stats.kept_tokens == k and all(t.numel() == k for t in stats.kept)
    assert cache.slots == k + NEW and cache.rope_offset == PREFIX - k
    torch.testing.assert_close(logits, _masked_oracle(loaded.module, ids[: PREFIX + NEW], stats.kept),
                               atol=1e-4, rtol=1e-4)
    if selection is Selection.RECENT:
        assert all(t.tolist() == list(range(PREFIX - k, PREFIX)) for t in stats.kept)


def test_a_per_layer_budget_keeps_each_layers_share_and_equals_the_masked_oracle(loaded, tmp_path):
    """With a slope, early layers keep more and late ones less at the same total; the new rows
    (and a decode after them) are what full attention with each layer's dropped tokens masked
    gives. The engine, whose pool holds the same slots in every layer, refuses such a policy."""
    ids = _ids(loaded.config.vocab_size, PREFIX + NEW + 3, seed=6)
    policy = ImpressPolicy(ratio=0.25, selection=Selection.RANDOM, layer_slope=0.5)
    layers = loaded.config.num_layers
    want = [math.ceil(0.25 * (1 + 0.5 * (1 - 2 * li / (layers - 1))) * PREFIX) for li in range(layers)]
    assert want[0] > want[-1]
    with _stored(loaded, tmp_path, ids) as store:
        rope, logits, cache, stats = _restore(loaded, store, ids[: PREFIX + NEW], policy)
    assert [t.numel() for t in stats.kept] == want and [k.shape[0] for k in cache.k] == [w + NEW for w in want]
    assert cache.rope_offset == PREFIX - want[0]
    torch.testing.assert_close(logits, _masked_oracle(loaded.module, ids[: PREFIX + NEW], stats.kept),
                               atol=1e-4, rtol=1e-4)
    more = extend(loaded.module, rope, ReducedCache.of(cache), ids[PREFIX + NEW :])
    torch.testing.assert_close(more, _masked_oracle(loaded.module, ids, stats.kept)[NEW:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="layer slope"):
        ImpressPolicy(layer_slope=1.0)
    # The engine's pool gives a request the same slots in every layer: its restore refuses a slope.
    with pytest.raises(ValueError, match="same share in every layer"):
        ImpressRestore(None, policy, None, None, [], [])  # type: ignore[arg-type]


def test_each_layer_is_chosen_by_its_own_probe_head(loaded, tmp_path):
    """Per-layer probe heads: a layer probed by head 1 keeps what head 1 keeps there (the oracle: the
    same layer with head 1 everywhere) while the layers before it keep head 0's choice. A layer's
    input depends on what the layers before it kept, so each is compared where those agree."""
    ids = _ids(loaded.config.vocab_size, PREFIX + NEW, seed=6)
    last = loaded.config.num_layers - 1
    policy = ImpressPolicy(ratio=0.25, selection=Selection.PROBES)

    def kept(firsts: tuple[int, ...], name: str) -> list[torch.Tensor]:
        with _stored(loaded, tmp_path / name, ids, firsts) as store:
            return _restore(loaded, store, ids, policy)[3].kept

    zero, one = kept((0,) * (last + 1), "zero"), kept((1,) * (last + 1), "one")
    first_one = kept((1,) + (0,) * last, "first")  # layer 0 probed by head 1, the rest by head 0
    last_one = kept((0,) * last + (1,), "last")  # only the last layer probed by head 1
    assert torch.equal(first_one[0], one[0]) and not torch.equal(one[0], zero[0])
    assert all(torch.equal(a, b) for a, b in zip(last_one[:last], zero[:last]))
    assert not torch.equal(last_one[last], zero[last])


def test_pooling_keeps_the_neighbours_of_an_important_token():
    imp = torch.zeros(1, 20)  # [heads, prefix]
    imp[0, 10], imp[0, 3] = 1.0, 0.5

    def chosen(unit: int, window: int, kept: int) -> list[int]:
        units = Units(20, unit, 20 // unit, kept, window)
        return units.tokens(select_all(units.pooled(imp), kept).tokens).tolist()

    assert chosen(1, 1, 5) == [0, 1, 2, 3, 10]  # the two peaks, then ties by position
    assert chosen(1, 5, 5) == [8, 9, 10, 11, 12]  # the peak and two tokens either side of it
    assert chosen(1, 5, 7) == [1, 2, 8, 9, 10, 11, 12]  # then the lower peak's window
    # Granules of 4, by their pooled sums.
    assert chosen(4, 1, 2) == [0, 1, 2, 3, 8, 9, 10, 11]  # 0.5 (0-3), 1 (8-11)
    assert chosen(4, 5, 2) == [0, 1, 2, 3, 8, 9, 10, 11]  # 1.5 (0-3), 4 (8-11) over 1 (4-7), 1 (12-15)
    assert chosen(4, 9, 2) == [4, 5, 6, 7, 8, 9, 10, 11]  # 4 (8-11), 3 (4-7; 12-15 ties, later) over 2 (0-3)
    with pytest.raises(ValueError, match="odd"):
        ImpressPolicy(window=4)
    with pytest.raises(ValueError, match="importance_window"):
        ImpressConfig(window=0)


def test_a_layer_window_ranks_units_by_their_highest_share_in_the_last_layers():
    """Exact ids: each layer's summed importance as a share of its total, max-pooled over the window."""
    pool = LayerPool(window=2)
    sel = LayerSelection(torch.tensor([0]), True, 0.5)  # the layer's own choice: only `passed`/`jaccard` carry over

    def layer(*units: float) -> list[int]:
        out = pool.choose(torch.tensor([units]), sel, kept=2)  # one scoring head
        assert out.passed and out.jaccard == 0.5
        return out.tokens.tolist()

    assert layer(0.1, 0.6, 0.0, 0.3) == [1, 3]  # the first layer: its own shares
    # Unit 1 led the layer before; here unit 2 leads and unit 1 is low. Shares 0.05, 0.1, 0.8, 0.05
    # (the totals differ tenfold: shares, not raw sums, are compared) pooled with 0.1, 0.6, 0.0, 0.3.
    assert layer(0.5, 1.0, 8.0, 0.5) == [1, 2]
    assert layer(0.0, 0.0, 0.2, 0.8) == [2, 3]  # unit 1 is two layers back now: out of a window of 2
    assert LayerPool(window=1).choose(torch.tensor([[0.3, 0.1, 0.2]]), sel, kept=1).tokens.tolist() == [0]
    with pytest.raises(ValueError, match="layer window must be an integer"):
        ImpressPolicy(layer_window=0)
    with pytest.raises(ValueError, match="vote sum"):
        ImpressPolicy(layer_window=2, vote="majority")
    with pytest.raises(ValueError, match="vote sum"):
        ImpressPolicy(layer_window=2, selection=Selection.H2O, vote="sum")


def test_a_layer_window_leaves_the_first_layer_its_own_choice(loaded, tmp_path):
    ids = _ids(loaded.config.vocab_size, PREFIX + NEW, seed=8)
    with _stored(loaded, tmp_path, ids) as store:
        alone = _restore(loaded, store, ids, ImpressPolicy(ratio=0.25, selection=Selection.PROBES, vote="sum"))[3].kept
        pooled = _restore(loaded, store, ids, ImpressPolicy(ratio=0.25, selection=Selection.PROBES, vote="sum",
                                                            layer_window=loaded.config.num_layers))[3].kept
    assert torch.equal(alone[0], pooled[0])
    assert any(not torch.equal(a, b) for a, b in zip(alone[1:], pooled[1:]))


def test_bytes_read_follow_the_selection(loaded, tmp_path):
    ids = _ids(loaded.config.vocab_size, PREFIX + NEW, seed=7)
    with _stored(loaded, tmp_path, ids) as store:
        full = _restore(loaded, store, ids, ImpressPolicy(selection=Selection.FULL))[3]
        h2o = _restore(loaded, store, ids, ImpressPolicy(ratio=0.25, selection=Selection.H2O))[3]
        imp = _restore(loaded, store, ids, ImpressPolicy(ratio=0.25, alpha=100.0))[3]  # t ~ 0: every layer passes
        strict = _restore(loaded, store, ids, ImpressPolicy(ratio=0.25, alpha=0.0))[3]  # t = 1: every layer falls back
    cfg = loaded.config
    row = cfg.num_kv_heads * cfg.head_dim * 4  # one token's K (or V) of one layer
    probe_bytes = PREFIX * cfg.num_layers * (1 if cfg.num_kv_heads <= 2 else 2) * cfg.head_dim * 4
    assert full.bytes_read == 2 * PREFIX * cfg.num_layers * row  # K and V, nothing else
    assert h2o.bytes_read == full.bytes_read // 2 + (h2o.granules_read - PREFIX * cfg.num_layers // 8) * 8 * row
    # IMPRESS: the probe keys, then whole granules (8 tokens) of K and V holding the kept tokens.
    assert imp.layers_passed == cfg.num_layers and strict.layers_passed == 0
    assert imp.bytes_read == probe_bytes + imp.granules_read * 8 * row
    assert imp.granules_read <= imp.granules_whole
    # Falling back reads every key besides the probes: more than passing.
    assert strict.bytes_read == probe_bytes + strict.granules_read * 8 * row > imp.bytes_read


def test_block_selection_keeps_whole_granules_and_reads_only_them(loaded, tmp_path):
    assert ImpressPolicy(ratio=0.25, block=8).kept(96) == 24  # 3 of 12 blocks
    assert ImpressPolicy(ratio=0.25, block=8).kept(100) == 3 * 8 + 4  # the trailing part-block is kept
    assert ImpressPolicy(ratio=0.25, block=8, selection=Selection.RANDOM).kept(100) == 25  # blind: tokens
    ids = _ids(loaded.config.vocab_size, PREFIX + NEW, seed=8)
    cfg = loaded.config
    for selection in (Selection.IMPRESS, Selection.PROBES, Selection.H2O):
        policy = ImpressPolicy(ratio=0.25, block=8, selection=selection)
        with _stored(loaded, tmp_path / selection.value, ids) as store:
            _, logits, cache, stats = _restore(loaded, store, ids, policy)
        for kept in stats.kept:
            assert kept.numel() == 24 and torch.equal(kept.view(3, 8)[:, 0] % 8, torch.zeros(3, dtype=torch.long))
            assert torch.equal(kept.view(3, 8), kept.view(3, 8)[:, :1] + torch.arange(8))  # whole, aligned blocks
        torch.testing.assert_close(logits, _masked_oracle(loaded.module, ids, stats.kept), atol=1e-4, rtol=1e-4)
        if selection is Selection.PROBES:  # no threshold: every layer chooses from the probe keys
            assert stats.layers_passed == cfg.num_layers
            # The probe keys, then exactly the 3 kept granules of K and of V per layer.
            row = cfg.num_kv_heads * cfg.head_dim * 4
            probe_bytes = PREFIX * cfg.num_layers * (1 if cfg.num_kv_heads <= 2 else 2) * cfg.head_dim * 4
            assert stats.bytes_read == probe_bytes + cfg.num_layers * 2 * 3 * 8 * row


def test_probe_calibration_scores_each_candidate_kv_head(loaded):
    cfg = loaded.config
    rope = Rope(cfg, 4096, torch.float32)
    ids = _ids(cfg.vocab_size, 160, seed=9)
    err = calibrate_probe(loaded.module, rope, ids[:128], ids[40:56], probes=1)  # [layers, candidates]
    assert err.shape == (cfg.num_layers, cfg.num_kv_heads) and bool((err > 0.0).all())
    # Keeping the whole prefix changes nothing, whichever head chooses.
    none_lost = calibrate_probe(loaded.module, rope, ids[:128], ids[40:56], probes=1, ratio=1.0)
    assert float(none_lost.max()) < 1e-5


def test_probe_pass_rate_and_the_cached_calibration(loaded, tmp_path, monkeypatch):
    cfg = loaded.config
    rope = Rope(cfg, 4096, torch.float32)
    ids = _ids(cfg.vocab_size, 160, seed=9)
    zeros = (0,) * cfg.num_layers
    assert probe_pass_rate(loaded.module, rope, ids, 128, zeros, 1, ratio=1.0) == 1.0  # every set is everything
    rate = probe_pass_rate(loaded.module, rope, ids, 128, zeros, 1)
    assert 0.0 <= rate <= 1.0 and rate * cfg.num_layers == round(rate * cfg.num_layers)  # whole layers
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    first = calibrate(loaded, 1)
    assert first.first == ()  # no tokenizer: the paper's first heads
    monkeypatch.setattr(probe_calibration, "probe_pass_rate", lambda *a, **k: pytest.fail("not cached"))
    assert calibrate(loaded, 1) == first  # measured once per model, dtype and probe count
