"""Prometheus metrics, in a registry of the app's own (several apps can live in one process).

Names follow vLLM's where a metric means what vLLM's means, under the `kvtier:` prefix and with
the same `model_name` label (`vllm:time_to_first_token_seconds` is `kvtier:time_to_first_token_seconds`),
so vLLM's Grafana dashboards port by swapping the prefix; kvtier's own families (restores, tiers,
store) use the same prefix and label. docs/serve.md has the table and the mapping.

Request-path metrics (latencies, tokens, reuse) are recorded as tokens arrive and requests finish;
engine and store state (queue depth, KV blocks, store bytes, hits, evictions, dropped saves) is
read when scraped, so nothing has to be pushed from the engine thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtier.engine.background import BackgroundEngine
from kvtier.engine.engine import Engine, RequestOutput

log = logging.getLogger("kvtier.serve")

PREFIX = "kvtier:"

# Latency buckets: from a warm decode step on a small model to a long prefill on a CPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# Whole-request phases (queue, prefill, decode, end to end): milliseconds to many minutes.
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A restore: a memory-tier copy of a few chunks to a long prefix read from a remote tier.
_RESTORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

# Paths we label by name; anything else is "other", so scanners cannot blow up cardinality.
KNOWN_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/openapi.json", "/docs",
     "/tokenize", "/detokenize", "/version"}
)
# Where reused prompt tokens came from, in the order a restore looks (the store's tiers after "device").
TIER_ORDER = ("device", "memory", "disk", "redis")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to the context window (vLLM's build_1_2_5_buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


def tier_rank(tier: str) -> tuple[int, str]:
    return (TIER_ORDER.index(tier) if tier in TIER_ORDER else len(TIER_ORDER), tier)


def restore_tier(reused_by_tier: dict[str, int]) -> str:
    """The store tier(s) a restore read from, as one label value ("memory", "disk+redis"); "none"
    when the output names no store tier."""
    tiers = sorted((t for t, n in reused_by_tier.items() if n and t != "device"), key=tier_rank)
    return "+".join(tiers) or "none"


@dataclass
class Totals:
    """Plain running totals beside the Prometheus counters, for the periodic stats log (read on
    the event loop, where they are written)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tokens_computed: int = 0  # of finished requests
    reused_by_tier: dict[str, int] = field(default_factory=dict)  # of finished requests


class ServerMetrics:
    """The request-path families. Every family carries `model_name` (the served name)."""

    def __init__(self, model_name: str = "", max_model_len: int = 2048) -> None:
        self.model_name = model_name
        self.totals = Totals()
        self.registry = CollectorRegistry(auto_describe=True)
        self._add_histograms(max_model_len)
        self._add_counters()

    # Every family lives in this app's own registry and is labelled by `model_name` first, as vLLM's are.
    def _hist(self, name: str, doc: str, labels: Sequence[str], buckets: Sequence[float]) -> Histogram:
        return Histogram(PREFIX + name, doc, ["model_name", *labels], buckets=buckets, registry=self.registry)

    def _counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name", *labels], registry=self.registry)

    def _add_histograms(self, max_model_len: int) -> None:
        """Per-request distributions: latencies, phases, sizes and restore times."""
        hist = self._hist
        self.ttft = hist("time_to_first_token_seconds",
                         "Request received to first generated token (includes tokenization and queueing)",
                         ["endpoint"], _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive generated tokens of a request",
                        ["endpoint"], _TBT_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds",
                         "Same observations as inter_token_latency_seconds (vLLM's older name for it)",
                         ["endpoint"], _TBT_BUCKETS)
        self.request_tpot = hist("request_time_per_output_token_seconds",
                                 "Per request: its decode time over its generated tokens after the first",
                                 ["endpoint"], _TBT_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request received to its last token",
                        ["endpoint"], _REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Engine arrival to first scheduled (waiting)",
                               ["endpoint"], _REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token (restore and prefill)",
                                 ["endpoint"], _REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to last token", ["endpoint"],
                                _REQUEST_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds", "First scheduled to last token (prefill + decode)",
                                   ["endpoint"], _REQUEST_BUCKETS)
        tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per finished request", [], tokens)
        self.request_generation_tokens = hist("request_generation_tokens",
                                              "Generated tokens per finished request (all its samples)", [], tokens)
        self.restore_duration = hist(
            "restore_duration_seconds",
            "A restore from the store: its start to the end of the first step of the request's new tokens",
            ["method", "tier"], _RESTORE_BUCKETS)

    def _add_counters(self) -> None:
        """Running totals: HTTP answers, finished and rejected requests, tokens by where they came from."""
        counter = self._counter
        self.http_requests = counter("http_requests", "HTTP requests by path and status code", ["path", "code"])
        self.request_success = counter(
            "request_success",
            "Generation requests by how they ended: stop, length, abort (client left), error (engine failed)",
            ["endpoint", "finished_reason"])
        self.rejected = counter("requests_rejected",
                                "Requests turned away before reaching the engine (429: the queue was full)", ["reason"])
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed (counted at each request's first token)")
        self.generation_tokens = counter("generation_tokens", "Generated tokens (counted as they are streamed)")
        self.reused_by_tier = counter("prompt_tokens_reused",
                                      "Prompt tokens restored instead of computed, by the tier they came from", ["tier"])
        self.reused_by_method = counter("prompt_tokens_reused_by_method",
                                        "Prompt tokens restored instead of computed, by restore method", ["method"])
        self.prompt_tokens_computed = counter("prompt_tokens_computed", "Prompt tokens computed by prefill")
        self.prefix_attended = counter(
            "importance_prefix_tokens_attended",
            "Stored prefix tokens restored by importance (impress) that each layer attended to")
        self.prefix_skipped = counter(
            "importance_prefix_tokens_skipped", "Stored prefix tokens an importance restore (impress) left out of attention")
        for plain in (self.prompt_tokens, self.generation_tokens, self.prompt_tokens_computed, self.prefix_attended,
                      self.prefix_skipped):
            plain.labels(self.model_name)  # exported as 0 from the start, so rate() has a first point
        self.rejected.labels(self.model_name, "queue_full")

    def attach(self, background: BackgroundEngine) -> None:
        self.registry.register(EngineCollector(background, self.model_name))

    # ----- recorded on the event loop -------------------------------------------------------
    def count_http(self, path: str, code: int) -> None:
        self.http_requests.labels(self.model_name, path, str(code)).inc()

    def count_rejected(self, reason: str) -> None:
        self.rejected.labels(self.model_name, reason).inc()

    def count_finish(self, endpoint: str, reason: str) -> None:
        self.request_success.labels(self.model_name, endpoint, reason).inc()

    def first_token(self, endpoint: str, ttft: float, prompt_tokens: int) -> None:
        """A request's first token (whichever sample drew it): its prompt has been processed."""
        self.ttft.labels(self.model_name, endpoint).observe(ttft)
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.totals.prompt_tokens += prompt_tokens

    def generated(self, endpoint: str, n: int, gap: float | None) -> None:
        """`n` tokens of one sample arrived, `gap` seconds apart (None: its first ones)."""
        self.generation_tokens.labels(self.model_name).inc(n)
        self.totals.generation_tokens += n
        if gap is not None:
            itl, tpot = self.itl.labels(self.model_name, endpoint), self.tpot.labels(self.model_name, endpoint)
            for _ in range(n):
                itl.observe(gap)
                tpot.observe(gap)

    def observe_finished(self, endpoint: str, out: RequestOutput, e2e: float, generation_tokens: int) -> None:
        """A request that ended by stop or length: `out` is its sample 0 (which computed or restored
        the prompt; the others forked from it), `generation_tokens` those of all its samples."""
        name = self.model_name
        self.e2e.labels(name, endpoint).observe(e2e)
        self.request_prompt_tokens.labels(name).observe(out.prompt_tokens)
        self.request_generation_tokens.labels(name).observe(generation_tokens)
        decode = out.mean_tbt * (len(out.output_ids) - 1) if out.mean_tbt is not None else 0.0
        if out.queue_time is not None:
            self.queue_time.labels(name, endpoint).observe(out.queue_time)
            if out.ttft is not None:
                prefill = max(out.ttft - out.queue_time, 0.0)
                self.prefill_time.labels(name, endpoint).observe(prefill)
                self.decode_time.labels(name, endpoint).observe(decode)
                self.inference_time.labels(name, endpoint).observe(prefill + decode)
        if out.mean_tbt is not None:
            self.request_tpot.labels(name, endpoint).observe(out.mean_tbt)
        self.prompt_tokens_computed.labels(name).inc(out.prompt_tokens_computed)
        self.totals.prompt_tokens_computed += out.prompt_tokens_computed
        for tier, n in out.reused_by_tier.items():
            self.reused_by_tier.labels(name, tier).inc(n)
            self.totals.reused_by_tier[tier] = self.totals.reused_by_tier.get(tier, 0) + n
        for method, n in reused_by_method(out).items():
            self.reused_by_method.labels(name, method).inc(n)
        if out.restore is not None:
            self.restore_duration.labels(name, out.restore.method, restore_tier(out.reused_by_tier)).observe(
                out.restore.seconds)
        attended = out.restore.prefix_attended if out.restore else None
        if attended is not None:
            restored = sum(n for tier, n in out.reused_by_tier.items() if tier != "device")
            self.prefix_attended.labels(name).inc(attended)
            self.prefix_skipped.labels(name).inc(max(restored - attended, 0))


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


class EngineCollector(Collector):
    """Reads engine, pool and store state at scrape time (plain ints; safe across threads)."""

    def __init__(self, background: BackgroundEngine, model_name: str) -> None:
        self.background = background
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        bg, name = self.background, self.model_name
        eng: Engine = bg.engine
        st = eng.stats(with_store=False)  # the store's own statistics come through store_metrics

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        yield gauge("num_requests_waiting", "Requests waiting to be scheduled", st.waiting)
        yield gauge("num_requests_running", "Requests in the running batch", st.running)
        yield gauge("kv_cache_usage_perc", "Share of device KV blocks in use (1 means 100 percent)", st.kv_usage)
        yield gauge("kv_blocks_free", "Free device KV blocks (cached ones included)", st.kv_blocks_free)
        yield gauge("kv_blocks_total", "Device KV blocks in the pool", st.kv_blocks_total)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the device prefix cache (in full blocks)",
                      st.prefix_cache_queries * st.block_size)
        yield counter("prefix_cache_hits", "Prompt tokens found in the device prefix cache (in full blocks)",
                      st.prefix_cache_hits * st.block_size)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks", st.preemptions)
        yield counter("engine_steps", "Engine steps run", bg.steps)
        yield counter("engine_step_errors", "Engine steps that raised (their requests were failed)", bg.errors)
        yield gauge("engine_alive", "1 while the engine step loop runs", int(bg.alive))
        counters = st.counters
        yield counter("restores", "Requests whose prompt prefix was restored from the store", counters.get("restores", 0))
        yield counter("restore_failures", "Store restores that failed (the prefix was recomputed)",
                      counters.get("restore_failures", 0))
        yield counter("saves", "Chunks of request state handed to the store's writer", counters.get("saves", 0))
        partial = st.partial or {}  # partial token-wise caching; zeros when it is off
        yield gauge("partial_batch", "Decoding requests in the latest step (b)", partial.get("last_b", 0))
        yield gauge("partial_uncached_ratio", "Uncached share of the latest step's decoding tokens (r)",
                    partial.get("last_ratio", 0.0))
        yield gauge("partial_recomputed_layers", "Front layers recomputed in the latest step (the rest read back)",
                    partial.get("last_boundary", 0))
        yield counter("partial_recomputed_tokens", "Uncached front tokens recomputed, summed over decode steps",
                      partial.get("recomputed_tokens", 0))
        yield counter("partial_swapped_tokens", "Uncached front tokens read back from host memory, summed over steps",
                      partial.get("swapped_tokens", 0))
        yield counter("partial_slo_misses", "Decode steps slower than the TPOT SLO", partial.get("slo_misses", 0))
        yield gauge("partial_swap_bytes", "Host memory holding uncached fronts", partial.get("swap_bytes", 0))
        yield from store_metrics(eng.store, name)


# Per-tier families: (name, kind, doc, the key in the tier's stats(), default).
_TIER_FAMILIES: tuple[tuple[str, str, str, str, float], ...] = (
    ("store_bytes", "gauge", "Bytes held by each store tier", "bytes_used", 0),
    ("store_capacity_bytes", "gauge", "Capacity of each store tier", "capacity", 0),
    ("store_read_bytes", "counter", "Chunk bytes read from each tier", "bytes_read", 0),
    ("store_written_bytes", "counter", "Chunk bytes written to each tier", "bytes_written", 0),
    ("store_hits", "counter", "Chunk reads served by each tier", "hits", 0),
    ("store_misses", "counter", "Chunk reads each tier could not serve", "misses", 0),
    ("store_evictions", "counter", "Chunks evicted from each tier", "evictions", 0),
    ("store_put_errors", "counter", "Chunk writes a tier failed or refused (full, read-only, unreachable)",
     "put_errors", 0),
    ("store_corrupt", "counter", "Chunks found corrupt and removed", "corrupt", 0),
    ("store_errors", "counter", "Tier calls refused or failed otherwise (permissions, wrong key types, junk index "
     "entries): each a miss", "errors", 0),
    ("store_unavailable", "counter", "Calls to a remote tier that failed or were skipped while it was unreachable",
     "unavailable", 0),
    ("store_tier_up", "gauge", "1 while a tier is reachable, 0 during an outage", "up", 1),
)
# Store-wide families: (name, kind, doc, section of stats(), key).
_STORE_FAMILIES: tuple[tuple[str, str, str, str, str], ...] = (
    ("store_dropped_saves", "counter", "Saves dropped because the writer queue was full", "writer", "dropped_saves"),
    ("store_write_queue_depth", "gauge", "Saves waiting in the asynchronous writer", "writer", "queue_depth"),
    ("store_writer_busy", "gauge", "1 while the asynchronous writer is writing a job (a save, a promotion, a "
     "reorder), else 0", "writer", "writing"),
    ("store_chunks_written", "counter", "Chunks the writer stored", "store", "chunks_written"),
    ("store_chunks_skipped", "counter", "Chunks not stored because the state of their first tokens was not at hand",
     "store", "chunks_skipped"),
    ("store_lookup_errors", "counter", "Store lookups that raised despite the tiers' own guards (each a miss)",
     "store", "lookup_errors"),
)


def store_metrics(store: Any, model_name: str) -> Iterator[Metric]:
    """Store families are always exported (empty without a store) so dashboards need no change
    when one is attached. The store is duck-typed through `stats()` (TieredStore's shape)."""
    stats: dict[str, Any] | None = None
    if store is not None and hasattr(store, "stats"):
        try:
            stats = store.stats()
        except Exception:  # a scrape must never fail because a tier is unreachable
            log.warning("could not read store stats for /metrics", exc_info=True)
    tiers: dict[str, dict[str, Any]] = (stats or {}).get("tiers") or {}
    for metric, kind, doc, key, default in _TIER_FAMILIES:
        fam = _family(kind, metric, doc, ["model_name", "tier"])
        for tier, t in tiers.items():
            value = t.get(key)
            fam.add_metric([model_name, tier], float(default if value is None else value))
        yield fam
    for metric, kind, doc, section, key in _STORE_FAMILIES:
        fam = _family(kind, metric, doc, ["model_name"])
        if stats:
            fam.add_metric([model_name], (stats.get(section) or {}).get(key, 0))
        yield fam


def _family(kind: str, metric: str, doc: str, labels: list[str]) -> GaugeMetricFamily | CounterMetricFamily:
    cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
    return cls(PREFIX + metric, doc, labels=labels)
