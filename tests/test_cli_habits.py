"""Command lines written for vLLM or llama-server: their spellings of kvtier's options parse to the
same options, their flags kvtier has no equivalent for are one line naming what to use instead, and
--threads, kvtier's own thread count, is applied before the model loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.cli import engine_args, foreign_flags
from kvtier.cli.engine_args import EngineOptions
from kvtier.cli.main import build_parser, main
from kvtier.cli.options import apply_sources, from_args
from kvtier.cli.serve import ServeOptions
from kvtier.models.presets import PRESETS


def _parse(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    apply_sources(args, {}, known=(EngineOptions, ServeOptions))
    return args


def _serve(*flags: str) -> tuple[EngineOptions, ServeOptions]:
    args = _parse(["serve", *flags])
    return EngineOptions.from_args(args), from_args(ServeOptions, args)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("home")


@pytest.mark.parametrize("theirs, ours", [
    (["-m", "tiny-gqa"], ["--model", "tiny-gqa"]),
    (["--dtype", "bfloat16"], ["--dtype", "bf16"]),
    (["--dtype", "float16"], ["--dtype", "fp16"]),
    (["--dtype", "half"], ["--dtype", "fp16"]),
    (["--dtype", "float32"], ["--dtype", "fp32"]),
    (["--dtype", "float"], ["--dtype", "fp32"]),
    (["--max-num-batched-tokens", "512"], ["--max-batched-tokens", "512"]),
    (["--no-enable-prefix-caching"], ["--no-prefix-cache"]),
    (["--enable-prefix-caching"], []),
    (["-c", "1024"], ["--max-model-len", "1024"]),
    (["--ctx-size", "1024"], ["--max-model-len", "1024"]),
    (["-t", "1"], ["--threads", "1"]),
    (["--uvicorn-log-level", "debug"], ["--log-level", "debug"]),
])
def test_their_spelling_parses_to_the_same_options(theirs: list[str], ours: list[str]) -> None:
    assert _serve(*theirs) == _serve(*ours)


def test_the_aliases_reach_generate_chat_and_the_model_only_commands() -> None:
    for command in (["generate", "--prompt", "x"], ["chat"], ["demo"]):
        opts = EngineOptions.from_args(_parse([*command, "-m", "tiny-gqa", "-c", "64", "-t", "1",
                                                "--dtype", "float", "--max-num-batched-tokens", "32"]))
        assert (opts.model, opts.max_model_len, opts.threads, opts.dtype, opts.max_batched_tokens) == \
            ("tiny-gqa", 64, 1, "fp32", 32)
    args = _parse(["bench", "sampling", "-m", "tiny-gqa", "--dtype", "bfloat16"])
    assert (args.model, args.dtype) == ("tiny-gqa", "bf16")
    assert _parse(["profile", "-m", "tiny-gqa", "--dtype", "half"]).dtype == "fp16"


def test_enable_prefix_caching_as_a_flag_wins_over_the_environment_and_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "kvtier.yaml"
    cfg.write_text("no_prefix_cache: true\n")
    for argv, env in ((["--config", str(cfg)], {}), ([], {"KVTIER_NO_PREFIX_CACHE": "1"})):
        args = build_parser().parse_args(["serve", *argv])
        apply_sources(args, env, known=(EngineOptions, ServeOptions))
        assert args.no_prefix_cache is True
        args = build_parser().parse_args(["serve", *argv, "--enable-prefix-caching"])
        apply_sources(args, env, known=(EngineOptions, ServeOptions))
        assert args.no_prefix_cache is False


def test_a_dtype_neither_kvtier_nor_vllm_has_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--dtype", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err


def test_help_lists_the_aliases_and_threads() -> None:
    help = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert help.returncode == 0, help.stderr
    text = " ".join(help.stdout.split())
    for spelling in ("-m MODEL", "-c MAX_MODEL_LEN", "--ctx-size", "--max-num-batched-tokens",
                     "--no-enable-prefix-caching", "--enable-prefix-caching", "--uvicorn-log-level",
                     "--threads N, -t N", "bfloat16", "physical core"):
        assert spelling in text, spelling
    assert "%(" not in text and "%%" not in text
    assert text.count("(default: auto) (default: auto)") == 0


@pytest.mark.parametrize("flag, hint", [
    (["-tp", "2"], "--device"), (["--tensor-parallel-size=2"], "--device"),
    (["-ngl", "99"], "--device"), (["--n-gpu-layers", "99"], "--device"),
    (["--trust-remote-code"], "never a model's own code"),
    (["--chat-template", "t.jinja"], "model's own chat template"),
    (["--jinja"], "model's own (Jinja) chat template"),
    (["--tokenizer", "org/tok"], "comes with --model"),
    (["--generation-config", "auto"], "with each request"),
    (["--enable-auto-tool-choice"], "on by default"), (["--tool-call-parser", "hermes"], "chat template"),
])
@pytest.mark.parametrize("command", [["serve"], ["generate", "--prompt", "x"], ["chat"], ["bench", "sampling"]])
def test_a_flag_kvtier_has_no_equivalent_for_is_one_line_naming_the_alternative(
        command: list[str], flag: list[str], hint: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--model", "tiny-gqa", *flag]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "kvtier has no such option" in err and hint in err, err
    assert err.startswith(f"kvtier: error: {flag[0].split('=')[0]}: ")


def test_every_refusal_is_short_and_nothing_after_a_double_dash_is_read() -> None:
    for flags in foreign_flags.REFUSED:
        for flag in flags:
            line = foreign_flags.refusal([flag])
            assert line is not None and len(line) <= 160, line
    assert foreign_flags.refusal(["generate", "--", "--jinja"]) is None
    assert foreign_flags.refusal(["serve", "--threads", "1"]) is None


def test_the_real_command_refuses_a_foreign_flag_before_loading_anything() -> None:
    run = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--model", "no-such-model", "-tp", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().splitlines() == [
        "kvtier: error: -tp: kvtier has no such option; no tensor parallelism: kvtier runs the whole model on one "
        "device (--device)"], run.stderr


@pytest.mark.parametrize("value", ["0", "-1", str((os.cpu_count() or 1) * 4 + 1), "two"])
def test_a_thread_count_out_of_range_is_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["generate", "--prompt", "x", "--threads", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --threads/-t:" in err.splitlines()[-1]
    with pytest.raises(ValueError, match="--threads must be from 1 to"):
        EngineOptions(model="tiny-gqa", threads=0).build()  # the Python API's keyword is checked too


def test_a_thread_count_from_the_environment_is_checked(capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_THREADS", "0")
    assert main(["generate", "--prompt", "x", "--model", "no-such-model"]) == 2
    assert "$KVTIER_THREADS: must be from 1 to" in capsys.readouterr().err


def test_threads_sets_torchs_threads_before_the_model_loads(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVTIER_HOME", str(home))
    seen: list[int] = []
    real = engine_args.model_context_limit

    def limit(model: str) -> int | None:  # called before the load: what the load runs with is set by then
        seen.append(torch.get_num_threads())
        return real(model)

    monkeypatch.setattr(engine_args, "model_context_limit", limit)
    before = torch.get_num_threads()
    want = 2 if before == 1 else 1
    try:
        code = main(["generate", "--model", "tiny-gqa", "--dtype", "fp32", "--no-store", "--raw", "--prompt", "hi",
                     "--max-tokens", "2", "-t", str(want)])
        assert (code, seen, torch.get_num_threads()) == (0, [want], want), capsys.readouterr().err
    finally:
        torch.set_num_threads(before)


def test_a_context_window_over_the_models_is_refused_before_the_load(capsys: pytest.CaptureFixture[str]) -> None:
    limit = PRESETS["tiny-gqa"].max_position_embeddings
    assert main(["generate", "--model", "tiny-gqa", "--no-store", "--prompt", "x", "--max-model-len", "99999999"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: --max-model-len 99999999 is more than tiny-gqa's context window of {limit} tokens "
                   f"(max_position_embeddings): use at most {limit}, or leave it unset for the model's\n")


def test_a_local_model_directorys_limit_is_read_from_its_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 8, "hidden_size": 8, '
                                          '"intermediate_size": 8, "num_hidden_layers": 1, '
                                          '"num_attention_heads": 2, "max_position_embeddings": 512}')
    assert engine_args.model_context_limit(str(tmp_path)) == 512
    (tmp_path / "config.json").write_text("not json")
    assert engine_args.model_context_limit(str(tmp_path)) is None  # the load says what is wrong
    assert engine_args.model_context_limit("org/name") is None


def test_a_limit_known_only_once_loaded_is_refused_after_the_load(home: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A GGUF file or a Hub id: the engine reports the model's window; the engine is closed again."""
    monkeypatch.setenv("KVTIER_HOME", str(home))
    monkeypatch.setattr(engine_args, "model_context_limit", lambda model: None)
    closed: list[bool] = []
    from kvtier.engine.engine import Engine

    real_close = Engine.close

    def close(self: Engine) -> None:
        closed.append(True)
        real_close(self)

    monkeypatch.setattr(Engine, "close", close)
    limit = PRESETS["tiny-gqa"].max_position_embeddings
    with pytest.raises(ValueError, match=f"context window of {limit} tokens"):
        EngineOptions(model="tiny-gqa", dtype="fp32", no_store=True, kv_cache_gb=0.0625,
                      max_model_len=limit + 1).build()
    assert closed == [True]
    with EngineOptions(model="tiny-gqa", dtype="fp32", no_store=True, kv_cache_gb=0.0625,
                       max_model_len=limit).build() as engine:
        assert engine.max_model_len == limit
