"""Blending over HTTP: a chat message's content parts and a completions prompt's separated parts
are documents; `blend` turns it off per request or is refused where the server does not blend."""
from __future__ import annotations

import httpx
import pytest

from kvtier.engine.config import ReuseConfig
from kvtier.planning.blend import BlendOptions
from kvtier.serve.config import ServeConfig

from serve_testlib import BODY_LIMIT, DEFAULT_MAX_TOKENS, serve

DOCS = ["the river runs north past the old mill and the stone bridge " * 3,
        "a red fox sleeps under the oak tree near the quiet pond " * 3]


@pytest.fixture(scope="module")
def blend_server(tiny_model):
    config = ServeConfig(default_max_tokens=DEFAULT_MAX_TOKENS, max_body_bytes=BODY_LIMIT, blend_separator="##")
    reuse = ReuseConfig(chunk_tokens=16, blend=BlendOptions(link_tokens=4))
    yield from serve(tiny_model, store="memory:64MB", reuse=reuse, config=config)


def _chat(url: str, docs=DOCS, **extra) -> httpx.Response:
    parts = [{"type": "text", "text": d} for d in docs]
    body = {"model": "tiny-gqa", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": parts}, {"role": "user", "content": "which animal?"}], **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def test_content_parts_blend_and_usage_says_how_much(blend_server):
    r = _chat(blend_server.url)
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["blended_tokens"] > 0 and details["recomputed_tokens"] > 0
    off = _chat(blend_server.url, blend=False)
    assert off.status_code == 200 and off.json()["usage"]["prompt_tokens_details"]["blended_tokens"] is None
    # The documents in the other order (this prompt's prefix is not in the device cache), naive.
    own = _chat(blend_server.url, DOCS[::-1], blend={"link_tokens": 0, "mode": "naive"})
    assert own.json()["usage"]["prompt_tokens_details"]["blended_tokens"] > details["blended_tokens"]


def test_a_completions_prompt_marks_the_parts_between_separators(blend_server):
    prompt = "Read these.##" + "##".join(DOCS) + "##Which animal?"
    r = httpx.post(blend_server.url + "/v1/completions", timeout=60,
                   json={"model": "tiny-gqa", "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["blended_tokens"] > 0


@pytest.mark.parametrize("bad", [{"mode": "magic"}, {"link_tokens": -1}, {"ratio": 2}, {"extra": 1}, "yes", 1])
def test_bad_blend_values_are_400s_naming_the_field(blend_server, bad):
    r = _chat(blend_server.url, blend=bad)
    assert r.status_code == 400 and "blend" in r.text


def test_asking_to_blend_where_the_server_does_not_is_a_400_naming_the_flag(tiny_server):
    r = _chat(tiny_server.url, blend=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "blend" and "--blend" in r.text
    assert _chat(tiny_server.url).status_code == 200  # content parts without --blend: a plain prompt


def test_too_many_content_parts_to_blend_is_a_400_naming_messages(blend_server):
    r = _chat(blend_server.url, ["x"] * 1025)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "1024" in r.text
