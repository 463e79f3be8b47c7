"""The real default model behind `python -m kvtier.serve`, driven by the official openai client.

One server process serves most of the module: it exercises the command line, the API key from the
environment, the store, and answers whose content can be checked (the tiny presets produce noise).
The last test restarts the server on the same store: the conversation comes back from disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.bench.load.server import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
KEY = "test-key-from-env"
BLOCK = 16  # the engine's block size: device-cache reuse is counted in whole blocks
ENV = {**os.environ, "KVTIER_API_KEY": KEY, "TOKENIZERS_PARALLELISM": "false"}
TRIP = ("I am planning a trip to Italy. What is its capital?", "Name one famous museum there.",
        "What food should I try?")


def start(store: Path) -> ServerProcess:
    # The first start on a machine plans on an estimate of it (no profile measured before it answers).
    # A disk-only store: a memory tier above it would keep the newest state in the process, and a
    # restart would lose it (the tiers demote on eviction, not on shutdown). The restore method is
    # pinned: for prompts this short `auto` may rightly prefer recompute on some machines.
    server = ServerProcess(["--model", MODEL, "--kv-cache-gb", "0.5", "--max-model-len", "2048",
                            "--store", f"disk:{store}:1GB", "--restore-method", "kv",
                            "--log-level", "warning"], env=ENV)
    try:
        server.wait_ready(timeout=900)  # the first load ever also converts the GGUF
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture(scope="module")
def server(store: Path) -> Iterator[ServerProcess]:
    proc = start(store)
    yield proc
    proc.stop()  # a no-op if a test stopped it already


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_api_key_from_environment(server: ServerProcess) -> None:
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4)
    assert httpx.get(server.url + "/health").status_code == 200


def test_chat_plain_and_streaming(server: ServerProcess) -> None:
    client = client_for(server)
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    text = plain.choices[0].message.content
    assert "Paris" in text, text
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions(server: ServerProcess) -> None:
    resp = client_for(server).completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                                 temperature=0)
    assert "Paris" in resp.choices[0].text, resp.choices[0].text


SYSTEM = "You are a helpful travel assistant. Keep answers short."


def converse(client: openai.OpenAI, questions: tuple[str, ...], system: str = SYSTEM) -> list:
    """Ask `questions` as one conversation: (usage, answer) per turn."""
    messages = [{"role": "system", "content": system}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        turns.append((resp.usage, resp.choices[0].message.content))
    return turns


def test_three_turn_conversation_reuses_earlier_turns(server: ServerProcess) -> None:
    turns = [u for u, _ in converse(client_for(server), TRIP)]
    cached = [u.prompt_tokens_details.cached_tokens for u in turns]
    assert cached[1] > 0 and cached[2] > 0, cached
    # Each later turn restores at least the whole blocks of the previous turn's prompt.
    for prev, cur in zip(turns, turns[1:]):
        assert cur.prompt_tokens_details.cached_tokens >= prev.prompt_tokens // BLOCK * BLOCK, cached
        assert cur.prompt_tokens_details.cached_tokens < cur.prompt_tokens


# ----- tool calls and structured output (issue 29) -----------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def _valid_call(name: str, arguments: str) -> None:
    assert name in SCHEMAS, name
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_tool_choice_required_and_named_always_yield_valid_calls(server: ServerProcess) -> None:
    client = client_for(server)
    required = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                              n=2, temperature=1.0, seed=7, max_tokens=60)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls", choice
        call = choice.message.tool_calls[0]
        _valid_call(call.function.name, call.function.arguments)
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}},
                                            temperature=1.0, seed=3, stream=True)
    calls, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            reasons.append(c.finish_reason)
    assert [c.function.name for c in calls] == ["get_time"] and "tool_calls" in reasons
    _valid_call("get_time", calls[0].function.arguments)


def test_tool_round_trip_reuses_the_first_turn(server: ServerProcess) -> None:
    client = client_for(server)
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                           temperature=0, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    _valid_call(call.function.name, call.function.arguments)
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})},
    ]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                            max_tokens=30)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // BLOCK * BLOCK, (cached, first.usage.prompt_tokens)


def test_json_object_and_json_schema_responses_parse(server: ServerProcess) -> None:
    client = client_for(server)
    ask = [{"role": "user", "content": "Describe a cat as a JSON object with a name and an age."}]
    # The grammar admits EOS only after the object closes: every sample that stops parses. (Sampling,
    # this 135M model may write one string past any max_tokens: then it is "length". Which samples
    # do depends on the dtype `auto` picks, so the test asks for most, not all, to stop.)
    objects = client.chat.completions.create(model=MODEL, messages=ask, response_format={"type": "json_object"},
                                             n=8, temperature=0.7, seed=11, max_tokens=160)
    stopped = [c for c in objects.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 6 and all(c.finish_reason == "length" for c in objects.choices if c not in stopped)
    for choice in stopped:
        assert isinstance(json.loads(choice.message.content), dict)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "legs": {"type": "integer", "minimum": 0, "maximum": 8},
                                               "sound": {"enum": ["meow", "purr", "hiss"]}},
              "required": ["name", "legs", "sound"], "additionalProperties": False}
    shaped = client.chat.completions.create(model=MODEL, messages=ask, temperature=1.0, seed=12, max_tokens=120,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "cat", "schema": schema}})
    jsonschema.validate(json.loads(shaped.choices[0].message.content), schema)


def _reused_by_tier(url: str) -> dict[str, float]:
    out = {}
    headers = {"Authorization": f"Bearer {KEY}"}  # with a key set, /metrics needs it too
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", headers=headers).text):
        for s in family.samples:
            if s.name == "kvtier:prompt_tokens_reused_total":
                out[s.labels["tier"]] = s.value
    return out


def test_restart_restores_the_conversation_from_the_store(server: ServerProcess, store: Path) -> None:
    """A new server process on the same store: nothing is in its device cache, yet the conversation
    comes back from disk (the old process drained its pending saves on shutdown).

    The conversation has a system prompt of its own: a first chunk whose head came from the device
    prefix cache (a system prompt shared with earlier conversations) is not stored today (see
    docs/serve.md, known limitations)."""
    system, questions = "You are a concise guide to Italian cities.", ("Tell me about Venice.", "And Florence?")
    answers = [reply for _, reply in converse(client_for(server), questions, system)]
    server.stop()
    fresh = start(store)
    try:
        # Only the last turn, so the new process has computed nothing of this conversation itself.
        messages = [{"role": "system", "content": system}, {"role": "user", "content": questions[0]},
                    {"role": "assistant", "content": answers[0]}, {"role": "user", "content": questions[1]}]
        resp = client_for(fresh).chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        cached = resp.usage.prompt_tokens_details.cached_tokens
        assert cached > 0, (resp.usage, fresh.tail())
        assert _reused_by_tier(fresh.url) == {"disk": cached}
    finally:
        fresh.stop()
