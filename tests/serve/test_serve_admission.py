"""Admission under overload: beyond the running batch plus --max-queued-requests, a request gets 429
with Retry-After in OpenAI's error shape (counted in /metrics) instead of waiting without bound."""

from __future__ import annotations

import contextlib
import threading
import time

import openai
import pytest

from serve_testlib import TINY, metric, metrics, serve


def test_full_queue_answers_429_with_retry_after_and_recovers(tiny_model):
    with contextlib.contextmanager(serve)(tiny_model, max_num_seqs=1, max_queued_requests=1) as s:
        gate = threading.Event()
        step = s.engine.step
        s.engine.step = lambda: gate.wait(60) and step()  # hold the engine: admitted requests stay in flight
        client = openai.OpenAI(base_url=s.v1, api_key="unused", max_retries=0, timeout=60)
        body = dict(model=TINY, messages=[{"role": "user", "content": "hold"}], max_tokens=4, temperature=0)
        answers: list = []
        held = [threading.Thread(target=lambda: answers.append(client.chat.completions.create(**body)))
                for _ in range(2)]  # one running + one queued = the limit
        for t in held:
            t.start()
        deadline = time.monotonic() + 30
        while s.in_flight < 2:
            assert time.monotonic() < deadline, s.in_flight
            time.sleep(0.02)

        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(**body)
        assert e.value.status_code == 429
        assert e.value.response.headers["retry-after"] == "1"
        err = e.value.response.json()["error"]
        assert err["code"] == "too_many_requests" and err["type"] == "rate_limit_error" and "capacity" in err["message"]
        assert metric(metrics(s.url), "kvtier:requests_rejected_total", reason="queue_full") == 1

        gate.set()  # the engine runs again: the held requests finish and their slots come back
        for t in held:
            t.join(60)
        assert len(answers) == 2 and all(a.choices[0].finish_reason for a in answers)
        assert client.chat.completions.create(**body).choices[0].message is not None
        assert s.in_flight == 0
