"""A random-weight Qwen3 model with Qwen3's chat template and <tool_call>, </tool_call> as added tokens
(as Qwen2.5's and Qwen3's tokenizers have them), through the HTTP server: a forced tool call (tool_choice
"required" or a named function) names the tags as tokens in its grammar and comes back parsed, whole and
streamed; /tokenize renders chat messages as /v1/chat/completions does, its template variables, tools
and generation-prompt controls included."""

from __future__ import annotations

import contextlib
import json

import httpx
import llguidance
import llguidance.hf
import pytest
from test_serve_reasoning import NAME, qwen3  # noqa: F401 - the module's model fixture

from kvtier.serve.tools import forced_grammar, tag_tokens

from serve_testlib import serve

ASK = [{"role": "user", "content": "Weather in Paris?"}]
# Small enough that a random model's call ends well within max_tokens (byte tokens: ~1 per character).
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def served(qwen3):  # noqa: F811 - the imported fixture
    # Byte tokens make prompts long: Qwen3's tool block alone is some 500.
    with contextlib.contextmanager(serve)(qwen3, window=1024) as s:
        # The grammar engine's view of the tokenizer, built once here rather than inside the first
        # forced call's compile deadline (seconds of it on a busy CPU).
        assert s.engine.grammars.tokenizer is not None
        yield s


def _post(s, path: str, body: dict) -> httpx.Response:
    return httpx.post(s.url + path, json=body, timeout=60)


def _chat(s, **kw) -> dict:
    r = _post(s, "/v1/chat/completions", {"model": NAME, "messages": ASK, "max_tokens": 4, "seed": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def _streamed_calls(s, **kw) -> tuple[list[tuple[str, str]], str | None]:
    """The streamed calls as (name, arguments), each joined from its deltas, and the finish reason."""
    body = {"model": NAME, "messages": ASK, "seed": 0, "stream": True, **kw}
    calls: dict[int, list[str]] = {}
    finish = None
    with httpx.stream("POST", s.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                for d in c["delta"].get("tool_calls") or []:
                    got = calls.setdefault(d["index"], ["", ""])
                    got[0] += d.get("function", {}).get("name") or ""
                    got[1] += d.get("function", {}).get("arguments") or ""
                finish = c["finish_reason"] or finish
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))], finish


def _valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    return args == {} if name == "get_time" else (name == "get_weather" and args["city"] in ("Paris", "Oslo"))


def test_the_grammar_names_the_tags_as_tokens_where_they_are_added_tokens(qwen3):  # noqa: F811
    tok = qwen3.tokenizer
    assert tag_tokens(tok) == {"<tool_call>", "</tool_call>"} and tag_tokens(object()) == frozenset()
    ll = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ids = tok.encode(call)
    assert ids[0] == tok.convert_tokens_to_ids("<tool_call>") and ids[-1] == tok.convert_tokens_to_ids("</tool_call>")
    for optional in (False, True):
        grammar = forced_grammar(TOOLS, None, "hermes", optional=optional, tokens=tag_tokens(tok))
        assert '"<tool_call>"' not in grammar and '"</tool_call>"' not in grammar
        matcher = llguidance.LLMatcher(ll, grammar)
        assert matcher.consume_tokens(ids) and matcher.is_accepting(), matcher.get_error()
    # As text, the tag is offered as its token and then refused: why the grammar names it.
    text = llguidance.LLMatcher(ll, forced_grammar(TOOLS, None, "hermes"))
    assert not text.consume_tokens(ids[:1]) or text.is_error()


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_comes_back_parsed_whole_and_streamed(served, choice):
    want = {"get_weather"} if choice == NAMED else {"get_weather", "get_time"}
    got = _chat(served, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=80, n=2)
    for c in got["choices"]:
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] in want and _valid(call["function"]["name"], call["function"]["arguments"])
    calls, finish = _streamed_calls(served, tools=TOOLS, tool_choice=choice, temperature=1.0, max_tokens=80)
    assert finish == "tool_calls" and len(calls) == 1, calls
    assert calls[0][0] in want and _valid(*calls[0])


def test_tokenize_renders_messages_as_chat_does(served):
    def count(**kw) -> int:
        r = _post(served, "/tokenize", {"messages": ASK, **kw})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    def usage(**kw) -> int:
        return _chat(served, structured_outputs={"grammar": 'start: "ok"'}, **kw)["usage"]["prompt_tokens"]

    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert count() == usage() and count(**off) == usage(**off)
    assert count(**off) - count() == usage(**off) - usage() > 0  # "<think>\n\n</think>\n\n"
    assert count(tools=TOOLS) == usage(tools=TOOLS) > count() + 100
    assert count(add_generation_prompt=False) < count()
    answered = [*ASK, {"role": "assistant", "content": "Sunny"}]
    kept_open = _post(served, "/tokenize", {"messages": answered, "add_generation_prompt": False,
                                            "continue_final_message": True}).json()
    assert served.engine.model.tokenizer.decode(kept_open["tokens"]).endswith("Sunny")


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": ASK, "enable_thinking": False}, None),  # a template variable goes in chat_template_kwargs
    ({"messages": ASK, "chat_template_kwargs": {"tools": "x"}}, "chat_template_kwargs"),
    ({"messages": ASK, "chat_template_kwargs": {"k": [1]}}, "chat_template_kwargs"),
    ({"messages": ASK, "continue_final_message": True}, "continue_final_message"),  # needs no generation prompt
    ({"messages": ASK, "tools": [WEATHER, WEATHER]}, None),
    ({"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}}, None),  # messages only
    ({"prompt": "x", "tools": TOOLS}, None),
])
def test_bad_chat_fields_on_tokenize_are_400s(served, body, param):
    r = _post(served, "/tokenize", body)
    assert r.status_code == 400, (body, r.text)
    if param is not None:
        assert r.json()["error"]["param"] == param
