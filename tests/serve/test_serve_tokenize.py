"""/tokenize, /detokenize and /version (vLLM's shapes) against the live tiny-model server: the ids
/tokenize reports are the ids the completion endpoints run, and every option is honoured or refused."""

from __future__ import annotations

from importlib.metadata import version

import httpx

from serve_testlib import TINY

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three."}]


def _post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=30)


def test_tokenize_a_prompt_as_completions_does(tiny_server):
    tok = tiny_server.engine.model.tokenizer
    text = "Once upon a time, in a land far away"
    r = _post(tiny_server, "/tokenize", {"model": TINY, "prompt": text})
    assert r.status_code == 200
    got = r.json()
    assert got["tokens"] == tiny_server.engine.encode(text, add_special_tokens=True) == tok.encode(text)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == tiny_server.engine.max_model_len
    # The completion endpoint runs exactly those ids: its usage counts them.
    done = _post(tiny_server, "/v1/completions", {"model": TINY, "prompt": text, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == got["count"]
    bare = _post(tiny_server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)  # this tokenizer adds no BOS anyway


def test_tokenize_messages_as_chat_completions_does(tiny_server):
    tok = tiny_server.engine.model.tokenizer
    got = _post(tiny_server, "/tokenize", {"messages": MESSAGES}).json()
    assert got["tokens"] == tiny_server.engine.encode_chat(MESSAGES)
    done = _post(tiny_server, "/v1/chat/completions", {"model": TINY, "messages": MESSAGES, "max_tokens": 1}).json()
    assert done["usage"]["prompt_tokens"] == got["count"]
    bare = _post(tiny_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    want = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=True)
    assert bare["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert bare["count"] < got["count"]


def test_detokenize_round_trips_and_refuses_ids_outside_the_vocabulary(tiny_server):
    text = "The quick brown fox"
    ids = _post(tiny_server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert _post(tiny_server, "/detokenize", {"model": TINY, "tokens": ids}).json() == {"prompt": text}
    assert _post(tiny_server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    vocab = tiny_server.engine.model.config.vocab_size
    bad = _post(tiny_server, "/detokenize", {"tokens": [1, vocab]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_bad_tokenize_requests_are_refused_with_the_field(tiny_server):
    cases = [
        ({"prompt": "a", "messages": MESSAGES}, None),  # both
        ({}, None),  # neither
        ({"messages": MESSAGES, "add_special_tokens": True}, None),  # not for messages: refused, not ignored
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ]
    for body, param in cases:
        r = _post(tiny_server, "/tokenize", body)
        assert r.status_code == 400, (body, r.text)
        if param is not None:
            assert r.json()["error"]["param"] == param
    other = _post(tiny_server, "/tokenize", {"model": "another-model", "prompt": "a"})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


def test_version(tiny_server):
    r = httpx.get(tiny_server.url + "/version", timeout=30)
    assert r.status_code == 200 and r.json() == {"version": version("kvtier")}


def test_the_new_paths_need_the_key_when_one_is_set(keyed_server):
    for method, path in (("post", "/tokenize"), ("post", "/detokenize"), ("get", "/version")):
        r = httpx.request(method.upper(), keyed_server.url + path, json={"prompt": "a"}, timeout=30)
        assert r.status_code == 401, path
    ok = httpx.post(keyed_server.url + "/tokenize", json={"prompt": "a"}, timeout=30,
                    headers={"Authorization": "Bearer s3cret-key"})
    assert ok.status_code == 200


def _bos_tokenizer(tok):
    """The tiny model's tokenizer made to add a BOS by default, as Llama tokenizers do."""
    import copy

    from tokenizers.processors import TemplateProcessing

    bos = copy.deepcopy(tok)
    bos_id = tok.convert_tokens_to_ids(tok.bos_token)
    bos.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos_id)])
    return bos, bos_id


def test_completions_add_the_tokenizers_bos_unless_asked_not_to(tiny_model):
    """/v1/completions tokenizes text as the tokenizer does by default (vLLM's behaviour: a Llama
    prompt starts with BOS); add_special_tokens false sends the text alone; /tokenize agrees."""
    import contextlib
    from dataclasses import replace

    from serve_testlib import serve

    tok, bos_id = _bos_tokenizer(tiny_model.tokenizer)
    text = "Once upon a time"
    plain = tiny_model.tokenizer.encode(text, add_special_tokens=False)
    assert tok.encode(text) == [bos_id, *plain]
    with contextlib.contextmanager(serve)(replace(tiny_model, tokenizer=tok)) as s:
        def usage(**kw) -> int:
            body = {"model": TINY, "prompt": text, "max_tokens": 1, "temperature": 0, **kw}
            return _post(s, "/v1/completions", body).json()["usage"]["prompt_tokens"]

        assert usage() == len(plain) + 1
        assert usage(add_special_tokens=False) == len(plain)
        assert _post(s, "/tokenize", {"prompt": text}).json()["tokens"] == [bos_id, *plain]
        assert _post(s, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == plain
        ids_prompt = _post(s, "/v1/completions", {"model": TINY, "prompt": plain, "max_tokens": 1}).json()
        assert ids_prompt["usage"]["prompt_tokens"] == len(plain)  # token ids run as given
