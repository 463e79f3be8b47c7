"""`kvtier bench restore`: time-to-first-token of every restore method against tier and bandwidth.

For each model, context length, tier and (optionally emulated) read bandwidth, every method runs
through the Engine, as a user meets it: an engine pinned to the method (and to the layout the
method reads) saves the history once, then a returning request (history + new tokens) restores it
and produces its first token, --repeats times after --warmup untimed runs:

    recompute   prefill history + new tokens from token ids
    kv          layer-wise load of K/V (CachedAttention)
    hidden      layer-wise load of layer inputs, projected to K/V (HCache)
    bubblefree  HCache's per-layer mix (hidden + KV load, or recompute + hidden)
    cake        compute chunks from the front while loading KV chunks from the back
    auto        the planner's choice among the above

and two baselines with HF transformers on the same weights and dtype: `hf_recompute` (one forward
of the whole prompt) and `hf_torch_save` (the usual workaround: `torch.save` a `DynamicCache`,
`torch.load` it back from the same tier and prefill the new tokens on top).

Timing: TTFT is the engine's own (arrival to first token), medians over --repeats. Each row also
has the plan's prediction (the planner's model of that very restore), its ideal bound, the
restore's own time and the bytes it read. Disk reads are direct I/O (cold by construction; the
spec has no memory tier above the disk). Bandwidth limits other than `none` are emulated by the
store's read throttle and labelled `(emulated)` in every row. Exactness: max abs difference of the
first token's logits against a full forward of our module, and whether --greedy-tokens greedy
tokens equal a recompute's.

Writes partial JSON after each cell, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.markup import escape

from kvtier import dtypes
from kvtier.bench.common import (
    RedisServer,
    bench_redis_client,
    drop_page_cache,
    machine_info,
    median,
    timed,
    write_json_atomic,
)
from kvtier.bench.restore.goals import evaluate_goals, evaluate_gpu_goals
from kvtier.bench.restore.methods import METHODS
from kvtier.bench.restore.report import markdown, num, plot, rich_table
from kvtier.store.redact import redact
from kvtier.store.spec import parse_spec
from kvtier.store.throttle import Emulation, Throttle

ROW_KEYS = ("model", "dtype", "storage", "context_tokens", "new_tokens", "tier", "bandwidth", "method",
            "restore_s", "ttft_s", "bytes_read", "stored_bytes_per_token", "ideal_s", "predicted_s",
            "max_logit_diff", "greedy_match", "repeats", "plan", "copy_s", "overlap", "host_s", "ttft_runs")


# ----- small helpers ----------------------------------------------------------------------------
def parse_bandwidth(text: str) -> float | None:
    from kvtier.store.spec import parse_rate

    t = text.strip()
    return None if t.lower() in ("none", "", "raw") else parse_rate(t)


def bw_label(text: str) -> str:
    t = text.strip()
    return "none" if parse_bandwidth(t) is None else f"{t} (emulated)"


# ----- configuration ----------------------------------------------------------------------------
@dataclass
class BenchConfig:
    models: list[str]
    dtype: str = "bf16"
    device: str = "auto"
    storage: list[str] = field(default_factory=lambda: [""])
    contexts: list[int] = field(default_factory=lambda: [1024])
    new_tokens: int = 64
    tiers: list[str] = field(default_factory=lambda: ["memory"])
    bandwidths: list[str] = field(default_factory=lambda: ["none"])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    baselines: bool = True
    repeats: int = 3
    warmup: int = 1
    greedy_tokens: int = 8
    chunk_tokens: int = 64
    workdir: str = "out/restore-work"
    redis_url: str | None = None
    json_path: str | None = None
    markdown_path: str | None = None
    plot_path: str | None = None
    seed: int = 0


def tier_spec(tier: str, bw: float | None, workdir: Path, redis_url: str | None, tag: str) -> str:
    """A single-tier store spec (a disk spec has no memory tier above it: reads hit the disk)."""
    bwtxt = f"{bw / 1e6:g}MB/s" if bw else ""
    if tier == "memory":
        return "memory:32GB" + (f":bw={bwtxt}" if bw else "")
    if tier == "disk":
        return f"disk:{workdir / 'disk' / tag}:60GB" + (f":bw={bwtxt}" if bw else "")
    if tier == "redis":
        if not redis_url:
            raise ValueError("the redis tier needs a server: pass --redis-url or have redis-server on PATH")
        return f"{redis_url}?prefix=kvbench-{tag}" + (f"&bw={bwtxt}" if bw else "")
    raise ValueError(f"unknown tier {tier!r}: use memory, disk or redis")


# ----- the benchmark ----------------------------------------------------------------------------
@dataclass
class Context:
    """One history and what every method is checked against."""

    ids: list[int]  # history + new tokens
    hist: int
    ref_logits: "torch.Tensor"  # next-token logits [vocab] of a full forward
    ref_greedy: list[int]  # greedy tokens after the prompt, from a recomputing engine


def _layout_for(method: str, n: int, partition: tuple) -> tuple[str, ...] | None:
    """What each method's engine stores per layer (auto: the engine decides)."""
    return {"kv": ("kv",) * n, "cake": ("kv",) * n, "recompute": ("kv",) * n, "hidden": ("hidden",) * n,
            "bubblefree": tuple(r.value for r in partition)}.get(method)


class RestoreBench:
    def __init__(self, cfg: BenchConfig, console=None):
        from rich.console import Console

        self.cfg = cfg
        self.console = console or Console()
        self.rows: list[dict] = []
        self.meta: dict = dict(machine_info(), started=time.strftime("%Y-%m-%d %H:%M:%S"), argv=sys.argv,
                               profiles={}, notes=[])
        self.workdir = Path(cfg.workdir)
        self._redis: RedisServer | None = None
        self._redis_url = cfg.redis_url
        self._warm = False  # one throwaway run before the first measured cell

    def log(self, msg: str) -> None:  # rich markup: escape([...]) where brackets are data
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")

    def add(self, row: dict) -> None:
        self.rows.append({k: row.get(k) for k in ROW_KEYS})

    def write_partial(self) -> None:
        if self.cfg.json_path:
            goals = evaluate_goals(self.rows)
            if self.meta.get("device"):
                goals += evaluate_gpu_goals(self.rows, self.meta.get("h2d_pinned_Bps"))
            write_json(self.cfg.json_path, self.rows, goals, self.meta)

    def redis_url(self) -> str | None:
        if self._redis_url is None and "redis" in self.cfg.tiers:
            self._redis = RedisServer().start()
            self._redis_url = self._redis.url
            self.log(f"started redis-server on port {self._redis.port}")
        return self._redis_url

    def run(self) -> list[dict]:
        from kvtier.models.loading import load_model

        shutil.rmtree(self.workdir / "disk", ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            for name in self.cfg.models:
                self.log(f"[bold]loading {name} ({self.cfg.dtype})[/bold]")
                loaded = load_model(name, dtype=self.cfg.dtype, device=self.cfg.device, tokenizer=False)
                dev = loaded.module.lm_head.weight.device
                if dev.type == "cuda" and "h2d_pinned_Bps" not in self.meta:
                    from kvtier.bench.common import pinned_copy_rate
                    from kvtier.device import describe

                    self.meta.update(device=describe(dev), h2d_pinned_Bps=pinned_copy_rate(dev),
                                     h2d_pageable_Bps=pinned_copy_rate(dev, pinned=False))
                    self.log(f"{self.meta['device']}: plain host-to-device copy {self.meta['h2d_pinned_Bps'] / 1e9:.1f} "
                             f"GB/s pinned, {self.meta['h2d_pageable_Bps'] / 1e9:.1f} GB/s pageable")
                self.run_model(loaded)
        finally:
            if self._redis is not None:
                self._redis.close()
            self.write_partial()
        return self.rows

    def run_model(self, loaded) -> None:
        from kvtier.bench.hf import build_hf
        from kvtier.engine.calibrate.hardware import load_or_measure
        from kvtier.paths import home

        spec = ",".join(tier_spec(t, None, self.workdir, self.redis_url(), "profile") for t in self.cfg.tiers)
        self.log(f"hardware profile of {loaded.name} over {redact(spec)} (measured unless saved)")
        profile = load_or_measure(loaded, home(), spec)
        self.meta["profiles"][f"{loaded.name}/{self.cfg.dtype}"] = json.loads(profile.to_json())
        shutil.rmtree(self.workdir / "disk" / "profile", ignore_errors=True)
        hf = build_hf(loaded) if self.cfg.baselines else None
        for ctx in self.cfg.contexts:
            self.run_context(loaded, profile, hf, ctx)

    def engine(self, loaded, ctx: int, spec: str | None = None, reuse=None, profile=None):
        from kvtier.engine.config import EngineConfig
        from kvtier.engine.engine import Engine
        from kvtier.engine.runner.model_runner import ModelRunner

        max_len = min(ctx + self.cfg.new_tokens + self.cfg.greedy_tokens, loaded.config.max_position_embeddings)
        kv_bytes = ModelRunner.bytes_per_block(loaded.module, 16) * (max_len // 16 + 2)  # one sequence
        return Engine(loaded, EngineConfig(kv_cache_bytes=kv_bytes, max_model_len=max_len, enable_prefix_cache=False),
                      store=spec, reuse=reuse, profile=profile)

    def run_context(self, loaded, profile, hf, ctx: int) -> None:
        from kvtier.engine.request import SamplingParams

        cfg = self.cfg
        if ctx % cfg.chunk_tokens or cfg.new_tokens > cfg.chunk_tokens:
            raise ValueError(f"context {ctx} must be a multiple of --chunk-tokens {cfg.chunk_tokens} and --new-tokens "
                             "at most one chunk: the timed prompt then restores exactly the history every time")
        gen = torch.Generator().manual_seed(cfg.seed + ctx)
        ids = torch.randint(100, loaded.config.vocab_size, (ctx + cfg.new_tokens,), generator=gen).tolist()
        self.log(f"[bold]{loaded.name} context {ctx} + {cfg.new_tokens} new tokens[/bold]: reference")
        with torch.inference_mode():
            ref_logits = loaded.module(torch.tensor(ids))[-1].float().cpu()  # [vocab] full recompute, on the host as engine outputs are
        plain = self.engine(loaded, ctx)
        greedy = SamplingParams(max_tokens=cfg.greedy_tokens, temperature=0.0, ignore_eos=True)
        info = Context(ids, ctx, ref_logits, plain.generate([ids], greedy)[0].output_ids)
        plain.close()
        if hf is not None:
            self.hf_recompute(loaded, hf, info)
        if not self._warm:
            self.warm_up(loaded, profile, info)
        for storage in cfg.storage:
            for tier in cfg.tiers:
                for bw in cfg.bandwidths:
                    self.run_cell(loaded, profile, hf, info, storage, tier, bw)
                    self.write_partial()

    def warm_up(self, loaded, profile, info: Context) -> None:
        """One throwaway run of the first cell's first method, not recorded: the process's first
        engine pays one-time costs (allocator, kernels, thread pools) that --warmup, per method,
        does not absorb (without it, the first cell's recompute measured several times slower than later)."""
        from kvtier.engine.config import ReuseConfig

        cfg = self.cfg
        tier, method = cfg.tiers[0], cfg.methods[0]
        bw = parse_bandwidth(cfg.bandwidths[0])
        self.log(f"[dim]warm-up: {method} on {tier} (not recorded)[/dim]")
        tag = f"warmup-{time.monotonic_ns()}"
        layout = ("kv",) * loaded.config.num_layers if method in ("kv", "cake", "recompute") else None
        reuse = ReuseConfig(method=method, chunk_tokens=cfg.chunk_tokens, layout=layout, storage_dtype=cfg.storage[0],
                            lookahead=False, save=method != "recompute")
        self.measure(loaded, profile, info, tier_spec(tier, bw, self.workdir, self.redis_url(), tag), reuse, tier)
        shutil.rmtree(self.workdir / "disk" / tag, ignore_errors=True)
        self._warm = True

    def run_cell(self, loaded, profile, hf, info: Context, storage: str, tier: str, bw_text: str) -> None:
        from kvtier.engine.budget import step_tokens
        from kvtier.engine.config import EngineConfig, ReuseConfig
        from kvtier.planning.costs import ModelShape, links
        from kvtier.planning.plan import PlannedChunk
        from kvtier.planning.planner import Planner
        from kvtier.store.layout import Repr, StoreNamespace

        cfg = self.cfg
        bw, label = parse_bandwidth(bw_text), bw_label(bw_text)
        sdt = storage
        self.log(f"[cyan]cell {loaded.name} ctx={info.hist} tier={tier} bw={label}{' storage=' + sdt if sdt else ''}[/cyan]")
        c, n = loaded.config, loaded.config.num_layers
        ns = StoreNamespace(loaded.fingerprint, n, c.num_kv_heads, c.head_dim, c.hidden_size,
                            compute_dtype=dtypes.name_of(loaded.dtype), storage_dtype=sdt)
        shape = ModelShape(n, ns.layer_bytes_per_token(Repr.KV), ns.layer_bytes_per_token(Repr.HIDDEN))
        em = parse_spec(tier_spec(tier, bw, self.workdir, self.redis_url(), "x")).tiers()[0][1]
        # Recompute is predicted in the engine's own steps (16K tokens on a GPU: with the planner's
        # default 2048 a GPU's recompute was predicted well over its time, four steps' fixed cost too many).
        steps = step_tokens(EngineConfig(), loaded.module.lm_head.weight.device)
        planner = Planner(profile, shape, links(profile, [(tier, em.bandwidth, em.latency)]), prefill_chunk_tokens=steps)
        chunks = [PlannedChunk("", a, a + cfg.chunk_tokens, tier, 0) for a in range(0, info.hist, cfg.chunk_tokens)]
        partition = planner.partition(chunks)
        for method in cfg.methods:
            layout = _layout_for(method, n, partition)
            tag = f"{method}-{sdt or 'c'}-{info.hist}-{time.monotonic_ns()}"
            spec = tier_spec(tier, bw, self.workdir, self.redis_url(), tag)
            reuse = ReuseConfig(method=method, chunk_tokens=cfg.chunk_tokens, layout=layout, storage_dtype=sdt,
                                lookahead=False, save=method != "recompute")  # recompute: nothing to save or read
            row = self.measure(loaded, profile, info, spec, reuse, tier)
            predicted = planner.prefill_chunks_s(0, len(info.ids)) if method == "recompute" else row.pop("predicted")
            ideal = planner.prefill_chunks_s(0, len(info.ids)) if method == "recompute" else row.pop("ideal")
            row.pop("predicted", None)
            row.pop("ideal", None)
            self.add(dict(row, model=loaded.name, dtype=cfg.dtype, storage=sdt, context_tokens=info.hist,
                          new_tokens=cfg.new_tokens, tier=tier, bandwidth=label, method=method, predicted_s=predicted,
                          ideal_s=ideal))
            self.write_partial()  # a slow cell keeps every method it finished
            r = self.rows[-1]
            self.log(f"  {method:10s} ttft {r['ttft_s']:7.3f}s  pred {num(r['predicted_s'])}s  ideal {num(r['ideal_s'])}s  "
                     f"read {r['bytes_read'] / 1e6:8.1f} MB  diff {r['max_logit_diff']:.2e}  "
                     f"greedy {'ok' if r['greedy_match'] else 'DIFF'}  {escape(r['plan'])}")
            if tier == "disk":
                shutil.rmtree(self.workdir / "disk" / tag, ignore_errors=True)
        if hf is not None and not sdt:
            self.hf_torch_save(loaded, hf, info, tier, bw, label)

    def measure(self, loaded, profile, info: Context, spec: str, reuse, tier: str) -> dict:
        """One method on one cell: save the history, then restore it --warmup + --repeats times.
        The prediction reported is the first run's: later plans carry the engine's online
        correction, fitted to these very measurements."""
        from kvtier.engine.request import SamplingParams

        cfg = self.cfg
        engine = self.engine(loaded, info.hist, spec, reuse, profile)
        try:
            engine.generate([info.ids[: info.hist]], SamplingParams(max_tokens=1, temperature=0.0))
            engine.flush()
            # first_logits: the row the first token was sampled from, as the engine's own step made it
            greedy = SamplingParams(max_tokens=cfg.greedy_tokens, temperature=0.0, ignore_eos=True, first_logits=True)
            runs, first_report = [], None
            for i in range(cfg.warmup + cfg.repeats):
                if tier == "disk":  # cold even where the filesystem refuses direct I/O
                    drop_page_cache(self.workdir / "disk")
                out = engine.generate([info.ids], greedy)[0]
                engine.flush()  # the new tokens' saves land before the next run, untimed
                first_report = first_report or out.restore
                if i >= cfg.warmup:
                    assert out.first_logits is not None
                    runs.append((out, out.first_logits))
            stats = engine.stats()
        finally:
            engine.close()
        out, first = runs[-1]
        rep = out.restore
        first_report = first_report or rep
        timed_runs = [o.restore for o, _ in runs if o.restore is not None and o.restore.copy_s is not None]
        return dict(ttft_s=median([o.ttft for o, _ in runs]), ttft_runs=[round(o.ttft, 4) for o, _ in runs],
                    copy_s=median([r.copy_s for r in timed_runs]) if timed_runs else None,
                    overlap=median([r.overlap for r in timed_runs]) if timed_runs else None,
                    host_s=median(hosts) if (hosts := [o.restore.host_s for o, _ in runs
                                                       if o.restore and o.restore.host_s is not None]) else None,
                    restore_s=median([o.restore.seconds for o, _ in runs if o.restore]) if rep else None,
                    bytes_read=rep.bytes_read if rep else 0, stored_bytes_per_token=stats.stored_bytes_per_token,
                    predicted=first_report.predicted_s if first_report else None,
                    ideal=first_report.ideal_s if first_report else None,
                    max_logit_diff=float((first.float() - info.ref_logits).abs().max()),
                    greedy_match=out.output_ids == info.ref_greedy, repeats=len(runs),
                    plan=f"{rep.method} [{rep.layout}]" if rep else "recompute (no restore)")

    def hf_recompute(self, loaded, hf, info: Context) -> None:
        from kvtier.bench.hf import HFPeers

        peer = HFPeers(hf, info.ids, info.hist, ["hf_recompute"], self.workdir / "hf.pt", None, "")
        for _ in range(self.cfg.warmup):
            peer.hf_recompute()
        secs = median([timed(peer.hf_recompute)[0] for _ in range(self.cfg.repeats)])
        self.add(dict(model=loaded.name, dtype=self.cfg.dtype, storage="", context_tokens=info.hist,
                      new_tokens=self.cfg.new_tokens, tier="-", bandwidth="-", method="hf_recompute", restore_s=secs,
                      ttft_s=secs, bytes_read=0, stored_bytes_per_token=0, max_logit_diff=0.0,
                      greedy_match=peer.hf_recompute() == int(info.ref_logits.argmax()), repeats=self.cfg.repeats,
                      plan="HF transformers forward of the whole prompt (greedy_match: next token only)"))
        self.log(f"hf_recompute {secs:.3f}s")
        if peer.device.type == "cuda":
            self.hf_device_peers(loaded, hf, info)

    def hf_device_peers(self, loaded, hf, info: Context) -> None:
        """On a GPU: HF with the history's cache kept on the device (the floor: only the new
        tokens run) and with it offloaded to pinned host memory and copied back per request."""
        from kvtier.bench.hf import HFPeers

        peer = HFPeers(hf, info.ids, info.hist, ["hf_floor", "hf_offload"], self.workdir / "hf.pt", None, "")
        for name, tier in (("hf_floor", "-"), ("hf_offload", "memory")):
            fn = getattr(peer, name)
            for _ in range(self.cfg.warmup):
                fn()
            secs = median([timed(fn)[0] for _ in range(self.cfg.repeats)])
            nbytes = sum(k.nbytes + v.nbytes for k, v in peer.host_kv) if name == "hf_offload" else 0
            self.add(dict(model=loaded.name, dtype=self.cfg.dtype, storage="", context_tokens=info.hist,
                          new_tokens=self.cfg.new_tokens, tier=tier, bandwidth="none" if tier != "-" else "-",
                          method=name, restore_s=None, ttft_s=secs, bytes_read=nbytes, stored_bytes_per_token=0,
                          max_logit_diff=0.0, greedy_match=fn() == int(info.ref_logits.argmax()),
                          repeats=self.cfg.repeats,
                          plan={"hf_floor": "HF with the history's DynamicCache kept on the GPU: only the new tokens",
                                "hf_offload": "HF DynamicCache in pinned host memory, copied to the GPU, then the "
                                              "new tokens"}[name]))
            self.log(f"{name} {secs:.3f}s")

    def hf_torch_save(self, loaded, hf, info: Context, tier: str, bw: float | None, label: str) -> None:
        """The workaround from the same tier: torch.save'd DynamicCache bytes, a cold file or a
        Redis value (with the same emulated bandwidth), torch.load, then the new tokens."""
        from kvtier.bench.hf import HFPeers

        name = {"memory": "hf_load_bytes", "disk": "hf_load_cold_file", "redis": "hf_load_redis"}[tier]
        client = None
        if tier == "redis":
            url = self.redis_url()
            assert url is not None  # benched only when redis is among the tiers
            client = bench_redis_client(url)
        peer = HFPeers(hf, info.ids, info.hist, [name], self.workdir / "hf_dynamic_cache.pt", client, "kvbench-hf")
        throttle = Throttle(Emulation(bw))
        try:
            def once() -> tuple[float, int]:
                peer.before(name)
                t = time.perf_counter()
                token = getattr(peer, name)()
                throttle.read(len(peer.blob))  # the emulated limit on the bytes it fetched
                return time.perf_counter() - t, token

            for _ in range(self.cfg.warmup):
                once()
            runs = [once() for _ in range(self.cfg.repeats)]
        finally:
            peer.close()
        ttft = median([r[0] for r in runs])
        self.add(dict(model=loaded.name, dtype=self.cfg.dtype, storage="", context_tokens=info.hist,
                      new_tokens=self.cfg.new_tokens, tier=tier, bandwidth=label, method="hf_torch_save", restore_s=None,
                      ttft_s=ttft, bytes_read=len(peer.blob), stored_bytes_per_token=len(peer.blob) // info.hist,
                      max_logit_diff=0.0, greedy_match=runs[-1][1] == int(info.ref_logits.argmax()),
                      repeats=len(runs), plan="torch.save(DynamicCache) -> torch.load -> HF prefill of the new tokens "
                                              "(greedy_match: next token only)"))
        self.log(f"  hf_torch_save ttft {ttft:7.3f}s  ({len(peer.blob) / 1e6:.1f} MB)")


def write_json(path: str, rows: list[dict], goals: list[dict], meta: dict) -> None:
    write_json_atomic(path, {"rows": rows, "goals": goals, "meta": meta})


# ----- command line -----------------------------------------------------------------------------


def cmd_restore(cfg: BenchConfig) -> int:
    import signal

    from rich.console import Console

    # SIGTERM ends the run through the finally blocks: partial JSON written, redis-server stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    console = Console(width=None if sys.stdout.isatty() else 200)
    bench = RestoreBench(cfg, console)
    rows = bench.run()
    goals = evaluate_goals(rows)
    if bench.meta.get("device"):
        goals += evaluate_gpu_goals(rows, bench.meta.get("h2d_pinned_Bps"))
    console.print(rich_table(rows))
    for g in goals:
        console.print(f"{'[green]met[/green]' if g['met'] else '[red]NOT met[/red]'}: {g['goal']}: {g['summary']}")
    if cfg.json_path:
        write_json(cfg.json_path, rows, goals, bench.meta)
    if cfg.markdown_path:
        Path(cfg.markdown_path).parent.mkdir(parents=True, exist_ok=True)
        Path(cfg.markdown_path).write_text(markdown(rows, goals))
    if cfg.plot_path:
        plot(rows, cfg.plot_path)
    return 0


def merge_runs(docs: list[dict], names: Sequence[str]) -> tuple[list[dict], dict]:
    """Rows of several runs; a later run's row replaces an earlier one for the same cell and method
    (re-measuring some methods after a fix). Each row records the file it came from."""
    key = lambda r: (r["model"], r["dtype"], r["storage"], r["context_tokens"], r["tier"], r["bandwidth"],  # noqa: E731
                     r["method"])
    merged: dict[tuple, dict] = {}
    meta: dict = {"sources": list(names), "profiles": {}}
    for doc, name in zip(docs, names):
        for r in doc["rows"]:
            merged[key(r)] = dict(r, source=str(name))
        for k, v in doc.get("meta", {}).get("profiles", {}).items():
            meta["profiles"][f"{k} ({name})"] = v
    return list(merged.values()), meta


def report(json_in: list[str], json_path: str | None, markdown_path: str | None, plot_path: str | None) -> int:
    """`kvtier bench restore report A.json [B.json ...]`: merge runs, re-judge the goals, re-render."""
    rows, meta = merge_runs([json.loads(Path(f).read_text()) for f in json_in], json_in)
    goals = evaluate_goals(rows)
    if json_path:
        write_json(json_path, rows, goals, meta)
    if markdown_path:
        Path(markdown_path).write_text(markdown(rows, goals))
    if plot_path:
        plot(rows, plot_path)
    for g in goals:
        print(f"{'met' if g['met'] else 'NOT met'}: {g['goal']}: {g['summary']}")
    return 0
