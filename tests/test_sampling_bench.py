"""`kvtier bench sampling` end to end on the tiny random model: every row at both batch sizes, the
baseline (today's per-row host sampler) beside the batched sampler's plain row only."""

from __future__ import annotations

import json

from kvtier.cli.main import main as kvtier_main


def test_sampling_bench_smoke(tmp_path):
    rc = kvtier_main(["bench", "sampling", "--model", "tiny-gqa", "--tokens", "4", "--repeats", "1",
                      "--prompt-len", "16", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "sampling.json").read_text())
    rows = {(r["batch"], r["row"]): r for r in doc["rows"]}
    assert set(rows) == {(b, k) for b in (1, 8) for k in ("plain", "penalties", "logprobs", "json")}
    for (b, key), r in rows.items():
        assert r["batched"]["tok_s"] > 0 and r["vs_host_plain"] > 0
        assert r["batched"]["tokens"] == [b * 3]  # 4 tokens a request, the first one not timed
        if key == "plain":
            assert r["host"]["tok_s"] > 0
        else:
            assert r["host"] is None  # the host sampler cannot do penalties, logprobs or grammars
    assert doc["meta"]["cpu_count"] and doc["meta"]["torch"] and doc["meta"]["dtype"]
    assert (tmp_path / "sampling.png").stat().st_size > 0
