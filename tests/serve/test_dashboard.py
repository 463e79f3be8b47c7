"""The Grafana dashboard queries what the server exports, and the vLLM-shaped metrics hold the
values they claim: one served conversation restored from a memory tier, scraped once."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvtier.serve.config import ServeConfig

from serve_testlib import Served, serve

DASHBOARD = Path(__file__).resolve().parents[2] / "dashboards" / "kvtier.json"
NAME = "kvtier-test"  # the served model name: what every family's model_name label says
STATS_INTERVAL = 0.05


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@dataclass
class Run:
    served: Served
    text: str  # the /metrics exposition after the conversation
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached: list[int]
    stats: _Lines
    idle_lines: int  # stats lines logged while the server sat idle


@pytest.fixture(scope="module")
def run(tiny_model) -> Iterator[Run]:
    stats = _Lines()
    logger = logging.getLogger("kvtier.stats")
    logger.addHandler(stats)
    level = logger.level
    logger.setLevel(logging.INFO)
    config = ServeConfig(served_model_name=NAME, default_max_tokens=8, stats_interval_s=STATS_INTERVAL)
    try:
        for served in serve(tiny_model, store="memory:64MB", prefix_cache=False, config=config):
            client = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0)
            # Long enough that the stored prefix passes the engine's minimum worth restoring.
            messages = [{"role": "system", "content": "You are a careful assistant. " * 8}]
            prompt, completion, cached = [], [], []
            for question in ("First question?", "Second question?"):
                messages.append({"role": "user", "content": question})
                resp = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
                messages.append({"role": "assistant", "content": resp.choices[0].message.content})
                assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
                prompt.append(resp.usage.prompt_tokens)
                completion.append(resp.usage.completion_tokens)
                cached.append(resp.usage.prompt_tokens_details.cached_tokens or 0)
                assert served.engine.flush(30)  # this turn's saves are stored before the next
            # past the interval that saw the last tokens, with room for a late logger on a busy machine
            time.sleep(max(3 * STATS_INTERVAL, 1.0))
            before = len(stats.lines)
            time.sleep(3 * STATS_INTERVAL)
            idle = len(stats.lines) - before
            text = httpx.get(served.url + "/metrics", timeout=30).text
            yield Run(served, text, prompt, completion, cached, stats, idle)
    finally:
        logger.removeHandler(stats)
        logger.setLevel(level)


def _samples(text: str) -> dict[str, list]:
    """{sample name: its samples} of the kvtier families."""
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvtier:"):
                out.setdefault(s.name, []).append(s)
    return out


def _types(text: str) -> dict[str, str]:
    """{sample name: the type of its family} (a histogram's _bucket, _sum and _count; a counter's _total)."""
    return {s.name: fam.type for fam in text_string_to_metric_families(text) for s in fam.samples}


def _value(samples: dict[str, list], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(s.value for s in samples.get(name, []) if labels.items() <= s.labels.items())


def _exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_exported_metrics(run: Run) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    var = {v["name"]: v for v in dash["templating"]["list"]}["model_name"]
    exprs = _exprs(dash)
    assert len(dash["panels"]) >= 12 and len(exprs) >= 30
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${DS_PROMETHEUS}" and p["targets"], p["title"]
    types = _types(run.text)
    samples = _samples(run.text)
    queried = set(re.findall(r"kvtier:[A-Za-z0-9_:]+", var["query"]["query"]))
    for expr in exprs:
        assert 'model_name="$model_name"' in expr, expr
        names = re.findall(r"kvtier:[A-Za-z0-9_:]+", expr)
        assert names, expr
        queried.update(names)
        # rate() only over counters and histogram series; a gauge under rate() is a dashboard bug.
        for name in re.findall(r"rate\((kvtier:[A-Za-z0-9_:]+)", expr):
            assert types.get(name) in ("counter", "histogram"), (name, types.get(name))
        if "_bucket" in expr:
            assert "histogram_quantile" in expr, expr
    for name in sorted(queried):
        # The exact sample name (histograms' _bucket/_sum/_count, counters' _total) has samples,
        # labelled with the served name.
        assert name in samples, f"{name} is queried but not exported"
        assert {s.labels.get("model_name") for s in samples[name]} == {NAME}, name
    # vLLM's Grafana dashboard queries these; with the prefix swapped they all resolve.
    vllm_names = {"time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                  "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                  "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                  "request_inference_time_seconds_bucket", "time_per_output_token_seconds_bucket",
                  "request_time_per_output_token_seconds_bucket", "request_prompt_tokens_bucket",
                  "request_generation_tokens_bucket", "prompt_tokens_total", "generation_tokens_total",
                  "request_success_total", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"}
    assert {n for n in vllm_names if "kvtier:" + n not in samples} == set()


def test_every_family_is_prefixed_and_labelled(run: Run) -> None:
    families = [f for f in text_string_to_metric_families(run.text) if not f.name.endswith("_created")]
    assert families and all(f.name.startswith("kvtier:") for f in families)
    assert not re.search(r"^kvtier_", run.text, re.M)
    for fam in families:
        for s in fam.samples:
            assert s.labels.get("model_name") == NAME, s


def test_request_metrics_count_the_requests(run: Run) -> None:
    s = _samples(run.text)
    n = len(run.prompt_tokens)
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):
        assert _value(s, f"kvtier:{hist}_count") == n, hist
    assert _value(s, "kvtier:request_prompt_tokens_sum") == sum(run.prompt_tokens)
    assert _value(s, "kvtier:request_generation_tokens_sum") == sum(run.completion_tokens)
    assert _value(s, "kvtier:prompt_tokens_total") == sum(run.prompt_tokens)
    assert _value(s, "kvtier:generation_tokens_total") == sum(run.completion_tokens)
    # Each token after a request's first is one inter-token gap (and the older name sees the same).
    gaps = sum(c - 1 for c in run.completion_tokens)
    assert _value(s, "kvtier:inter_token_latency_seconds_count") == gaps
    assert _value(s, "kvtier:time_per_output_token_seconds_count") == gaps
    assert _value(s, "kvtier:request_success_total", endpoint="chat") == n
    assert _value(s, "kvtier:request_success_total", finished_reason="length") + \
        _value(s, "kvtier:request_success_total", finished_reason="stop") == n
    # Prefill and decode split the inference time; the queue comes before both, within TTFT.
    inference = _value(s, "kvtier:request_inference_time_seconds_sum")
    assert inference == pytest.approx(_value(s, "kvtier:request_prefill_time_seconds_sum")
                                      + _value(s, "kvtier:request_decode_time_seconds_sum"))
    assert _value(s, "kvtier:request_queue_time_seconds_sum") + inference <= \
        _value(s, "kvtier:e2e_request_latency_seconds_sum")
    assert _value(s, "kvtier:requests_rejected_total", reason="queue_full") == 0


def test_restore_and_store_metrics_match_the_store(run: Run) -> None:
    s = _samples(run.text)
    engine = run.served.engine
    assert run.cached[0] == 0 and run.cached[1] > 0, run.cached
    # One restore (the second turn), by the kv method from the memory tier.
    assert _value(s, "kvtier:restore_duration_seconds_count", method="kv", tier="memory") == 1
    assert _value(s, "kvtier:restore_duration_seconds_count") == 1
    assert _value(s, "kvtier:restore_duration_seconds_sum") > 0
    assert _value(s, "kvtier:restores_total") == 1
    assert _value(s, "kvtier:prompt_tokens_reused_total", tier="memory") == run.cached[1]
    assert _value(s, "kvtier:prompt_tokens_computed_total") == sum(run.prompt_tokens) - run.cached[1]
    tier = engine.link.store.stats()["tiers"]["memory"]
    assert tier["bytes_written"] > 0 and tier["bytes_read"] > 0
    assert _value(s, "kvtier:store_written_bytes_total", tier="memory") == tier["bytes_written"]
    assert _value(s, "kvtier:store_read_bytes_total", tier="memory") == tier["bytes_read"]
    # Idle after the run: nothing running or waiting, no block in use (no prefix cache to hold any).
    assert _value(s, "kvtier:num_requests_running") == 0 and _value(s, "kvtier:num_requests_waiting") == 0
    assert _value(s, "kvtier:kv_cache_usage_perc") == 0.0
    pool = engine.pool
    assert _value(s, "kvtier:prefix_cache_queries_total") == pool.queries * pool.block_size


def test_stats_log_lines_while_busy_only(run: Run) -> None:
    shape = re.compile(r"Avg prompt throughput: \d+\.\d tokens/s, Avg generation throughput: \d+\.\d tokens/s, "
                       r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: \d+\.\d%, Reuse: (-|device \d+% / "
                       r"memory \d+% / computed \d+%)")
    assert run.stats.lines, "no stats line while serving"
    for line in run.stats.lines:
        assert shape.fullmatch(line), line
    assert any("memory 0%" not in line and "Reuse: -" not in line for line in run.stats.lines)  # the restore shows
    assert run.idle_lines == 0
