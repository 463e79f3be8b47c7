"""The official `openai` client against a live server (tiny random-weight model)."""

from __future__ import annotations

import openai
import pytest

from serve_testlib import DEFAULT_MAX_TOKENS, TINY, Served, wait_idle


@pytest.fixture(scope="module")
def client(tiny_server: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.v1, api_key="unused", max_retries=0, timeout=60)


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [TINY]
    assert client.models.retrieve(TINY).id == TINY
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=TINY, messages=_user("Hello!"), max_tokens=5, temperature=0)
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = resp.usage
    assert u.completion_tokens <= 5 and u.prompt_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_default_max_tokens_and_max_completion_tokens(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=TINY, messages=_user("Count"), temperature=0)
    assert resp.usage.completion_tokens <= DEFAULT_MAX_TOKENS
    resp = client.chat.completions.create(
        model=TINY, messages=_user("Count"), temperature=0, max_tokens=50, max_completion_tokens=3
    )
    assert resp.usage.completion_tokens <= 3  # the newer field wins, as in OpenAI's API


def test_chat_stream_matches_plain(client: openai.OpenAI) -> None:
    kw = dict(model=TINY, messages=_user("Tell me a story"), max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [plain.choices[0].finish_reason]
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == plain.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(model=TINY, messages=_user("Hi"), max_tokens=3, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason is not None


def test_completions_plain_and_stream(client: openai.OpenAI) -> None:
    kw = dict(model=TINY, prompt="The weather today is", max_tokens=10, temperature=0)
    plain = client.completions.create(**kw)
    assert plain.object == "text_completion" and plain.usage.completion_tokens <= 10
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_completions_token_ids(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=TINY, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0)
    assert resp.usage.prompt_tokens == 4 and resp.usage.completion_tokens <= 4


def test_seed_reproducible(client: openai.OpenAI) -> None:
    kw = dict(model=TINY, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text


def test_any_integer_seed(client: openai.OpenAI) -> None:
    for seed in (-1, 2**63, 2**64 + 5, -(2**70)):  # reduced to the generator's 64-bit range
        kw = dict(model=TINY, prompt="Seeds", max_tokens=6, temperature=1.0, seed=seed)
        assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_stop_string(client: openai.OpenAI) -> None:
    kw = dict(model=TINY, prompt="Once upon a time", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    assert len(full) > 4, full
    stop = full[2:4]
    stopped = client.completions.create(**kw, stop=[stop])
    assert stopped.choices[0].text == full[: full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_three_turn_conversation_reports_cached_tokens(client: openai.OpenAI, tiny_server: Served) -> None:
    messages = [{"role": "system", "content": "You are a terse assistant for a conversation test."}]
    cached = []
    for question in ("First question about caching?", "A second, follow-up question?", "And a third one?"):
        messages.append({"role": "user", "content": question})
        resp = client.chat.completions.create(model=TINY, messages=messages, max_tokens=6, temperature=0)
        messages.append({"role": "assistant", "content": resp.choices[0].message.content})
        cached.append(resp.usage.prompt_tokens_details.cached_tokens)
    # Later turns restore the earlier turns' prompt blocks instead of computing them.
    assert cached[1] > 0 and cached[2] > cached[1], cached
    wait_idle(tiny_server.engine)


@pytest.mark.parametrize("params", [{"temperature": 5e-324}, {"temperature": 1e-300}, {"top_p": 5e-324},
                                    {"top_p": 2.5e-133}, {"temperature": 2.0, "top_p": 1e-40}])
def test_extreme_sampling_values(client: openai.OpenAI, tiny_server: Served, params: dict) -> None:
    """Values at the edge of the valid ranges must not break the engine step (found by schemathesis)."""
    resp = client.completions.create(model=TINY, prompt="edge", max_tokens=3, **params)
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert tiny_server.background.errors == 0


def test_overlong_prompt_with_a_truncating_engine(tiny_model) -> None:
    """An engine configured to truncate keeps serving prompts longer than its window."""
    from kvtier.planning.truncation import TruncationConfig

    from serve_testlib import serve

    for served in serve(tiny_model, truncation=TruncationConfig(keep_prefix=4)):
        client = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0)
        resp = client.completions.create(model=TINY, prompt="word " * 400, max_tokens=5, temperature=0)
        assert resp.usage.completion_tokens <= 5 and resp.usage.prompt_tokens < 256
        with pytest.raises(openai.BadRequestError):  # still no room for more than half the window
            client.completions.create(model=TINY, prompt="word " * 400, max_tokens=200)
