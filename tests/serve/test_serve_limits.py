"""The output limit: how many output entries (sampled tokens and their top logprobs, prompt
logprobs) one request may ask for, over `--max-output-entries`."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvtier.cli import serve as cli
from kvtier.cli.options import from_args
from kvtier.serve.budget import DEFAULT_MAX_OUTPUT_ENTRIES, OutputAsk
from kvtier.serve.config import ServeConfig

from serve_testlib import BODY_LIMIT, DEFAULT_MAX_TOKENS, TINY, Served, serve

LIMIT = 64  # 4 samples x 4 tokens x (1 + 3 top logprobs)
MESSAGES = [{"role": "user", "content": "hi"}]
PROMPT_IDS = [5, 6, 7, 8, 9, 10]


def _config(limit: int) -> ServeConfig:
    return ServeConfig(max_output_entries=limit, default_max_tokens=DEFAULT_MAX_TOKENS, max_body_bytes=BODY_LIMIT)


@pytest.fixture(scope="module")
def limited(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model, config=_config(LIMIT))


def _chat(c: httpx.Client, **fields: Any) -> httpx.Response:
    return c.post("/v1/chat/completions", json={"model": TINY, "messages": MESSAGES, **fields})


def _completion(c: httpx.Client, **fields: Any) -> httpx.Response:
    return c.post("/v1/completions", json={"model": TINY, "prompt": PROMPT_IDS, **fields})


def _refused(resp: httpx.Response, *fields: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["code"] == "output_limit_exceeded" and err["type"] == "invalid_request_error"
    for word in (*fields, f"{LIMIT}", "--max-output-entries"):
        assert word in err["message"], (word, err["message"])
    return err["message"]


def test_chat_over_the_limit_is_a_400_naming_the_fields(limited: Served) -> None:
    with limited.client() as c:
        message = _refused(_chat(c, n=4, max_tokens=4, logprobs=True, top_logprobs=4), "n", "max_tokens",
                           "top_logprobs")
        assert "80" in message  # 4 x 4 x (1 + 4)
        _refused(_chat(c, n=4, max_completion_tokens=5, logprobs=True, top_logprobs=3), "max_completion_tokens")


def test_chat_at_the_limit_is_accepted(limited: Served) -> None:
    with limited.client() as c:
        resp = _chat(c, n=4, max_tokens=4, logprobs=True, top_logprobs=3)
        assert resp.status_code == 200, resp.text
        assert len(resp.json()["choices"]) == 4


def test_completions_count_logprobs_and_prompt_logprobs(limited: Served) -> None:
    with limited.client() as c:
        assert _completion(c, n=4, max_tokens=4, logprobs=3).status_code == 200
        _refused(_completion(c, n=4, max_tokens=4, logprobs=4), "n", "max_tokens", "logprobs")
        # Every choice carries the prompt's logprobs: 2 x 2 tokens + 2 x 6 prompt tokens x (1 + 4) = 64.
        ok = _completion(c, n=2, max_tokens=2, prompt_logprobs=4)
        assert ok.status_code == 200, ok.text
        _refused(_completion(c, n=2, max_tokens=2, prompt_logprobs=5), "prompt_logprobs")


def test_the_default_completion_length_counts_when_max_tokens_is_unset(limited: Served) -> None:
    with limited.client() as c:
        assert _chat(c, n=LIMIT // DEFAULT_MAX_TOKENS).status_code == 200
        message = _refused(_chat(c, n=LIMIT // DEFAULT_MAX_TOKENS + 1), "max_tokens")
        assert "not given" in message


def test_zero_means_no_limit(tiny_model) -> None:
    for served in serve(tiny_model, config=_config(0)):
        with served.client() as c:
            resp = _chat(c, n=16, max_tokens=4, logprobs=True, top_logprobs=20)  # 1,344 entries
            assert resp.status_code == 200, resp.text


def test_entries_and_the_default() -> None:
    ask = OutputAsk(n=16, max_tokens=8191, top_logprobs=20)
    assert ask.entries == 16 * 8191 * 21
    assert OutputAsk(n=2, max_tokens=2, top_logprobs=0, prompt_tokens=6, prompt_logprobs=4,
                     prompt_copies=2).entries == 64
    assert ServeConfig().max_output_entries == DEFAULT_MAX_OUTPUT_ENTRIES == 1 << 20
    # Without logprobs, 16 samples that fill a 64K-token window fit.
    assert OutputAsk(n=16, max_tokens=65536, top_logprobs=0).entries <= DEFAULT_MAX_OUTPUT_ENTRIES
    with pytest.raises(ValueError, match="max_output_entries must be >= 0"):
        ServeConfig(max_output_entries=-1)


def test_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvtier")
    cli.register(parser.add_subparsers(dest="command"))
    for argv, want in ((["serve"], DEFAULT_MAX_OUTPUT_ENTRIES), (["serve", "--max-output-entries", "0"], 0)):
        args = parser.parse_args(argv)
        assert from_args(cli.ServeOptions, args).serve_config().max_output_entries == want
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--max-output-entries", "-1"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "--max-output-entries" in capsys.readouterr().out


def test_a_whole_answer_is_built_and_written_off_the_event_loop(limited: Served, monkeypatch) -> None:
    """At the limit a non-streamed answer with logprobs runs to tens of megabytes: its choices are
    built, and the answer written as JSON, on a worker thread, never on the event loop that every
    other request and stream shares."""
    import asyncio

    from kvtier.serve import completions

    on_loop: list[bool] = []

    def watched(build):
        def choice(*a, **k):
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
            return build(*a, **k)
        return choice

    monkeypatch.setattr(completions, "chat_choice", watched(completions.chat_choice))
    monkeypatch.setattr(completions, "completion_choice", watched(completions.completion_choice))
    with limited.client() as c:
        chat = _chat(c, n=4, max_tokens=4, logprobs=True, top_logprobs=3)
        text = _completion(c, n=4, max_tokens=4, logprobs=3)
    assert chat.status_code == 200 and text.status_code == 200, (chat.text, text.text)
    assert on_loop == [False] * 8
    assert chat.headers["content-type"] == "application/json"
    assert len(chat.json()["choices"]) == 4 and len(chat.json()["choices"][0]["logprobs"]["content"]) == 4


def test_a_whole_answer_is_written_in_pieces_with_the_bytes_of_one_dump(limited: Served) -> None:
    """One dump of tens of megabytes holds the GIL, and so the event loop, throughout: answers are
    written in pieces (models field by field, long lists a slice at a time), which join to the very
    bytes pydantic's own dump writes."""
    from kvtier.serve import responses as r

    with limited.client() as c:
        chat = _chat(c, n=4, max_tokens=4, logprobs=True, top_logprobs=3)
    answer = r.ChatCompletion.model_validate(chat.json())
    long = answer.model_copy(update={"choices": [answer.choices[0].model_copy(update={"logprobs": r.ChatLogprobs(
        content=answer.choices[0].logprobs.content * 300)})] * 3})  # 1,200 entries a choice: sliced
    ids = r.TokenizeResponse(count=1000, max_model_len=2048, tokens=list(range(1000)))
    for model in (answer, long, ids):
        pieces = list(r.json_pieces(model))
        assert b"".join(pieces) == model.model_dump_json().encode()
    assert len(list(r.json_pieces(long))) > 3 * (1200 // 256)
