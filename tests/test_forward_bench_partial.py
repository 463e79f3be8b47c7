"""`kvtier bench forward --json` writes its file after every row: a run stopped part-way (a GPU
lease's time limit) keeps the rows it measured."""

from __future__ import annotations

import json

import kvtier.bench.forward as forward
from kvtier.cli.main import main


def test_the_json_holds_every_row_measured_before_a_stop(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))

    def stopped(*a, **kw):
        raise KeyboardInterrupt  # the time limit, after the prefill rows

    monkeypatch.setattr(forward, "bench_continuation", stopped)
    out = tmp_path / "forward.json"
    rc = main(["bench", "forward", "--model", "tiny-gqa", "--dtype", "fp32", "--prefill", "16,32", "--continuation", "8",
               "--batch", "1", "--repeats", "1", "--hf-compiled", "off", "--json", str(out)])
    assert rc == 130  # interrupted, as at a time limit
    rows = json.loads(out.read_text())["rows"]
    assert [(r["phase"], r["tokens"]) for r in rows] == [("prefill", 16), ("prefill", 32)]
    assert all(r["kvtier_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in rows)


def test_each_rows_modes_run_back_to_back_in_alternating_order(tmp_path, monkeypatch):
    """A VM drifts over minutes: exact and inexact rows measured a table apart would compare unlike
    machines, so each row's modes run one after the other, first-to-run alternating by row."""
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    out = tmp_path / "forward.json"
    rc = main(["bench", "forward", "--model", "tiny-gqa", "--dtype", "fp32", "--prefill", "16,32", "--continuation", "8",
               "--batch", "1", "--repeats", "1", "--modes", "exact,inexact", "--hf-compiled", "off", "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["phase"], r["tokens"], r["mode"]) for r in rows] == [
        ("prefill", 16, "exact"), ("prefill", 16, "inexact"), ("prefill", 32, "inexact"), ("prefill", 32, "exact"),
        ("continuation", 8, "exact"), ("continuation", 8, "inexact"), ("decode", 1, "inexact"), ("decode", 1, "exact")]
    assert forward._MODE == {}  # the engines built after the run are plain ones again
