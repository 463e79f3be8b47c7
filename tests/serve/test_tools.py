"""Tool calling without a model: prompts for both kinds of template, calls parsed back out of text, and
the llguidance grammar that forces a call, checked token by token with SmolLM2's tokenizer."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest

from kvtier.models.loading import load_model
from kvtier.serve.tools import (
    ToolCall,
    forced_grammar,
    may_be_tool_call,
    parse_tool_calls,
    prepare_messages,
    template_renders_tools,
    tool_family,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters at all
TOOLS = [WEATHER, CLOCK]
NAMES = {"get_weather", "get_time"}

# A template that lays tools out itself, as Qwen's and Llama's do (only far smaller).
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}\n"
    "{% endfor %}"
)
LLAMA3_SNIPPET = '{{- "Environment: ipython\\n" }}{%- if tools is not none %}{{ "<|python_tag|>" }}{% endif %}'

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


@pytest.fixture(scope="module")
def tok():
    return load_model("tiny-gqa").tokenizer


@pytest.fixture(scope="module")
def ll_tok(tok):
    return llguidance.hf.from_tokenizer(tok, n_vocab=49152)


def hermes(body: dict) -> str:
    return f"<tool_call>\n{json.dumps(body)}\n</tool_call>"


# ----- templates ----------------------------------------------------------------------------------


def test_tool_family_tells_llama3_from_hermes(tok):
    assert tool_family(LLAMA3_SNIPPET) == "llama3_json"
    assert tool_family("{{ '<|python_tag|>' }}") == "llama3_json"
    assert tool_family(tok.chat_template) == "hermes"
    assert tool_family(TOOL_TEMPLATE) == "hermes"
    assert tool_family(None) == "hermes"


def test_template_renders_tools_only_when_jinja_reads_the_variable(tok):
    assert template_renders_tools(TOOL_TEMPLATE)
    assert template_renders_tools("{{- tools | tojson }}")
    assert template_renders_tools(LLAMA3_SNIPPET)
    assert not template_renders_tools(tok.chat_template)  # SmolLM2-135M: role and content only
    assert not template_renders_tools(None)
    # The word in literal text, in a string inside a tag, or as part of another name is not the variable.
    assert not template_renders_tools("You may use tools. {{ messages[0].content }}")
    assert not template_renders_tools("{{ 'tools are listed below' }}{% for c in m.tool_calls %}{% endfor %}")


# ----- prepare_messages ---------------------------------------------------------------------------


def test_plain_template_gets_tools_in_a_new_system_message(tok):
    messages, tools_kwarg = prepare_messages(CONVERSATION, TOOLS, tok.chat_template)
    assert tools_kwarg is None  # the template would ignore it
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert all(isinstance(m["content"], str) for m in messages)
    system = messages[0]["content"]
    lines = system.split("\n")
    tools_block = lines[lines.index("<tools>") + 1 : lines.index("</tools>")]
    assert [json.loads(line) for line in tools_block] == TOOLS
    assert "<tool_call>" in system and "</tool_call>" in system
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3] == {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'}
    # The template accepts the result, and the tools reach the prompt instead of its default system line.
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in prompt and "SmolLM" not in prompt
    assert CONVERSATION[1]["content"] is None  # the caller's messages are left alone


def test_plain_template_appends_tools_to_an_existing_system_message(tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    messages, _ = prepare_messages(chat, [CLOCK], tok.chat_template)
    assert len(messages) == 2
    assert messages[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(CLOCK) in messages[0]["content"]


def test_plain_template_without_tools_still_renders_past_calls(tok):
    messages, tools_kwarg = prepare_messages(CONVERSATION, None, tok.chat_template)
    assert tools_kwarg is None
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"].startswith("<tool_call>\n")
    said = {"role": "assistant", "content": "Checking.", "tool_calls": CONVERSATION[1]["tool_calls"] * 2}
    (text,), _ = prepare_messages([said], None, tok.chat_template)
    assert text["content"].startswith("Checking.\n<tool_call>\n") and text["content"].count("</tool_call>") == 2


def test_history_round_trips_through_the_parser(tok):
    messages, _ = prepare_messages(CONVERSATION, TOOLS, tok.chat_template)
    content, calls = parse_tool_calls(messages[2]["content"], "hermes", NAMES)
    assert content is None
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}')]


def test_tool_template_gets_mappings_and_the_tools(tok):
    messages, tools_kwarg = prepare_messages(CONVERSATION, TOOLS, TOOL_TEMPLATE)
    assert tools_kwarg == TOOLS
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["content"] == ""
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[1]["tool_calls"][0]["id"] == "call_1"
    assert messages[2]["tool_call_id"] == "call_1"
    assert CONVERSATION[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # not mutated
    prompt = tok.apply_chat_template(messages, tools=tools_kwarg, chat_template=TOOL_TEMPLATE, tokenize=False)
    assert prompt.startswith("TOOLS:get_weather;get_time;")
    assert "CALL get_weather Paris" in prompt


# ----- parse_tool_calls: hermes -------------------------------------------------------------------


def test_hermes_content_and_a_call():
    text = "Let me check.\n" + hermes({"name": "get_weather", "arguments": {"city": "Zürich"}})
    content, calls = parse_tool_calls(text, "hermes", NAMES)
    assert content == "Let me check."
    assert calls == [ToolCall("get_weather", '{"city": "Zürich"}')]  # not \u-escaped


def test_hermes_several_calls_and_missing_arguments():
    text = (
        hermes({"name": "get_weather", "arguments": {"city": "Oslo"}})
        + "\n"
        + hermes({"name": "get_time"})
        + '<tool_call>  {"name": "get_weather", "arguments": {"city": "Rome"}}  </tool_call>'
    )
    content, calls = parse_tool_calls(text, "hermes", NAMES)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_time", "get_weather"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Oslo"}, {}, {"city": "Rome"}]


def test_hermes_bad_blocks_stay_content():
    good = hermes({"name": "get_time", "arguments": {}})
    for bad in [
        "<tool_call>\n{not json}\n</tool_call>",
        hermes({"name": "delete_everything", "arguments": {}}),  # not one of the tools
        hermes({"name": "get_weather", "arguments": "city=Paris"}),  # arguments not an object
        hermes({"arguments": {}}),  # no name
        "<tool_call>\n[1, 2]\n</tool_call>",
    ]:
        content, calls = parse_tool_calls(f"{bad}\n{good}", "hermes", NAMES)
        assert calls == [ToolCall("get_time", "{}")]
        assert content == bad
        # With no valid call at all the text comes back exactly as generated.
        assert parse_tool_calls(f" {bad}\n", "hermes", NAMES) == (f" {bad}\n", [])


def test_hermes_missing_closing_tag_at_the_end():
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n'
    assert parse_tool_calls(text, "hermes", NAMES) == ("Sure.", [ToolCall("get_weather", '{"city": "Lima"}')])
    truncated = 'Sure. <tool_call>\n{"name": "get_weather", "argu'
    assert parse_tool_calls(truncated, "hermes", NAMES) == (truncated, [])


def test_plain_answers_pass_through():
    assert parse_tool_calls("  The answer is 4.\n", "hermes", NAMES) == ("  The answer is 4.\n", [])
    assert parse_tool_calls("", "hermes", NAMES) == (None, [])
    assert parse_tool_calls(" \n", "llama3_json", NAMES) == (None, [])


# ----- parse_tool_calls: llama3_json --------------------------------------------------------------


def test_llama3_single_and_tagged_calls():
    call = ToolCall("get_weather", '{"city": "Paris"}')
    body = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parse_tool_calls(body, "llama3_json", NAMES) == (None, [call])
    assert parse_tool_calls(f"<|python_tag|>{body}\n", "llama3_json", NAMES) == (None, [call])
    alias = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    assert parse_tool_calls(alias, "llama3_json", NAMES) == (None, [call])


def test_llama3_several_calls_split_on_semicolons_outside_strings():
    text = '{"name": "get_weather", "parameters": {"city": "a;b"}}; {"name": "get_time", "parameters": {}}'
    content, calls = parse_tool_calls(text, "llama3_json", NAMES)
    assert content is None
    assert calls == [ToolCall("get_weather", '{"city": "a;b"}'), ToolCall("get_time", "{}")]


def test_llama3_anything_else_is_content():
    for text in [
        "It is sunny in Paris.",
        '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some prose',
        '{"name": "get_weather", "parameters": {}}; {"name": "unknown", "parameters": {}}',  # all or nothing
        '{"name": "get_weather", "parameters": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Par',
    ]:
        assert parse_tool_calls(text, "llama3_json", NAMES) == (text, [])


# ----- may_be_tool_call ---------------------------------------------------------------------------


def test_may_be_tool_call_while_streaming():
    for so_far in ["", "  ", "\n<", "<tool", "<tool_call>", '<tool_call>\n{"na']:
        assert may_be_tool_call(so_far, "hermes"), so_far
    for so_far in ["Hi", "<tools>", "<b>", "{", "I will <tool_call>"]:
        assert not may_be_tool_call(so_far, "hermes"), so_far
    for so_far in ["", "<|py", "<|python_tag|>{", ' {"name"']:
        assert may_be_tool_call(so_far, "llama3_json"), so_far
    for so_far in ["The", "<tool_call>", "<|eot"]:
        assert not may_be_tool_call(so_far, "llama3_json"), so_far


# ----- forced_grammar -----------------------------------------------------------------------------


def matches(grammar: str, ll_tok, tok, text: str) -> bool:
    """Whether the whole of `text`, as the model would emit its tokens, is a sentence of the grammar."""
    matcher = llguidance.LLMatcher(ll_tok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tok.encode(text, add_special_tokens=False))
    return ok and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("choice", [None, "get_weather"])
@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
def test_forced_grammar_validates(ll_tok, choice, family):
    grammar = forced_grammar(TOOLS, choice, family)
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tok) == ""
    assert llguidance.LLMatcher.validate_grammar(llguidance.grammar_from("lark", grammar), ll_tok) == ""


def test_named_call_is_forced(ll_tok, tok):
    grammar = forced_grammar(TOOLS, "get_weather", "hermes")
    assert matches(grammar, ll_tok, tok, hermes({"name": "get_weather", "arguments": {"city": "Paris"}}))
    assert matches(grammar, ll_tok, tok, hermes({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}))
    for wrong in [
        hermes({"name": "get_time", "arguments": {}}),  # another tool than the named one
        hermes({"name": "get_weather", "arguments": {}}),  # "city" is required
        hermes({"name": "get_weather", "arguments": {"city": 7}}),  # not a string
        hermes({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}),  # not in the enum
        hermes({"name": "get_weather", "arguments": {"city": "Oslo"}, "extra": 1}),
        json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}),  # no <tool_call> wrapper
    ]:
        assert not matches(grammar, ll_tok, tok, wrong), wrong
    # An unfinished call is not accepted yet.
    assert not matches(grammar, ll_tok, tok, hermes({"name": "get_weather", "arguments": {"city": "Paris"}})[:-3])


def test_required_call_allows_any_tool(ll_tok, tok):
    grammar = forced_grammar(TOOLS, None, "hermes")
    assert matches(grammar, ll_tok, tok, hermes({"name": "get_weather", "arguments": {"city": "Paris"}}))
    assert matches(grammar, ll_tok, tok, hermes({"name": "get_time", "arguments": {}}))
    assert matches(grammar, ll_tok, tok, hermes({"name": "get_time", "arguments": {"any": ["thing"]}}))
    assert not matches(grammar, ll_tok, tok, hermes({"name": "get_date", "arguments": {}}))
    assert not matches(grammar, ll_tok, tok, "Sorry, I cannot call tools.")


def test_llama3_grammar_uses_parameters_without_a_wrapper(ll_tok, tok):
    grammar = forced_grammar(TOOLS, "get_weather", "llama3_json")
    call = {"name": "get_weather", "parameters": {"city": "Paris"}}
    assert matches(grammar, ll_tok, tok, json.dumps(call))
    assert not matches(grammar, ll_tok, tok, hermes(call))
    assert not matches(grammar, ll_tok, tok, json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}))


def test_forced_grammar_keeps_local_schema_references(ll_tok, tok):
    place = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tool = {
        "type": "function",
        "function": {
            "name": "trip",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/place"}},
                "required": ["to"],
                "$defs": {"place": place},
            },
        },
    }
    grammar = forced_grammar([tool], "trip", "hermes")
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tok) == ""
    assert matches(grammar, ll_tok, tok, hermes({"name": "trip", "arguments": {"to": {"city": "Rome"}}}))
    assert not matches(grammar, ll_tok, tok, hermes({"name": "trip", "arguments": {"to": {"town": "Rome"}}}))


def test_forced_grammar_refuses_an_unknown_choice():
    with pytest.raises(ValueError, match="get_stock"):
        forced_grammar(TOOLS, "get_stock", "hermes")
    with pytest.raises(ValueError):
        forced_grammar([], None, "hermes")




def test_optional_call_grammar_allows_text_or_a_valid_call(ll_tok, tok):
    """tool_choice auto with a strict tool: plain text, or a call that follows the schema."""
    grammar = forced_grammar(TOOLS, None, "hermes", optional=True)
    assert matches(grammar, ll_tok, tok, "It is sunny in Paris today.")
    assert matches(grammar, ll_tok, tok, hermes({"name": "get_weather", "arguments": {"city": "Paris"}}))
    assert not matches(grammar, ll_tok, tok, hermes({"name": "get_weather", "arguments": {"town": "Paris"}}))
    assert not matches(grammar, ll_tok, tok, "<b>bold</b> text")
