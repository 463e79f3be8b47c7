"""Structured output, logprobs and tool plumbing on the tiny random model (issue 29): a model that
never means to follow a format follows every one the grammar engine is given; chat logprobs come in
OpenAI's shape; tool_choice none hides the tools and parallel_tool_calls false keeps one call."""

from __future__ import annotations

import json
import math
import re

import httpx
import pytest

from kvtier.serve.choices import read_calls
from kvtier.serve.inputs import chat_prompt, tool_setup
from kvtier.serve.schemas import ChatCompletionRequest

from serve_testlib import TINY

ASK = [{"role": "user", "content": "Answer:"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"]}}}


def _chat(s, **kw) -> httpx.Response:
    return httpx.post(s.url + "/v1/chat/completions", json={"model": TINY, "messages": ASK, "max_tokens": 40, **kw},
                      timeout=60)


def _text(s, **kw) -> str:
    r = _chat(s, temperature=1.0, **kw)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["message"]["content"]


@pytest.mark.parametrize("seed", range(3))
def test_every_constraint_form_is_followed(tiny_server, seed):
    s = tiny_server
    assert re.fullmatch(r"\d{3}-[a-z]{2}", _text(s, seed=seed, structured_outputs={"regex": r"\d{3}-[a-z]{2}"}))
    assert _text(s, seed=seed, structured_outputs={"choice": ["yes", "no", "maybe so"]}) in ("yes", "no", "maybe so")
    assert re.fullmatch(r"x[bc]{2}d", _text(s, seed=seed, structured_outputs={
        "grammar": 'start: "x" mid mid "d"\nmid: "b" | "c"'}))
    assert _text(s, seed=seed, grammar='root ::= "on" | "off"') in ("on", "off")  # llama-server's GBNF
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2]}}, "required": ["k"], "additionalProperties": False}
    for form in ({"structured_outputs": {"json": schema}}, {"structured_outputs": {"json": json.dumps(schema)}},
                 {"response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": schema}}}):
        assert json.loads(_text(s, seed=seed, **form))["k"] in (1, 2)


@pytest.mark.parametrize(("body", "param"), [
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn"),
    ({"grammar": "root ::= undefined-rule"}, "grammar"),
])
def test_bad_constraints_are_400s_naming_the_field(tiny_server, body, param):
    r = _chat(tiny_server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_logprobs_in_openai_shape(tiny_server):
    r = _chat(tiny_server, temperature=0, logprobs=True, top_logprobs=3, max_tokens=5).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"] == 5
    for tok in content:
        assert len(tok["top_logprobs"]) == 3 and bytes(tok["bytes"]).decode(errors="replace") == tok["token"]
        assert tok["logprob"] == tok["top_logprobs"][0]["logprob"] <= 0  # greedy: the likeliest
        assert sum(math.exp(t["logprob"]) for t in tok["top_logprobs"]) <= 1 + 1e-6
    plain = _chat(tiny_server, temperature=0, logprobs=True, max_tokens=5).json()["choices"][0]["logprobs"]["content"]
    assert [t["top_logprobs"] for t in plain] == [[]] * 5
    assert _chat(tiny_server, top_logprobs=2).status_code == 400  # needs logprobs: true


def test_tool_choice_none_hides_the_tools_and_auto_shows_them(tiny_server):
    engine = tiny_server.engine

    def ids(**kw) -> list[int]:
        body = ChatCompletionRequest(model=TINY, messages=ASK, **kw)
        return chat_prompt(engine, body, tool_setup(engine, body))[0]  # (ids, documents' spans)

    assert ids(tools=[TOOL], tool_choice="none") == ids()
    shown = engine.model.tokenizer.decode(ids(tools=[TOOL]))
    assert "<tools>" in shown and '"name": "f"' in shown


def test_forced_calls_on_the_random_model_parse_and_parallel_false_keeps_one(tiny_server):
    r = _chat(tiny_server, tools=[TOOL], tool_choice="required", temperature=1.0, seed=1, max_tokens=60, n=3).json()
    for choice in r["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "f" and json.loads(call["function"]["arguments"])["x"] in range(10)
    setup = tool_setup(tiny_server.engine, ChatCompletionRequest(model=TINY, messages=ASK, tools=[TOOL]))
    two = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "f", ' \
          '"arguments": {"x": 2}}\n</tool_call>'
    assert len(read_calls(two, setup, parallel=True)[1]) == 2 and len(read_calls(two, setup, parallel=False)[1]) == 1


def test_a_strict_tool_in_auto_mode_answers_text_or_a_valid_call(tiny_server):
    strict = {"type": "function", "function": {**TOOL["function"], "strict": True}}
    r = _chat(tiny_server, tools=[strict], temperature=1.0, seed=2, max_tokens=60, n=6).json()
    for choice in r["choices"]:
        if choice["finish_reason"] == "tool_calls":
            (call,) = choice["message"]["tool_calls"]
            assert json.loads(call["function"]["arguments"])["x"] in range(10)
        else:  # text: the grammar let nothing begin like a call
            assert not choice["message"]["content"].startswith("<"), choice
    both = _chat(tiny_server, tools=[strict], response_format={"type": "json_object"})
    assert both.status_code == 400  # two constraints on one output
