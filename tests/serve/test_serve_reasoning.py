"""--reasoning-parser through the HTTP server: a random-weight Qwen3 model with Qwen3's own chat
template and a byte-level tokenizer whose <think> and </think> are added tokens, as Qwen3's are.
Its outputs are forced by Lark grammars (structured_outputs), so the text is known: the thinking
and the answer come apart whole and streamed, per choice, tags cut across deltas included, as
each parser reads the prompt's end (enable_thinking false closes the block in the prompt). The
splitter's own cases are in tests/test_reasoning.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import torch

from kvtier.models.loading import LoadedModel, _build
from kvtier.models.presets import random_state_dict
from kvtier.serve.config import ServeConfig

from kvtier_testlib import _tiny
from serve_testlib import DEFAULT_MAX_TOKENS, serve

TEMPLATE = Path(__file__).parents[1] / "data" / "qwen3_chat_template.jinja"
NAME = "tiny-qwen3"
ASK = [{"role": "user", "content": "Is 7 prime?"}]
# What Qwen3 writes, in small. The tags are token references (llguidance's `<name>`): as text
# ("<think>") the grammar engine would offer the tag's token and then refuse it, an added token
# being a special one to it.
THINK_THEN_ANSWER = r'start: <think> "\nabc\n" </think> "\n\nyes"'


def qwen3_tokenizer():
    """Bytes (GPT-2's byte-level alphabet, no merges) plus Qwen3's added tokens: ChatML's special
    ones, and <think>, </think>, <tool_call>, </tool_call> as ordinary added tokens (decoding keeps
    them), with Qwen3's chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                               merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = TEMPLATE.read_text()
    return hf


@pytest.fixture(scope="module")
def qwen3() -> LoadedModel:
    tok = qwen3_tokenizer()
    cfg = _tiny(model_type="qwen3", vocab_size=len(tok), num_kv_heads=2, head_dim=24, num_layers=2,
                eos_token_ids=(tok.eos_token_id,))
    module = _build(cfg, random_state_dict(cfg, 0), torch.float32, torch.device("cpu"))
    return LoadedModel(NAME, cfg, module, tok, f"test-{cfg.digest()[:8]}", "test")


@pytest.fixture(scope="module")
def served(qwen3):
    # Byte tokens make prompts long: Qwen3's tool block alone is some 500.
    with contextlib.contextmanager(serve)(qwen3, window=1024, config=ServeConfig(
            reasoning_parser="qwen3", default_max_tokens=DEFAULT_MAX_TOKENS)) as s:
        yield s


@pytest.fixture
def parser_named(served, monkeypatch):
    """Switch the module's server to another parser (or none) for one test."""
    ctx = served.app.state.kvtier

    def switch(name: str | None):
        monkeypatch.setattr(ctx, "config", replace(ctx.config, reasoning_parser=name))
        return served

    return switch


def _chat(s, grammar: str | None = None, **kw) -> dict:
    body = {"model": NAME, "messages": ASK, "max_tokens": 40, "temperature": 1.0, "seed": 0, **kw}
    if grammar is not None:
        body["structured_outputs"] = {"grammar": grammar}
    r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(s, grammar: str | None = None, **kw) -> dict[int, dict]:
    """Each choice's streamed deltas joined: {index: {"reasoning", "content", "finish", "deltas"}}."""
    body = {"model": NAME, "messages": ASK, "max_tokens": 40, "temperature": 1.0, "seed": 0, "stream": True, **kw}
    if grammar is not None:
        body["structured_outputs"] = {"grammar": grammar}
    got: dict[int, dict] = {}
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                mine = got.setdefault(c["index"], {"reasoning": None, "content": "", "finish": None, "deltas": []})
                d = c["delta"]
                mine["deltas"].append(d)
                if d.get("reasoning_content") is not None:
                    mine["reasoning"] = (mine["reasoning"] or "") + d["reasoning_content"]
                    assert not mine["content"].strip(), "thinking after the answer began"
                mine["content"] += d.get("content") or ""
                mine["finish"] = c["finish_reason"] or mine["finish"]
    return got


def test_thinking_and_answer_come_apart_whole_and_streamed_for_every_choice(served):
    whole = _chat(served, THINK_THEN_ANSWER, n=2)
    assert len(whole["choices"]) == 2
    for choice in whole["choices"]:
        msg = choice["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("\nabc\n", "\n\nyes"), msg
        assert choice["finish_reason"] == "stop"
    streamed = _stream(served, THINK_THEN_ANSWER, n=2)
    assert sorted(streamed) == [0, 1]
    for got in streamed.values():
        assert (got["reasoning"], got["content"], got["finish"]) == ("\nabc\n", "\n\nyes", "stop"), got
        assert not any("<think>" in (d.get("content") or "") + (d.get("reasoning_content") or "")
                       for d in got["deltas"])


def test_tags_cut_across_deltas_split_the_same(parser_named):
    """A stop string makes the detokenizer hold the last characters back, so the text arrives in
    pieces that cut the tags (seen without a parser); the split is the same."""
    forced = dict(grammar=r'start: <think> "abcdef" </think> "ghijkl"', stop=["zzzzz"])
    raw = [d.get("content") or "" for d in _stream(parser_named(None), **forced)[0]["deltas"]]
    assert "".join(raw) == "<think>abcdef</think>ghijkl"
    assert any(p.endswith(tag[:k]) for p in raw for tag in ("<think>", "</think>") for k in range(2, len(tag))), raw
    got = _stream(parser_named("qwen3"), **forced)[0]
    assert (got["reasoning"], got["content"]) == ("abcdef", "ghijkl"), got


def test_an_answer_without_a_think_block_is_all_content(served):
    msg = _chat(served, 'start: "plain answer"')["choices"][0]["message"]
    assert (msg["reasoning_content"], msg["content"]) == (None, "plain answer")
    got = _stream(served, 'start: "plain answer"')[0]
    assert (got["reasoning"], got["content"]) == (None, "plain answer")


def test_thinking_cut_short_is_all_reasoning(served):
    choice = _chat(served, "start: <think> /[a-z]{30}/", max_tokens=10)["choices"][0]
    assert choice["finish_reason"] == "length"
    msg = choice["message"]
    assert msg["content"] is None and re.fullmatch("[a-z]{9}", msg["reasoning_content"]), msg


def test_enable_thinking_false_closes_the_block_in_the_rendered_prompt(served, qwen3):
    tok = qwen3.tokenizer
    on = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == on + "<think>\n\n</think>\n\n"
    grown = len(tok.encode("<think>\n\n</think>\n\n"))
    plain = _chat(served, 'start: "ok"', max_tokens=4)
    closed = _chat(served, 'start: "ok"', max_tokens=4, chat_template_kwargs={"enable_thinking": False})
    assert closed["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + grown
    assert closed["choices"][0]["message"]["content"] == "ok"


def _no_tags(qwen3) -> dict[str, int]:
    """logit_bias that keeps the random model from writing a tag."""
    return {str(t): -100 for t in qwen3.tokenizer.convert_tokens_to_ids(["<think>", "</think>", "<|im_end|>"])}


def test_deepseek_r1_reads_output_before_any_end_tag_as_thinking(parser_named, qwen3):
    """deepseek_r1 reads the output as begun inside a block (DeepSeek-R1's template opens one), so
    free output without </think> is all thinking; where the prompt closed the block
    (enable_thinking false), it is all answer."""
    s = parser_named("deepseek_r1")
    free = dict(max_tokens=5, logit_bias=_no_tags(qwen3))
    msg = _chat(s, **free)["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"], msg
    got = _stream(s, **free)[0]
    assert got["reasoning"] == msg["reasoning_content"] and got["content"] == ""
    closed = _chat(s, **free, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert closed["reasoning_content"] is None and closed["content"], closed
    # Under a grammar the output begins outside: a block it opens itself is read as qwen3 reads it.
    forced = _chat(s, THINK_THEN_ANSWER)["choices"][0]["message"]
    assert (forced["reasoning_content"], forced["content"]) == ("\nabc\n", "\n\nyes")


def test_qwen3_without_tags_and_no_parser_leave_everything_in_content(parser_named, qwen3):
    free = dict(max_tokens=5, logit_bias=_no_tags(qwen3))
    msg = _chat(parser_named("qwen3"), **free)["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"]
    off = _chat(parser_named(None), THINK_THEN_ANSWER)["choices"][0]["message"]
    assert (off["reasoning_content"], off["content"]) == (None, "<think>\nabc\n</think>\n\nyes")


def test_completions_are_never_split(served):
    forced = {"grammar": 'start: <think> "a" </think> "b"'}
    r = httpx.post(served.url + "/v1/completions", timeout=60,
                   json={"model": NAME, "prompt": "x", "max_tokens": 8, "structured_outputs": forced})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "<think>a</think>b"


def test_a_tool_call_after_thinking_is_read_from_the_answer(served):
    tool = {"type": "function", "function": {"name": "is_prime", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    call = (r'start: <think> "\nabc\n" </think> "\n\n" '
            r'<tool_call> "\n{\"name\": \"is_prime\", \"arguments\": {\"n\": 7}}\n" </tool_call>')
    choice = _chat(served, call, tools=[tool], max_tokens=80)["choices"][0]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["reasoning_content"] == "\nabc\n", choice
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == [
        ("is_prime", {"n": 7})]
    got = _stream(served, call, tools=[tool], max_tokens=80)[0]
    assert got["reasoning"] == "\nabc\n" and got["finish"] == "tool_calls" and not got["content"].strip()


def test_the_option_takes_the_two_parsers_and_refuses_others(tmp_path, capsys):
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import ConfigError, apply_sources, from_args
    from kvtier.cli.serve import ServeOptions

    def options(argv: list[str], env: dict[str, str]) -> ServeOptions:
        args = build_parser().parse_args(["serve", *argv])
        apply_sources(args, env)
        return from_args(ServeOptions, args)

    assert options([], {}).serve_config().reasoning_parser is None
    assert options(["--reasoning-parser", "deepseek_r1"], {}).serve_config().reasoning_parser == "deepseek_r1"
    assert options([], {"KVTIER_REASONING_PARSER": "qwen3"}).reasoning_parser == "qwen3"
    config = tmp_path / "c.yaml"
    config.write_text("reasoning-parser: qwen3\n")
    assert options(["--config", str(config)], {}).reasoning_parser == "qwen3"
    with pytest.raises(ConfigError, match="'qwen4' is not one of qwen3, deepseek_r1"):
        options([], {"KVTIER_REASONING_PARSER": "qwen4"})
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServeConfig(reasoning_parser="granite")
    run = subprocess.run([sys.executable, "-m", "kvtier", "serve", "--model", "tiny-gqa", "--reasoning-parser", "r2"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "KVTIER_HOME": str(tmp_path)})
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2 and "error: argument --reasoning-parser: invalid choice: 'r2'" in last, run.stderr
    assert "qwen3" in last and "deepseek_r1" in last, last
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--reasoning-parser {qwen3,deepseek_r1}" in help_text and "reasoning_content" in help_text

