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
