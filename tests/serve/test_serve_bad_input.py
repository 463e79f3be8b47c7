"""Bad input gets an OpenAI-style 4xx (never a 5xx), and the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvtier.serve import completions as completions_module
from kvtier.serve.bodies import MAX_DEPTH, OFF_LOOP_BYTES
from kvtier.serve.errors import QUOTED_CHARS
from kvtier.serve.schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

from serve_testlib import BODY_LIMIT, TINY, WINDOW, Served, wait_idle

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**overrides) -> dict:
    return {"model": TINY, "messages": OK_MESSAGES, "max_tokens": 2, **overrides}


def completion(**overrides) -> dict:
    return {"model": TINY, "prompt": "hi", "max_tokens": 2, **overrides}


LONG = "word " * (WINDOW + 10)

# (name, path, JSON body, status, param the error names (or None to skip), code (or None to skip))
CASES = [
    ("unknown model", CHAT, chat(model="gpt-4o"), 404, "model", "model_not_found"),
    ("unknown model (completions)", COMPLETIONS, completion(model="nope"), 404, "model", "model_not_found"),
    ("missing model", CHAT, {"messages": OK_MESSAGES}, 400, "model", None),
    ("empty messages", CHAT, chat(messages=[]), 400, "messages", None),
    ("missing messages", CHAT, {"model": TINY}, 400, "messages", None),
    ("messages not a list", CHAT, chat(messages="hello"), 400, "messages", None),
    ("message not an object", CHAT, chat(messages=["hello"]), 400, "messages.0", None),
    ("content wrong type", CHAT, chat(messages=[{"role": "user", "content": 42}]), 400, None, None),
    ("missing content", CHAT, chat(messages=[{"role": "user"}]), 400, "messages.0.content", None),
    ("unknown role", CHAT, chat(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role", None),
    ("tool calls on a user message", CHAT, chat(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "messages.0", None),
    ("image content part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages.0.content", None),
    ("prompt too long (chat)", CHAT, chat(messages=[{"role": "user", "content": LONG}]), 400, "messages",
     "context_length_exceeded"),
    ("prompt too long (completions)", COMPLETIONS, completion(prompt=LONG), 400, "prompt", "context_length_exceeded"),
    ("prompt + max_tokens too long", CHAT, chat(max_tokens=WINDOW), 400, "max_tokens", "context_length_exceeded"),
    ("huge max_tokens", CHAT, chat(max_tokens=10**12), 400, "max_tokens", "context_length_exceeded"),
    ("absurd max_tokens", CHAT, chat(max_tokens=10**40), 400, "max_tokens", "context_length_exceeded"),
    ("huge max_completion_tokens", CHAT, chat(max_completion_tokens=10**9), 400, "max_completion_tokens",
     "context_length_exceeded"),
    ("negative max_tokens", CHAT, chat(max_tokens=-5), 400, "max_tokens", None),
    ("zero max_tokens", COMPLETIONS, completion(max_tokens=0), 400, "max_tokens", None),
    ("max_tokens not a number", CHAT, chat(max_tokens="lots"), 400, "max_tokens", None),
    ("max_tokens fractional", CHAT, chat(max_tokens=2.5), 400, "max_tokens", None),
    ("temperature too high", CHAT, chat(temperature=2.5), 400, "temperature", None),
    ("temperature negative", COMPLETIONS, completion(temperature=-0.1), 400, "temperature", None),
    ("top_p zero", CHAT, chat(top_p=0), 400, "top_p", None),
    ("top_p above one", CHAT, chat(top_p=1.5), 400, "top_p", None),
    ("seed not an integer", CHAT, chat(seed=1.5), 400, "seed", None),
    ("numeric string not coerced", CHAT, chat(max_tokens="5"), 400, "max_tokens", None),
    ("int for a bool not coerced", COMPLETIONS, completion(echo=0), 400, "echo", None),
    ("max_tokens too large though unused", CHAT, chat(max_tokens=WINDOW, max_completion_tokens=2), 400,
     "max_tokens", "context_length_exceeded"),
    ("empty stop string", CHAT, chat(stop=[""]), 400, "stop", None),
    ("too many stop strings", CHAT, chat(stop=list("abcde")), 400, "stop", None),
    ("n too large", CHAT, chat(n=17), 400, "n", None),
    ("penalty out of range", CHAT, chat(presence_penalty=2.5), 400, "presence_penalty", None),
    ("tool without a function", CHAT, chat(tools=[{"type": "function"}]), 400, "tools.0.function", None),
    ("tool name with a space", CHAT, chat(tools=[{"type": "function", "function": {"name": "a b"}}]), 400,
     "tools.0.function.name", None),
    ("tool_choice naming no tool", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                              tool_choice={"type": "function", "function": {"name": "g"}}), 400,
     None, None),
    ("beam search refused", CHAT, chat(use_beam_search=True), 400, "use_beam_search", None),
    ("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options", None),
    ("two constraints", CHAT, chat(response_format={"type": "json_object"}, grammar="root ::= \"a\""), 400, None,
     None),
    ("stream not a bool", CHAT, chat(stream="yes please"), 400, "stream", None),
    ("empty prompt", COMPLETIONS, completion(prompt=""), 400, "prompt", None),
    ("empty token list", COMPLETIONS, completion(prompt=[]), 400, "prompt", None),
    ("token id out of vocabulary", COMPLETIONS, completion(prompt=[1, 10**9]), 400, "prompt", None),
    ("negative token id", COMPLETIONS, completion(prompt=[-1]), 400, "prompt", None),
    ("batched prompts", COMPLETIONS, completion(prompt=["a", "b"]), 400, "prompt", None),
    ("prompt wrong type", COMPLETIONS, completion(prompt={"text": "x"}), 400, "prompt", None),
    ("echo with logprobs", COMPLETIONS, completion(echo=True, logprobs=1), 400, "logprobs", None),
    ("body is a list", CHAT, [1, 2], 400, None, None),
    ("body is a string", COMPLETIONS, "hello", 400, None, None),
    ("body is null", CHAT, None, 400, None, None),
]


@pytest.fixture(scope="module")
def http(tiny_server: Served) -> Iterator[httpx.Client]:
    with tiny_server.client() as c:
        yield c


def assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] in ("invalid_request_error", "not_found_error", "authentication_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    if status == 400:
        assert err["code"], err  # every 400 says what kind it is
    return err


# Padded with whitespace past OFF_LOOP_BYTES, the same body is decoded and validated off the event loop.
PADS = pytest.mark.parametrize("pad", [0, OFF_LOOP_BYTES], ids=["small", "validated off the loop"])


@PADS
@pytest.mark.parametrize("name,path,body,status,param,code", CASES, ids=[c[0] for c in CASES])
def test_bad_json_body(http: httpx.Client, name, path, body, status, param, code, pad: int) -> None:
    assert_error(http.post(path, content=json.dumps(body) + " " * pad, headers={"content-type": "application/json"}),
                 status, param, code)


@pytest.mark.parametrize(
    "raw",
    [b"{bad json", b"", b'{"model": ', b"\xff\xfe\x00", b"NaN", b'{"model": "x", "max_tokens": ' + b"9" * 5000 + b"}"],
    ids=["garbage", "empty", "truncated", "binary", "nan", "5000-digit integer"],
)
@PADS
def test_malformed_json(http: httpx.Client, raw: bytes, pad: int) -> None:
    assert_error(http.post(CHAT, content=raw + b" " * pad, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b'{"model": "\xff\xfe"}',
                                 '{"model": "caf\u00e9"}'.encode("latin-1")],
                         ids=["nested 5000 deep", "invalid utf-8", "latin-1"])
@PADS
def test_a_body_json_cannot_read_is_a_400_invalid_json(http: httpx.Client, raw: bytes, pad: int) -> None:
    assert_error(http.post(CHAT, content=raw + b" " * pad, headers={"content-type": "application/json"}), 400,
                 code="invalid_json")


@pytest.mark.parametrize("key", [" 5", "+5", "\uff15", "05", "5.0", "-1", ""])
def test_logit_bias_keys_are_plain_decimal_ids(http: httpx.Client, key: str) -> None:
    """No coercion: int() would read " 5", "+5" and a full-width 5 as 5, and "05" would merge with "5"."""
    assert_error(http.post(CHAT, json=chat(logit_bias={key: 1, "5": 2})), 400, "logit_bias")


def test_nan_temperature(http: httpx.Client) -> None:
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}' % TINY.encode()
    assert_error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400, "temperature")


def test_missing_content_type_is_read_as_json(http: httpx.Client) -> None:
    resp = http.post(COMPLETIONS, content=json.dumps(completion()).encode(), headers={"content-type": ""})
    assert resp.status_code == 200, resp.text


def test_form_content_type_is_explained(http: httpx.Client) -> None:
    """`curl -d` sends form encoding unless told otherwise; say so instead of "field required"."""
    resp = http.post(COMPLETIONS, content=json.dumps(completion()).encode(),
                     headers={"content-type": "application/x-www-form-urlencoded"})
    assert assert_error(resp, 400, code="invalid_content_type")["message"].count("application/json") == 1


def test_oversized_body_with_length(http: httpx.Client) -> None:
    body = completion(prompt="x" * (BODY_LIMIT + 1))
    assert_error(http.post(COMPLETIONS, json=body), 413, code="request_too_large")


def test_oversized_body_chunked(http: httpx.Client) -> None:
    def chunks():  # no Content-Length: the limit must hold while reading
        yield b'{"model": "%s", "prompt": "' % TINY.encode()
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b"y" * 1024
        yield b'"}'

    err = assert_error(http.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"}), 413)
    assert str(BODY_LIMIT) in err["message"], err  # as with a Content-Length


# A million bad items would be a million validation errors to build and describe (seconds of the
# event loop and gigabytes); every list stops at its first bad item.
MANY = 200_000
MANY_BAD = [
    ("messages", ChatCompletionRequest, {"model": TINY, "messages": [{}] * MANY}),
    ("content parts", ChatCompletionRequest, {"model": TINY, "messages": [{"role": "user", "content": [{}] * MANY}]}),
    ("tool calls", ChatCompletionRequest, {"model": TINY, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{}] * MANY}]}),
    ("prompt ids", CompletionRequest, {"model": TINY, "prompt": [-1] * MANY}),
    ("batched prompt ids", CompletionRequest, {"model": TINY, "prompt": [[-1] * MANY]}),
    ("choice", ChatCompletionRequest, {"model": TINY, "messages": OK_MESSAGES, "structured_outputs": {"choice": [1] * MANY}}),
    ("tokenize messages", TokenizeRequest, {"messages": [{}] * MANY}),
    ("detokenize ids", DetokenizeRequest, {"tokens": [-1] * MANY}),
]


@pytest.mark.parametrize("name,schema,body", MANY_BAD, ids=[c[0] for c in MANY_BAD])
def test_a_list_of_many_bad_items_is_a_few_errors(name, schema, body) -> None:
    with pytest.raises(ValueError) as e:
        schema.model_validate(body)
    assert e.value.error_count() <= 8, e.value.error_count()


def test_many_bad_items_and_members_are_one_bounded_400(http: httpx.Client) -> None:
    many = BODY_LIMIT // 8  # within this server's body limit
    for path, body in [(CHAT, {"model": TINY, "messages": [{}] * many}),
                       (COMPLETIONS, {"model": TINY, "prompt": [-1] * many}),
                       ("/detokenize", {"tokens": [-1] * many}),
                       ("/tokenize", {"prompt": "x", **{f"k{i}": 0 for i in range(many // 2)}})]:  # each a field error
        err = assert_error(http.post(path, json=body), 400)
        assert len(err["message"]) < 1000, err["message"][:200]


HUGE = "x" * (BODY_LIMIT // 2)  # within this server's body limit
QUOTING = [
    ("model", CHAT, chat(model=HUGE), 404),
    ("tokenize model", "/tokenize", {"model": HUGE, "prompt": "x"}, 404),
    ("tool_choice name", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}],
                                    tool_choice={"type": "function", "function": {"name": "g" + HUGE}}), 400),
    ("logit_bias key", CHAT, chat(logit_bias={"9" * 10 + "x" + HUGE: 1}), 400),
    ("logit_bias key of a bad value", COMPLETIONS, completion(logit_bias={HUGE: 999}), 400),
    ("unknown tokenize field", "/tokenize", {"prompt": "x", HUGE: 1}, 400),
    ("unknown detokenize field", "/detokenize", {"tokens": [1], HUGE: 1}, 400),
    ("template variable", CHAT, chat(chat_template_kwargs={"a" + HUGE: 1}), 400),
]


@pytest.mark.parametrize("name,path,body,status", QUOTING, ids=[c[0] for c in QUOTING])
def test_an_error_quotes_at_most_a_hundred_characters_of_a_value(http: httpx.Client, name, path, body, status) -> None:
    err = assert_error(http.post(path, json=body), status)
    assert len(err["message"]) < QUOTED_CHARS + 300, len(err["message"])
    assert err["param"] is None or len(err["param"]) < QUOTED_CHARS + 20, len(err["param"])


def test_a_message_from_many_errors_of_one_field_still_names_another_fields() -> None:
    from fastapi.exceptions import RequestValidationError

    from kvtier.serve.errors import DESCRIBED_ERRORS, _describe_validation

    with pytest.raises(ValueError) as e:
        CompletionRequest.model_validate(dict(model="m", prompt="x", prompt_logprobs=-1,
                                              logit_bias={str(i): 999 for i in range(DESCRIBED_ERRORS + 6)}))
    errors = [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]
    described = _describe_validation(RequestValidationError(errors))
    # several fields: the first named, the rest counted (not one field's messages alone)
    assert described.param == "logit_bias.0" and f"(and {len(errors) - 1} more problems)" in str(described), described


def test_a_huge_content_type_is_quoted_short(http: httpx.Client) -> None:
    err = assert_error(http.post(COMPLETIONS, content=json.dumps(completion()).encode(),
                                 headers={"content-type": "text/plain; x=" + "y" * 8000}), 400, code="invalid_content_type")
    assert len(err["message"]) < QUOTED_CHARS + 300


@pytest.mark.parametrize("content_type", ["text/json", "application/x-json", "application/jsonl",
                                          "application/json-patch", "application/a/b+json"])
def test_a_content_type_fastapi_does_not_read_as_json_is_explained(http: httpx.Client, content_type: str) -> None:
    resp = http.post(COMPLETIONS, content=json.dumps(completion()).encode(), headers={"content-type": content_type})
    assert_error(resp, 400, code="invalid_content_type")


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "application/vnd.kvtier+json"])
def test_json_content_types_are_read(http: httpx.Client, content_type: str) -> None:
    resp = http.post(COMPLETIONS, content=json.dumps(completion()).encode(), headers={"content-type": content_type})
    assert resp.status_code == 200, resp.text


def test_echo_and_tools_are_prepared_off_the_loop_after_the_length_check(http: httpx.Client, monkeypatch) -> None:
    """Decoding a long prompt's ids to echo them, and copying the tools, are a request's work: on
    a worker thread, and the ids of a prompt longer than the context are never decoded."""
    import asyncio

    calls: list[str] = []

    def on_the_loop() -> bool:
        try:
            asyncio.get_running_loop()
            return True
        except RuntimeError:
            return False

    echoed, tools = completions_module._echoed_prompt, completions_module.tool_setup
    monkeypatch.setattr(completions_module, "_echoed_prompt",
                        lambda *a: (calls.append(f"echo on loop={on_the_loop()}"), echoed(*a))[1])
    monkeypatch.setattr(completions_module, "tool_setup",
                        lambda *a: (calls.append(f"tools on loop={on_the_loop()}"), tools(*a))[1])
    assert_error(http.post(COMPLETIONS, json=completion(prompt=[1] * (WINDOW + 5), echo=True)), 400,
                 "prompt", "context_length_exceeded")
    assert calls == []
    assert http.post(COMPLETIONS, json=completion(prompt=[1, 2, 3], echo=True)).status_code == 200
    assert http.post(CHAT, json=chat(tools=[{"type": "function", "function": {"name": "f"}}])).status_code == 200
    assert calls == ["echo on loop=False", "tools on loop=False"]


def test_unknown_path_and_method(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing-here"), 404)
    resp = http.get(CHAT)
    assert resp.status_code == 405 and set(resp.json()["error"]) == {"message", "type", "param", "code"}


LONE = "a\ud800b"  # JSON can carry it (an escape); no UTF-8 form, and the tokenizer raises on it
TOOL = {"type": "function", "function": {"name": "f", "description": LONE, "parameters": {"type": "object"}}}
SURROGATES = [
    ("chat content", CHAT, chat(messages=[{"role": "user", "content": LONE}]), "messages"),
    ("content part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]), "messages"),
    ("tool description", CHAT, chat(tools=[TOOL], tool_choice="required"), "tools"),
    ("template variable", CHAT, chat(chat_template_kwargs={"x": LONE}), "chat_template_kwargs"),
    ("tool call arguments", CHAT, chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": LONE}}]},
        {"role": "user", "content": "x"}]), "messages"),
    ("streamed chat", CHAT, chat(messages=[{"role": "user", "content": LONE}], stream=True), "messages"),
    ("completion prompt", COMPLETIONS, completion(prompt=LONE), "prompt"),
    ("tokenize prompt", "/tokenize", {"prompt": LONE}, "prompt"),
    ("tokenize messages", "/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages"),
]


@pytest.mark.parametrize("name,path,body,param", SURROGATES, ids=[c[0] for c in SURROGATES])
def test_a_lone_surrogate_anywhere_in_the_text_is_a_400(http: httpx.Client, name, path, body, param) -> None:
    assert_error(http.post(path, content=json.dumps(body), headers={"content-type": "application/json"}), 400, param)


def test_server_survives_bad_input(http: httpx.Client, tiny_server: Served) -> None:
    """Runs after the cases above (file order): nothing broke, nothing leaked."""
    assert http.get("/health").json()["status"] == "ok"
    assert http.post(CHAT, json=chat()).status_code == 200
    assert tiny_server.background.errors == 0 and tiny_server.background.alive
    wait_idle(tiny_server.engine)
    metrics = http.get("/metrics").text
    assert 'code="500"' not in metrics


@PADS
@pytest.mark.parametrize("levels", [MAX_DEPTH - 4, 980])
def test_a_deep_schema_is_a_400_at_any_body_size(http: httpx.Client, levels: int, pad: int) -> None:
    """A schema nested MAX_DEPTH deep in the body is read and refused by the grammar limits; past
    it the body is invalid JSON, whatever its size (json.loads alone accepts more on a worker
    thread than on the event loop, and a value read deep there fails json.dumps on the loop)."""
    raw = (b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "response_format": '
           b'{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "default": '
           % TINY.encode() + b"[" * levels + b"]" * levels + b"}}}}" + b" " * pad)  # the list: 4 levels down
    err = assert_error(http.post(CHAT, content=raw, headers={"content-type": "application/json"}), 400)
    assert (err["code"] == "invalid_json") == (levels > MAX_DEPTH - 4), err
    assert err["param"] == ("response_format" if levels <= MAX_DEPTH - 4 else None), err
