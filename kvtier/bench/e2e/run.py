"""`kvtier bench e2e`: a returning context through the public API, beside peers measured in the same run.

For each compute dtype and history length H, fresh random contexts (H history tokens + N new ones,
the same token ids for every peer) come back, and each peer produces the first new token:

    hf_recompute        HF transformers: one forward of the whole prompt
    hf_floor            HF with the history's DynamicCache still in RAM: forward of the new tokens only
    hf_load_bytes       torch.load of the saved cache from bytes in RAM, then the new tokens
    hf_load_cold_file   torch.load from a file whose pages were evicted, then the new tokens
    hf_load_redis       GET from Redis + torch.load, then the new tokens
    kvtier_recompute    Engine without a store: engine.generate(prompt)
    kvtier_device_cache Engine with the device prefix cache on (the history is still on the device)
    kvtier_memory       Engine with store memory:8GB, prefix cache off: the history is restored from memory
    kvtier_disk_cold    the history saved by one Engine, restored by a new one (restart) from disk, cold
    kvtier_redis        the same through a Redis-only store

TTFT = median over --contexts of the wall time of the timed call (kvtier: `generate` with
max_tokens=1, so what a user waits for), after one untimed warm-up context per peer. Every peer runs
on a context before the next context (HF's and kvtier's in alternating order), and a goal's ratio is
the median of the per-context ratios: a VM whose speed drifts over minutes shifts both sides alike.
Each such ratio comes with a 90% interval for its median; where that interval holds the target, the
goal's line says the run cannot tell (more --contexts narrow it).
Every peer's first token is checked against its family's recompute. Once the models are loaded the
heap is frozen, as `kvtier serve` freezes it (kvtier/heap.py): a full collection over torch's
modules (a noticeable pause) does not land inside one peer's timing. Goals are judged from the rows
only (`evaluate_goals`), so `report` re-judges a saved JSON. bf16 rows only mean something on a CPU with
native bf16 (avx512_bf16 / amx_bf16); `meta.cpu_native_bf16` says whether this one has it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.bench.common import (
    RedisServer,
    bench_redis_client,
    drop_page_cache,
    machine_info,
    median,
    read_bandwidth,
    timed,
    write_json_atomic,
)
from kvtier.bench.e2e.goals import RATIOS, cells_of, evaluate_goals, ratio, ttft_of
from kvtier.bench.e2e.peers import HF_PEERS, KV_PEERS, PEER_TIER, PEERS, PLOT_STYLE
from kvtier.bench.hf import HFPeers
from kvtier.bench.report import markdown_rows, pyplot, save_figure
from kvtier.heap import freeze_startup_heap

if TYPE_CHECKING:
    import redis



# ----- reports ------------------------------------------------------------------------------------
def _s(x: float | None, nd: int = 3) -> str:
    return "-" if x is None or x != x else f"{x:.{nd}f}"


def _met(g: dict) -> str:
    return "not measured" if g["met"] is None else ("met" if g["met"] else "NOT met")


def _unresolved(goal: dict) -> str:
    hs = goal.get("unresolved") or []
    return f"; the run cannot tell at H={', '.join(map(str, hs))} (the 90% interval holds the target)" if hs else ""


def pivot(rows: Sequence[dict]) -> tuple[list[str], list[list[str]]]:
    """One line per (dtype, H): median TTFT of each measured peer, the goals' ratios, disk bandwidth."""
    cells = cells_of(rows)
    peers = [p for p in PEERS if any(p in c for c in cells.values())]
    head = ["dtype", "H"] + [f"{p} s" for p in peers] + list(RATIOS) + ["disk MB/s"]
    body = []
    for (dtype, h), c in cells.items():
        d = c.get("kvtier_disk_cold") or {}
        bw = d.get("disk_read_bps")
        body.append([dtype, str(h)] + [_s(ttft_of(c, p)) for p in peers] + [_s(ratio(c, n), 2) for n in RATIOS]
                    + [_s(bw / 1e6 if bw else None, 0)])
    return head, body


def markdown(rows: Sequence[dict], goals: Sequence[dict], meta: dict | None = None) -> str:
    meta = meta or {}
    bf16 = meta.get("cpu_native_bf16")
    lines = [f"End-to-end returning context: median TTFT in seconds over {meta.get('contexts', '?')} contexts "
             f"(+1 warm-up), {meta.get('new_tokens', '?')} new tokens, model {meta.get('model', '?')}, kvtier's "
             f"stores in chunks of {meta.get('chunk_tokens', 64)} tokens.", "",
             f"Machine: {meta.get('cpu_model', '?')}, {meta.get('cpu_count', '?')} cores, torch "
             f"{meta.get('torch', '?')} ({meta.get('torch_threads', '?')} threads), load "
             f"{meta.get('loadavg_start', '?')} -> {meta.get('loadavg_end', '?')}, {meta.get('date', '?')}.",
             "bf16 rows only mean something on a CPU with native bf16 (avx512_bf16/amx_bf16): this CPU "
             + ("has it." if bf16 else "does NOT have it: bf16 rows are emulated and slow." if bf16 is False
                else "was not recorded."),
             "Ratios: median over the contexts of each context's numerator / denominator; disk/bound = "
             "kvtier_disk_cold / max(hf_floor, bytes restored / raw cold disk read bandwidth).", ""]
    head, body = pivot(rows)
    lines += markdown_rows(head, body)
    lines += ["", "kvtier rows (restore method, tokens reused by tier, bytes restored, engine-measured TTFT):", "",
              "| dtype | H | peer | method | reused by tier | MB restored | out.ttft s | first token match |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["peer"].startswith("kvtier"):
            mb = r.get("bytes_restored")
            lines.append(f"| {r['dtype']} | {r['history']} | {r['peer']} | {r.get('restore_method') or '-'} | "
                         f"{r.get('reused_by_tier') or {}} | {_s(mb / 1e6 if mb else None, 1)} | "
                         f"{_s(r.get('engine_ttft_s'))} | {r.get('first_token_match')} |")
    lines += ["", "Goals:", ""]
    for g in goals:
        lines.append(f"- **{_met(g)}**: {g['goal']}: value {g['value']} (target {g['target']}); {g['detail']}{_unresolved(g)}")
    return "\n".join(lines) + "\n"


def rich_table(rows: Sequence[dict]):
    from rich.table import Table

    head, body = pivot(rows)  # transposed: one column per (dtype, H) fits a terminal
    t = Table(title="e2e: median TTFT (s), ratios")
    t.add_column("peer / ratio")
    for b in body:
        t.add_column(f"{b[0]} H={b[1]}", justify="right")
    for i, name in enumerate(head[2:], start=2):
        t.add_row(name, *(b[i] for b in body))
    return t


def plot(rows: Sequence[dict], path: str) -> None:
    """Grouped bars: one panel per dtype, groups by H, one bar per peer, log y."""
    plt = pyplot()

    cells = cells_of(rows)
    dtypes = list(dict.fromkeys(k[0] for k in cells))
    if not dtypes:
        return
    peers = [p for p in PLOT_STYLE if any(p in c for c in cells.values())]  # HF peer beside its kvtier pair
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        hs = sorted(h for d, h in cells if d == dtype)
        width = 0.8 / max(1, len(peers))
        for i, p in enumerate(peers):
            ys = [ttft_of(cells[(dtype, h)], p) for h in hs]
            xs = [j + (i - (len(peers) - 1) / 2) * width for j in range(len(hs))]
            ax.bar([x for x, y in zip(xs, ys) if y], [y for y in ys if y], width, label=p, color=PLOT_STYLE[p],
                   hatch="//" if p.startswith("hf") else None, edgecolor="white")
        ax.set_xticks(range(len(hs)), [f"H={h}" for h in hs])
        ax.set_yscale("log")
        ax.set_ylabel("TTFT (s, median)")
        ax.set_title(f"{dtype}")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    save_figure(fig, path)


# ----- measurement --------------------------------------------------------------------------------
@dataclass
class Sample:
    seconds: float  # wall time of the timed part
    token: int  # the first generated token
    out: Any = None  # kvtier: the RequestOutput
    stats: Any = None  # kvtier: engine.stats() right after the timed run


class KvtierPeers:
    """The kvtier peers for one (model, H), through the public API only, one context at a time
    (`sample`). The recompute, device-cache and memory peers keep one engine for every context
    (opened on first use, closed by `close`); the disk and Redis peers restart on each."""

    PERSISTENT = ("kvtier_recompute", "kvtier_device_cache", "kvtier_memory")

    def __init__(self, bench: "E2EBench", loaded, hist: int, tag: str):
        from kvtier.engine.request import SamplingParams

        self.bench, self.loaded, self.hist, self.tag = bench, loaded, hist, tag
        self.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self.disk_dir = bench.workdir / "disk" / tag
        self.engines: dict[str, Any] = {}

    def engine(self, store: str | None = None, prefix_cache: bool = False):
        from kvtier.engine.config import EngineConfig, ReuseConfig
        from kvtier.engine.engine import Engine

        a = self.bench.args
        extra = {"max_batched_tokens": a.max_batched_tokens} if a.max_batched_tokens else {}
        cfg = EngineConfig(kv_cache_bytes=self.bench.kv_bytes, enable_prefix_cache=prefix_cache,
                           max_model_len=min(self.hist + a.new_tokens, self.loaded.config.max_position_embeddings),
                           exact=not a.fast_inexact, bf16_attention=a.bf16_attention, **extra)
        reuse = ReuseConfig(method=a.method, chunk_tokens=a.chunk_tokens) if store else None
        return Engine(self.loaded, cfg, store=store, reuse=reuse,
                      profile=self.bench.profile if store else None)

    def _timed(self, peer: str, i: int, engine, ids: list[int]) -> Sample:
        seconds, outs = timed(lambda: engine.generate([ids], self.params))
        return self.bench.progress(peer, self.tag, i, Sample(seconds, outs[0].output_ids[0], outs[0], engine.stats()))

    def _save(self, engine, ids: list[int]) -> None:
        engine.generate([ids[: self.hist]], self.params)  # the history's state is saved on the way
        engine.flush()  # ... and written before the context returns

    def sample(self, peer: str, i: int, ids: list[int]) -> Sample:
        """Peer `peer` on context `i` (0: the warm-up)."""
        if peer in self.PERSISTENT:
            store = None if peer == "kvtier_recompute" else "memory:8GB"
            if peer not in self.engines:
                self.engines[peer] = self.engine(store, prefix_cache=peer == "kvtier_device_cache")
            if store:
                self._save(self.engines[peer], ids)
            return self._timed(peer, i, self.engines[peer], ids)
        if peer == "kvtier_disk_cold":
            spec = f"memory:8GB,disk:{self.disk_dir}:20GB"
            return self._restarted(peer, i, ids, spec, lambda: drop_page_cache(self.disk_dir))
        return self._restarted(peer, i, ids, self.bench.redis_spec(self.tag), lambda: None)  # kvtier_redis

    def _restarted(self, peer: str, i: int, ids: list[int], store: str, evict: Callable[[], Any]) -> Sample:
        """Engine A saves the history and closes; a new Engine B (empty memory tier) restores it."""
        a = self.engine(store)
        try:
            self._save(a, ids)
        finally:
            a.close()
        b = self.engine(store)
        try:
            evict()  # after B opened the store, so nothing B did at open warms the pages it reads
            return self._timed(peer, i, b, ids)
        finally:
            b.close()

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()


def kvtier_fields(samples: list[Sample], tier: str | None) -> dict:
    """Row fields only kvtier runs have; bytes restored = tokens read from `tier` x stored bytes/token."""
    last = samples[-1]
    stats = dataclasses.asdict(last.stats)
    from_tier = median([s.out.reused_by_tier.get(tier, 0) if tier else 0 for s in samples])
    # The restore's own time and the plan's prediction of it (RequestOutput.restore; None without one).
    restore_s = [s.out.restore.seconds for s in samples if s.out.restore is not None]
    predicted = [s.out.restore.predicted_s for s in samples if s.out.restore is not None]
    return dict(engine_ttft_s=median([s.out.ttft for s in samples if s.out.ttft is not None]),
                restore_s=median(restore_s) if restore_s else None,
                predicted_s=median(predicted) if predicted else None,
                restore_method=last.out.restore_method, tokens_reused=[s.out.prompt_tokens_reused for s in samples],
                reused_by_tier=last.out.reused_by_tier, tokens_from_tier=from_tier,
                bytes_restored=from_tier * last.stats.stored_bytes_per_token,
                stored_bytes_per_token=last.stats.stored_bytes_per_token, layout=list(stats["layout"]),
                counters=stats["counters"], store=stats["store"])


class E2EBench:
    def __init__(self, args: argparse.Namespace, console) -> None:
        from kvtier.store.spec import parse_size

        self.args, self.console = args, console
        self.kv_bytes = parse_size(args.kv_cache)
        self.workdir = Path(args.workdir)
        self.peers = [p for p in PEERS if p in args.peers and PEER_TIER.get(p, "any") in args.tiers + ["any"]]
        self.rows: list[dict] = []
        self.meta: dict = dict(machine_info(), model=args.model, contexts=args.contexts, new_tokens=args.new_tokens,
                               chunk_tokens=args.chunk_tokens,
                               options={k: v for k, v in vars(args).items() if k != "func"})
        self.redis_url: str | None = args.redis_url
        self.redis_client: redis.Redis | None = None
        self.profile = None
        self.key_prefix = f"kvtier-e2e-{os.getpid()}"  # our Redis keys, also on a shared server

    def progress(self, peer: str, tag: str, i: int, s: Sample) -> Sample:
        what = "warm-up" if i == 0 else f"{i}/{self.args.contexts}"
        o = s.out
        more = f" reused {o.prompt_tokens_reused} {o.reused_by_tier} via {o.restore_method or '-'}" if o else ""
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {tag} [bold]{peer}[/bold] {what}: "
                           f"{s.seconds:.3f}s token {s.token}{more}")
        return s

    def save(self) -> None:
        self.meta["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
        if self.args.json:
            write_json_atomic(self.args.json, dict(rows=self.rows, goals=evaluate_goals(self.rows), meta=self.meta))

    def redis_spec(self, tag: str) -> str:
        url = self.redis_url
        assert url is not None  # run() starts a server for redis peers when none was given
        return f"{url}{'&' if '?' in url else '?'}prefix={self.key_prefix}-{tag}"

    def run(self) -> list[dict]:
        for sub in ("disk", "hf"):  # only what we write there: stale chunks would be restored
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        server = None
        try:
            if any(PEER_TIER.get(p) == "redis" for p in self.peers):
                if self.redis_url is None:
                    server = RedisServer().start()
                    self.redis_url = server.url
                    self.console.print(f"started redis-server on port {server.port}")
                self.redis_client = bench_redis_client(self.redis_url)
            for dtype in self.args.dtype:
                self.run_dtype(dtype)
        finally:
            if server is not None:
                server.close()
            self.save()
        return self.rows

    def run_dtype(self, dtype: str) -> None:
        import torch

        from kvtier.bench.hf import build_hf
        from kvtier.models import exact_matmul
        from kvtier.models.loading import load_model

        self.console.print(f"[bold]loading {self.args.model} ({dtype})[/bold]")
        loaded = load_model(self.args.model, dtype=dtype, tokenizer=False)
        window, new = loaded.config.max_position_embeddings, self.args.new_tokens
        if bad := [h for h in self.args.history if h + new > window]:
            raise ValueError(f"history {bad} + {new} new tokens does not fit {self.args.model}'s "
                             f"{window}-token window: use H <= {window - new}")
        if loaded.dtype == torch.bfloat16:  # which exact kernel kvtier's bf16 attention ran (auto: this CPU's)
            c = loaded.config
            gemm = exact_matmul.active(loaded.dtype, c.num_heads, c.num_kv_heads, c.head_dim, self.args.bf16_attention)
            self.meta["bf16_attention_kernel"] = "gemm" if gemm else "flash"
        self.profile = self.measure_profile(loaded)
        hf = build_hf(loaded) if any(p in HF_PEERS for p in self.peers) else None
        freeze_startup_heap()  # as `kvtier serve` does: no collection over the models inside a timing
        try:
            for h in self.args.history:
                self.run_cell(loaded, hf, dtype, h)
        finally:
            gc.unfreeze()  # this dtype's models go when the next dtype's load

    def measure_profile(self, loaded):
        """This machine's profile for the model over every tier of the run (measured once, kept
        under KVTIER_HOME), so `auto` plans with real numbers, as `kvtier serve` would."""
        from kvtier.engine.calibrate.hardware import load_or_measure
        from kvtier.paths import home

        tiers = {PEER_TIER[p] for p in self.peers if p in KV_PEERS and p in PEER_TIER}
        kv = KvtierPeers(self, loaded, min(self.args.history), "profile")
        spec = ["memory:8GB"]
        if "disk" in tiers:
            spec.append(f"disk:{kv.disk_dir}:20GB")
        if "redis" in tiers:
            spec.append(self.redis_spec("profile"))
        profile = load_or_measure(loaded, home(), ",".join(spec))
        shutil.rmtree(kv.disk_dir, ignore_errors=True)
        self.clear_redis("profile")
        return profile

    def clear_redis(self, tag: str) -> None:
        if self.redis_client is not None:
            for k in self.redis_client.scan_iter(match=f"{self.key_prefix}-{tag}:*", count=1000):
                self.redis_client.delete(k)

    def contexts(self, vocab: int, hist: int) -> list[list[int]]:
        """Warm-up + --contexts fresh random prompts, the same for every peer and dtype."""
        import torch

        gen = torch.Generator().manual_seed(self.args.seed * 1_000_003 + hist)
        shape = (self.args.contexts + 1, hist + self.args.new_tokens)
        return torch.randint(100, vocab, shape, generator=gen).tolist()

    def run_cell(self, loaded, hf, dtype: str, hist: int) -> None:
        """Every peer on each context in turn, HF's and kvtier's in alternating order, so the VM's
        drift over minutes lands on every peer alike and the ratios can be paired per context."""
        tag = f"{dtype}-H{hist}"
        ctxs = self.contexts(loaded.config.vocab_size, hist)
        hf_peers = [p for p in self.peers if p in HF_PEERS]
        kv_peers = [p for p in self.peers if p in KV_PEERS]
        runs: dict[str, list[Sample]] = {p: [] for p in hf_peers + kv_peers}
        blob_bytes = 0
        kv = KvtierPeers(self, loaded, hist, tag)
        try:
            for i, ids in enumerate(ctxs):
                for side in ("hf", "kv") if i % 2 == 0 else ("kv", "hf"):
                    if side == "hf" and hf_peers:
                        blob_bytes = self.run_hf(hf, tag, hist, i, ids, hf_peers, runs)
                    elif side == "kv":
                        for p in kv_peers:
                            runs[p].append(kv.sample(p, i, ids))
        finally:
            kv.close()
        samples = {p: s[1:] for p, s in runs.items()}  # contexts[0] was the warm-up
        for p in hf_peers:
            self.add_row(dtype, hist, p, samples, {} if p == "hf_recompute" else dict(blob_bytes=blob_bytes))
        for peer in kv_peers:
            extra = kvtier_fields(samples[peer], PEER_TIER.get(peer))
            if peer == "kvtier_disk_cold":  # the raw device bandwidth, over the very chunk files just read
                extra["disk_read_bps"] = read_bandwidth(sorted(kv.disk_dir.rglob("*.kvc")))
                shutil.rmtree(kv.disk_dir, ignore_errors=True)
                self.console.print(f"{tag} raw cold disk read (O_DIRECT): {extra['disk_read_bps'] / 1e6:.0f} MB/s")
            if peer == "kvtier_redis":
                self.clear_redis(tag)
            self.add_row(dtype, hist, peer, samples, extra)

    def run_hf(self, hf, tag: str, hist: int, i: int, ids: list[int], peers: list[str],
               runs: dict[str, list[Sample]]) -> int:
        """Every HF peer on context `i` (its history prefilled once); appends to runs[peer] and
        returns the size of the saved cache in bytes."""
        ctx = HFPeers(hf, ids, hist, peers, self.workdir / "hf" / f"{tag}.pt", self.redis_client,
                      f"{self.key_prefix}-hf-{tag}")
        try:
            for p in peers:
                ctx.before(p)
                runs[p].append(self.progress(p, tag, i, Sample(*timed(getattr(ctx, p)))))
            return len(ctx.blob)
        finally:
            ctx.close()

    def add_row(self, dtype: str, hist: int, peer: str, samples: dict[str, list[Sample]], extra: dict) -> None:
        mine = samples[peer]
        tokens = [s.token for s in mine]
        ref_peer = "hf_recompute" if peer.startswith("hf") else "kvtier_recompute"
        ref = samples.get(ref_peer) if peer != ref_peer else None
        if peer == "kvtier_recompute" and "hf_recompute" in samples:  # information only: our model vs HF's
            extra = dict(extra, matches_hf_recompute=tokens == [s.token for s in samples["hf_recompute"]])
        self.rows.append(dict(
            model=self.args.model, dtype=dtype, history=hist, new_tokens=self.args.new_tokens, peer=peer,
            tier=PEER_TIER.get(peer, "-"), contexts=len(mine), ttft_s=median([s.seconds for s in mine]),
            ttft_all_s=[round(s.seconds, 6) for s in mine], first_tokens=tokens,
            first_token_match=None if ref is None else tokens == [s.token for s in ref], **extra))
        self.save()  # partial JSON after every row: an interrupted run keeps what it measured


# ----- command line -------------------------------------------------------------------------------


def render(rows: list[dict], meta: dict, markdown_path: str | None, plot_path: str | None, console) -> list[dict]:
    goals = evaluate_goals(rows)
    console.print(rich_table(rows))
    for g in goals:
        color = {True: "green", False: "red", None: "yellow"}[g["met"]]
        console.print(f"[{color}]{_met(g)}[/{color}]: {g['goal']}: value {g['value']} (target {g['target']}); "
                      f"{g['detail']}{_unresolved(g)}")
    if markdown_path:
        Path(markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(markdown_path).write_text(markdown(rows, goals, meta))
    if plot_path:
        plot(rows, plot_path)
    return goals


def cmd_e2e(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=None if sys.stdout.isatty() else 200)
    if getattr(args, "sub", None) == "report":
        doc = json.loads(Path(args.json_in).read_text())
        render(doc["rows"], doc.get("meta", {}), args.report_markdown, args.report_plot, console)
        return 0
    if args.contexts < 1 or args.new_tokens < 1:
        raise ValueError("--contexts and --new-tokens must be at least 1")
    for p in args.peers:
        if p not in PEERS:
            raise ValueError(f"unknown peer {p!r}: use {', '.join(PEERS)}")
    from kvtier.engine.config import ReuseConfig

    ReuseConfig(method=args.method, chunk_tokens=args.chunk_tokens)  # a bad value fails now, not after the HF peers ran
    # SIGTERM unwinds through the finally blocks: engines closed, redis-server stopped, JSON kept.
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    bench = E2EBench(args, console)
    bench.run()
    render(bench.rows, bench.meta, args.markdown, args.plot, console)
    return 0
