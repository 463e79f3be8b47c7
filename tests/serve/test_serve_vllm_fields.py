"""vLLM's and llama-server's request extras, and unknown fields: each is honoured (its effect
checked against an equivalent request, greedy) or refused with a 400 naming it."""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvtier.serve.config import ServeConfig

from serve_testlib import TINY, serve

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ASK = [{"role": "user", "content": "Tell me a story"}]
PARTIAL = [*ASK, {"role": "assistant", "content": "Once upon a time"}]


def _post(server, path: str, **body) -> httpx.Response:
    base = {"model": TINY, "max_tokens": 6, "temperature": 0}
    if path == CHAT:
        base["messages"] = ASK
    else:
        base["prompt"] = "Once upon a time"
    return httpx.post(server.url + path, json={**base, **body}, timeout=60)


def _refused(r: httpx.Response, param: str, *words: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


def test_unknown_fields_are_a_400_naming_them(tiny_server):
    for path in (CHAT, COMPLETIONS):
        _refused(_post(tiny_server, path, temprature=0.5), "temprature",
                 "Unrecognized request argument supplied: temprature")


def test_unknown_fields_warn_once_and_are_ignored_when_the_server_says_so(tiny_model, caplog):
    for served in serve(tiny_model, config=ServeConfig(unknown_fields="warn")):
        with caplog.at_level(logging.WARNING, logger="kvtier.serve"):
            for _ in range(2):
                r = _post(served, CHAT, some_extra_field=1)
                assert r.status_code == 200, r.text
        warned = [rec for rec in caplog.records if "some_extra_field" in rec.getMessage()]
        assert len(warned) == 1, [rec.getMessage() for rec in caplog.records]


# OpenAI fields kvtier does not implement: accepted in their neutral form (clients send them so),
# refused otherwise.
OPENAI_NEUTRAL = {"store": False, "metadata": None, "service_tier": "auto", "modalities": ["text"],
                  "prediction": None, "reasoning_effort": None, "audio": None, "web_search_options": None,
                  "verbosity": None, "functions": None, "function_call": None}
OPENAI_NOT_NEUTRAL = {"store": True, "metadata": {"a": "b"}, "service_tier": "flex", "modalities": ["text", "audio"],
                      "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high",
                      "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {},
                      "verbosity": "low", "functions": [{"name": "f"}], "function_call": "auto"}


def test_openai_fields_we_do_not_implement_are_accepted_neutral_and_refused_otherwise(tiny_server):
    r = _post(tiny_server, CHAT, **OPENAI_NEUTRAL)
    assert r.status_code == 200, r.text
    for field, value in OPENAI_NOT_NEUTRAL.items():
        _refused(_post(tiny_server, CHAT, **{field: value}), field)


def test_add_generation_prompt_false_renders_without_the_assistant_header(tiny_server):
    engine = tiny_server.engine
    plain = _post(tiny_server, CHAT).json()
    assert plain["usage"]["prompt_tokens"] == len(engine.encode_chat(ASK))
    r = _post(tiny_server, CHAT, add_generation_prompt=False)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(engine.encode_chat(ASK, add_generation_prompt=False))
    assert len(engine.encode_chat(ASK, add_generation_prompt=False)) < len(engine.encode_chat(ASK))


def test_continue_final_message_continues_the_assistants_message(tiny_server):
    tok = tiny_server.engine.model.tokenizer
    ids = list(tok.apply_chat_template(PARTIAL, continue_final_message=True, tokenize=True)["input_ids"])
    r = _post(tiny_server, CHAT, messages=PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200, r.text
    same = _post(tiny_server, COMPLETIONS, prompt=ids).json()
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    assert r.json()["choices"][0]["message"]["content"] == same["choices"][0]["text"]
    _refused(_post(tiny_server, CHAT, messages=PARTIAL, continue_final_message=True), "continue_final_message",
             "add_generation_prompt")


def test_chat_template_kwargs_reach_the_template(tiny_server, monkeypatch):
    tok = tiny_server.engine.model.tokenizer
    monkeypatch.setattr(tok, "chat_template", tok.chat_template + "{% if enable_thinking %}<think>\n{% endif %}")
    plain = _post(tiny_server, CHAT).json()["usage"]["prompt_tokens"]
    thinking = _post(tiny_server, CHAT, chat_template_kwargs={"enable_thinking": True}).json()
    assert thinking["usage"]["prompt_tokens"] > plain
    off = _post(tiny_server, CHAT, chat_template_kwargs={"enable_thinking": False}).json()
    assert off["usage"]["prompt_tokens"] == plain
    for bad in ({"messages": []}, {"add_generation_prompt": False}, {"bos_token": "x"}, {"x": {"nested": 1}},
                {f"k{i}": 1 for i in range(33)}, {"x": "y" * 5000}, {"not an identifier": 1}):
        _refused(_post(tiny_server, CHAT, chat_template_kwargs=bad), "chat_template_kwargs")


def test_echo_prepends_the_prompt_or_the_final_assistant_message(tiny_server):
    tok = tiny_server.engine.model.tokenizer
    for prompt in ("Once upon a time", tok.encode("Once upon a time")):
        plain = _post(tiny_server, COMPLETIONS, prompt=prompt).json()["choices"][0]["text"]
        echoed = _post(tiny_server, COMPLETIONS, prompt=prompt, echo=True).json()["choices"][0]["text"]
        assert echoed == tok.decode(tok.encode("Once upon a time")) + plain
    _refused(_post(tiny_server, COMPLETIONS, echo=True, logprobs=1), "logprobs", "prompt_logprobs")
    with httpx.stream("POST", tiny_server.url + COMPLETIONS, timeout=60, json={
            "model": TINY, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "echo": True,
            "stream": True}) as s:
        parts = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in parts if c["choices"]) == echoed

    plain = _post(tiny_server, CHAT, messages=PARTIAL).json()["choices"][0]["message"]["content"]
    echoed = _post(tiny_server, CHAT, messages=PARTIAL, echo=True).json()["choices"][0]["message"]["content"]
    assert echoed == "Once upon a time" + plain
    # The final message is the user's: nothing to echo.
    assert (_post(tiny_server, CHAT, echo=True).json()["choices"][0]["message"]["content"]
            == _post(tiny_server, CHAT).json()["choices"][0]["message"]["content"])
    with httpx.stream("POST", tiny_server.url + CHAT, timeout=60, json={
            "model": TINY, "messages": PARTIAL, "max_tokens": 6, "temperature": 0, "echo": True, "stream": True}) as s:
        parts = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in parts if c["choices"]) == echoed


def test_return_tokens_as_token_ids(tiny_server):
    tok = tiny_server.engine.model.tokenizer
    plain = _post(tiny_server, CHAT, logprobs=True, top_logprobs=2).json()["choices"][0]["logprobs"]["content"]
    ids = _post(tiny_server, CHAT, logprobs=True, top_logprobs=2,
                return_tokens_as_token_ids=True).json()["choices"][0]["logprobs"]["content"]
    assert len(ids) == len(plain)
    for a, b in zip(plain, ids):
        assert b["token"].startswith("token_id:") and tok.decode([int(b["token"][9:])]) == a["token"]
        assert b["logprob"] == a["logprob"] and all(t["token"].startswith("token_id:") for t in b["top_logprobs"])
    text = _post(tiny_server, COMPLETIONS, logprobs=1, return_tokens_as_token_ids=True).json()
    lp = text["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)


def test_n_predict_is_max_tokens(tiny_server):
    for path in (CHAT, COMPLETIONS):
        body = {"max_tokens": None, "n_predict": 3, "ignore_eos": True}
        assert _post(tiny_server, path, **body).json()["usage"]["completion_tokens"] == 3
        assert _post(tiny_server, path, max_tokens=3, n_predict=3, ignore_eos=True).status_code == 200
        _refused(_post(tiny_server, path, max_tokens=4, n_predict=3), "n_predict", "max_tokens")
        _refused(_post(tiny_server, path, n_predict=0), "n_predict")
    assert _post(tiny_server, CHAT, max_tokens=None, max_completion_tokens=3, n_predict=3).status_code == 200
    _refused(_post(tiny_server, CHAT, max_tokens=None, max_completion_tokens=2, n_predict=3), "n_predict")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_priority_and_cache_prompt_take_their_types_and_range(tiny_server, path):
    for ok in ({"priority": 0, "cache_prompt": True}, {"priority": None, "cache_prompt": None},
               {"priority": -(2**31)}, {"priority": 2**31 - 1}, {"cache_prompt": False}):
        assert _post(tiny_server, path, **ok).status_code == 200, ok
    for bad in (2**31, -(2**31) - 1, 1.5, "1", True):
        _refused(_post(tiny_server, path, priority=bad), "priority")
    for bad in ("false", 0):
        _refused(_post(tiny_server, path, cache_prompt=bad), "cache_prompt")


def test_priority_orders_admission(tiny_model):
    """One sequence at a time, the engine held until all five requests are queued: they run
    lowest priority first, equal ones in arrival order."""
    for served in serve(tiny_model, max_num_seqs=1):
        engine, gate = served.engine, threading.Event()
        arrived: list[str] = []  # request ids in the order the engine got them
        finished: list[str] = []
        add, step = engine.add_request, engine.step

        def counted_add(*args, **kw):
            arrived.append(add(*args, **kw))
            return arrived[-1]

        def held_step():
            gate.wait()
            outs = step()
            finished.extend(o.request_id for o in outs if o.finished)
            return outs

        engine.add_request, engine.step = counted_add, held_step
        priorities = [5, 0, -1, 0, -1]
        try:
            with ThreadPoolExecutor(len(priorities)) as pool:
                futures = [pool.submit(_post, served, COMPLETIONS, priority=p, max_tokens=2) for p in priorities]
                deadline = time.monotonic() + 30
                while len(arrived) < len(priorities) and time.monotonic() < deadline:
                    time.sleep(0.01)
                gate.set()
                replies = [f.result() for f in futures]
        finally:
            gate.set()
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        priority_of = {r.json()["id"]: p for r, p in zip(replies, priorities)}
        assert sorted(priority_of) == sorted(arrived)
        # A reply may come back before its step has returned to held_step: wait for the last one.
        deadline = time.monotonic() + 10
        while len(finished) < len(priorities) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert finished == sorted(arrived, key=priority_of.__getitem__)  # a stable sort: arrival breaks ties
        assert [priority_of[rid] for rid in finished] == [-1, -1, 0, 0, 5]


LONG_PROMPT = " ".join(f"Line {i}: a prompt long enough for several blocks." for i in range(8))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_cache_prompt_false_neither_reuses_nor_saves(tiny_model, path):
    """With a memory store and the prefix cache: cache_prompt false reports no cached tokens and
    saves nothing, even when the state is there to take; the default takes it; same answers."""
    for served in serve(tiny_model, store="memory:64MB"):
        def ask(**fields) -> tuple[int, str]:
            body = {"messages": [{"role": "user", "content": LONG_PROMPT}]} if path == CHAT else {"prompt": LONG_PROMPT}
            r = _post(served, path, **body, **fields)
            assert r.status_code == 200, r.text
            assert served.engine.flush(30)  # stored before the next request looks
            choice = r.json()["choices"][0]
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], \
                choice["message"]["content"] if path == CHAT else choice["text"]

        def saves() -> int:
            return served.engine.stats().counters["saves"]

        private = ask(cache_prompt=False)
        assert private[0] == 0 and saves() == 0 and not served.engine.pool.cached
        first = ask()
        assert first[0] == 0 and saves() > 0  # the first request left nothing to take
        done = saves()
        again = ask(cache_prompt=False)
        assert again[0] == 0 and saves() == done
        hit = ask(cache_prompt=True)
        assert hit[0] > 0
        assert private[1] == first[1] == again[1] == hit[1]


def test_the_unknown_fields_flag_reaches_the_config():
    from kvtier.cli.main import build_parser
    from kvtier.cli.options import from_args
    from kvtier.cli.serve import ServeOptions

    for argv, mode in (([], "reject"), (["--unknown-fields", "warn"], "warn")):
        args = build_parser().parse_args(["serve", *argv])
        assert from_args(ServeOptions, args).serve_config().unknown_fields == mode
