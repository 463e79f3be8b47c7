"""`kvtier bench load`: many concurrent streaming chat clients against the OpenAI-compatible server.

Starts `kvtier serve` in a subprocess on a free loopback port (or targets `--url`), runs N clients
that each send streaming chat completions back to back for a fixed time, and reports requests/s,
TTFT p50/p99, tokens/s, errors, incomplete streams and the server's resident memory over the run.
Requests still in flight at the deadline are allowed to finish and are counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from kvtier.bench.load import conversations
from kvtier.bench.load.client import (
    QUESTIONS,
    LoadReport,
    StreamResult,
    auth_headers,
    one_stream,
    rss_mb,
    store_memory_mb,
)
from kvtier.bench.load.report import format_table
from kvtier.bench.load.server import ServerProcess
from kvtier.bench.stats import percentile


async def run_clients(url: str, model: str, clients: int, duration: float, max_tokens: int,
                      api_key: str | None, server_pid: int | None, report: LoadReport) -> list[StreamResult]:
    headers = auth_headers(api_key)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    timeout = httpx.Timeout(300.0, connect=10.0)
    results: list[StreamResult] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as client:
        warm = await one_stream(client, model, QUESTIONS[0], max_tokens, 0)  # first-call costs do not count
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        start = time.perf_counter()
        deadline = start + duration
        report.rss_start_mb = rss_mb(server_pid) if server_pid else None
        report.store_memory_start_mb = store_memory_mb(url, api_key)

        async def worker(i: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                question = QUESTIONS[(i * 7 + n) % len(QUESTIONS)]
                results.append(await one_stream(client, model, question, max_tokens, seed=i * 100_003 + n))
                n += 1

        async def sample_rss() -> None:
            while server_pid:
                value = rss_mb(server_pid)
                if value is not None:
                    report.rss_samples.append((round(time.perf_counter() - start, 1), round(value, 1)))
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample_rss())
        await asyncio.gather(*(worker(i) for i in range(clients)))
        report.elapsed_s = time.perf_counter() - start
        sampler.cancel()
        report.rss_end_mb = rss_mb(server_pid) if server_pid else None
        report.store_memory_end_mb = store_memory_mb(url, api_key)
    return results


def summarize(results: list[StreamResult], report: LoadReport) -> LoadReport:
    ok = [r for r in results if r.ok]
    report.requests = len(results)
    report.completed = len(ok)
    report.errors = sum(1 for r in results if r.error and r.error != "stream ended early")
    report.incomplete_streams = sum(1 for r in results if r.error == "stream ended early")
    report.error_samples = sorted({r.error for r in results if r.error})[:5]
    t = max(report.elapsed_s, 1e-9)
    report.requests_per_s = len(ok) / t
    report.tokens_per_s = sum(r.completion_tokens for r in ok) / t
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    p50, p99 = percentile(ttfts, 50), percentile(ttfts, 99)
    report.ttft_p50_ms = None if p50 is None else p50 * 1000
    report.ttft_p99_ms = None if p99 is None else p99 * 1000
    tbts = [(r.latency - r.ttft) / (r.completion_tokens - 1) for r in ok if r.ttft and r.completion_tokens > 1]
    report.tbt_mean_ms = sum(tbts) / len(tbts) * 1000 if tbts else None
    lat = percentile([r.latency for r in ok], 50)
    report.latency_p50_ms = None if lat is None else lat * 1000
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    report.cached_token_fraction = sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0
    if report.rss_samples:
        values = [v for _, v in report.rss_samples]
        report.rss_peak_mb = max(values + ([report.rss_end_mb] if report.rss_end_mb is not None else []))
        report.rss_mid_mb = values[len(values) // 2]
    return report


def _command_line() -> str:
    """How this run was started, as `kvtier bench load ...` (also when run as a module)."""
    argv = sys.argv[1:]
    if "load" in argv:
        argv = argv[argv.index("load") + 1:]
    return shlex.join(["kvtier", "bench", "load", *argv])


def run_load(args: argparse.Namespace) -> LoadReport:
    kw = dict(model=args.model, clients=args.clients, duration_s=args.duration, max_tokens=args.max_tokens,
              command=_command_line())
    conv = args.mode == "conversation"
    report = conversations.ConversationReport(**kw, turns=args.turns) if conv else LoadReport(**kw)
    server = None if args.url else ServerProcess.for_bench(args)
    try:
        if server is not None:
            server.wait_ready(args.startup_timeout)
        url = args.url or server.url  # type: ignore[union-attr]
        pid = server.proc.pid if server is not None else args.server_pid
        model = args.served_model_name or args.model
        if isinstance(report, conversations.ConversationReport):
            turns = asyncio.run(conversations.run_conversations(
                url, model, args.clients, args.duration, args.max_tokens, args.turns, args.sample_every,
                args.api_key, pid, report, args.history_tokens, args.document_words))
        else:
            results = asyncio.run(run_clients(url, model, args.clients, args.duration, args.max_tokens,
                                              args.api_key, pid, report))
    finally:
        if server is not None:
            server.stop()
    if isinstance(report, conversations.ConversationReport):
        return conversations.summarize(turns, report)
    return summarize(results, report)


def cmd_load(args: argparse.Namespace) -> int:
    report = run_load(args)
    passed = report.errors == 0 and report.incomplete_streams == 0
    if isinstance(report, conversations.ConversationReport):
        print(conversations.format_table(report))
        if args.plot:
            conversations.plot(report, args.plot)
            print(f"wrote {args.plot}")
        passed = all(v for k, v in report.verdict.items() if k in ("no_errors", "rss_flat", "tiers_within_caps"))
    else:
        print(format_table(report))
    if report.error_samples:
        print("errors seen:", *report.error_samples, sep="\n  ")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
        print(f"wrote {args.json}")
    return 0 if passed else 1
