"""One streaming chat request against the OpenAI-compatible server, and what a load run reports
(shared by the single-question and the conversation modes)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

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


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The bearer header a keyed server wants on every path but /health (/metrics included)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def store_memory_mb(client_url: str, api_key: str | None = None) -> float | None:
    """Bytes in the server's memory store tier, from its /metrics (None without a store)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(client_url + "/metrics", timeout=10, headers=auth_headers(api_key)).text
    except httpx.HTTPError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvtier:store_bytes" and sample.labels.get("tier") == "memory":
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
