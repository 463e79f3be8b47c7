"""`kvtier bench e2e` runs every peer on a context before the next context, HF's and kvtier's in
alternating order, so the ratios it pairs per context compare runs made minutes apart at most.
The restore method is fixed: with `auto`, a 128-token history on a busy machine may be planned as a
recompute, which reuses nothing."""

from __future__ import annotations

import json
import re

from kvtier.cli.main import main


def test_peers_take_turns_on_each_context(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    out = tmp_path / "e2e.json"
    rc = main(["bench", "e2e", "--model", "tiny-gqa", "--dtype", "fp32", "--history", "128", "--contexts", "2",
               "--tiers", "memory,disk", "--peers", "hf_floor,kvtier_memory,kvtier_disk_cold",
               "--method", "kv", "--workdir", str(tmp_path / "work"), "--json", str(out)])
    assert rc == 0
    runs = re.findall(r"fp32-H128 (\w+) (warm-up|\d/2):", capsys.readouterr().out)
    hf, mem, disk = "hf_floor", "kvtier_memory", "kvtier_disk_cold"
    assert [p for p, _ in runs] == [hf, mem, disk, mem, disk, hf, hf, mem, disk]
    assert [w for _, w in runs] == ["warm-up"] * 3 + ["1/2"] * 3 + ["2/2"] * 3
    rows = {r["peer"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(len(rows[p]["ttft_all_s"]) == 2 for p in (hf, mem, disk))
    assert rows[mem]["tokens_reused"] == [128, 128] and rows[disk]["reused_by_tier"] == {"disk": 128}
