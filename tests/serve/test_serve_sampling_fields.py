"""Every sampling field of the server has its effect (issue 29): top_k, min_p, logit_bias,
repetition_penalty, min_tokens, stop_token_ids, ignore_eos, seed with n > 1, logprobs and
continuous usage. The sampler's arithmetic is checked against transformers in tests/test_sampler.py;
here the fields are followed from the request body to the tokens."""

from __future__ import annotations

import json

import httpx
import pytest

from kvtier.engine.engine import Engine
from kvtier.engine.request import SamplingParams
from kvtier.serve.inputs import prepare
from kvtier.serve.schemas import CompletionRequest

from serve_testlib import TINY

PROMPT = [5, 17, 301, 42, 9]


def _complete(s, **kw) -> httpx.Response:
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 8, **kw}
    return httpx.post(s.url + "/v1/completions", json=body, timeout=60)


def _tokens(s, **kw) -> list[str]:
    """The choice's tokens as text (from logprobs: the text alone can merge tokens)."""
    r = _complete(s, logprobs=0, **kw)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


@pytest.fixture(scope="module")
def greedy_ids(tiny_model) -> list[int]:
    with Engine(tiny_model) as e:
        return e.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].output_ids


def test_top_k_one_min_p_one_and_a_tiny_top_p_sample_the_greedy_tokens(tiny_server):
    greedy = _complete(tiny_server, temperature=0).json()["choices"][0]["text"]
    for field in ({"top_k": 1}, {"min_p": 1.0}, {"top_p": 1e-9}):
        sampled = {_complete(tiny_server, temperature=2.0, seed=s, **field).json()["choices"][0]["text"]
                   for s in range(6)}
        assert sampled == {greedy}, field
    free = {_complete(tiny_server, temperature=2.0, seed=s).json()["choices"][0]["text"] for s in range(6)}
    assert free != {greedy}  # without them the same seeds do sample other tokens: the fields matter


def test_logit_bias_bans_a_token(tiny_server, greedy_ids):
    banned = greedy_ids[0]
    tok = tiny_server.engine.model.tokenizer.decode([banned])
    assert tok in _tokens(tiny_server, temperature=0)
    assert tok not in _tokens(tiny_server, temperature=0, logit_bias={str(banned): -100})


def test_repetition_penalty_changes_a_repetitive_continuation(tiny_server):
    plain = _tokens(tiny_server, temperature=0)
    assert len(set(plain)) == 1  # the random model repeats one token
    assert len(set(_tokens(tiny_server, temperature=0, repetition_penalty=2.0))) > 1


def test_stop_token_ids_stop_and_min_tokens_holds_them_back(tiny_server, greedy_ids):
    stop = greedy_ids[0]
    r = _complete(tiny_server, temperature=0, stop_token_ids=[stop]).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["text"] == ""  # a stop token ends the output and is not in the text
    held = _complete(tiny_server, temperature=0, stop_token_ids=[stop], min_tokens=5, logprobs=0).json()
    assert len(held["choices"][0]["logprobs"]["tokens"]) >= 5
    assert held["usage"]["completion_tokens"] >= 5
    word = tiny_server.engine.model.tokenizer.decode([stop])  # the same token's text as a stop string
    assert _complete(tiny_server, temperature=0, stop=[word]).json()["choices"][0]["text"] == ""
    late = _complete(tiny_server, temperature=0, stop=[word], min_tokens=3).json()["choices"][0]
    assert late["finish_reason"] == "stop" and late["text"].startswith(word * 3)


@pytest.mark.parametrize(("given", "top_k"), [(None, 0), (-1, 0), (0, 0), (1, 1), (50, 50)])
def test_top_k_reaches_the_engine(tiny_server, given, top_k):
    body = CompletionRequest(model=TINY, prompt=[5, 6, 7], max_tokens=4, top_k=given)
    assert prepare(tiny_server.engine, [5, 6, 7], body, 4, None).params.top_k == top_k


def test_fields_reach_the_engine(tiny_server):
    """Every sampling field lands in the engine's SamplingParams (whose effects tests/test_sampler.py
    checks against transformers and OpenAI's formula)."""
    body = CompletionRequest(model=TINY, prompt=[5, 6, 7], max_tokens=9, temperature=0.5, top_p=0.8, min_p=0.1,
                             presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2,
                             logit_bias={"7": -3.5}, min_tokens=2, stop_token_ids=[4], ignore_eos=True, seed=2**64 + 3,
                             stop=["xx"], n=2, logprobs=4)
    got = prepare(tiny_server.engine, [5, 6, 7], body, 9, None).params
    assert got == SamplingParams(max_tokens=9, temperature=0.5, top_p=0.8, min_p=0.1, presence_penalty=0.5,
                                 frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias=((7, -3.5),),
                                 min_tokens=2, stop_token_ids=(4,), ignore_eos=True, seed=3, stop=("xx",), n=2,
                                 logprobs=4)


def test_n_samples_are_the_seeded_single_requests(tiny_server):
    both = _complete(tiny_server, temperature=2.0, seed=40, n=3).json()
    assert [c["index"] for c in both["choices"]] == [0, 1, 2]
    for i, c in enumerate(both["choices"]):  # sample i is drawn with seed + i
        alone = _complete(tiny_server, temperature=2.0, seed=40 + i).json()["choices"][0]
        assert c["text"] == alone["text"]
    assert both["usage"]["completion_tokens"] == sum(
        len(_tokens(tiny_server, temperature=2.0, seed=40 + i)) for i in range(3))


def test_streamed_n_samples_logprobs_and_continuous_usage(tiny_server):
    body = {"model": TINY, "prompt": PROMPT, "max_tokens": 4, "n": 2, "stream": True, "logprobs": 2, "seed": 3,
            "temperature": 1.5, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    texts, tokens, usages = {0: "", 1: ""}, {0: [], 1: []}, []
    with httpx.stream("POST", tiny_server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usages.append(chunk["usage"])
            for c in chunk["choices"]:
                texts[c["index"]] += c["text"]
                tokens[c["index"]] += c["logprobs"]["tokens"]
                assert all(len(t) == 2 for t in c["logprobs"]["top_logprobs"])
    whole = _complete(tiny_server, **{k: v for k, v in body.items() if k not in ("stream", "stream_options")}).json()
    assert [texts[i] for i in range(2)] == [c["text"] for c in whole["choices"]]
    assert [tokens[i] for i in range(2)] == [c["logprobs"]["tokens"] for c in whole["choices"]]
    assert all(u is not None for u in usages)  # usage in every chunk
    assert usages[-1] == whole["usage"]


def test_refused_fields_name_themselves(tiny_server):
    for field, value in [("use_beam_search", True), ("best_of", 3), ("prompt_logprobs", 21), ("top_k", -2),
                         ("logit_bias", {"x": 1}), ("logit_bias", {"999999": 1}), ("stop_token_ids", [10**7]),
                         ("guided_json", {"type": "object"})]:
        r = _complete(tiny_server, **{field: value})
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field
    ok = _complete(tiny_server, min_p=0, repetition_penalty=1, min_tokens=0, logit_bias={}, stop_token_ids=[],
                   top_k=-1, ignore_eos=False, use_beam_search=False, best_of=1, prompt_logprobs=None)
    assert ok.status_code == 200, ok.text


def test_prompt_logprobs_in_vllms_shape(tiny_server):
    got = _complete(tiny_server, prompt_logprobs=2, max_tokens=2).json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(PROMPT) and got[0] is None
    for token, entry in zip(PROMPT[1:], got[1:]):
        assert str(token) in entry and 2 <= len(entry) <= 3  # the prompt token's own entry and the 2 likeliest
        assert entry[str(token)]["rank"] >= 1 and entry[str(token)]["logprob"] <= 0
        assert sorted(e["rank"] for t, e in entry.items() if t != str(token))[:2] == [1, 2]
    chat = httpx.post(tiny_server.url + "/v1/chat/completions", json={
        "model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
        timeout=60).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    streamed = _complete(tiny_server, prompt_logprobs=1, stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
