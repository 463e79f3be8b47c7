"""`kvtier bench blend` end to end on random ids and the tiny random model: every row, the shares
computed in the order the methods promise, legolink recomputing whole passages equal to the full
prefill bit for bit, the JSON and the figure written; without the data the run is skipped."""

from __future__ import annotations

import json

from kvtier.cli.main import main

PASSAGE = 24


def test_blend_bench_rows_shares_and_exact_legolink(tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    out, png = tmp_path / "blend.json", tmp_path / "blend.png"
    rc = main(["bench", "blend", "--model", "tiny-gqa", "--dtype", "fp32", "--synthetic", "--n", "3",
               "--speed-n", "1", "--passage-tokens", str(PASSAGE), "--max-tokens", "4",
               "--link-tokens", f"2,8,{PASSAGE}", "--ratios", "0.15", "--check-layer", "0", "--chunk-tokens", "32",
               "--dir", str(tmp_path / "disk"), "--json", str(out), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(out.read_text())
    rows = {r["row"]: r for r in doc["rows"]}
    assert list(rows) == ["full", "prefix", "naive", "legolink-2", "legolink-8", f"legolink-{PASSAGE}",
                          "cacheblend-0.15"]
    shares = [rows[k]["recomputed_share"] for k in ("naive", "legolink-2", "legolink-8", f"legolink-{PASSAGE}")]
    assert shares == sorted(set(shares)) and shares[-1] == 1.0  # strictly increasing in k; whole passages: all
    assert rows["naive"]["recomputed_share"] < rows["cacheblend-0.15"]["recomputed_share"] < 1.0
    assert rows["cacheblend-0.15"]["check_layer"] == 0 and rows["legolink-8"]["check_layer"] is None
    assert rows["cacheblend-0.15"]["score"] == "weighted" and rows["legolink-8"]["score"] is None
    exact = rows[f"legolink-{PASSAGE}"]
    assert exact["first_token_agreement"] == 1.0 and exact["kl_mean"] == 0.0 and exact["leading_equal"] == 4
    assert rows["full"]["kl_mean"] == 0.0 and rows["prefix"]["n"] == 1
    for q in doc["questions"]:
        assert all(r["method"] == "blend" for k, r in q["rows"].items() if k not in ("full", "prefix"))
        assert q["rows"]["naive"]["bytes_read"] > 0  # the passages' state came from the store
    assert rows["full"]["disk"]["n"] == 1 and rows["cacheblend-0.15"]["disk"]["bytes_read"] > 0
    assert rows["legolink-2"]["disk"] is None and doc["rates"]["disk_bandwidth"] > 0
    assert doc["data"] is None and doc["settings"]["synthetic"] and doc["machine"]["cpu_model"]
    assert png.stat().st_size > 0


def test_blend_bench_without_the_data_is_skipped(tmp_path, capsys):
    out = tmp_path / "blend.json"
    rc = main(["bench", "blend", "--model", "tiny-gqa", "--data", str(tmp_path / "absent.json"),
               "--json", str(out)])
    assert rc == 0 and not out.exists()
    said = capsys.readouterr().out.strip()
    assert said.startswith("skipped: no MuSiQue data at") and len(said.splitlines()) == 1


def test_a_stopped_run_resumes_where_it_stopped(tmp_path, monkeypatch, capsys):
    """--resume keeps the questions --json holds (their values unchanged), runs the rest, and
    refuses a file run with other settings, naming them."""
    import pytest

    monkeypatch.setenv("KVTIER_HOME", str(tmp_path / "home"))
    out = tmp_path / "blend.json"
    args = ["bench", "blend", "--model", "tiny-gqa", "--dtype", "fp32", "--synthetic", "--speed-n", "0",
            "--passage-tokens", str(PASSAGE), "--max-tokens", "2", "--link-tokens", "2", "--ratios", "",
            "--chunk-tokens", "32", "--json", str(out)]
    assert main([*args, "--n", "1"]) == 0
    first = json.loads(out.read_text())["questions"]
    assert main([*args, "--n", "2", "--resume"]) == 0
    assert "resuming" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [q["index"] for q in doc["questions"]] == [0, 1] and {r["row"]: r["n"] for r in doc["rows"]}["naive"] == 2
    kept = doc["questions"][0]["rows"]
    assert {k: (v["kl"], v["text"]) for k, v in kept.items()} == \
        {k: (v["kl"], v["text"]) for k, v in first[0]["rows"].items()}
    with pytest.raises(SystemExit, match="--max-tokens 2 there, 3 now"):
        main([*args[:-6], "--max-tokens", "3", *args[-6:], "--n", "3", "--resume"])
    with pytest.raises(SystemExit, match="give --json"):
        main([*args[:-2], "--n", "3", "--resume"])
    out.write_text("[1, 2")  # a file that is not a run's JSON: a clear refusal, the file left as it was
    with pytest.raises(SystemExit, match="is not a bench blend run's JSON"):
        main([*args, "--n", "3", "--resume"])
    assert out.read_text() == "[1, 2"
