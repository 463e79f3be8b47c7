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
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

# A shared system prompt (as real deployments have) and varied questions: some prefix reuse,
# mostly fresh work.
SYSTEM = "You are a concise assistant. Answer in one or two sentences."
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Name three prime numbers.",
    "What does a CPU cache do?", "How do bees make honey?", "What is the boiling point of water?",
    "Who wrote Hamlet?", "What is photosynthesis?", "Explain gravity to a child.",
    "What is the largest ocean?", "How many legs does a spider have?", "What is an API?",
    "Why do leaves change color in autumn?", "What is the speed of light?", "What is a black hole?",
    "How does a refrigerator keep food cold?",
]


@dataclass
class StreamResult:
    ok: bool  # HTTP 200, no error event, finish_reason, usage and [DONE] all seen
    status: int | None
    error: str | None
    ttft: float | None  # request sent -> first content token
    latency: float
    completion_tokens: int
    cached_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class LoadReport:
    model: str
    clients: int
    duration_s: float
    max_tokens: int
    elapsed_s: float = 0.0
    requests: int = 0
    completed: int = 0
    errors: int = 0
    incomplete_streams: int = 0
    requests_per_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tbt_mean_ms: float | None = None
    latency_p50_ms: float | None = None
    cached_token_fraction: float = 0.0
    rss_start_mb: float | None = None
    rss_mid_mb: float | None = None
    rss_end_mb: float | None = None
    rss_peak_mb: float | None = None
    # The store's memory tier lives in the server process: RSS growth up to its capacity is the
    # store filling, by design. These let the report separate that from anything else.
    store_memory_start_mb: float | None = None
    store_memory_end_mb: float | None = None
    error_samples: list[str] = field(default_factory=list)
    rss_samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds into run, MiB)
    command: str = ""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(min(rank, len(ordered))) - 1]


def store_memory_mb(client_url: str, api_key: str | None = None) -> float | None:
    """Bytes in the server's memory store tier, from its /metrics (None without a store)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(client_url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvtier_store_bytes" and sample.labels.get("tier") == "memory":
                return sample.value / (1 << 20)
    return None


def rss_mb(pid: int) -> float | None:
    """Resident set size of a process in MiB (Linux /proc; None elsewhere or when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def one_stream(client: httpx.AsyncClient, model: str, question: str, max_tokens: int, seed: int) -> StreamResult:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return (await stream_chat(client, model, messages, max_tokens, seed))[0]


async def stream_chat(client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], max_tokens: int,
                      seed: int) -> tuple[StreamResult, str]:
    """One streaming chat completion; -> (its result, the answer's text)."""
    body = {
        "model": model, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": max_tokens,
        "temperature": 0.7, "seed": seed, "messages": messages,
    }
    t0 = time.perf_counter()
    ttft = None
    finish = usage = done = False
    tokens = cached = prompt = 0
    text: list[str] = []
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                why = (await resp.aread()).decode(errors="replace")[:200]
                return StreamResult(False, resp.status_code, f"HTTP {resp.status_code}: {why}", None,
                                    time.perf_counter() - t0, 0, 0), ""
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return StreamResult(False, 200, f"error event: {chunk['error'].get('message')}", ttft,
                                        time.perf_counter() - t0, 0, 0), ""
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        text.append(choice["delta"]["content"])
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                    finish = finish or choice.get("finish_reason") is not None
                if chunk.get("usage"):
                    usage = True
                    tokens = chunk["usage"]["completion_tokens"]
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                    prompt = chunk["usage"]["prompt_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        return StreamResult(False, None, f"{type(e).__name__}: {e}", ttft, time.perf_counter() - t0, 0, 0), ""
    latency = time.perf_counter() - t0
    ok = finish and usage and done
    result = StreamResult(ok, 200, None if ok else "stream ended early", ttft or latency, latency, tokens, cached, prompt)
    return result, "".join(text)


async def run_clients(url: str, model: str, clients: int, duration: float, max_tokens: int,
                      api_key: str | None, server_pid: int | None, report: LoadReport) -> list[StreamResult]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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
        report.store_memory_start_mb = store_memory_mb(url)

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
        report.store_memory_end_mb = store_memory_mb(url)
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


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f} MiB"


def markdown_table(rows: list[tuple[str, str]]) -> str:
    """A two-column (metric, value) markdown table."""
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    return "\n".join(lines + [f"| {k.ljust(width)} | {v} |" for k, v in rows])


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


class ServerProcess:
    """`python -m kvtier.serve ARGS` on a free loopback port; output goes to a log file."""

    def __init__(self, serve_args: list[str], env: dict[str, str] | None = None) -> None:
        from kvtier.serve.server import free_port

        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvtier-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "kvtier.serve", "--port", str(self.port), *serve_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"

    @classmethod
    def for_bench(cls, args: argparse.Namespace) -> "ServerProcess":
        serve_args = ["--model", args.model, "--dtype", args.dtype, "--log-level", "warning",
                      "--kv-cache-gb", str(args.kv_cache_gb), "--max-num-seqs", str(args.max_num_seqs)]
        if args.store:
            serve_args += ["--store", args.store]
        if args.no_prefix_cache:
            serve_args += ["--no-prefix-cache"]
        if args.restore_method:
            serve_args += ["--restore-method", args.restore_method]
        if args.no_store:
            serve_args += ["--no-store"]
        if args.api_key:
            serve_args += ["--api-key", args.api_key]
        return cls(serve_args)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        return Path(self.log.name).read_text()[-n:]

    def stop(self) -> None:
        """SIGTERM: uvicorn shuts down gracefully and the engine drains its pending saves. Idempotent."""
        if self.log.closed:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)  # draining saves to a slow disk can take a while
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)


def _command_line() -> str:
    """How this run was started, as `kvtier bench load ...` (also when run as a module)."""
    argv = sys.argv[1:]
    if "load" in argv:
        argv = argv[argv.index("load") + 1:]
    return shlex.join(["kvtier", "bench", "load", *argv])


def run_load(args: argparse.Namespace) -> LoadReport:
    from kvtier.bench.load import conversations

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
    from kvtier.bench.load import conversations

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
