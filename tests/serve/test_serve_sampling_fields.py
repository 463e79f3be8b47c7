"""vLLM's sampling extras are honoured (top_k, ignore_eos) or refused with a 400 naming the field
(min_p, repetition_penalty, min_tokens, logit_bias, stop_token_ids,
stream_options.continuous_usage_stats): none is accepted and ignored. (Part of issue 29.)"""

from __future__ import annotations

import httpx
import pytest

from kvtier.serve.inputs import prepare
from kvtier.serve.schemas import CompletionRequest

from serve_testlib import TINY


def _complete(s, **kw) -> httpx.Response:
    body = {"model": TINY, "prompt": [5, 17, 301, 42, 9], "max_tokens": 8, **kw}
    return httpx.post(s.url + "/v1/completions", json=body, timeout=60)


def test_top_k_one_samples_the_greedy_tokens(tiny_server):
    greedy = _complete(tiny_server, temperature=0).json()["choices"][0]["text"]
    sampled = {_complete(tiny_server, temperature=2.0, top_k=1, seed=s).json()["choices"][0]["text"] for s in range(6)}
    assert sampled == {greedy}
    free = {_complete(tiny_server, temperature=2.0, seed=s).json()["choices"][0]["text"] for s in range(6)}
    assert free != {greedy}  # without top_k the same seeds do sample other tokens: the field matters


@pytest.mark.parametrize(("given", "top_k"), [(None, 0), (-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_and_ignore_eos_reach_the_engine(tiny_server, given, top_k):
    body = CompletionRequest(model=TINY, prompt=[5, 6, 7], max_tokens=4, top_k=given, ignore_eos=True)
    params = prepare(tiny_server.engine, [5, 6, 7], body, 4, None).params
    assert params.top_k == top_k and params.ignore_eos


@pytest.mark.parametrize(("field", "value"), [
    ("min_p", 0.1), ("repetition_penalty", 1.2), ("min_tokens", 3), ("logit_bias", {"42": -100}),
    ("stop_token_ids", [2]), ("top_k", -2),
])
def test_unsupported_values_are_refused_with_the_field(tiny_server, field, value):
    r = _complete(tiny_server, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_continuous_usage_stats_is_refused_and_neutral_values_pass(tiny_server):
    r = _complete(tiny_server, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert r.status_code == 400 and "continuous_usage_stats" in r.json()["error"]["param"]
    ok = _complete(tiny_server, min_p=0, repetition_penalty=1, min_tokens=0, logit_bias={}, stop_token_ids=[],
                   top_k=-1, ignore_eos=False, stream_options=None)
    assert ok.status_code == 200, ok.text
