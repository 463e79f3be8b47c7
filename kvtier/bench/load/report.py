"""The load benchmark's table: one (metric, value) row per figure."""

from __future__ import annotations

from kvtier.bench.load.client import LoadReport
from kvtier.bench.report import markdown_table, mib, ms


def format_table(rep: LoadReport) -> str:
    rows = [
        ("model", rep.model), ("clients", str(rep.clients)),
        ("duration (s)", f"{rep.duration_s:.0f} (all requests done at {rep.elapsed_s:.1f})"),
        ("max_tokens", str(rep.max_tokens)), ("requests", str(rep.requests)),
        ("completed streams", str(rep.completed)), ("errors", str(rep.errors)),
        ("incomplete streams", str(rep.incomplete_streams)), ("requests/s", f"{rep.requests_per_s:.2f}"),
        ("generated tokens/s", f"{rep.tokens_per_s:.1f}"), ("TTFT p50", ms(rep.ttft_p50_ms)),
        ("TTFT p99", ms(rep.ttft_p99_ms)), ("TBT mean", ms(rep.tbt_mean_ms)),
        ("latency p50", ms(rep.latency_p50_ms)),
        ("prompt tokens cached", f"{rep.cached_token_fraction:.0%}"), ("server RSS start", mib(rep.rss_start_mb)),
        ("server RSS mid", mib(rep.rss_mid_mb)), ("server RSS end", mib(rep.rss_end_mb)),
        ("server RSS peak", mib(rep.rss_peak_mb)),
        ("store memory tier start", mib(rep.store_memory_start_mb)),
        ("store memory tier end", mib(rep.store_memory_end_mb)),
    ]
    return markdown_table(rows)
