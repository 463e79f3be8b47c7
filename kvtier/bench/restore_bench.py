"""`kvtier bench restore`: time-to-first-token of every restore method against tier and bandwidth.

For each model, context length, tier and (optionally emulated) read bandwidth, the context's state
is saved once per layout it needs (all-KV, all-hidden, the planner's bubble-free partition), then
every method restores it and computes the new tokens on top, back to back in one process:

    recompute   prefill history + new tokens from token ids
    kv          layer-wise load of pre-RoPE K/V (CachedAttention)
    hidden      layer-wise load of layer inputs, projected to K/V (HCache)
    bubblefree  HCache's per-layer mix (hidden + KV load, or recompute + hidden)
    cake        compute chunks from the front while loading KV chunks from the back
    auto        the planner's choice among the above

and two baselines with HF transformers on the same weights and dtype: `hf_recompute` (one forward
of the whole prompt) and `hf_torch_save` (the usual workaround: `torch.save` a `DynamicCache`,
`torch.load` it back from the same tier and prefill the new tokens on top).

Timing: medians of --repeats after one untimed warm-up per (model, context, method). Disk reads
are made cold before every run by dropping the chunk files' pages (posix_fadvise DONTNEED), and
the disk spec has no memory tier above it. Bandwidth limits other than `none` are emulated by the
store's read throttle and labelled `(emulated)` in every row. Exactness: max abs difference of the
next-token logits against a full forward of our module, and whether greedy continuations of
--greedy-tokens tokens equal those after a recompute.

Writes partial JSON after each cell, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

METHODS = ("recompute", "kv", "hidden", "bubblefree", "cake", "auto")
BASELINES = ("hf_recompute", "hf_torch_save")
ROW_KEYS = ("model", "dtype", "storage", "context_tokens", "new_tokens", "tier", "bandwidth", "method",
            "restore_s", "ttft_s", "bytes_read", "stored_bytes_per_token", "ideal_s", "predicted_s",
            "max_logit_diff", "greedy_match", "repeats", "plan")
STORAGE_NAMES = {"": "", "fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
                 "fp16": "float16", "float16": "float16", "int8": "int8"}


# ----- small helpers ----------------------------------------------------------------------------
def parse_bandwidth(text: str) -> float | None:
    from kvtier.store.spec import parse_rate

    t = text.strip()
    return None if t.lower() in ("none", "", "raw") else parse_rate(t)


def bw_label(text: str) -> str:
    t = text.strip()
    return "none" if parse_bandwidth(t) is None else f"{t} (emulated)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def drop_page_cache(root: str | os.PathLike) -> int:
    """Evict every file under `root` from the page cache (so disk reads come from the device).
    Returns the number of files handled; works without root, unlike /proc/sys/vm/drop_caches."""
    n = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            except OSError:
                pass
            finally:
                os.close(fd)
    return n


class RedisServer:
    """A throwaway redis-server (no persistence) on a free local port."""

    def __init__(self, binary: str = "redis-server") -> None:
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="kvtier-bench-redis-")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", self.dir, "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        self.client = client
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


# ----- configuration ----------------------------------------------------------------------------
@dataclass
class BenchConfig:
    models: list[str]
    dtype: str = "bf16"
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
    drop_cache: bool = True


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


# ----- HF baselines -----------------------------------------------------------------------------
def build_hf(loaded):
    """An HF transformers model holding the very weights of `loaded`, in the same dtype."""
    import transformers

    dtype = loaded.dtype
    if loaded.source and Path(loaded.source).is_dir() and (Path(loaded.source) / "config.json").exists():
        hf = transformers.AutoModelForCausalLM.from_pretrained(loaded.source, dtype=dtype)
    else:
        cfg = loaded.config
        hf = transformers.AutoModelForCausalLM.from_config(cfg.to_hf(), dtype=dtype)
        state = {k: v for k, v in loaded.module.state_dict().items()}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = hf.load_state_dict(state, strict=False)
        bad = [k for k in missing if k != "lm_head.weight"]
        if bad or unexpected:
            raise RuntimeError(f"HF baseline weights do not match: missing {bad[:4]}, unexpected {unexpected[:4]}")
        if cfg.tie_word_embeddings:
            hf.tie_weights()
    return hf.eval()


class HFBaseline:
    def __init__(self, loaded, ids: list[int], hist: int, repeats: int, warmup: int):
        self.hf = build_hf(loaded)
        self.ids, self.hist, self.repeats, self.warmup = ids, hist, repeats, warmup
        self.prompt = torch.tensor([ids])  # [1, tokens]
        self.new = torch.tensor([ids[hist:]])  # [1, new]
        self._blob: bytes | None = None
        self._warm = False

    @torch.inference_mode()
    def recompute(self) -> tuple[float, torch.Tensor]:
        def once():
            return self.hf(self.prompt, use_cache=False).logits[0, -1].float()

        for _ in range(self.warmup):
            once()
        ts, logits = [], None
        for _ in range(self.repeats):
            t = time.perf_counter()
            logits = once()
            int(logits.argmax())
            ts.append(time.perf_counter() - t)
        return _median(ts), logits

    @torch.inference_mode()
    def blob(self) -> bytes:
        """The user's workaround, step 1: prefill the history and torch.save the DynamicCache."""
        if self._blob is None:
            out = self.hf(self.prompt[:, : self.hist], use_cache=True)
            buf = io.BytesIO()
            torch.save(out.past_key_values, buf)
            self._blob = buf.getvalue()
        return self._blob

    @torch.inference_mode()
    def load_and_prefill(self, fetch) -> tuple[float, float, torch.Tensor]:
        """Step 2 (timed): get the bytes back, torch.load them and prefill the new tokens.
        -> (restore seconds, TTFT seconds, logits)."""
        t0 = time.perf_counter()
        raw = fetch()
        cache = torch.load(io.BytesIO(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else raw,
                           weights_only=False)
        t1 = time.perf_counter()
        pos = torch.arange(self.hist, len(self.ids))[None]
        logits = self.hf(self.new, past_key_values=cache, use_cache=True, position_ids=pos,
                         cache_position=pos[0]).logits[0, -1].float()
        int(logits.argmax())
        return t1 - t0, time.perf_counter() - t0, logits


# ----- the benchmark ----------------------------------------------------------------------------
class RestoreBench:
    def __init__(self, cfg: BenchConfig, console=None):
        from rich.console import Console

        self.cfg = cfg
        self.console = console or Console()
        self.rows: list[dict] = []
        self.meta: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "torch_threads": torch.get_num_threads(),
                           "argv": sys.argv, "profiles": {}, "notes": []}
        self.workdir = Path(cfg.workdir)
        self._redis: RedisServer | None = None

    # -- output
    def log(self, msg: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")

    def add(self, row: dict) -> None:
        self.rows.append({k: row.get(k) for k in ROW_KEYS})

    def write_partial(self) -> None:
        if self.cfg.json_path:
            write_json(self.cfg.json_path, self.rows, evaluate_goals(self.rows), self.meta)

    # -- setup
    def redis_url(self) -> str | None:
        if self.cfg.redis_url:
            return self.cfg.redis_url
        if "redis" not in self.cfg.tiers:
            return None
        if self._redis is None:
            binary = shutil.which("redis-server") or "/usr/bin/redis-server"
            self._redis = RedisServer(binary)
            self.log(f"started redis-server on port {self._redis.port}")
        return self._redis.url

    def run(self) -> list[dict]:
        from kvtier.models.loading import load_model

        if self.workdir.exists():
            shutil.rmtree(self.workdir / "disk", ignore_errors=True)
        self.workdir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(self.cfg.seed)
        try:
            for name in self.cfg.models:
                self.log(f"[bold]loading {name} ({self.cfg.dtype})[/bold]")
                loaded = load_model(name, dtype=self.cfg.dtype, tokenizer=False)
                self.run_model(loaded)
                del loaded
        finally:
            if self._redis is not None:
                self._redis.close()
            self.write_partial()
        return self.rows

    def run_model(self, loaded) -> None:
        from kvtier.engine.config import EngineConfig
        from kvtier.engine.engine import Engine
        from kvtier.engine.runner import ModelRunner
        from kvtier.restore.profile import measure

        cfg = self.cfg
        max_len = max(cfg.contexts) + cfg.new_tokens + cfg.greedy_tokens + 16
        per_block = ModelRunner.bytes_per_block(loaded.module, 16)
        engine = Engine(loaded, EngineConfig(kv_cache_bytes=per_block * (max_len // 16 + 4), max_model_len=max_len,
                                             max_batched_tokens=2048, enable_prefix_cache=False))
        spec = ",".join(tier_spec(t, None, self.workdir, self.redis_url(), "profile") for t in cfg.tiers)
        self.log(f"measuring the hardware profile of {loaded.name} on {spec}")
        t = time.perf_counter()
        profile = measure(loaded, spec)
        self.log(f"profile in {time.perf_counter() - t:.0f}s: prefill a={profile.prefill_a * 1e3:.3f} ms/tok "
                 f"b={profile.prefill_b * 1e6:.4f} us/tok^2; tiers "
                 + ", ".join(f"{n} {r.chunk_bps / 1e9:.2f} GB/s" for n, r in profile.tiers.items()))
        self.meta["profiles"][f"{loaded.name}/{self.cfg.dtype}"] = json.loads(profile.to_json())
        shutil.rmtree(self.workdir / "disk" / "profile", ignore_errors=True)
        for ctx in cfg.contexts:
            self.run_context(loaded, engine, profile, ctx)

    def run_context(self, loaded, engine, profile, ctx: int) -> None:
        from kvtier.engine.runner import RunItem
        from kvtier.restore.state import context_state

        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed + ctx)
        vocab = loaded.config.vocab_size
        ids = torch.randint(100, vocab, (ctx + cfg.new_tokens,), generator=gen).tolist()
        self.log(f"[bold]{loaded.name} context {ctx} + {cfg.new_tokens} new tokens[/bold]: state and reference")
        t = time.perf_counter()
        state = context_state(loaded.module, ids[:ctx])
        with torch.inference_mode():
            ref_logits = loaded.module(torch.tensor(ids))[-1].float()  # [vocab] full recompute
        self.log(f"state + reference forward in {time.perf_counter() - t:.1f}s")
        blocks = engine.pool.allocate(-(-(len(ids) + cfg.greedy_tokens + 1) // engine.pool.block_size))
        runner = engine.runner
        # Time to prefill only the new tokens on top of a ready cache: restore_s = ttft_s - this.
        RunItem_ = RunItem
        with torch.inference_mode():
            from kvtier.restore.executor import Executor

            ex = Executor(runner)
            ex._compute(ids[:ctx], 0, blocks, _Stats())
            item = RunItem_(ids[ctx:], ctx, blocks, True)
            runner.execute([item])
            ts = []
            for _ in range(max(1, cfg.repeats)):
                t = time.perf_counter()
                runner.execute([item])
                ts.append(time.perf_counter() - t)
            new_prefill_s = _median(ts)
        ref_greedy = greedy(runner, blocks, len(ids), int(ref_logits.argmax()), cfg.greedy_tokens)
        ctxinfo = dict(ids=ids, state=state, ref_logits=ref_logits, ref_greedy=ref_greedy, blocks=blocks,
                       new_prefill_s=new_prefill_s, warmed=set(), recompute_row=None)
        hfb = None
        if cfg.baselines:
            hfb = HFBaseline(loaded, ids, ctx, cfg.repeats, cfg.warmup)
            secs, logits = hfb.recompute()
            self.add(dict(model=loaded.name, dtype=self.cfg.dtype, storage="", context_tokens=ctx,
                          new_tokens=cfg.new_tokens, tier="-", bandwidth="-", method="hf_recompute",
                          restore_s=secs - 0.0, ttft_s=secs, bytes_read=0, stored_bytes_per_token=0, ideal_s=None,
                          predicted_s=None, max_logit_diff=float((logits - ref_logits).abs().max()),
                          greedy_match=int(logits.argmax()) == int(ref_logits.argmax()), repeats=cfg.repeats,
                          plan="HF transformers forward of the whole prompt (greedy_match: next token only)"))
            self.log(f"hf_recompute {secs:.3f}s")
            self.write_partial()
        try:
            for storage in cfg.storage:
                for tier in cfg.tiers:
                    for bw in cfg.bandwidths:
                        self.run_cell(loaded, engine, profile, ctx, storage, tier, bw, ctxinfo, hfb)
                        self.write_partial()
        finally:
            engine.pool.release(blocks)
            if hfb is not None:
                del hfb

    # -- one cell: (model, context, storage, tier, bandwidth)
    def run_cell(self, loaded, engine, profile, ctx, storage, tier, bw_text, info, hfb) -> None:
        from kvtier.restore.executor import Executor
        from kvtier.restore.glue import chunks_of, links, model_shape, namespace
        from kvtier.restore.plan import Method
        from kvtier.restore.planner import Planner
        from kvtier.store import Repr, TieredStore

        cfg = self.cfg
        n_layers = loaded.config.num_layers
        bw = parse_bandwidth(bw_text)
        label = bw_label(bw_text)
        sdt = STORAGE_NAMES[storage]
        ids, st = info["ids"], info["state"]
        hist_ids = ids[:ctx]
        cell = f"{loaded.name} ctx={ctx} tier={tier} bw={label}" + (f" storage={sdt}" if sdt else "")
        self.log(f"[cyan]cell {cell}[/cyan]")
        stores: dict[tuple, TieredStore] = {}

        def store_for(layout: tuple) -> tuple[TieredStore, object]:
            if layout not in stores:
                ns = namespace(loaded, layout, storage_dtype=sdt)
                tag = ns.digest()[:10]
                spec = tier_spec(tier, bw, self.workdir, self.redis_url(), tag)
                s = TieredStore.open(spec, ns, chunk_tokens=cfg.chunk_tokens, writer_queue_bytes=1 << 40)
                need_kv = Repr.KV in layout
                need_h = Repr.HIDDEN in layout
                if s.lookup(hist_ids).num_tokens < ctx:
                    s.save(hist_ids, 0, st.k if need_kv else None, st.v if need_kv else None, st.h if need_h else None)
                    s.flush()
                stores[layout] = s
            s = stores[layout]
            return s, s.lookup(hist_ids)

        kv_layout = (Repr.KV,) * n_layers
        h_layout = (Repr.HIDDEN,) * n_layers
        try:
            kv_store, kv_match = store_for(kv_layout)
            if kv_match.num_tokens != ctx:
                self.console.print(f"[red]store holds {kv_match.num_tokens} of {ctx} tokens; skipping cell[/red]")
                return
            planner = Planner(profile, model_shape(loaded, sdt), links(kv_store, profile))
            chunks = chunks_of(kv_match)
            bf_layout = tuple(planner.partition(chunks))
            layouts = {Method.KV: kv_layout, Method.HIDDEN: h_layout, Method.BUBBLEFREE: bf_layout,
                       Method.CAKE: kv_layout}
            ex = Executor(engine.runner)
            width_ratio = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}[sdt or str(loaded.dtype)[6:]] \
                / loaded.dtype.itemsize
            for mname in cfg.methods:
                method = Method(mname)
                if method is Method.RECOMPUTE and info["recompute_row"] is not None:
                    row = dict(info["recompute_row"], tier=tier, bandwidth=label, storage=sdt)
                    self.add(row)
                    continue
                if method is Method.AUTO:
                    plan = planner.choose(chunks, cfg.new_tokens, layouts)
                    layout = plan.layer_reprs if plan.method is not Method.RECOMPUTE else kv_layout
                else:
                    layout = layouts.get(method, kv_layout)
                    plan = planner.plan(method, chunks, cfg.new_tokens, layout if method is Method.BUBBLEFREE else None)
                store, match = store_for(tuple(layout) if plan.method is not Method.CAKE else kv_layout)
                if Repr.NONE in layout and plan.method is not Method.RECOMPUTE:
                    store, match = store_for(tuple(layout))
                runs = []
                key = (method, sdt)
                n_warm = cfg.warmup if key not in info["warmed"] else 0
                info["warmed"].add(key)
                for i in range(n_warm + cfg.repeats):
                    if tier == "disk" and cfg.drop_cache:
                        drop_page_cache(self.workdir / "disk")
                    t0 = time.perf_counter()
                    logits, stats = ex.run(plan, store, match, ids, info["blocks"])
                    nxt = int(logits.argmax())
                    dt = time.perf_counter() - t0
                    if i >= n_warm:
                        runs.append((dt, stats, logits, nxt))
                ttft = _median([r[0] for r in runs])
                _, stats, logits, nxt = runs[-1]
                g = greedy(engine.runner, info["blocks"], len(ids), nxt, cfg.greedy_tokens)
                used_ns = namespace(loaded, layout, storage_dtype=sdt)
                row = dict(model=loaded.name, dtype=cfg.dtype, storage=sdt, context_tokens=ctx,
                           new_tokens=cfg.new_tokens, tier=tier, bandwidth=label, method=mname,
                           restore_s=max(ttft - info["new_prefill_s"], 0.0), ttft_s=ttft,
                           bytes_read=int(stats.bytes_read * width_ratio),
                           stored_bytes_per_token=0 if plan.method is Method.RECOMPUTE else used_ns.bytes_per_token(),
                           ideal_s=plan.ideal_s, predicted_s=plan.predicted_s,
                           max_logit_diff=float((logits - info["ref_logits"]).abs().max()),
                           greedy_match=g == info["ref_greedy"], repeats=len(runs), plan=plan.describe())
                self.add(row)
                self.write_partial()  # a slow cell keeps every method it finished
                if method is Method.RECOMPUTE:
                    info["recompute_row"] = {k: v for k, v in row.items()}
                    info["recompute_row"]["plan"] = plan.describe() + " (measured once per model/context)"
                self.log(f"  {mname:10s} ttft {ttft:7.3f}s  ideal {plan.ideal_s:7.3f}s  pred {plan.predicted_s:7.3f}s  "
                         f"read {row['bytes_read'] / 1e6:8.1f} MB  diff {row['max_logit_diff']:.2e}  "
                         f"greedy {'ok' if row['greedy_match'] else 'DIFF'}  {plan.describe()}")
            if hfb is not None and not sdt:
                self.hf_cell(loaded, ctx, tier, bw, label, hfb, info)
        finally:
            for s in stores.values():
                s.close()

    def hf_cell(self, loaded, ctx, tier, bw, label, hfb: HFBaseline, info) -> None:
        from kvtier.store.throttle import Emulation, Throttle

        cfg = self.cfg
        blob = hfb.blob()
        throttle = Throttle(Emulation(bw))
        if tier == "memory":
            def fetch():
                data = bytes(blob)  # a copy, as a read from a host cache would be
                throttle.read(len(data))
                return data
        elif tier == "disk":
            path = self.workdir / "disk" / "hf_dynamic_cache.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)

            def fetch():
                with open(path, "rb") as f:
                    data = f.read()
                throttle.read(len(data))
                return data
        else:
            client = self._redis.client if self._redis else __import__("redis").Redis.from_url(self.redis_url())
            client.set("kvbench-hf-cache", blob)

            def fetch():
                data = client.get("kvbench-hf-cache")
                throttle.read(len(data))
                return data

        key = ("hf_torch_save", "")
        n_warm = cfg.warmup if key not in info["warmed"] else 0
        info["warmed"].add(key)
        runs = []
        for i in range(n_warm + cfg.repeats):
            if tier == "disk" and cfg.drop_cache:
                drop_page_cache(self.workdir / "disk")
            r = hfb.load_and_prefill(fetch)
            if i >= n_warm:
                runs.append(r)
        logits = runs[-1][2]
        ttft = _median([r[1] for r in runs])
        self.add(dict(model=loaded.name, dtype=cfg.dtype, storage="", context_tokens=ctx, new_tokens=cfg.new_tokens,
                      tier=tier, bandwidth=label, method="hf_torch_save", restore_s=_median([r[0] for r in runs]),
                      ttft_s=ttft, bytes_read=len(blob), stored_bytes_per_token=len(blob) // ctx, ideal_s=None,
                      predicted_s=None, max_logit_diff=float((logits - info["ref_logits"]).abs().max()),
                      greedy_match=int(logits.argmax()) == int(info["ref_logits"].argmax()), repeats=len(runs),
                      plan="torch.save(DynamicCache) -> torch.load -> HF prefill of the new tokens "
                           "(greedy_match: next token only)"))
        if tier == "disk":
            (self.workdir / "disk" / "hf_dynamic_cache.pt").unlink(missing_ok=True)
        self.log(f"  hf_torch_save ttft {ttft:7.3f}s  (restore {runs[-1][0]:.3f}s, {len(blob) / 1e6:.1f} MB)")


class _Stats:
    bytes_read = 0
    chunks_computed = 0


@torch.inference_mode()
def greedy(runner, blocks, pos: int, first: int, n: int) -> list[int]:
    """`n` greedy tokens after `first` (placed at `pos`), decoding on the pool as restored."""
    from kvtier.engine.runner import RunItem

    out = [first]
    for i in range(n - 1):
        logits = runner.execute([RunItem([out[-1]], pos + i, blocks, True)])
        out.append(int(logits[0].argmax()))
    return out


# ----- goals ------------------------------------------------------------------------------------
KVTIER = ("recompute", "kv", "hidden", "bubblefree", "cake")


def _cells(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["tier"] == "-":
            continue
        k = (r["model"], r["dtype"], r["storage"], r["context_tokens"], r["tier"], r["bandwidth"])
        out.setdefault(k, {})[r["method"]] = r
    return out


def _fmt_cell(k: tuple) -> str:
    model, dtype, storage, ctx, tier, bw = k
    return f"{model}/{dtype}{'/' + storage if storage else ''} ctx={ctx} {tier} {bw}"


def evaluate_goals(rows: list[dict]) -> list[dict]:
    cells = _cells(rows)
    goals = []
    # 1. auto within 15% of the best method in every cell
    worst, detail = None, []
    for k, m in cells.items():
        if "auto" not in m:
            continue
        best_name = min((n for n in KVTIER if n in m), key=lambda n: m[n]["ttft_s"], default=None)
        if best_name is None:
            continue
        ratio = m["auto"]["ttft_s"] / m[best_name]["ttft_s"]
        detail.append(dict(cell=_fmt_cell(k), auto_s=m["auto"]["ttft_s"], best=best_name,
                           best_s=m[best_name]["ttft_s"], ratio=round(ratio, 3), met=ratio <= 1.15))
        worst = ratio if worst is None else max(worst, ratio)
    if detail:
        bad = [d for d in detail if not d["met"]]
        goals.append(dict(goal="auto within 15% of the best method in every cell", met=not bad,
                          summary=f"worst auto/best = {worst:.2f}; {len(detail) - len(bad)}/{len(detail)} cells within 15%",
                          failing=bad, cells=detail))
    # 2. bubblefree and cake within 15% of their own ideal bound
    for name in ("bubblefree", "cake"):
        det = []
        for k, m in cells.items():
            r = m.get(name)
            if r and r.get("ideal_s"):
                ratio = r["ttft_s"] / r["ideal_s"]
                det.append(dict(cell=_fmt_cell(k), ttft_s=r["ttft_s"], ideal_s=r["ideal_s"], ratio=round(ratio, 3),
                                met=bool(ratio <= 1.15)))
        if det:
            bad = [d for d in det if not d["met"]]
            below = sum(d["ratio"] < 1.0 for d in det)
            # With an emulated limit most of the IO time is waiting, which can overlap compute; at a
            # real tier's own speed the reads are copies on the compute cores (no copy engine here).
            emu = [d for d in det if "emulated" in d["cell"]]
            # A measured time under the "ideal" means the profile over-predicts: the bound is not a
            # bound on this run, so "within 15%" says little there; count those cells separately.
            goals.append(dict(goal=f"{name} within 15% of its ideal bound", met=not bad,
                              summary=f"ttft/ideal from {min(d['ratio'] for d in det):.2f} to "
                                      f"{max(d['ratio'] for d in det):.2f}; {len(det) - len(bad)}/{len(det)} cells within 15%"
                                      + (f" ({sum(d['met'] for d in emu)}/{len(emu)} of the emulated-bandwidth cells)"
                                         if emu else "")
                                      + (f"; in {below} cells TTFT is below the ideal, i.e. the profile-based bound "
                                         "is not a true bound there" if below else ""),
                              failing=bad, cells=det))
    # 3. mha-1b, 4096, 100 MB/s: best mixed >= 1.3x faster than the best single
    det = []
    for k, m in cells.items():
        model, dtype, storage, ctx, tier, bw = k
        if model == "mha-1b" and ctx == 4096 and bw.startswith("100MB/s") and not storage:
            mixed = [n for n in ("bubblefree", "cake") if n in m]
            single = [n for n in ("kv", "recompute") if n in m]
            if mixed and single:
                bm = min(mixed, key=lambda n: m[n]["ttft_s"])
                bs = min(single, key=lambda n: m[n]["ttft_s"])
                sp = m[bs]["ttft_s"] / m[bm]["ttft_s"]
                det.append(dict(cell=_fmt_cell(k), best_mixed=bm, mixed_s=m[bm]["ttft_s"], best_single=bs,
                                single_s=m[bs]["ttft_s"], speedup=round(sp, 3), met=sp >= 1.3))
    goals.append(dict(goal="mha-1b, 4096 tokens, 100 MB/s: best mixed >= 1.3x faster than best of kv/recompute",
                      met=bool(det) and all(d["met"] for d in det),
                      summary="; ".join(f"{d['cell']}: {d['best_mixed']} {d['mixed_s']:.2f}s vs {d['best_single']} "
                                        f"{d['single_s']:.2f}s = {d['speedup']:.2f}x" for d in det) or "not measured",
                      cells=det))
    # 4. smollm2 4096 + 64 from local disk: TTFT <= half of the torch.save/torch.load workaround
    det = []
    for k, m in cells.items():
        model, dtype, storage, ctx, tier, bw = k
        if model.startswith("smollm2") and ctx == 4096 and tier == "disk" and bw == "none" and not storage \
                and "hf_torch_save" in m:
            base = m["hf_torch_save"]["ttft_s"]
            for n in ("auto",):
                if n in m:
                    best = min((x for x in KVTIER if x in m), key=lambda x: m[x]["ttft_s"])
                    det.append(dict(cell=_fmt_cell(k), auto_s=m[n]["ttft_s"], best=best, best_s=m[best]["ttft_s"],
                                    workaround_s=base, ratio=round(m[n]["ttft_s"] / base, 3),
                                    met=m[n]["ttft_s"] <= 0.5 * base))
    goals.append(dict(goal="smollm2, 4096 + 64 tokens from local disk: TTFT <= 1/2 of torch.save/torch.load workaround",
                      met=bool(det) and all(d["met"] for d in det),
                      summary="; ".join(f"auto {d['auto_s']:.3f}s (best {d['best']} {d['best_s']:.3f}s) vs workaround "
                                        f"{d['workaround_s']:.3f}s = {d['ratio']:.2f}x" for d in det) or "not measured",
                      cells=det))
    # 5. mha-1b hidden bytes/token about half of KV
    kvb = next((r["stored_bytes_per_token"] for r in rows if r["model"] == "mha-1b" and r["method"] == "kv"
                and not r["storage"]), None)
    hb = next((r["stored_bytes_per_token"] for r in rows if r["model"] == "mha-1b" and r["method"] == "hidden"
               and not r["storage"]), None)
    if kvb and hb:
        goals.append(dict(goal="mha-1b: hidden-state storage about half the bytes per token of KV",
                          met=abs(hb / kvb - 0.5) <= 0.05,
                          summary=f"hidden {hb} B/token vs KV {kvb} B/token = {hb / kvb:.3f}"))
    else:
        goals.append(dict(goal="mha-1b: hidden-state storage about half the bytes per token of KV", met=False,
                          summary="not measured"))
    # 6. lower precision storage: fidelity is reported
    low = [r for r in rows if r["storage"] and r["method"] in KVTIER + ("auto",)]
    if low:
        by = {}
        for r in low:
            by.setdefault(r["storage"], []).append(r)
        summ = "; ".join(f"{s}: max logit diff {max(x['max_logit_diff'] for x in rs):.3g}, greedy match "
                         f"{sum(bool(x['greedy_match']) for x in rs)}/{len(rs)}" for s, rs in by.items())
        goals.append(dict(goal="lower-precision storage reports logit difference and greedy agreement", met=True,
                          summary=summ))
    return goals


# ----- reports ----------------------------------------------------------------------------------
def write_json(path: str, rows: list[dict], goals: list[dict], meta: dict) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps({"rows": rows, "goals": goals, "meta": meta}, indent=1, default=str))
    tmp.replace(p)


def _f(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(rows: list[dict], goals: list[dict]) -> str:
    lines = ["Bandwidths marked `(emulated)` are limits imposed by the store's read throttle on top of the real "
             "device; `none` is the real tier. Times are medians in seconds. `bytes_read` is in MB (storage dtype).",
             ""]
    # pivot: one line per cell, TTFT per method
    cells = _cells(rows)
    cols = [m for m in METHODS + ("hf_torch_save",) if any(m in c for c in cells.values())]
    lines.append("| model | storage | context | tier | bandwidth | " + " | ".join(cols) + " | hf_recompute | best |")
    lines.append("|" + "---|" * (len(cols) + 7))
    hfr = {(r["model"], r["dtype"], r["context_tokens"]): r for r in rows if r["method"] == "hf_recompute"}
    for k, m in cells.items():
        model, dtype, storage, ctx, tier, bw = k
        best = min((n for n in KVTIER if n in m), key=lambda n: m[n]["ttft_s"], default="-")
        h = hfr.get((model, dtype, ctx))
        lines.append(f"| {model} ({dtype}) | {storage or dtype} | {ctx} | {tier} | {bw} | "
                     + " | ".join(_f(m[c]["ttft_s"]) if c in m else "-" for c in cols)
                     + f" | {_f(h['ttft_s']) if h else '-'} | {best} |")
    lines += ["", "Full rows (TTFT, restore time = TTFT minus the new tokens' prefill on a ready cache, ideal bound, "
              "fidelity):", "",
              "| model | storage | ctx | new | tier | bandwidth | method | restore_s | ttft_s | ideal_s | bytes_read MB "
              "| stored B/token | max_logit_diff | greedy | repeats | plan |",
              "|" + "---|" * 16]
    for r in rows:
        lines.append(f"| {r['model']} ({r['dtype']}) | {r['storage'] or r['dtype']} | {r['context_tokens']} | "
                     f"{r['new_tokens']} | {r['tier']} | {r['bandwidth']} | {r['method']} | {_f(r['restore_s'])} | "
                     f"{_f(r['ttft_s'])} | {_f(r['ideal_s'])} | {r['bytes_read'] / 1e6:.1f} | "
                     f"{r['stored_bytes_per_token']} | {r['max_logit_diff']:.2e} | "
                     f"{'yes' if r['greedy_match'] else 'NO'} | {r['repeats']} | {r['plan'] or ''} |")
    lines += ["", "Goals:", ""]
    for g in goals:
        lines.append(f"- **{'met' if g['met'] else 'NOT met'}**: {g['goal']}: {g['summary']}")
        for d in g.get("failing", [])[:12]:
            lines.append(f"  - failing: {d['cell']} ratio {d['ratio']}")
    return "\n".join(lines) + "\n"


def rich_table(rows: list[dict]):
    from rich.table import Table

    t = Table(title="kvtier restore benchmark (medians; '(emulated)' bandwidths are throttled)")
    for c in ("model", "storage", "ctx", "tier", "bandwidth", "method", "restore_s", "ttft_s", "ideal_s", "MB read",
              "B/token", "logit diff", "greedy"):
        t.add_column(c)
    for r in rows:
        t.add_row(r["model"], r["storage"] or r["dtype"], str(r["context_tokens"]), r["tier"], r["bandwidth"],
                  r["method"], _f(r["restore_s"]), _f(r["ttft_s"]), _f(r["ideal_s"]), f"{r['bytes_read'] / 1e6:.1f}",
                  str(r["stored_bytes_per_token"]), f"{r['max_logit_diff']:.1e}", "yes" if r["greedy_match"] else "NO")
    return t


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtier.store.spec import parse_rate

    def xval(bw: str) -> float:
        return 2e9 if bw == "none" else parse_rate(bw.split()[0])

    panels: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["tier"] != "-":
            panels.setdefault((r["model"], r["dtype"], r["storage"], r["context_tokens"], r["tier"]), []).append(r)
    hfr = {(r["model"], r["dtype"], r["context_tokens"]): r["ttft_s"] for r in rows if r["method"] == "hf_recompute"}
    keys = sorted(panels, key=lambda k: (k[0], k[2], k[3], ["memory", "disk", "redis"].index(k[4])
                                         if k[4] in ("memory", "disk", "redis") else 9))
    if not keys:
        return
    ncol = 3
    nrow = -(-len(keys) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(5 * ncol, 3.6 * nrow), squeeze=False)
    styles = {"recompute": ("k", "o", "-"), "kv": ("tab:blue", "s", "-"), "hidden": ("tab:orange", "^", "-"),
              "bubblefree": ("tab:green", "D", "-"), "cake": ("tab:red", "v", "-"),
              "auto": ("tab:purple", "*", ":"), "hf_torch_save": ("tab:gray", "x", "--")}
    for ax, k in zip(axes.flat, keys):
        rs = panels[k]
        for m, (col, mark, ls) in styles.items():
            pts = sorted((xval(r["bandwidth"]), r["ttft_s"]) for r in rs if r["method"] == m)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], color=col, marker=mark, linestyle=ls, label=m,
                        markersize=7 if m == "auto" else 5)
        h = hfr.get((k[0], k[1], k[3]))
        if h:
            ax.axhline(h, color="tab:gray", linestyle=":", label="hf_recompute")
        ax.set_xscale("log")
        ax.set_yscale("log")
        xs = sorted({xval(r["bandwidth"]) for r in rs})
        ax.set_xticks(xs)
        ax.set_xticklabels(["none" if x == 2e9 else f"{x / 1e6:g}MB/s*" for x in xs], fontsize=8)
        ax.minorticks_off()
        ax.set_title(f"{k[0]} {k[2] or k[1]} ctx={k[3]} {k[4]}", fontsize=9)
        ax.set_ylabel("TTFT (s)")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9)
    fig.text(0.5, 0.005, "read bandwidth (* = emulated limit; 'none' = the real tier, unthrottled)", ha="center")
    fig.tight_layout(rect=(0, 0.02, 1, 0.96))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----- command line -----------------------------------------------------------------------------
def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="comma-separated model names (default: %(default)s)")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16", "auto"], help="compute dtype")
    p.add_argument("--storage-dtype", default="", help="comma-separated storage dtypes (int8, fp16, bf16, fp32); "
                                                       "empty = the compute dtype (lossless)")
    p.add_argument("--context", default="1024,4096,8192", help="comma-separated history lengths")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tier", default="memory,disk,redis", help="comma-separated tiers: memory, disk, redis")
    p.add_argument("--bandwidth", default="none,500MB/s,100MB/s,20MB/s",
                   help="comma-separated read limits; anything but none is emulated")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--no-baselines", action="store_true", help="skip the HF transformers baselines")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs of each method per model/context")
    p.add_argument("--greedy-tokens", type=int, default=8, help="greedy tokens compared after each restore")
    p.add_argument("--chunk-tokens", type=int, default=64)
    p.add_argument("--workdir", default="out/restore-work", help="disk tier directory (wiped at start)")
    p.add_argument("--redis-url", default=None, help="redis server to use (default: start a private redis-server)")
    p.add_argument("--no-drop-cache", action="store_true", help="keep disk pages cached between runs")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--plot", default=None, help="PNG path of TTFT vs bandwidth per method")
    p.add_argument("--seed", type=int, default=0)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    storage = [STORAGE_NAMES[s] if s in STORAGE_NAMES else s for s in _csv(args.storage_dtype)] or [""]
    for s in storage:
        if s not in STORAGE_NAMES.values():
            raise ValueError(f"unknown storage dtype {s!r}")
    methods = _csv(args.methods)
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}: use {', '.join(METHODS)}")
    if "recompute" in methods:  # measured first: every other method is compared with it
        methods = ["recompute"] + [m for m in methods if m != "recompute"]
    for b in _csv(args.bandwidth):
        parse_bandwidth(b)
    return BenchConfig(models=_csv(args.model), dtype=args.dtype, storage=storage,
                       contexts=[int(c) for c in _csv(args.context)], new_tokens=args.new_tokens,
                       tiers=_csv(args.tier), bandwidths=_csv(args.bandwidth), methods=methods,
                       baselines=not args.no_baselines, repeats=args.repeats, warmup=args.warmup,
                       greedy_tokens=args.greedy_tokens, chunk_tokens=args.chunk_tokens, workdir=args.workdir,
                       redis_url=args.redis_url, json_path=args.json, markdown_path=args.markdown,
                       plot_path=args.plot, seed=args.seed, drop_cache=not args.no_drop_cache)


def cmd_restore(args: argparse.Namespace) -> int:
    from rich.console import Console

    import signal

    # SIGTERM ends the run through the finally blocks: partial JSON written, redis-server stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    console = Console(width=None if sys.stdout.isatty() else 200)
    cfg = config_from_args(args)
    bench = RestoreBench(cfg, console)
    rows = bench.run()
    goals = evaluate_goals(rows)
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


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    p = bench_subparsers.add_parser("restore", help="TTFT of every restore method vs tier and (emulated) bandwidth")
    add_arguments(p)
    p.set_defaults(func=cmd_restore)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.bench.restore_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sub = parser.add_subparsers(dest="sub")  # `report` re-renders a JSON file (markdown, plot, goals)
    rp = sub.add_parser("report", help="re-render markdown/plot/goals from JSON written by runs; with several "
                                       "files, a later file's row replaces an earlier one of the same cell and method")
    rp.add_argument("json_in", nargs="+")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.sub == "report":
        rows, meta = merge_runs([json.loads(Path(f).read_text()) for f in args.json_in], args.json_in)
        goals = evaluate_goals(rows)
        if args.json:
            write_json(args.json, rows, goals, meta)
        if args.markdown:
            Path(args.markdown).write_text(markdown(rows, goals))
        if args.plot:
            plot(rows, args.plot)
        for g in goals:
            print(f"{'met' if g['met'] else 'NOT met'}: {g['goal']}: {g['summary']}")
        return 0
    return cmd_restore(args)


if __name__ == "__main__":
    sys.exit(main())
