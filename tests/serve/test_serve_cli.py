"""`kvtier serve` and `kvtier bench load` option parsing, help text and a short load run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.load import run as load_bench
from kvtier.cli import serve as cli
from kvtier.cli.bench import load as load_cli
from kvtier.cli.main import main as kvtier_main
from kvtier.cli.options import apply_sources, from_args


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier")
    cli.register(parser.add_subparsers(dest="command"))
    return parser


def test_serve_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    args = _serve_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.api_key) == ("smollm2-135m", "127.0.0.1", 8000, None)
    assert args.func is cli.run and args.store  # a store spec by default (or None without kvtier.store)


def test_serve_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.API_KEY_ENV, "from-env")
    for argv, key in ((["serve"], "from-env"), (["serve", "--api-key", "flag"], "flag")):
        args = _serve_parser().parse_args(argv)
        apply_sources(args)
        assert args.api_key == key


def test_serve_metrics_key_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVTIER_METRICS_KEY", "m-from-env")
    for argv, key in ((["serve"], "m-from-env"), (["serve", "--metrics-key", "m-flag"], "m-flag")):
        args = _serve_parser().parse_args(argv)
        apply_sources(args)
        assert from_args(cli.ServeOptions, args).serve_config().metrics_key == key
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["serve", "--metrics-key", "m-flag", "--help"])
    assert "--metrics-key" in capsys.readouterr().out


def test_serve_options_parse() -> None:
    args = _serve_parser().parse_args([
        "serve", "--model", "tiny-gqa", "--dtype", "fp32", "--host", "0.0.0.0", "--port", "9001",
        "--max-model-len", "512", "--max-batched-tokens", "256", "--max-num-seqs", "8", "--kv-cache-gb", "0.5",
        "--max-body-bytes", "1000", "--served-model-name", "mine", "--default-max-tokens", "32",
        "--log-level", "debug", "--store", "memory:64MB", "--no-prefix-cache", "--restore-method", "hidden",
        "--chunk-tokens", "32", "--no-store",
    ])
    assert (args.port, args.max_num_seqs, args.kv_cache_gb, args.served_model_name) == (9001, 8, 0.5, "mine")
    assert args.log_level == "debug" and args.no_prefix_cache and args.store == "memory:64MB"
    assert (args.restore_method, args.chunk_tokens, args.no_store) == ("hidden", 32, True)


@pytest.mark.parametrize("bad", [["--port", "70000"], ["--max-num-seqs", "0"], ["--dtype", "int3"],
                                 ["--log-level", "loud"]])
def test_serve_rejects_bad_options(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["serve", *bad])


def test_a_blend_separator_without_blend_is_refused_before_the_port_or_the_model() -> None:
    from kvtier.cli import serve

    args = _serve_parser().parse_args(["serve", "--model", "no-such-model", "--blend-separator", "##", "--port", "1"])
    with pytest.raises(ValueError, match="--blend-separator marks the documents to blend: add --blend"):
        serve.run(args)


def test_serve_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _serve_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for option in ("--model", "--dtype", "--store", "--host", "--port", "--api-key", "--max-model-len",
                   "--max-batched-tokens", "--max-num-seqs", "--kv-cache-gb", "--max-body-bytes",
                   "--served-model-name", "--default-max-tokens", "--log-level", "--no-prefix-cache",
                   "--no-store", "--restore-method", "--chunk-tokens",
                   "KVTIER_API_KEY", "/v1/chat/completions", "/metrics"):
        assert option in text, option


def test_module_entry_point_reports_a_bad_model() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.serve", "--model", "no-such-model", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no-such-model" in proc.stderr, proc.stderr


def test_bench_load_registration() -> None:
    parser = argparse.ArgumentParser(prog="kvtier bench")
    load_cli.register(parser.add_subparsers(dest="bench_command"))
    args = parser.parse_args(["load", "--model", "tiny-gqa", "--clients", "3", "--duration", "2", "--json", "x.json"])
    assert (args.clients, args.duration, args.json, args.func) == (3, 2.0, "x.json", load_cli.run)


def test_percentile() -> None:
    assert load_bench.percentile([], 50) is None
    values = [float(v) for v in range(1, 101)]
    assert load_bench.percentile(values, 50) == 50 and load_bench.percentile(values, 99) == 99
    assert load_bench.percentile([7.0], 99) == 7


def test_short_load_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark end to end on the tiny model: a server subprocess, streaming clients, JSON."""
    out = tmp_path / "load.json"
    code = kvtier_main(["bench", "load", "--model", "tiny-gqa", "--clients", "4", "--duration", "3", "--max-tokens", "8",
                            "--kv-cache-gb", "0.05", "--no-store", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0, report
    assert report["completed"] > 0 and report["errors"] == 0 and report["incomplete_streams"] == 0
    assert report["requests_per_s"] > 0 and report["ttft_p50_ms"] > 0 and report["rss_end_mb"] > 0
    assert "TTFT p99" in capsys.readouterr().out


def test_the_servers_startup_heap_is_left_out_of_later_collections() -> None:
    """`kvtier serve` freezes what start-up made: a later full collection does not walk it (one
    over smollm2's start-up heap took ~190 ms: a stalled step)."""
    import gc

    junk = [[i] for i in range(50_000)]  # objects alive at start-up
    gc.collect()
    tracked = len(gc.get_objects())
    try:
        cli.freeze_startup_heap()
        assert gc.get_freeze_count() >= tracked - 1000
        assert len(gc.get_objects()) < tracked - len(junk)  # a collection no longer walks them
    finally:
        gc.unfreeze()
    assert junk
