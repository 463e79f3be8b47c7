"""`kvtier bench load --mode conversation` end to end: a real server, clients holding multi-turn chats
that resend their history, the report's reuse, time series, plot and verdict."""

from __future__ import annotations

import json

from kvtier.cli.main import main as kvtier_main


def test_conversation_mode_reports_reuse_samples_and_verdict(tmp_path):
    out, png = tmp_path / "conv.json", tmp_path / "conv.png"
    rc = kvtier_main([
        "bench", "load",
        "--mode", "conversation", "--model", "tiny-gqa", "--dtype", "fp32", "--clients", "3", "--duration", "8",
        "--turns", "3", "--max-tokens", "6", "--sample-every", "1", "--kv-cache-gb", "0.05", "--no-prefix-cache",
        "--restore-method", "kv", "--store", f"memory:32MB,disk:{tmp_path}/disk:64MB",
        "--json", str(out), "--plot", str(png),
    ])
    rep = json.loads(out.read_text())
    assert rep["errors"] == 0 and rep["incomplete_streams"] == 0
    v = rep["verdict"]
    assert rc == (0 if v["no_errors"] and v.get("rss_flat", False) and v["tiers_within_caps"] else 1)
    assert rep["completed"] == rep["requests"] > 3 and rep["conversations"] >= 3
    # Later turns resend the history: what earlier turns saved comes back from the store tiers.
    assert rep["cached_fraction_later_turns"] > 0
    assert sum(rep["reused_by_tier"].values()) > 0 and set(rep["reused_by_tier"]) <= {"memory", "disk"}
    samples = rep["samples"]
    assert len(samples) >= 4 and all(s["rss_mb"] for s in samples)
    assert samples[-1]["tier_capacity"] == {"memory": 32e6, "disk": 64e6}
    assert samples[-1]["tier_bytes"]["disk"] > 0 and rep["verdict"]["tiers_within_caps"] is True
    assert rep["verdict"]["no_errors"] is True and png.stat().st_size > 0
