"""`kvtier bench load --mode conversation`: many clients, each holding multi-turn chats.

Every turn resends the whole conversation so far (system prompt, earlier questions and the answers
the server gave) plus a new question, as chat clients do; after `--turns` turns a client starts a
new conversation. Every `--sample-every` seconds the server's /metrics and RSS are sampled: tokens
reused per tier, each tier's bytes against its capacity, requests and errors so far. The verdict
checks what a soak is for: no errors, RSS flat after warm-up, every tier within its cap.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvtier.bench.load.client import QUESTIONS, SYSTEM, LoadReport, StreamResult, auth_headers, rss_mb, stream_chat
from kvtier.bench.report import markdown_table, mib, ms, pyplot, save_figure
from kvtier.bench.stats import percentile

WORDS = ("river", "ledger", "orbit", "copper", "meadow", "signal", "harbor", "lantern", "quartz", "summit",
         "archive", "falcon", "garden", "pillar", "tundra", "vessel", "canyon", "beacon", "mosaic", "thistle")


def document(conversation: int, words: int) -> str:
    """A document of its own for each conversation (the RAG/long-context case: state worth
    keeping that no other conversation shares), deterministic in the conversation number."""
    n = len(WORDS)
    body = " ".join(WORDS[(conversation * 7 + i * (conversation % 5 + 1) + i // n) % n] for i in range(words))
    return f"Document {conversation}: {body}. Answer questions about document {conversation}."


FOLLOW_UPS = ["Why?", "Give an example.", "Say that more simply.", "What follows from that?",
              "Is there an exception?", "Summarize our conversation."]


@dataclass
class Sample:
    t: float  # seconds into the run
    rss_mb: float | None
    requests: int
    errors: int
    tier_bytes: dict[str, float]
    tier_capacity: dict[str, float]
    reused_by_tier: dict[str, float]  # cumulative tokens, from the server's counters
    writer: dict[str, float] = field(default_factory=dict)  # saves queued, dropped, chunks written so far


@dataclass
class ConversationReport(LoadReport):
    turns: int = 0
    conversations: int = 0
    ttft_first_turn_p50_ms: float | None = None
    ttft_later_turns_p50_ms: float | None = None
    ttft_later_turns_p99_ms: float | None = None
    cached_fraction_later_turns: float = 0.0  # of turns >= 2's prompt tokens
    errors_by_kind: dict[str, int] = field(default_factory=dict)
    reused_by_tier: dict[str, float] = field(default_factory=dict)  # tokens during the run
    samples: list[Sample] = field(default_factory=list)
    verdict: dict[str, Any] = field(default_factory=dict)


WRITER_METRICS = {"kvtier:store_write_queue_depth": "queued", "kvtier:store_dropped_saves_total": "dropped",
                  "kvtier:store_chunks_written_total": "written", "kvtier:restores_total": "restores"}


def scrape(url: str, api_key: str | None = None
           ) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float]]:
    """(bytes per tier, capacity per tier, tokens reused per tier so far, writer and restore counts)
    from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    used: dict[str, float] = {}
    cap: dict[str, float] = {}
    reused: dict[str, float] = {}
    writer: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10, headers=auth_headers(api_key)).text
    except httpx.HTTPError:
        return used, cap, reused, writer
    wanted = {"kvtier:store_bytes": used, "kvtier:store_capacity_bytes": cap,
              "kvtier:prompt_tokens_reused_total": reused}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted and "tier" in s.labels:
                wanted[s.name][s.labels["tier"]] = s.value
            elif s.name in WRITER_METRICS:
                writer[WRITER_METRICS[s.name]] = s.value
    return used, cap, reused, writer


async def run_conversations(url: str, model: str, clients: int, duration: float, max_tokens: int, turns: int,
                            sample_every: float, api_key: str | None, server_pid: int | None,
                            report: ConversationReport, history_tokens: int = 1536,
                            document_words: int = 0) -> list[tuple[int, StreamResult]]:
    """-> (turn number, result) of every request. A conversation also ends early when its next turn
    could outgrow `history_tokens` (the prompt so far plus two answers), so it never hits the
    server's context window. With `document_words`, each conversation's system prompt carries a
    document of its own of that many words."""
    headers = auth_headers(api_key)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    results: list[tuple[int, StreamResult]] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(300.0, connect=10.0)) as client:
        warm, _ = await stream_chat(client, model, [{"role": "user", "content": "Hello"}], max_tokens, 0)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        start = time.perf_counter()
        deadline = start + duration
        _, _, reused0, _ = await asyncio.to_thread(scrape, url, api_key)

        async def conversation_client(i: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                report.conversations += 1
                system = document(i * 100_000 + n, document_words) if document_words else SYSTEM
                messages = [{"role": "system", "content": system}]
                for turn in range(1, turns + 1):
                    if time.perf_counter() >= deadline:
                        break
                    question = QUESTIONS[(i * 5 + n) % len(QUESTIONS)] if turn == 1 \
                        else FOLLOW_UPS[(i + n + turn) % len(FOLLOW_UPS)]
                    messages.append({"role": "user", "content": question})
                    r, answer = await stream_chat(client, model, messages, max_tokens, seed=i * 100_003 + n * 17 + turn)
                    results.append((turn, r))
                    if not r.ok:
                        break  # a failed turn ends the conversation (a real client would retry)
                    messages.append({"role": "assistant", "content": answer})
                    if r.prompt_tokens + 2 * max_tokens + 64 > history_tokens:
                        break
                n += 1

        async def sampler() -> None:
            while True:
                await take_sample()
                await asyncio.sleep(sample_every)

        async def take_sample() -> None:
            used, cap, reused, writer = await asyncio.to_thread(scrape, url, api_key)
            report.samples.append(Sample(
                round(time.perf_counter() - start, 1), rss_mb(server_pid) if server_pid else None, len(results),
                sum(1 for _, r in results if not r.ok), used, cap,
                {k: v - reused0.get(k, 0.0) for k, v in reused.items()}, writer))

        task = asyncio.create_task(sampler())
        await asyncio.gather(*(conversation_client(i) for i in range(clients)))
        report.elapsed_s = time.perf_counter() - start
        task.cancel()
        await take_sample()
    return results


def summarize(results: list[tuple[int, StreamResult]], rep: ConversationReport) -> ConversationReport:
    ok = [(turn, r) for turn, r in results if r.ok]
    rep.requests, rep.completed = len(results), len(ok)
    kinds = Counter(r.error.split(":")[0] for _, r in results if r.error)
    rep.errors_by_kind = dict(kinds)
    rep.incomplete_streams = kinds.get("stream ended early", 0)
    rep.errors = rep.requests - rep.completed - rep.incomplete_streams
    rep.error_samples = sorted({r.error for _, r in results if r.error})[:5]
    t = max(rep.elapsed_s, 1e-9)
    rep.requests_per_s = len(ok) / t
    rep.tokens_per_s = sum(r.completion_tokens for _, r in ok) / t

    def p(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else v * 1000

    every = [r.ttft for _, r in ok if r.ttft is not None]
    later = [r.ttft for turn, r in ok if turn > 1 and r.ttft is not None]
    rep.ttft_p50_ms, rep.ttft_p99_ms = p(every, 50), p(every, 99)
    rep.ttft_first_turn_p50_ms = p([r.ttft for turn, r in ok if turn == 1 and r.ttft is not None], 50)
    rep.ttft_later_turns_p50_ms, rep.ttft_later_turns_p99_ms = p(later, 50), p(later, 99)
    rep.latency_p50_ms = p([r.latency for _, r in ok], 50)
    prompt = sum(r.prompt_tokens for _, r in ok)
    rep.cached_token_fraction = sum(r.cached_tokens for _, r in ok) / prompt if prompt else 0.0
    later_prompt = sum(r.prompt_tokens for turn, r in ok if turn > 1)
    rep.cached_fraction_later_turns = \
        sum(r.cached_tokens for turn, r in ok if turn > 1) / later_prompt if later_prompt else 0.0
    if rep.samples:
        rep.reused_by_tier = dict(rep.samples[-1].reused_by_tier)
        rss = [s.rss_mb for s in rep.samples if s.rss_mb is not None]
        if rss:
            rep.rss_start_mb, rep.rss_end_mb, rep.rss_peak_mb = rss[0], rss[-1], max(rss)
            rep.rss_mid_mb = rss[len(rss) // 2]
    rep.verdict = verdict(rep)
    return rep


def verdict(rep: ConversationReport) -> dict[str, Any]:
    """No errors; RSS flat after warm-up; every tier within its capacity at every sample.

    Warm-up is the first half: until then RSS grows by design, as the KV pool's pages are first
    touched and the memory tier fills up to its capacity. Flat: the second half's peak is within
    max(5%, 64 MiB) of the RSS at the half-way point."""
    out: dict[str, Any] = {"no_errors": rep.errors == 0 and rep.incomplete_streams == 0}
    rss = [s.rss_mb for s in rep.samples if s.rss_mb is not None]
    if len(rss) >= 4:
        warm, late = rss[len(rss) // 2], max(rss[len(rss) // 2:])
        out["rss_after_warmup_mb"], out["rss_late_peak_mb"] = round(warm, 1), round(late, 1)
        out["rss_flat"] = late - warm <= max(0.05 * warm, 64.0)
    over = [(s.t, tier, s.tier_bytes[tier], cap) for s in rep.samples for tier, cap in s.tier_capacity.items()
            if cap > 0 and s.tier_bytes.get(tier, 0.0) > cap]
    out["tiers_within_caps"] = not over
    out["cap_violations"] = over[:5]
    return out


def format_table(rep: ConversationReport) -> str:
    last = rep.samples[-1] if rep.samples else None
    tiers = ", ".join(f"{t} {last.tier_bytes.get(t, 0) / 2**20:.0f}/{c / 2**20:.0f} MiB"
                      for t, c in last.tier_capacity.items()) if last else "-"
    reuse = ", ".join(f"{t} {int(n)}" for t, n in sorted(rep.reused_by_tier.items()) if n) or "none"
    rows = [
        ("model", rep.model), ("clients (conversations)", f"{rep.clients} ({rep.conversations} started)"),
        ("turns per conversation", str(rep.turns)), ("duration (s)", f"{rep.duration_s:.0f} (done at {rep.elapsed_s:.1f})"),
        ("requests / completed", f"{rep.requests} / {rep.completed}"),
        ("errors / incomplete streams", f"{rep.errors} / {rep.incomplete_streams}"),
        ("requests/s", f"{rep.requests_per_s:.2f}"), ("generated tokens/s", f"{rep.tokens_per_s:.1f}"),
        ("TTFT p50 / p99", f"{ms(rep.ttft_p50_ms)} / {ms(rep.ttft_p99_ms)}"),
        ("TTFT p50 turn 1", ms(rep.ttft_first_turn_p50_ms)),
        ("TTFT p50 / p99 turns >= 2", f"{ms(rep.ttft_later_turns_p50_ms)} / {ms(rep.ttft_later_turns_p99_ms)}"),
        ("prompt tokens cached (turns >= 2)", f"{rep.cached_token_fraction:.0%} ({rep.cached_fraction_later_turns:.0%})"),
        ("tokens reused by tier", reuse),
        ("server RSS start / mid / end / peak",
         " / ".join(mib(v) for v in (rep.rss_start_mb, rep.rss_mid_mb, rep.rss_end_mb, rep.rss_peak_mb))),
        ("tier bytes / cap at the end", tiers),
        ("saves dropped / chunks written / restores",
         " / ".join(str(int(last.writer.get(k, 0))) for k in ("dropped", "written", "restores")) if last else "-"),
        ("verdict", ", ".join(f"{k}={v}" for k, v in rep.verdict.items() if k != "cap_violations")),
    ]
    return markdown_table(rows)


def plot(rep: ConversationReport, path: str) -> None:
    """RSS over time, and each tier's bytes against its capacity over time."""
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(11, 4))
    t = [s.t / 60 for s in rep.samples]
    a.plot(t, [s.rss_mb for s in rep.samples], label="server RSS")
    a.set(xlabel="minutes", ylabel="MiB", title="server resident memory")
    tiers = sorted({k for s in rep.samples for k in s.tier_capacity})
    for i, tier in enumerate(tiers):
        color = f"C{i}"
        b.plot(t, [s.tier_bytes.get(tier, 0) / 2**20 for s in rep.samples], color=color, label=f"{tier} bytes")
        b.plot(t, [s.tier_capacity.get(tier, 0) / 2**20 for s in rep.samples], color=color, ls="--",
               label=f"{tier} capacity")
    b.set(xlabel="minutes", ylabel="MiB", title="store tiers", yscale="log")
    b.legend(fontsize=8)
    fig.suptitle(f"{rep.model}: {rep.clients} conversation clients, {rep.errors} errors")
    fig.tight_layout()
    save_figure(fig, path)
