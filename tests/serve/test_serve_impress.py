"""A server run with --restore-method impress: usage and /metrics say how much of a restored
prefix each request attended to, and nothing an importance restore computed is stored."""
from __future__ import annotations

import openai

from kvtier.engine.config import ImpressConfig, ReuseConfig
from kvtier.engine.impress.policy import ImpressPolicy

from serve_testlib import TINY, metric, metrics, serve


def test_usage_and_metrics_report_the_attended_prefix(tiny_model) -> None:
    reuse = ReuseConfig(method="impress", chunk_tokens=16, impress=ImpressConfig(ratio=0.25))
    for served in serve(tiny_model, store="memory:64MB", prefix_cache=False, reuse=reuse):
        client = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": "You are a careful assistant. " * 8}]
        usages, written = [], []
        for question in ("First question?", "Second question?"):
            messages.append({"role": "user", "content": question})
            resp = client.chat.completions.create(model=TINY, messages=messages, max_tokens=6, temperature=0)
            messages.append({"role": "assistant", "content": resp.choices[0].message.content})
            usages.append(resp.usage.prompt_tokens_details)
            assert served.engine.flush(30)
            written.append(served.engine.link.store.stats()["store"]["chunks_written"])
        first, second = usages
        assert first.cached_tokens == 0 and first.attended_prefix_tokens is None
        assert second.cached_tokens >= 32
        assert second.attended_prefix_tokens == ImpressPolicy.of(reuse.impress).kept(second.cached_tokens)
        s = metrics(served.url)
        assert metric(s, "kvtier:importance_prefix_tokens_attended_total") == second.attended_prefix_tokens
        assert metric(s, "kvtier:importance_prefix_tokens_skipped_total") == \
            second.cached_tokens - second.attended_prefix_tokens
        assert metric(s, "kvtier:prompt_tokens_reused_by_method_total", method="impress") == second.cached_tokens
        # The second turn's state was not saved: the store wrote the first turn's chunks only.
        assert written[0] > 0 and written[1] == written[0], written
