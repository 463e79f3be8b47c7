"""Hostile grammars and schemas through the real server: each a 400 naming its field, the server
alive after (a subprocess, so a crash fails the test instead of killing the run); realistic ones
still served; a matcher built off the event loop; a grammar failing mid-sequence ends only its
own request, with a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import httpx
import pytest
from test_grammar_limits import defs_chain, gbnf_chain, lark_chain, realistic_grammar, wide_schema

from kvtier.engine.grammar_limits import GrammarLimits
from kvtier.engine.request import GrammarSpec
from kvtier.engine.structured import Constraint

from serve_testlib import TINY, Served, serve

ASK = [{"role": "user", "content": "Answer:"}]


@pytest.fixture(scope="module")
def served(kvtier_process) -> str:
    return kvtier_process.url


def _chat(url: str, **kw) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json={"model": TINY, "messages": ASK, "max_tokens": 24, **kw},
                      timeout=120)


def _schema_format(schema: str) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": json.loads(schema)}}}


HOSTILE = [
    ("lark-4000-rules", {"structured_outputs": {"grammar": lark_chain(4000)}}, "structured_outputs.grammar"),
    ("lark-chain-1000", {"structured_outputs": {"grammar": lark_chain(1000)}}, "structured_outputs.grammar"),
    ("defs-chain-4000", _schema_format(defs_chain(4000)), "response_format"),
    ("defs-chain-300", _schema_format(defs_chain(300)), "response_format"),
    ("gbnf-3000-rules", {"grammar": gbnf_chain(3000)}, "grammar"),
    ("regex-a-99999999", {"structured_outputs": {"regex": "a{99999999}"}}, "structured_outputs.regex"),
    ("regex-nested-1000", {"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs.regex"),
    ("lark-nested-1000", {"structured_outputs": {"grammar": '("a"{1000}){1000}'.join(["start: ", ""])}},
     "structured_outputs.grammar"),
    ("schema-10000-properties", {"structured_outputs": {"json": json.loads(wide_schema(10_000))}},
     "structured_outputs.json"),
]


@pytest.mark.parametrize(("body", "param"), [(b, p) for _, b, p in HOSTILE], ids=[n for n, _, _ in HOSTILE])
def test_a_hostile_grammar_is_a_400_naming_its_field_and_the_server_lives(served, body, param):
    r = _chat(served, **body)
    assert r.status_code == 400, r.text[:500]
    error = r.json()["error"]
    assert error["param"] == param and "--max-grammar-" in error["message"], error
    assert httpx.get(served + "/health", timeout=10).status_code == 200


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"json": json.loads(wide_schema(50))}},
    {"structured_outputs": {"grammar": realistic_grammar(200)}},
], ids=["schema-50-properties", "grammar-200-rules"])
def test_realistic_grammars_are_still_served(served, body):
    r = _chat(served, temperature=1.0, seed=1, max_tokens=200, **body)
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    if "json" in body["structured_outputs"] and choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.fixture(scope="module")
def roomy_server(tiny_model) -> Iterator[Served]:
    yield from serve(tiny_model, max_body_bytes=4 << 20)


def test_a_matcher_is_built_off_the_event_loop(roomy_server, monkeypatch):
    """A large schema (the limits raised to let it in) has its matcher built on a grammar thread,
    here made to take 1.5 s more (a sleep on that thread, as a slow build would take); /health keeps
    answering meanwhile: its worst wait is a fraction of the request's. (The grammar engine holds
    the GIL for part of a build, about 0.3 s for this schema: a wait that long is its, not the
    loop's; the model's grammar tokenizer is built first, once, so that its build is not timed.)"""
    engine = roomy_server.engine
    engine.grammars.ready().result(120)
    build = engine.grammars._constraint_here
    monkeypatch.setattr(engine.grammars, "_constraint_here", lambda spec: (time.sleep(1.5), build(spec))[1])
    before = engine.grammars.limits
    engine.grammars.limits = GrammarLimits(max_bytes=1 << 20, max_rules=100_000, timeout_s=120)
    body = {"model": TINY, "messages": ASK, "max_tokens": 2,
            "structured_outputs": {"json": json.loads(wide_schema(1_500))}}

    async def run() -> tuple[float, list[float], int]:
        async with httpx.AsyncClient(base_url=roomy_server.url, timeout=120) as client:
            t = time.perf_counter()
            task = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
            waits = []
            while not task.done():
                s = time.perf_counter()
                assert (await client.get("/health")).status_code == 200
                waits.append(time.perf_counter() - s)
                await asyncio.sleep(0.02)
            response = await task
            return time.perf_counter() - t, waits, response

    try:
        took, waits, response = asyncio.run(run())
    finally:
        engine.grammars.limits = before
    # Built and run: a 200, or a 400 where its 1,500 optional properties outgrow the grammar
    # engine's parser limits after the first token; never refused by the limits (raised here).
    assert response.status_code == 200 or response.json()["error"]["code"] == "grammar_failed", response.text
    assert len(waits) >= 3 and max(waits) < took / 3, (took, sorted(waits)[-3:])


class _Failing(Constraint):
    """A real matcher that reports a failure once a token has been accepted."""

    def __init__(self, inner: Constraint):
        super().__init__(inner._m)
        self.accepted = 0

    def accept(self, token: int) -> None:
        self.accepted += 1
        super().accept(token)

    @property
    def error(self) -> str | None:
        return "parser limits exceeded (step_max_items)" if self.accepted else None

    def fork(self) -> Constraint:
        return _Failing(super().fork())


def test_a_grammar_failing_mid_sequence_ends_only_its_request(tiny_server, monkeypatch):
    grammars = tiny_server.engine.grammars
    real = grammars.build

    def failing(spec) -> Future:
        done: Future = Future()
        done.set_result(_Failing(real(spec).result(timeout=60)))
        return done

    monkeypatch.setattr(grammars, "build", failing)
    so = {"structured_outputs": {"regex": "[a-z]{5,9}"}}
    with httpx.Client(base_url=tiny_server.url, timeout=60) as client:
        greedy = {"model": TINY, "messages": ASK, "max_tokens": 8, "temperature": 0}
        plain = client.post("/v1/chat/completions", json=greedy)
        r = client.post("/v1/chat/completions", json={"model": TINY, "messages": ASK, "max_tokens": 8, **so})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "grammar_failed" and "parser limits" in r.json()["error"]["message"]
        with client.stream("POST", "/v1/chat/completions",
                           json={"model": TINY, "messages": ASK, "max_tokens": 8, "stream": True, **so}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "grammar_failed" and error["type"] == "invalid_request_error"
        again = client.post("/v1/chat/completions", json=greedy)
    assert plain.status_code == again.status_code == 200
    assert again.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


def test_a_request_holds_its_slot_while_its_grammar_is_built(tiny_model, monkeypatch):
    """Admission comes first: a request whose prompt is being rendered or whose grammar is being
    built counts against --max-queued-requests, so such work cannot pile up past the limit."""
    with contextlib.contextmanager(serve)(tiny_model, max_num_seqs=1, max_queued_requests=0) as s:
        grammars = s.engine.grammars
        real, pending = grammars.build, Future()
        monkeypatch.setattr(grammars, "build", lambda spec: pending)
        body = {"model": TINY, "messages": ASK, "max_tokens": 4, "structured_outputs": {"regex": "[a-z]{3}"}}
        answers: list = []
        first = threading.Thread(target=lambda: answers.append(httpx.post(s.v1 + "/chat/completions", json=body,
                                                                           timeout=60)))
        first.start()
        deadline = time.monotonic() + 30
        while s.in_flight < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        plain = {"model": TINY, "messages": ASK, "max_tokens": 4}
        assert httpx.post(s.v1 + "/chat/completions", json=plain, timeout=60).status_code == 429
        pending.set_result(real(GrammarSpec("regex", "[a-z]{3}")).result(timeout=60))
        first.join(60)
        assert answers[0].status_code == 200, answers[0].text
        assert s.in_flight == 0


def test_a_first_start_serves_at_once_on_an_estimate(kvtier_process):
    """A machine without a saved profile is planned for on an estimate, not measured for minutes
    before the port answers; /health says so, and the log names `kvtier profile`."""
    health = httpx.get(kvtier_process.url + "/health", timeout=10).json()
    assert health["profile"] == "estimate", health
    assert "kvtier profile --model tiny-gqa" in kvtier_process.log.read_text()
    assert not list((kvtier_process.home).rglob("profiles/*.json"))


def test_the_grammar_tokenizer_is_built_before_the_server_reads_a_request(tiny_model):
    """Its build holds the GIL (a third of a second for a 49K vocabulary, a second more for its
    imports): a server pays it as it starts, never a request beside others in flight; engines of
    one model share it."""
    from kvtier.engine.structured import Grammars

    gen = serve(tiny_model)
    served = next(gen)
    try:
        assert served.engine.grammars.built
        again = Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size)
        assert not again.built and again.tokenizer is served.engine.grammars.tokenizer
    finally:
        gen.close()


def test_a_server_starts_without_waiting_long_for_a_slow_grammar_tokenizer(tiny_model, monkeypatch):
    """The start waits for the grammar tokenizer at most GRAMMAR_WARMUP_S (here 0.2 s against a
    2 s build): then it serves, and the build finishes on its grammar thread."""
    from kvtier.engine import structured
    from kvtier.serve import app

    build = structured._shared_tokenizer
    monkeypatch.setattr(structured, "_shared_tokenizer", lambda hf, vocab: (time.sleep(2.0), build(hf, vocab))[1])
    monkeypatch.setattr(app, "GRAMMAR_WARMUP_S", 0.2)
    gen = serve(tiny_model)
    served = next(gen)
    try:
        assert not served.engine.grammars.built  # started before the build ended
        assert httpx.get(f"{served.url}/health").status_code == 200
        served.engine.grammars.ready().result(30)
        assert served.engine.grammars.built
    finally:
        gen.close()


def test_a_tokenizer_the_grammar_engine_cannot_read_is_a_400_once_built_never_retried(tiny_model, monkeypatch):
    """llguidance refuses some tokenizers (slow ones, with a ValueError): the server starts, a
    structured request is a 400 naming its field and saying why, the build is tried once, and
    logprobs are served with null bytes."""
    from kvtier.engine import structured

    calls = []

    def refuse(hf, vocab):
        calls.append(vocab)
        raise ValueError("Only fast tokenizers are supported")

    monkeypatch.setattr(structured, "_shared_tokenizer", refuse)
    gen = serve(tiny_model)
    served = next(gen)
    try:
        for _ in range(2):
            r = _chat(served.url, **_schema_format('{"type": "object"}'))
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "response_format" and "cannot read this model's tokenizer" in err["message"]
        r = _chat(served.url, logprobs=True, top_logprobs=2, max_tokens=3, temperature=0)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert content and all(c["bytes"] is None and c["token"] for c in content)
        assert httpx.get(f"{served.url}/health").status_code == 200
        assert len(calls) == 1
    finally:
        gen.close()


def test_a_failed_grammar_tokenizer_is_a_new_error_for_every_asker(tiny_model, monkeypatch):
    """One error object raised again and again would keep every raiser's frames in its traceback
    (a request's grammar among them): each asker gets an error of its own, from one build."""
    from kvtier.engine import structured
    from kvtier.engine.grammar_limits import GrammarError

    calls = []

    def refuse(hf, vocab):
        calls.append(vocab)
        raise ValueError("slow tokenizer")

    monkeypatch.setattr(structured, "_shared_tokenizer", refuse)
    grammars = structured.Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size)
    errors = [grammars.ready().exception(30) for _ in range(3)]
    for _ in range(2):
        with pytest.raises(GrammarError, match="cannot read this model's tokenizer") as raised:
            _ = grammars.tokenizer
        errors.append(raised.value)
    assert all(isinstance(e, GrammarError) for e in errors) and len({id(e) for e in errors}) == len(errors)
    assert len(calls) == 1


def test_waiters_share_one_grammar_tokenizer_build_and_a_cancelled_wait_cancels_nothing(tiny_model, monkeypatch,
                                                                                         caplog):
    """Every wait for the grammar tokenizer is answered by one build; asking for it while the
    build runs never blocks the asker (the event loop asks), and a wait given up is its own (no
    error settling it)."""
    from kvtier.engine import structured

    calls, started, gate = [], threading.Event(), threading.Event()
    build = structured._shared_tokenizer

    def held(hf, vocab):
        calls.append(vocab)
        started.set()
        gate.wait(60)
        return build(hf, vocab)

    monkeypatch.setattr(structured, "_shared_tokenizer", held)
    grammars = structured.Grammars(tiny_model.tokenizer, tiny_model.config.vocab_size)
    waits = [grammars.ready()]
    try:
        assert started.wait(30)  # the build runs, holding its lock
        asking = threading.Thread(target=lambda: waits.extend(grammars.ready() for _ in range(3)))
        asking.start()
        asking.join(20)  # far past any honest answer: a wait here is a blocked event loop
        assert not asking.is_alive() and len(waits) == 4 and not any(w.done() for w in waits)
        assert waits[0].cancel()  # a client gone before the build ended
    finally:
        gate.set()
    got = {id(w.result(60)) for w in waits[1:]}
    assert "exception calling callback" not in caplog.text
    assert len(got) == 1 and grammars.built and len(calls) == 1
    assert grammars.ready().result(0) is grammars.tokenizer  # built: answered at once


def test_a_stop_while_the_grammar_tokenizer_builds_closes_the_engine(tiny_model, monkeypatch):
    """A signal during the start's wait for the grammar tokenizer still stops the step loop and
    closes the engine (which drains its saves): the wait lies inside the lifespan's shutdown path."""
    from kvtier.engine import structured
    from kvtier.engine.config import EngineConfig
    from kvtier.engine.engine import Engine
    from kvtier.serve.app import create_app

    build, gate = structured._shared_tokenizer, threading.Event()
    monkeypatch.setattr(structured, "_shared_tokenizer", lambda hf, vocab: (gate.wait(60), build(hf, vocab))[1])
    engine = Engine(tiny_model, EngineConfig(kv_cache_bytes=16 << 20, max_model_len=256))
    closed = []
    monkeypatch.setattr(engine, "close", lambda: closed.append(True))
    app = create_app(engine)
    ctx = app.state.kvtier

    async def start_then_stop() -> None:
        starting = asyncio.ensure_future(app.router.lifespan_context(app).__aenter__())
        await asyncio.sleep(0.3)  # the build is held: the start waits for it
        assert not starting.done() and ctx.background is not None and ctx.background.alive
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting

    try:
        asyncio.run(start_then_stop())
    finally:
        gate.set()
    assert not ctx.background.alive and closed == [True]
    Engine.close(engine)
