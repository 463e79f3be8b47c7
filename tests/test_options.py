"""One configuration surface: options declared once (EngineOptions, ServeOptions) become flags,
--config YAML keys and KVTIER_* environment variables, with flags > environment > file > default."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from kvtier.cli.engine_args import EngineOptions
from kvtier.cli.main import build_parser
from kvtier.cli.options import ConfigError, apply_sources, fields_of, from_args
from kvtier.cli.serve import ServeOptions

KNOWN = (EngineOptions, ServeOptions)


def _resolve(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    apply_sources(args, environ or {}, known=KNOWN)
    return args


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return str(path)


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path):
    cfg = _config(tmp_path, "max-num-seqs: 3\nchunk_tokens: 32\nno_prefix_cache: true\nport: 9100\n"
                            "restore_method: hidden\nmax_model_len: 256\n")
    args = _resolve(["serve", "--config", cfg, "--max-num-seqs", "5"],
                    {"KVTIER_MAX_NUM_SEQS": "4", "KVTIER_CHUNK_TOKENS": "16", "KVTIER_PORT": "9200"})
    assert (args.max_num_seqs, args.chunk_tokens, args.port) == (5, 16, 9200)  # flag, env, env
    assert (args.no_prefix_cache, args.restore_method, args.max_model_len) == (True, "hidden", 256)  # file
    assert (args.kv_cache_gb, args.host) == (None, "127.0.0.1")  # defaults (None: the device's budget)
    opts = EngineOptions.from_args(args)
    assert (opts.max_num_seqs, opts.chunk_tokens, opts.no_prefix_cache) == (5, 16, True)
    assert opts.engine_config()["enable_prefix_cache"] is False and opts.reuse().chunk_tokens == 16
    serve = from_args(ServeOptions, _resolve(["serve", "--log-stats-interval", "0", "--max-body-bytes", "99"]))
    assert (serve.serve_config().stats_interval_s, serve.serve_config().max_body_bytes) == (0.0, 99)


def test_a_file_shared_by_commands_may_hold_another_commands_options(tmp_path):
    cfg = _config(tmp_path, "port: 9100\nmax_num_seqs: 2\n")
    args = _resolve(["generate", "--prompt", "x", "--config", cfg])
    assert args.max_num_seqs == 2 and not hasattr(args, "port")


def test_the_store_options_reach_the_reuse_config():
    args = _resolve(["generate", "--prompt", "x", "--storage-dtype", "fp16", "--min-restore-tokens", "8",
                     "--chunk-tokens", "32", "--importance-window", "5", "--importance-unit", "token"])
    reuse = EngineOptions.from_args(args).reuse()
    assert (reuse.storage_dtype, reuse.min_restore_tokens, reuse.chunk_tokens) == ("float16", 8, 32)
    assert (reuse.impress.window, reuse.impress.unit.value) == (5, "token")
    assert EngineOptions().reuse().storage_dtype == ""  # auto: the compute dtype, lossless


@pytest.mark.parametrize("text, message", [
    ("max_num_seqs: 0\n", "max_num_seqs: expected a positive integer"),
    ("dtype: fp8\n", "dtype: 'fp8' is not one of auto, fp32, bf16, fp16"),
    ("no_store: maybe\n", "no_store: expected true or false"),
    ("bogus_option: 1\n", "unknown option(s) bogus_option"),
    ("- a list\n", "expected a mapping of option names"),
    ("max_num_seqs: [1\n", "is not valid YAML"),
    ("store: 'disk:/x'\n", "disk:PATH:SIZE"),
    ("importance_window: 4\n", "importance_window: expected an odd number of tokens >= 1"),
])
def test_a_bad_config_file_names_the_file_and_the_option(tmp_path, text, message):
    cfg = _config(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        _resolve(["generate", "--prompt", "x", "--config", cfg])
    assert message in str(e.value) and str(tmp_path) in str(e.value)


def test_a_bad_environment_variable_names_it_and_hides_secrets():
    with pytest.raises(ConfigError, match=r"\$KVTIER_MAX_BATCHED_TOKENS: expected a positive integer"):
        _resolve(["serve"], {"KVTIER_MAX_BATCHED_TOKENS": "lots"})
    assert _resolve(["serve"], {"KVTIER_API_KEY": "k-from-env"}).api_key == "k-from-env"
    with pytest.raises(SystemExit):  # --help never shows a secret's value or default
        build_parser().parse_args(["serve", "--help"])


def test_a_store_secret_file_wins_over_the_environment(tmp_path):
    """As before the options had environment variables: --store-secret-file, else $KVTIER_STORE_SECRET."""
    secret = tmp_path / "secret"
    secret.write_text("from-the-file-0123456789\n")
    env = {"KVTIER_STORE_SECRET": "from-the-environment-0123"}
    opts = EngineOptions.from_args(_resolve(["serve", "--store-secret-file", str(secret)], env))
    assert opts.store_secret is None and opts.reuse().seal.secret == b"from-the-file-0123456789"


def test_every_engine_option_is_a_flag_of_every_engine_command():
    names = set(fields_of(EngineOptions))
    assert {"storage_dtype", "chunk_tokens", "min_restore_tokens"} <= names
    parser = build_parser()
    for argv in (["generate", "--prompt", "x"], ["chat"], ["demo"], ["serve"]):
        args = parser.parse_args(argv)
        assert names <= set(vars(args)), argv
        assert dataclasses.asdict(EngineOptions.from_args(args)) == dataclasses.asdict(EngineOptions())
    assert set(fields_of(ServeOptions)) <= set(vars(parser.parse_args(["serve"])))


def test_one_log_level_flag_for_the_program():
    assert _resolve(["--log-level", "DEBUG", "serve"]).global_log_level == "debug"
    assert _resolve(["serve", "--log-level", "error"]).log_level == "error"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "loud", "models"])


def test_the_top_level_api_runs_the_engine():
    """`from kvtier import ...` as the README shows; LLM gives the engine's own tokens."""
    import kvtier
    from kvtier import LLM, Engine, SamplingParams, load_model

    assert {"LLM", "Engine", "SamplingParams", "load_model", "EngineOptions"} <= set(kvtier.__all__)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM("tiny-gqa", dtype="fp32", no_store=True) as llm:
        outs = llm.generate(["hello there", [5, 6, 7]], params)
        assert isinstance(llm.engine, Engine)
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
    with Engine(load_model("tiny-gqa", dtype="fp32")) as engine:
        assert [o.output_ids for o in engine.generate(["hello there", [5, 6, 7]], params)] == \
            [o.outputs[0].token_ids for o in outs]
    with pytest.raises(TypeError, match="no_such_option"):
        LLM("tiny-gqa", no_such_option=1)
