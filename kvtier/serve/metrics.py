"""Prometheus metrics, in a registry of the app's own (several apps can live in one process).

Request-path metrics (latencies, tokens, reuse) are recorded as requests finish; engine and store
state (queue depth, KV blocks, store bytes, hits, evictions, dropped saves) is read when scraped,
so nothing has to be pushed from the engine thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.engine import Engine, RequestOutput

log = logging.getLogger("kvtier.serve")

# Latency buckets: from a warm decode step on a small model to a long prefill on a CPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# Paths we label by name; anything else is "other", so scanners cannot blow up cardinality.
KNOWN_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json", "/docs",
     "/tokenize", "/detokenize", "/version"}
)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.ttft = Histogram(
            "kvtier_time_to_first_token_seconds",
            "Request received to first generated token (includes tokenization and queueing)",
            ["endpoint"], buckets=_TTFT_BUCKETS, registry=r,
        )
        self.tbt = Histogram(
            "kvtier_time_between_tokens_seconds", "Time between consecutive generated tokens of a request",
            ["endpoint"], buckets=_TBT_BUCKETS, registry=r,
        )
        self.http_requests = Counter(
            "kvtier_http_requests", "HTTP requests by path and status code", ["path", "code"], registry=r
        )
        self.finished = Counter(
            "kvtier_requests_finished",
            "Generation requests by how they ended: stop, length, cancelled (client left), error",
            ["endpoint", "reason"], registry=r,
        )
        self.rejected = Counter(
            "kvtier_requests_rejected", "Requests turned away before reaching the engine (429: the queue was full)",
            ["reason"], registry=r,
        )
        self.prompt_tokens = Counter("kvtier_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvtier_generation_tokens", "Generated tokens", registry=r)
        self.reused_by_tier = Counter(
            "kvtier_prompt_tokens_reused",
            "Prompt tokens restored instead of computed, by the tier they came from", ["tier"], registry=r,
        )
        self.reused_by_method = Counter(
            "kvtier_prompt_tokens_reused_by_method",
            "Prompt tokens restored instead of computed, by restore method", ["method"], registry=r,
        )
        self.prompt_tokens_computed = Counter(
            "kvtier_prompt_tokens_computed", "Prompt tokens computed by prefill", registry=r
        )
        self.prefix_attended = Counter(
            "kvtier_importance_prefix_tokens_attended",
            "Stored prefix tokens restored by importance (impress) that each layer attended to", registry=r,
        )
        self.prefix_skipped = Counter(
            "kvtier_importance_prefix_tokens_skipped",
            "Stored prefix tokens an importance restore (impress) left out of attention", registry=r,
        )

    def attach(self, background: BackgroundEngine) -> None:
        self.registry.register(EngineCollector(background))

    def observe_finished(self, endpoint: str, out: RequestOutput) -> None:
        self.prompt_tokens.inc(out.prompt_tokens)
        self.generation_tokens.inc(len(out.output_ids))
        self.prompt_tokens_computed.inc(out.prompt_tokens_computed)
        for tier, n in out.reused_by_tier.items():
            self.reused_by_tier.labels(tier).inc(n)
        for method, n in reused_by_method(out).items():
            self.reused_by_method.labels(method).inc(n)
        attended = out.restore.prefix_attended if out.restore else None
        if attended is not None:
            restored = sum(n for tier, n in out.reused_by_tier.items() if tier != "device")
            self.prefix_attended.inc(attended)
            self.prefix_skipped.inc(max(restored - attended, 0))


def reused_by_method(out: RequestOutput) -> dict[str, int]:
    """Reused prompt tokens by how they came back: blocks still in the device prefix cache need no
    restore ("device_cache"); tokens from a store tier came back by the request's restore method."""
    by_method: dict[str, int] = {}
    for tier, n in out.reused_by_tier.items():
        if not n:
            continue
        method = "device_cache" if tier == "device" else (getattr(out, "restore_method", None) or "unknown")
        by_method[method] = by_method.get(method, 0) + n
    return by_method


def engine_store(engine: Engine) -> Any:
    """The engine's TieredStore when it runs with one, else None."""
    return engine.link.store


class EngineCollector(Collector):
    """Reads engine, pool and store state at scrape time (plain ints; safe across threads)."""

    def __init__(self, background: BackgroundEngine) -> None:
        self.background = background

    def collect(self) -> Iterator[Metric]:
        bg = self.background
        eng: Engine = bg.engine
        sched, pool = eng.scheduler, eng.pool
        yield _gauge("kvtier_queue_depth", "Requests waiting to be scheduled", len(sched.waiting))
        yield _gauge("kvtier_running_requests", "Requests in the running batch", len(sched.running))
        yield _gauge("kvtier_kv_blocks_free", "Free device KV blocks (cached ones included)", pool.num_free)
        yield _gauge("kvtier_kv_blocks_total", "Device KV blocks in the pool", pool.num_blocks)
        yield _counter("kvtier_prefix_cache_queries", "Full blocks looked up in the device prefix cache", pool.queries)
        yield _counter("kvtier_prefix_cache_hits", "Full blocks found in the device prefix cache", pool.hits)
        yield _counter("kvtier_preemptions", "Requests preempted for lack of KV blocks", sched.num_preemptions)
        yield _counter("kvtier_engine_steps", "Engine steps run", bg.steps)
        yield _counter("kvtier_engine_step_errors", "Engine steps that raised (their requests were failed)", bg.errors)
        yield _gauge("kvtier_engine_alive", "1 while the engine step loop runs", int(bg.alive))
        counters = eng.stats(with_store=False).counters
        yield _counter("kvtier_restores", "Requests whose prompt prefix was restored from the store",
                       counters.get("restores", 0))
        yield _counter("kvtier_restore_failures", "Store restores that failed (the prefix was recomputed)",
                       counters.get("restore_failures", 0))
        yield _counter("kvtier_saves", "Chunks of request state handed to the store's writer", counters.get("saves", 0))
        yield from _partial_metrics(eng)
        yield from _store_metrics(engine_store(eng))


def _partial_metrics(eng: Engine) -> Iterator[Metric]:
    """Partial token-wise caching (eLLM); zeros when it is off, so dashboards need no change."""
    st = eng.partial.summary() or {}
    yield _gauge("kvtier_partial_batch", "Decoding requests in the latest step (b)", st.get("last_b", 0))
    yield _gauge("kvtier_partial_uncached_ratio", "Uncached share of the latest step's decoding tokens (r)",
                 st.get("last_ratio", 0.0))
    yield _gauge("kvtier_partial_recomputed_layers", "Front layers recomputed in the latest step (the rest read back)",
                 st.get("last_boundary", 0))
    yield _counter("kvtier_partial_recomputed_tokens", "Uncached front tokens recomputed, summed over decode steps",
                   st.get("recomputed_tokens", 0))
    yield _counter("kvtier_partial_swapped_tokens", "Uncached front tokens read back from host memory, summed over steps",
                   st.get("swapped_tokens", 0))
    yield _counter("kvtier_partial_slo_misses", "Decode steps slower than the TPOT SLO", st.get("slo_misses", 0))
    yield _gauge("kvtier_partial_swap_bytes", "Host memory holding uncached fronts", st.get("swap_bytes", 0))


def _store_metrics(store: Any) -> Iterator[Metric]:
    """Store families are always exported (empty without a store) so dashboards need no change
    when one is attached. The store is duck-typed through `stats()` (TieredStore's shape)."""
    used = GaugeMetricFamily("kvtier_store_bytes", "Bytes held by each store tier", labels=["tier"])
    cap = GaugeMetricFamily("kvtier_store_capacity_bytes", "Capacity of each store tier", labels=["tier"])
    hits = CounterMetricFamily("kvtier_store_hits", "Chunk reads served by each tier", labels=["tier"])
    misses = CounterMetricFamily("kvtier_store_misses", "Chunk reads each tier could not serve", labels=["tier"])
    evictions = CounterMetricFamily("kvtier_store_evictions", "Chunks evicted from each tier", labels=["tier"])
    put_errors = CounterMetricFamily(
        "kvtier_store_put_errors", "Chunk writes a tier failed or refused (full, read-only, unreachable)", labels=["tier"]
    )
    corrupt = CounterMetricFamily("kvtier_store_corrupt", "Chunks found corrupt and removed", labels=["tier"])
    errors = CounterMetricFamily(
        "kvtier_store_errors", "Tier calls refused or failed otherwise (permissions, wrong key types, junk index "
        "entries): each a miss", labels=["tier"],
    )
    unavailable = CounterMetricFamily(
        "kvtier_store_unavailable", "Calls to a remote tier that failed or were skipped while it was unreachable",
        labels=["tier"],
    )
    up = GaugeMetricFamily("kvtier_store_tier_up", "1 while a tier is reachable, 0 during an outage", labels=["tier"])
    dropped = CounterMetricFamily("kvtier_store_dropped_saves", "Saves dropped because the writer queue was full")
    queue = GaugeMetricFamily("kvtier_store_write_queue_depth", "Saves waiting in the asynchronous writer")
    written = CounterMetricFamily("kvtier_store_chunks_written", "Chunks the writer stored")
    skipped = CounterMetricFamily(
        "kvtier_store_chunks_skipped", "Chunks not stored because the state of their first tokens was not at hand"
    )
    lookup_errors = CounterMetricFamily(
        "kvtier_store_lookup_errors", "Store lookups that raised despite the tiers' own guards (each a miss)"
    )
    stats: dict[str, Any] | None = None
    if store is not None and hasattr(store, "stats"):
        try:
            stats = store.stats()
        except Exception:  # a scrape must never fail because a tier is unreachable
            log.warning("could not read store stats for /metrics", exc_info=True)
    if stats:
        for name, t in (stats.get("tiers") or {}).items():
            used.add_metric([name], t.get("bytes_used") or 0)
            cap.add_metric([name], t.get("capacity") or 0)
            hits.add_metric([name], t.get("hits", 0))
            misses.add_metric([name], t.get("misses", 0))
            evictions.add_metric([name], t.get("evictions", 0))
            put_errors.add_metric([name], t.get("put_errors", 0))
            corrupt.add_metric([name], t.get("corrupt", 0))
            errors.add_metric([name], t.get("errors", 0))
            unavailable.add_metric([name], t.get("unavailable", 0))
            up.add_metric([name], float(t.get("up", True)))
        writer = stats.get("writer") or {}
        dropped.add_metric([], writer.get("dropped_saves", 0))
        queue.add_metric([], writer.get("queue_depth", 0))
        counters = stats.get("store") or {}
        written.add_metric([], counters.get("chunks_written", 0))
        skipped.add_metric([], counters.get("chunks_skipped", 0))
        lookup_errors.add_metric([], counters.get("lookup_errors", 0))
    yield from (used, cap, hits, misses, evictions, put_errors, corrupt, errors, unavailable, up, dropped, queue,
                written, skipped, lookup_errors)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
