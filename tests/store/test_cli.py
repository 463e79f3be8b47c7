"""`kvtier store stats|verify|clear` and `kvtier bench store`, registered on a throwaway parser."""
import argparse
import json

import pytest

from kvtier.cli import store as store_cli
from kvtier.cli.bench import store as store_bench
from kvtier.store import TieredStore

from store_testlib import make_ns, make_state, tokens


def _parser():
    p = argparse.ArgumentParser(prog="kvtier")
    sub = p.add_subparsers(dest="command", required=True)
    store_cli.register(sub)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    store_bench.register(bench)
    return p


def _run(argv):
    args = _parser().parse_args(argv)
    return args.func(args)


def _fill(spec, models=("model-a", "model-b")):
    for m in models:
        with TieredStore.open(spec, make_ns(model=m), chunk_tokens=16) as s:
            k, v, _ = make_state(40)
            s.save(tokens(40), 0, k, v, None)


def test_stats_verify_clear_over_all_models(tmp_path, capsys):
    spec = f"disk:{tmp_path}/d:10MB"
    _fill(spec)
    assert _run(["store", "stats", "--store", spec, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["tiers"]["disk"]["entries"] == 6  # 3 chunks x 2 models
    assert _run(["store", "verify", "--store", spec]) == 0
    victim = sorted((tmp_path / "d").rglob("*.kvc"))[0]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert _run(["store", "verify", "--store", spec]) == 1
    assert "removed corrupt chunk" in capsys.readouterr().out
    assert _run(["store", "verify", "--store", spec]) == 0
    assert _run(["store", "stats", "--store", spec]) == 0  # the table form
    assert _run(["store", "clear", "--store", spec]) == 0
    assert not list((tmp_path / "d").rglob("*.kvc"))


def test_admin_commands_on_redis(redis_url, capsys):
    _fill(redis_url)
    assert _run(["store", "verify", "--store", redis_url]) == 0
    assert "checked 6 chunks" in capsys.readouterr().out
    assert _run(["store", "clear", "--store", redis_url]) == 0
    assert "6 chunks from redis" in capsys.readouterr().out


def test_bad_spec_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        _parser().parse_args(["store", "stats", "--store", "disk:/x"])
    assert e.value.code == 2
    assert "disk:PATH:SIZE" in capsys.readouterr().err


def test_default_store_spec_uses_home(monkeypatch):
    monkeypatch.setenv("KVTIER_HOME", "/k")
    p = argparse.ArgumentParser()
    store_cli.add_store_argument(p)
    assert p.parse_args([]).store == "memory:2GB,disk:/k/store:20GB"
    assert store_cli.default_store_spec("/h") == "memory:2GB,disk:/h/store:20GB"


def test_bench_store_small_run(tmp_path, capsys):
    out = tmp_path / "b.json"
    md = tmp_path / "b.md"
    assert _run(["bench", "store", "--tokens", "128", "--reps", "1", "--capacity", "200MB",
                 "--dir", str(tmp_path / "bd"), "--disk-opts", ":bw=2GB/s",
                 "--json", str(out), "--markdown", str(md)]) == 0
    res = json.loads(out.read_text())
    ops = {(r["tier"], r["op"]) for r in res["rows"]}
    assert ("disk", "raw: sequential file read (warm)") in ops and ("memory", "read whole chunks") in ops
    assert any("emulated" in r["note"] for r in res["rows"] if r["tier"] == "disk")
    assert "| disk | read whole chunks |" in md.read_text()
